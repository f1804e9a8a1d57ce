"""``hybridflow run EXP --clusters SPEC``: one controller, groups on two clusters (this host and
the one-node SLURM cluster of .ci/slurm-up). A quick run completes with the rollout group in the
SLURM job taking the actor's weights every step; a launch that fails part-way, a job that dies and
a run stopped by SIGTERM leave no process and no job behind. A manual cluster's printed command
joins the run, and a SLURM cluster is also driven through ssh to its "login node"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_system
from tests.deploy.test_slurm import cluster_up

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]
WITH_ROLLOUT = ["roles.rollout={model: base}", "placement.gen={roles: [rollout], nproc: 1}"]


@pytest.fixture
def slurm() -> None:
    require_system("SLURM", cluster_up(), "start a one-node cluster with .ci/slurm-up")


def write_spec(path: Path, farm: dict[str, Any]) -> Path:
    spec = {
        "controller": {"bind": "tcp://127.0.0.1:0", "wait": 60},
        "clusters": {"home": {"kind": "local"}, "farm": {"kind": "slurm", **farm}},
        "groups": {"actor": "home", "rollout": "farm"},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def run_argv(spec: Path, run_dir: Path, *extra: str) -> list[str]:
    argv = [*CLI, "run", str(EXAMPLES / "quickstart.yaml"), "--clusters", str(spec)]
    argv += ["--run-dir", str(run_dir), "--json"]
    for override in WITH_ROLLOUT:
        argv += ["--set", override]
    return [*argv, *extra]


def assert_fresh_weights(done: subprocess.CompletedProcess[str], run_dir: Path) -> None:
    """The quick run completed (46 steps), and the rollout group generated every batch with the
    weights the actor had just trained: policy versions 41..46 (40 SFT steps came first), never
    stale."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 46
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rl = [r for r in rows if "train/staleness" in r]
    assert [r["train/weight_version"] for r in rl] == [41, 42, 43, 44, 45, 46]
    assert all(r["train/staleness"] == 0 for r in rl)
    # each sync moved the weights rank to rank: megabytes into the rollout group's rank 0,
    # while the controller carried only the sync's commands (names, shapes, addresses)
    assert all(r["train/sync/bytes"] > 1_000_000 for r in rl), [r["train/sync/bytes"] for r in rl]
    assert all(0 < r["train/sync/controller_bytes"] < 64 << 10 for r in rl), rl
    assert all(r["train/sync/controller_weight_bytes"] == 0 for r in rl), rl  # no tensor at all


def our_jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "hybridflow-farm" in line]


def rank_processes(marker: str | Path) -> list[str]:
    """Rank and ``hybridflow role`` processes of one test: those whose command line,
    environment or open files (a rank's log) mention ``marker`` (the test's folder or its
    controller's address) — other runs on the machine are not this test's business."""
    out = subprocess.run(["pgrep", "-af", "roles.runtime|deploy.cli role"], capture_output=True)
    return [line for line in out.stdout.decode().splitlines() if _mentions(line, str(marker))]


def _mentions(line: str, marker: str) -> bool:
    proc = Path("/proc") / line.split()[0]
    try:
        seen = [(proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()]
        seen += [os.readlink(fd).encode() for fd in (proc / "fd").iterdir()]
    except OSError:
        return False  # gone meanwhile
    return any(marker.encode() in text for text in seen)


def settle(check: Any, limit: float = 20.0) -> Any:
    deadline = time.monotonic() + limit
    while (found := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_over_a_local_and_a_slurm_cluster(slurm: None, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "clusters.yaml", {})
    done = subprocess.run(
        run_argv(spec, tmp_path / "run", "--quick"), capture_output=True, text=True, timeout=200
    )
    assert_fresh_weights(done, tmp_path / "run")  # the SLURM group had each new version
    (out,) = (tmp_path / "run" / "farm").glob("slurm-*.out")
    assert "deploy.cli role" not in out.read_text()  # the job's own output, no shell echo
    assert settle(our_jobs) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_submission_stops_the_groups_already_started(slurm: None, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "clusters.yaml", {"time": "not-a-time"})
    done = subprocess.run(
        run_argv(spec, tmp_path / "run", "--quick"), capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 1
    assert "cluster 'farm': sbatch" in done.stderr and "time" in done.stderr.lower()
    assert settle(lambda: rank_processes(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_that_dies_ends_the_run_with_its_cause(slurm: None, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "clusters.yaml", {"python": "/nonexistent/python"})
    start = time.monotonic()
    done = subprocess.run(
        run_argv(spec, tmp_path / "run", "--quick"), capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 1
    text = " ".join(done.stderr.split())
    assert "group 'gen' died while starting: SLURM job" in text and "ended FAILED" in text
    assert time.monotonic() - start < 40  # not the 60 s join wait
    assert settle(our_jobs) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_mid_run_leaves_no_job_and_no_process(slurm: None, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "clusters.yaml", {})
    run = subprocess.Popen(
        run_argv(spec, tmp_path / "run"),  # the full run: minutes, stopped after a few steps
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert run.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.2)
    assert len(our_jobs()) == 1
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) != 0
    assert settle(our_jobs) == []
    assert settle(lambda: rank_processes(tmp_path)) == []


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_manual_cluster_prints_the_command_that_joins(tmp_path: Path) -> None:
    from tests.deploy.test_controller_cli import wait_for_line

    spec = tmp_path / "clusters.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "controller": {"bind": "tcp://127.0.0.1:0", "wait": 60},
                "clusters": {"home": {"kind": "local"}, "desk": {"kind": "manual"}},
                "groups": {"actor": "home", "rollout": "desk"},
            }
        )
    )
    err = tmp_path / "run.err"
    with err.open("w") as stderr:
        run = subprocess.Popen(
            run_argv(spec, tmp_path / "run", "--quick"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        command = r"HYBRIDFLOW_TOKEN=(\w+) hybridflow (role rollout .+)\n"
        found = wait_for_line(err, command, run, 60, "the run printing the rollout group's command")
        argv = [*found.group(2).split(), "--run-dir", str(tmp_path / "desk")]
        assert "--group gen" in found.group(2)
        role = subprocess.run(
            [*CLI, *argv], env={**os.environ, "HYBRIDFLOW_TOKEN": found.group(1)}, timeout=120
        )
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert role.returncode == 0 and run.returncode == 0, err.read_text()[-2000:]
    assert json.loads(out.splitlines()[-1])["steps"] == 46


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slurm_cluster_reached_through_ssh(slurm: None, tmp_path: Path) -> None:
    """sinfo, sbatch (the script on stdin), scontrol and the output folder all go through
    `via` (ssh to a login node: here a private sshd on loopback), in the cluster's workdir."""
    from tests.deploy.sshd import sshd

    there = tmp_path / "there"
    there.mkdir()
    with sshd(tmp_path / "ssh", "127.0.0.1") as login:
        spec = write_spec(tmp_path / "clusters.yaml", {"via": login, "workdir": str(there)})
        done = subprocess.run(
            run_argv(spec, tmp_path / "run", "--quick"), capture_output=True, text=True, timeout=200
        )
    assert_fresh_weights(done, tmp_path / "run")
    (out,) = (there / "runs" / "run" / "farm").glob("slurm-*.out")  # under the workdir there
    assert "error" not in out.read_text().lower()
    assert (tmp_path / "ssh" / "log").read_text().count("Accepted publickey") >= 3
    assert settle(our_jobs) == []
