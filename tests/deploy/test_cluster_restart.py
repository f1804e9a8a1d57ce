"""A group on a SLURM or an ssh cluster that dies is started again by its launcher and the run goes
on (``SlurmLauncher.restart``, ``RemoteLauncher.restart``; the supervisor:
``controller/supervisor.py``).

The run is the quickstart's tiny model with the reward group alone on the other cluster under a
restart policy; once the RL stage logged a step, that group's rank gets ``kill -9`` (found in
``/proc``, as a real fault is external). The run completes, its metrics hold the restart, and the
replacement is what the launcher promises: on SLURM a new step of the same job (the job's script
keeps its allocation: ``wait_steps``), over ssh a new ssh-started process. The script's end is
also checked on its own, with a fake ``squeue``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.launchers.sbatch import FAILED_STEPS, wait_steps
from deploy.processes import rank_title
from tests.conftest import require_system
from tests.deploy.test_multicluster import our_jobs, rank_processes, settle
from tests.deploy.test_slurm import cluster_up
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "deploy.cli"]
#: the actor here on 1 rank, the reward group (score) elsewhere, restarted at once when it dies
SETTINGS = [
    "placement.main={roles: [actor], nproc: 1}",
    "placement.score={roles: [reward], nproc: 1, restart: {max: 3, backoff_s: [0.0]}}",
    "trainer.val_data=null",
    "logging.tensorboard=false",
    "stages.0.steps=2",
    "stages.0.optim.warmup_steps=1",
    "stages.1.steps=10",
]
FIRST_RL_STEP = 3  # after the 2 SFT steps: every step from here calls the reward group


@dataclass(frozen=True)
class Rank:
    """A rank process seen in /proc."""

    pid: int
    env: dict[str, str]
    parent: int
    parent_name: str  # the parent's comm: slurmstepd, python (a ``hybridflow role``), ...
    role: int = 0  # the ``hybridflow role`` that started it (its parent or its fork server's)


def ranks_of(group: str, marker: Path) -> list[Rank]:
    """The processes running ``group``'s rank of this test's run (they mention ``marker``): a
    process started as a rank has ``--group GROUP`` in its command line under srun, and its
    title names the group when a ``hybridflow role`` started it (``tests/processes.py``)."""
    found = []
    for line in rank_processes(marker):
        pid = int(line.split()[0])
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            name = Path(f"/proc/{parent}/comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        env = dict(v.decode().split("=", 1) for v in raw.split(b"\0") if b"=" in v)
        by_srun = name == "slurmstepd" and group.encode() in _after(argv, b"--group")
        if by_srun:
            found.append(Rank(pid, env, parent, name))
        elif (rank_title(pid) or ("",))[0] == group:
            try:
                found.append(Rank(pid, env, parent, name, _role_command(pid)))
            except (OSError, AssertionError):
                continue  # it or its launcher ended meanwhile
    return found


def _after(argv: list[bytes], option: bytes) -> list[bytes]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == option]


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written
    return found


def rl_step_logged(run_dir: Path) -> bool:
    return any("stage_step" in r and r["step"] >= FIRST_RL_STEP for r in records(run_dir))


def start_run(tmp_path: Path, far: dict[str, Any]) -> subprocess.Popen[str]:
    """``hybridflow run`` with the actor here and the reward group on cluster ``farm``."""
    spec = tmp_path / "clusters.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "controller": {"bind": "tcp://127.0.0.1:0", "wait": 60},
                "clusters": {"home": {"kind": "local"}, "farm": far},
                "groups": {"actor": "home", "reward": "farm"},
            }
        )
    )
    argv = [*CLI, "run", str(ROOT / "examples" / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--clusters", str(spec), "--run-dir", str(tmp_path / "run")]
    argv += [x for s in SETTINGS for x in ("--set", s)]
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        return subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=ROOT)


def kill_rank_mid_run(run: subprocess.Popen[str], tmp_path: Path) -> Rank:
    """Once the RL stage logged a step, ``kill -9`` the reward group's rank; returns it."""
    stderr = lambda: (tmp_path / "err").read_text()[-3000:]  # noqa: E731
    wait_for(lambda: rl_step_logged(tmp_path / "run"), 90, "an RL step", proc=run, detail=stderr)
    (rank,) = wait_for(lambda: ranks_of("score", tmp_path), 30, "the reward rank", proc=run)
    os.kill(rank.pid, signal.SIGKILL)
    return rank


@contextmanager
def ended_on_error(run: subprocess.Popen[str]) -> Iterator[None]:
    """Kill the run when the test fails while it runs (nothing of it outlives the test)."""
    try:
        yield
    except BaseException:
        run.kill()
        run.wait(timeout=30)
        raise


