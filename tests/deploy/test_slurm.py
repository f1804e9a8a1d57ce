"""``hybridflow slurm``: the sbatch script, and real jobs on a one-node SLURM cluster (.ci/slurm-up):
a quick run completes and writes its metrics; a cancelled job leaves no process behind."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.commands.slurm import SlurmOptions, job_state, render
from deploy.experiment import load, placement
from tests.conftest import require_system
from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]


def cluster_up(wait: float = 30.0) -> bool:
    """The node takes jobs (idle or mixed); a job that just ended may hold it a few seconds
    (completing), so this waits up to ``wait`` seconds."""
    if shutil.which("sinfo") is None:
        return False
    deadline = time.monotonic() + wait
    while True:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        if done.returncode == 0 and ("idle" in done.stdout or "mix" in done.stdout):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)


@pytest.fixture
def slurm() -> None:
    require_system("SLURM", cluster_up(), "start a one-node cluster with .ci/slurm-up")


def test_the_script_starts_the_controller_then_each_group(tmp_path: Path) -> None:
    exp = load(EXAMPLES / "ppo.yaml")
    opts = SlurmOptions(
        experiment=EXAMPLES / "ppo.yaml",
        nodes=2,
        partition="gpu",
        time="01:00:00",
        gpus_per_node=1,
        quick=True,
        overrides=("stages.1.steps=3",),
        port=None,
        keys=Path("/k"),
    )
    script = render(exp, placement(exp), opts, tmp_path)
    # the controller on node 0, then the groups round robin from node 1: main there, value on 0
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    main, value = script.index("# group main"), script.index("# group value")
    assert "--nodelist=${nodes[1]}" in script[main:value]
    assert "--nodelist=${nodes[0]}" in script[value:]
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --gpus-per-node=1" in script
    assert 'head=$(scontrol show node "${nodes[0]}"' in script  # two nodes: its NodeAddr
    assert script.count("deploy.cli role") == 2 and "--launcher env" in script
    assert "role actor,reference" in script and "role critic,reward" in script
    assert "--set stages.1.steps=3" in script and "--quick" in script
    assert script.index("deploy.cli controller") < script.index("deploy.cli role")
    assert script.count("--keys /k") == 3 and "--client critics" not in script
    assert "--keys /k --client main" in script and "--keys /k --client value" in script
    # the controller's port: one free on the first node as the script starts there (a port made
    # of the job id could be another job's); the line runs and prints one
    (port_line,) = [line for line in script.splitlines() if line.startswith("port=")]
    assert "SLURM_JOB_ID" not in port_line
    shown = subprocess.run(
        ["bash", "-c", f'{port_line}; echo "$port"'], capture_output=True, text=True, check=True
    )
    assert 1024 <= int(shown.stdout) <= 65535


def test_bad_input_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(*argv: str) -> int:
        args = build_parser().parse_args(["slurm", *argv])
        code: int = args.fn(args)
        return code

    assert run(str(EXAMPLES / "quickstart.yaml"), "--nodes", "0") == 2
    assert run(str(EXAMPLES / "quickstart.yaml"), "--nodes", "2") == 2  # no --keys
    assert run(str(tmp_path / "missing.yaml")) == 2
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run(str(EXAMPLES / "quickstart.yaml"), "--submit", "--run-dir", str(tmp_path / "r")) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_submitted_run_completes_and_writes_its_metrics(slurm: None, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["slurm", str(EXAMPLES / "quickstart.yaml"), "--quick", "--run-dir", str(run_dir)]
    done = subprocess.run([*CLI, *argv, "--submit"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "COMPLETED" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 46
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) > 40


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scancel_leaves_no_process(slurm: None, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["slurm", str(EXAMPLES / "quickstart.yaml"), "--quick", "--run-dir", str(run_dir)]
    argv += ["--set", "stages.1.steps=1000", "--set", "trainer.val_data=null"]
    subprocess.run([*CLI, *argv], check=True, capture_output=True, timeout=60)
    job = subprocess.run(
        ["sbatch", "--parsable", str(run_dir / "job.sbatch")], capture_output=True, text=True
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and '"grpo"' in metrics.read_text():
                break
            assert job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), job_state(job)
            time.sleep(0.5)
        assert ours(run_dir)  # controller and ranks are running
    finally:
        subprocess.run(["scancel", job], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (ours(run_dir) or job_state(job) == "RUNNING"):
        time.sleep(0.5)
    assert not ours(run_dir)
    assert job_state(job) in ("CANCELLED", "FAILED", "COMPLETING")


def ours(run_dir: Path) -> list[str]:
    """Processes of this job: their command lines name the run dir (controller and ranks)."""
    done = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.timeout(120)
def test_munge_down_and_an_oversized_job_are_refused_before_sbatch(
    slurm: None, tmp_path: Path
) -> None:
    argv = [*CLI, "slurm", str(EXAMPLES / "quickstart.yaml"), "--quick", "--submit"]
    # 1 controller + 8 ranks on a node of 8 CPUs
    big = subprocess.run(
        [*argv, "--run-dir", str(tmp_path / "big"), "--set", "placement.main.nproc=8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert big.returncode == 2
    assert "node 0 of the job would run 9 tasks (controller, main) but a node holds 8" in big.stderr
    assert not (tmp_path / "big").exists()  # nothing written, nothing submitted
    # four nodes of a one-node cluster: the job would sit pending forever
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, timeout=60)
    wide = subprocess.run(
        [*argv, "--run-dir", str(tmp_path / "wide"), "--nodes", "4", "--keys", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wide.returncode == 2
    assert "--nodes=4: the default partition has 1 node(s); the job would never start" in (
        wide.stderr
    )
    assert not (tmp_path / "wide").exists()
    subprocess.run(["pkill", "-x", "munged"], check=True)
    try:
        wait_for(
            lambda: subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 1,
            10,
            "munged gone after pkill",
        )
        down = subprocess.run(
            [*argv, "--run-dir", str(tmp_path / "down")], capture_output=True, text=True, timeout=60
        )
    finally:
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    assert down.returncode == 2
    assert "munged is not running" in " ".join(down.stderr.split()), down.stderr
    assert cluster_up()


def queue() -> str:
    """``squeue``'s jobs: id, state, reason, name (empty: none)."""
    done = subprocess.run(["squeue", "-h", "-o", "%i %T %r %j"], capture_output=True, text=True)
    return done.stdout


