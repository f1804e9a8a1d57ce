"""``hybridflow run --supervise``: the controller killed with SIGKILL after a checkpoint is
started again with ``--resume`` and the run completes, every step once; bad input is not
retried. Real processes: the supervisor, the controller it starts, the controller's ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import EXAMPLE, ranks, records
from deploy.supervise_cli import child_argv
from tests.waiting import wait_for

SETS = [
    "stages.0.steps=2",
    "stages.0.optim.warmup_steps=1",
    "stages.1.steps=8",
    "trainer.save_every=2",
    "trainer.val_data=null",
    "logging.tensorboard=false",
]


def test_the_child_command_resumes_from_the_run_dir_without_the_supervisor_options() -> None:
    argv = ["run", "exp.yaml", "--quick", "--set", "a=1", "--supervise", "--max-restarts", "5"]
    first = child_argv([*argv, "--run-dir", "old"], Path("d"), resume=False)
    assert first == ["run", "exp.yaml", "--quick", "--set", "a=1", "--run-dir", "d"]
    again = child_argv(["run", "--set=b=2", "exp.yaml", "--supervise", "--json"], Path("d"), True)
    assert again == ["run", "--resume", "--set=b=2", "--json", "--run-dir", "d"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_controller_is_restarted_with_resume_and_the_run_completes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "deploy.cli", "run", str(EXAMPLE), "--quick", "--json"]
    argv += [x for s in SETS for x in ("--set", s)]
    argv += ["--run-dir", str(run_dir), "--supervise"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(
            lambda: (run_dir / "checkpoints" / "step_000004").is_dir(),
            180,
            "the checkpoint of step 4",
            proc=proc,
        )
        first = int((run_dir / "controller.pid").read_text())
        old_ranks = list(ranks(first).values())
        assert old_ranks  # the controller's groups are its children
        os.kill(first, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    starts = [json.loads(line) for line in (run_dir / "supervise.jsonl").read_text().splitlines()]
    assert [s["event"] for s in starts] == ["controller_start", "controller_restart"]
    assert starts[1]["cause"] == "killed by SIGKILL" and starts[1]["resumed_from_step"] >= 4
    assert int((run_dir / "controller.pid").read_text()) != first
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 10
    assert [r["step"] for r in records(run_dir) if "stage_step" in r] == list(range(1, 11))
    for pid in old_ranks:  # the killed controller's ranks died with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(120)
def test_bad_input_is_not_retried(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "run", str(EXAMPLE), "--set", "stages.0.steps=-1"]
    argv += ["--run-dir", str(tmp_path / "run"), "--supervise"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr
    starts = (tmp_path / "run" / "supervise.jsonl").read_text().splitlines()
    assert len(starts) == 1
    assert "restart" not in done.stderr.replace("controller_restart", "")