def finish(run: subprocess.Popen[str], tmp_path: Path) -> dict[str, Any]:
    """Wait for the run; it completed (rc 0, every step) and recorded one restart of the
    reward group; returns that record."""
    with ended_on_error(run):
        run.wait(timeout=120)
    assert run.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    summary = json.loads((tmp_path / "out").read_text().splitlines()[-1])
    assert summary["steps"] == 12 and summary["supervision"]["restarts"] == 1
    events = [(r["event"], r["group"]) for r in records(tmp_path / "run") if "event" in r]
    # (a "fault" may follow, logged as the groups' connections close at the run's end)
    assert events[:2] == [("fault", "score"), ("restart", "score")], events
    return next(r for r in records(tmp_path / "run") if r.get("event") == "restart")


def replacement(killed: Rank, marker: Path) -> Rank | None:
    """The reward group's rank that is not ``killed``, once there is one."""
    new = [r for r in ranks_of("score", marker) if r.pid != killed.pid]
    return new[0] if new else None


@pytest.fixture
def slurm() -> None:
    require_system("SLURM", cluster_up(), "start a one-node cluster with .ci/slurm-up")


def comes_back_in_its_job(tmp_path: Path, far: dict[str, Any], outputs: Path) -> None:
    """Kill the reward group's rank on SLURM cluster ``far`` (its job's output in
    ``outputs``): the group comes back as a new step of the same job, the run completes."""
    run = start_run(tmp_path, far)
    with ended_on_error(run):
        killed = kill_rank_mid_run(run, tmp_path)
        job, step = killed.env["SLURM_JOB_ID"], killed.env["SLURM_STEP_ID"]
        again = wait_for(lambda: replacement(killed, tmp_path), 60, "a new rank", proc=run)
        steps = subprocess.run(
            ["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True
        ).stdout.split("\n")
    restart = finish(run, tmp_path)
    # the same job, a new step (named after the group), started under slurmstepd like the first
    assert again.parent_name == "slurmstepd"
    assert again.env["SLURM_JOB_ID"] == job and again.env["SLURM_STEP_ID"] != step
    assert f"{job}.{again.env['SLURM_STEP_ID']} score" in steps
    assert f"{job}.{step} score" not in steps  # the old step was over before the new one began
    assert restart["tries"] == 1 and restart["recover_s"] < 60
    # one job for the whole run: it kept its allocation, then completed when the run was over
    (out,) = outputs.glob("slurm-*.out")
    assert out.name == f"slurm-{job}.out"
    assert "a step failed (137)" in out.read_text()  # the kill -9, which did not end the job
    assert settle(our_jobs) == []
    state = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True)
    assert "JobState=COMPLETED" in state.stdout
    assert f"Comment={FAILED_STEPS}score=137" in state.stdout  # how the script reported it
    assert settle(lambda: rank_processes(tmp_path)) == []


# extended: tests/deploy/test_slurm_nodes.py's node-lost test (default tier) shows the same on a
# group over two nodes: a kill -9 fails a step, the group comes back as a new step of its job,
# the job completes with the failed step in its comment; this one adds the step names in squeue
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slurm_group_comes_back_as_a_new_step_of_its_job(slurm: None, tmp_path: Path) -> None:
    comes_back_in_its_job(tmp_path, {"kind": "slurm"}, tmp_path / "run" / "farm")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_new_step_is_started_through_ssh_on_the_login_node(slurm: None, tmp_path: Path) -> None:
    """The same with the cluster reached through ``via`` (a private sshd on loopback): the
    replacement's srun runs there, in the cluster's workdir, with the token on its stdin."""
    from tests.deploy.sshd import sshd

    there = tmp_path / "there"
    there.mkdir()
    with sshd(tmp_path / "ssh", "127.0.0.1") as login:
        far = {"kind": "slurm", "via": login, "workdir": str(there)}
        comes_back_in_its_job(tmp_path, far, there / "runs" / "run" / "farm")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slurm_group_whose_job_is_gone_comes_back_in_a_job_of_its_own(
    slurm: None, tmp_path: Path
) -> None:
    run = start_run(tmp_path, {"kind": "slurm"})
    with ended_on_error(run):
        wait_for(lambda: rl_step_logged(tmp_path / "run"), 90, "an RL step", proc=run)
        (first,) = wait_for(lambda: ranks_of("score", tmp_path), 30, "the reward rank", proc=run)
        job = first.env["SLURM_JOB_ID"]
        subprocess.run(["scancel", job], check=True)  # the allocation ends under the run

        def elsewhere() -> Rank | None:
            new = [r for r in ranks_of("score", tmp_path) if r.env["SLURM_JOB_ID"] != job]
            return new[0] if new else None

        again = wait_for(elsewhere, 90, "the reward group in a new job", proc=run)
    finish(run, tmp_path)
    assert again.env["SLURM_STEP_ID"] == "0" and again.parent_name == "slurmstepd"
    outputs = sorted((tmp_path / "run" / "farm").glob("slurm-*.out"))
    second = f"slurm-{again.env['SLURM_JOB_ID']}.out"
    assert [o.name for o in outputs] == [f"slurm-{job}.out", second]
    assert "CANCELLED" in outputs[0].read_text()
    assert "group score joined" in outputs[1].read_text()  # a job of the reward group alone
    assert settle(our_jobs) == []
    assert settle(lambda: rank_processes(tmp_path)) == []