@pytest.mark.timeout(420)
def test_a_waiting_job_says_why_and_ctrl_c_cancels_it(slurm: None, tmp_path: Path) -> None:
    """The node held by another job: ``--submit`` prints the pending reason SLURM gives, and
    Ctrl-C cancels the job it submitted (exit 130, no traceback) instead of leaving it queued.
    The blocker takes the whole node, so it first waits for an earlier test's jobs to leave."""
    wait_for(lambda: not queue().strip(), 180, "the queue empty", detail=queue)
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(
            lambda: job_state(blocker) == "RUNNING",
            120,
            f"the blocking job {blocker} running",
            detail=queue,
        )
        argv = ["slurm", str(EXAMPLES / "quickstart.yaml"), "--quick"]
        proc = subprocess.Popen(
            [*CLI, *argv, "--run-dir", str(tmp_path / "run"), "--submit"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        lines = iter(proc.stdout.readline, "")
        assert next(lines).endswith("job.sbatch\n")  # the script written, then submitted
        submitted = next(lines)
        job = re.match(r"submitted job (\d+);", submitted)
        assert job is not None, submitted
        pending = next(lines)  # the first state it sees: waiting behind the blocker
        assert re.fullmatch(rf"job {job[1]}: pending \(\w+\)\n", pending), pending
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
        assert f"job {job[1]}: cancelled (SIGINT)" in err and "Traceback" not in err, err
        wait_for(lambda: job_state(job[1]) in ("CANCELLED", ""), 30, "the job cancelled")
    finally:
        subprocess.run(["scancel", blocker], check=False)
