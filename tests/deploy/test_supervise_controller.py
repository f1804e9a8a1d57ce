"""``hybridflow run --supervise`` (``deploy/commands/supervise.py``).

End to end, on real processes (the supervisor, the controller it starts, the controller's ranks):
the controller killed with SIGKILL after a checkpoint is started again with ``--resume``, the run
completes with every step once, and nothing outlives it; bad input is not retried. With a fake
child (a few lines of Python): the restart policy and its window, SIGINT/SIGTERM passed on and
not followed by a restart, and a child that dies with its supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import EXAMPLE, ranks, records
from controller.placement import RestartPolicy
from deploy.commands.supervise import LOG, PID_FILE, Supervision, child_argv
from tests.waiting import wait_for

SETS = [
    "stages.0.steps=2",
    "stages.0.optim.warmup_steps=1",
    "stages.1.steps=8",
    "trainer.save_every=2",
    "trainer.val_data=null",
    "logging.tensorboard=false",
]

#: a fake controller: says it is up, then waits; SIGINT/SIGTERM are written down and end it (130)
FAKE_CHILD = """
import pathlib, signal, sys
run_dir = pathlib.Path(sys.argv[sys.argv.index("--run-dir") + 1])
def stop(signum, frame):
    (run_dir / "child.signal").write_text(signal.Signals(signum).name)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
(run_dir / "child.ready").write_text("")
while True:
    signal.pause()
"""

#: the supervisor of FAKE_CHILD, as a process of its own: signals are sent to it
SUPERVISOR = """
import sys
from pathlib import Path
from deploy.commands.supervise import RestartPolicy, Supervision
child = [sys.executable, "-c", sys.argv[2]]
sys.exit(Supervision(["run"], Path(sys.argv[1]), RestartPolicy(), child).run())
"""


def starts(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / LOG).read_text().splitlines()]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def naming(run_dir: Path) -> list[int]:
    """Live processes whose command line, environment or open files (a rank's log) name
    ``run_dir`` (a controller, its ranks, a stray supervisor) — other than this test's own."""
    marker, found = str(run_dir).encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            seen = Path(f"/proc/{entry}/cmdline").read_bytes()
            seen += Path(f"/proc/{entry}/environ").read_bytes()
            seen += b"".join(os.readlink(fd).encode() for fd in Path(f"/proc/{entry}/fd").iterdir())
        except OSError:
            continue  # gone, or not ours to read
        if marker in seen and alive(int(entry)):
            found.append(int(entry))
    return found


def test_the_child_command_keeps_the_options_and_resumes_from_the_run_dir() -> None:
    argv = ["run", "exp.yaml", "--quick", "--set", "a=1", "--supervise", "--max-restarts", "5"]
    first = child_argv([*argv, "--run-dir", "old"], Path("d"), resume=False)
    assert first == ["run", "exp.yaml", "--quick", "--set", "a=1", "--run-dir", "d"]
    again = child_argv(["run", "--set=b=2", "exp.yaml", "--supervise", "--json"], Path("d"), True)
    assert again == ["run", "--resume", "--set=b=2", "--json", "--run-dir", "d"]
    # hybridflow's own options before the command; prefixes argparse takes, written in full
    argv = [
        "-v",
        "controller",
        "x.yaml",
        "--sup",
        "--bind",
        "tcp://h:1",
        "--stop",
        "4",
        "--run",
        "o",
    ]
    assert child_argv(argv, Path("d"), True) == [
        "-v",
        "controller",
        "--resume",
        "--bind",
        "tcp://h:1",
        "--stop-after",
        "4",
        "--run-dir",
        "d",
    ]


def test_the_policy_gives_up_past_max_restarts_within_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails = [sys.executable, "-c", "import sys; sys.exit(1)"]
    policy = RestartPolicy(max=2, window_s=600, backoff_s=[0.0])
    assert Supervision(["run", "x.yaml"], tmp_path / "run", policy, fails).run() == 1
    assert [s["try"] for s in starts(tmp_path / "run")] == [1, 2, 3]
    assert [s["cause"] for s in starts(tmp_path / "run")] == [None, "exit 1", "exit 1"]
    assert "raise --max-restarts or --restart-window" in capsys.readouterr().err


#: a fake controller that fails twice, then succeeds (its tries counted in a file)
FAIL_TWICE = """
import pathlib, sys
tries = pathlib.Path(sys.argv[1])
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
sys.exit(1 if len(tries.read_text()) < 3 else 0)
"""


def test_restarts_older_than_the_window_are_not_counted(tmp_path: Path) -> None:
    """max 1 restart within 0.2 s, 0.3 s apart: each restart is the only one in its window; the
    third try succeeds."""
    third_succeeds = [sys.executable, "-c", FAIL_TWICE, str(tmp_path / "tries")]
    policy = RestartPolicy(max=1, window_s=0.2, backoff_s=[0.3])
    assert Supervision(["run", "x.yaml"], tmp_path / "run", policy, third_succeeds).run() == 0
    assert [s["event"] for s in starts(tmp_path / "run")] == [
        "controller_start",
        "controller_restart",
        "controller_restart",
    ]


def start_supervisor(run_dir: Path) -> tuple[subprocess.Popen[str], int]:
    """The supervisor of a fake child, and the child's pid once it is up."""
    argv = [sys.executable, "-c", SUPERVISOR, str(run_dir), FAKE_CHILD]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run_dir / "child.ready").exists(), 30, "the fake child up", proc=proc)
    return proc, int((run_dir / PID_FILE).read_text())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_is_passed_on_and_not_followed_by_a_restart(
    sig: signal.Signals, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc, child = start_supervisor(run_dir)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert (run_dir / "child.signal").read_text() == sig.name
    assert len(starts(run_dir)) == 1 and "restarting" not in err
    assert not alive(child)


def test_the_child_dies_with_a_killed_supervisor(tmp_path: Path) -> None:
    proc, child = start_supervisor(tmp_path / "run")
    try:
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not alive(child), 10, "the child's end (PR_SET_PDEATHSIG)")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_bad_input_is_not_retried_and_leaves_no_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "deploy.cli", "-v", "run", str(EXAMPLE)]
    argv += ["--set", "stages.0.steps=-1", "--run-dir", str(run_dir), "--supervise"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr
    assert "stages.0.steps" in done.stderr  # the child's own message
    tries = [line for line in done.stderr.splitlines() if "hybridflow --supervise: try" in line]
    assert len(tries) == 1 and " -v run " in tries[0], done.stderr
    assert not run_dir.exists()  # as without --supervise: a config error leaves nothing


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
        first = int((run_dir / PID_FILE).read_text())
        old_ranks = list(ranks(first).values())
        assert old_ranks  # the controller's groups are its children
        os.kill(first, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    found = starts(run_dir)
    assert [s["event"] for s in found] == ["controller_start", "controller_restart"]
    assert found[1]["cause"] == "killed by SIGKILL" and found[1]["resumed_from_step"] >= 4
    second = int((run_dir / PID_FILE).read_text())
    assert second != first
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 10
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 10
    # the summary says what the supervisor saw, not only what the last try did
    assert summary["controller_supervision"] == {
        "tries": 2,
        "restarts": 1,
        "causes": ["killed by SIGKILL"],
    }
    assert summary["wall_s_all_tries"] > summary["wall_s"]
    assert [r["step"] for r in records(run_dir) if "stage_step" in r] == list(range(1, 11))
    # the killed controller's ranks died with it; the second controller's ended with the run
    assert not any(alive(pid) for pid in old_ranks)
    assert not ranks(first) and not ranks(second)
    assert not naming(run_dir)