# extended: tests/deploy/test_netns.py's group over two ssh hosts (default tier) shows a rank
# over ssh killed and started again through a second login, and nothing left after the run
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_over_ssh_comes_back_as_a_new_ssh_process(tmp_path: Path) -> None:
    from tests.deploy.sshd import sshd

    with sshd(tmp_path / "ssh", "127.0.0.1") as login:
        run = start_run(tmp_path, {"kind": "remote", "via": login})
        with ended_on_error(run):
            killed = kill_rank_mid_run(run, tmp_path)
            again = wait_for(lambda: replacement(killed, tmp_path), 60, "a new rank", proc=run)
            old_role, new_role = killed.role, again.role
            role = _parent(new_role)  # the new ``hybridflow role``, started by sshd
        restart = finish(run, tmp_path)
        logins = (tmp_path / "ssh" / "log").read_text().count("Accepted publickey")
    assert new_role != old_role  # a new ``hybridflow role``, over a second ssh login
    assert role[1] == "sshd" and logins == 2
    assert settle(lambda: Path(f"/proc/{old_role}").exists()) is False  # the old one left
    assert restart["tries"] == 1 and restart["recover_s"] < 60
    assert settle(lambda: rank_processes(tmp_path)) == []


def _role_command(pid: int) -> int:
    """The ``hybridflow role`` process above rank ``pid`` (its parent, or its fork server's)."""
    while pid > 1:
        pid = _parent(pid)[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"deploy.cli" in argv and b"role" in argv:
            return pid
    raise AssertionError("no hybridflow role above the rank")


def _parent(pid: int) -> tuple[int, str]:
    """The parent of process ``pid``: its id and name (comm)."""
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    return parent, Path(f"/proc/{parent}/comm").read_text().strip()


def test_the_job_outlives_a_failed_step_of_a_group_that_comes_back(tmp_path: Path) -> None:
    """The script's end (``wait_steps`` with ``linger_s``), with fakes of ``squeue`` (it lists a
    group's step while the file ``step`` exists) and ``scontrol``: a failed step in ``again``
    does not end the job but is written in its Comment for the controller; the job stays while
    a step runs and ``linger_s`` seconds after; SIGUSR1 ends it at once; a failed step of a
    group that does not come back still ends it with its status."""
    calls, said = tmp_path / "calls", tmp_path / "said"
    fakes = {
        # each call writes what it saw, after it looked: ``step`` (a group's step runs) or ``none``
        "squeue": f'echo "$SLURM_JOB_ID.batch"\nif [ -e {tmp_path / "step"} ]; then\n'
        f'echo "$SLURM_JOB_ID.1"; echo step >> {calls}\nelse echo none >> {calls}; fi\nexit 0',
        "scontrol": f'echo "$@" >> {said}',
    }
    for name, body in fakes.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    tail = "\n".join(wait_steps(controller=False, linger_s=1))

    def script(steps: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", "-c", f"set -u\n{steps}\n{tail}"], env=env, text=True)

    gone = "pids=() again=(); (exit 9) & pids+=($!); again[$!]=score; (exit 0) & pids+=($!)"
    (tmp_path / "step").touch()  # its replacement runs
    job = script(gone)
    wait_for(lambda: calls.exists(), 10, "the script seeing the step in squeue", proc=job)
    assert job.poll() is None  # the failed step did not end it
    assert said.read_text() == f"update JobId=7 Comment={FAILED_STEPS}score=9\n"
    (tmp_path / "step").unlink()  # the replacement is over
    assert job.wait(timeout=10) == 0
    seen = calls.read_text().split()
    assert seen[0] == "step" and seen[-1] == "none"  # it looked again before it ended

    (tmp_path / "step").touch()
    calls.unlink()
    job = script(gone)
    wait_for(lambda: calls.exists(), 10, "the script asking squeue", proc=job)
    job.send_signal(signal.SIGUSR1)  # the controller's end of the run
    start = time.monotonic()
    assert job.wait(timeout=10) == 0 and time.monotonic() - start < 5

    other = "pids=() again=(); (exit 3) & pids+=($!); (sleep 8) & pids+=($!); again[$!]=score"
    start = time.monotonic()
    assert script(other).wait(timeout=10) == 3 and time.monotonic() - start < 5
