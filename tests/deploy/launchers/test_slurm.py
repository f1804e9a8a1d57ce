"""The SLURM launcher's batch job: the script for one cluster's groups is valid bash that waits
for every step and fails with any of them; a cluster with its own workdir writes under it. The
launcher on a real SLURM cluster: ``tests/deploy/test_multicluster.py``,
``tests/deploy/test_cluster_restart.py``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from controller.placement import GroupSpec, RoleSpec
from deploy.clusters import SlurmCluster
from deploy.experiment import ExperimentError
from deploy.launchers.sbatch import slurm_cpus_per_node, step_first_node_addr, wait_steps
from deploy.launchers.slurm import SlurmLauncher
from transport.settings import Timeouts


def test_the_groups_job_script_waits_for_every_step_and_fails_with_one(tmp_path: Path) -> None:
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")}, nproc=2)
    job = SlurmLauncher(
        "farm",
        SlurmCluster(kind="slurm", partition="debug", time="00:10:00"),
        tmp_path,
        tmp_path / "keys",
        Timeouts(),
        lambda *_: None,
        "tcp://10.0.0.1:5555",
        "secret-token",
    )
    job.groups = [group]  # what start() keeps before it submits
    script = job.script()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --partition=debug" in script
    assert "--connect tcp://10.0.0.1:5555" in script and "--client gen" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # the end: the first step to fail fails the job at once, whatever still runs
    tail = "\n".join(wait_steps(controller=False))
    steps = "pids=(); (sleep 8) & pids+=($!); (exit 3) & pids+=($!)"
    assert bash(f"{steps}\n{tail}") == 3
    steps = "pids=(); (exit 0) & pids+=($!); (sleep 0.5) & pids+=($!)"
    assert bash(f"{steps}\n{tail}") == 0
    # with a controller: its clean exit ends the run (the groups are waited for); its failure too
    tail = "\n".join(wait_steps(controller=True))
    steps = "(sleep 0.2) & controller=$!; pids=($controller); (sleep 1.5) & pids+=($!)"
    assert bash(f"{steps}\n{tail}") == 0
    steps = "(exit 1) & controller=$!; pids=($controller); (sleep 8) & pids+=($!)"
    assert bash(f"{steps}\n{tail}") == 1


def bash(script: str) -> int:
    """Run a script; it must end within 10 s (a job must not outlive its failed step)."""
    start = time.monotonic()
    code = subprocess.run(["bash", "-c", script], timeout=20).returncode
    assert time.monotonic() - start < 10
    return code


def test_a_cluster_with_its_own_workdir_writes_under_it(tmp_path: Path) -> None:
    group = GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")})
    far = SlurmCluster(kind="slurm", via=["ssh", "login"], workdir="/scratch/me/hf")
    job = SlurmLauncher(
        "site2", far, tmp_path / "run-1", None, Timeouts(), lambda *_: None, "tcp://h:1", "t"
    )
    job.groups = [group]  # what start() keeps before it submits
    script = job.script()
    assert "#SBATCH --chdir=/scratch/me/hf" in script
    assert "#SBATCH --output=runs/run-1/site2/slurm-%j.out" in script
    assert "--run-dir runs/run-1/site2" in script and str(tmp_path) not in script


def test_the_step_s_first_node_is_asked_again_while_slurmctld_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of a step asks slurmctld for the first node's address at once; one that is
    slow to answer is asked again, never replaced by the node's name (which need not
    resolve), and one that never answers is named."""

    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo x >> {calls}\n"
        f'if [ "$(wc -l < {calls})" -le 2 ]; then echo "Socket timed out" >&2; exit 1; fi\n'
        'if [ "$2" = hostnames ]; then echo n1; echo n2; exit 0; fi\n'
        'echo "NodeName=n1 Arch=x86_64 NodeAddr=10.9.9.1 NodeHostName=n1 State=IDLE"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    env = {"SLURM_STEP_NODELIST": "n[1-2]"}
    assert step_first_node_addr(env) == "10.9.9.1"
    assert len(calls.read_text().split()) == 4  # two failures, then hostnames and the node
    calls.write_text("")
    fake.write_text('#!/bin/sh\necho "Unable to contact slurm controller" >&2\nexit 1\n')
    with pytest.raises(SystemExit, match="slurmctld does not answer"):
        step_first_node_addr(env, patience_s=0.6)


def test_a_busy_slurmctld_is_asked_again_for_the_node_size_and_a_down_one_is_named_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The probe before a run starts (``sinfo``): an answer that timed out (slurmctld up and
    busy) is asked again, saying so; a slurmctld that cannot be reached fails at once."""
    calls = tmp_path / "calls"
    fake = tmp_path / "sinfo"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo x >> {calls}\n"
        f'if [ "$(wc -l < {calls})" -le 2 ]; then\n'
        '  echo "sinfo: error: Socket timed out on send/recv operation" >&2; exit 1\nfi\n'
        "echo 4; echo 2\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm_cpus_per_node("cluster 'c'", [], None) == 2
    assert len(calls.read_text().split()) == 3
    assert (
        capfd.readouterr().err.count("sinfo failed, asking again: sinfo: error: Socket timed") == 2
    )
    fake.write_text(
        f"#!/bin/sh\necho x >> {calls}\necho 'Unable to contact slurm controller' >&2\nexit 1\n"
    )
    calls.write_text("")
    with pytest.raises(ExperimentError, match="cluster 'c': slurmctld does not answer"):
        slurm_cpus_per_node("cluster 'c'", [], None)
    assert len(calls.read_text().split()) == 1
    fake.write_text("#!/bin/sh\necho 'Socket timed out on send/recv operation' >&2\nexit 1\n")
    start = time.monotonic()
    with pytest.raises(ExperimentError, match="Socket timed out"):
        slurm_cpus_per_node("cluster 'c'", [], None, patience_s=0.6)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("answers", "ended"),
    [
        (["JobState=BOOT_FAIL Reason=NodeDown"], "BOOT_FAIL"),
        (["JobState=DEADLINE Reason=DeadLine"], "DEADLINE"),
        (["", "!slurm_load_jobs error: Invalid job id specified"], "GONE"),
    ],
)
def test_a_job_that_ended_in_any_of_slurms_final_states_reports_its_groups_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: list[str], ended: str
) -> None:
    """States this cluster cannot be made to reach (a node that fails to boot, a deadline
    passed) and a job slurmctld has forgotten: scontrol answers as SLURM would, first running
    (then, for the forgotten job, not answering at all, which is not an end)."""
    script = [
        "#!/bin/sh",
        f"n=$(cat {tmp_path}/n 2>/dev/null || echo 0)",
        f"echo $((n+1)) > {tmp_path}/n",
    ]
    script.append('if [ "$n" = 0 ]; then echo "JobId=7 JobState=RUNNING Reason=None"; exit 0; fi')
    for i, answer in enumerate(answers, start=1):
        if answer.startswith("!"):
            script.append(f'if [ "$n" -ge {i} ]; then echo "{answer[1:]}" >&2; exit 1; fi')
        elif answer:
            script.append(f'if [ "$n" -ge {i} ]; then echo "JobId=7 {answer}"; exit 0; fi')
    script.append("exit 1")  # no answer (slurmctld busy)
    fake = tmp_path / "scontrol"
    fake.write_text("\n".join(script) + "\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    deaths: list[tuple[str, int | None, str]] = []
    job = SlurmLauncher(
        "farm",
        SlurmCluster(kind="slurm"),
        tmp_path / "run",
        None,
        Timeouts(),
        lambda *death: deaths.append(death),
        "tcp://h:1",
        "t",
    )
    job.groups = [GroupSpec(name="gen", roles={"rollout": RoleSpec(cls="a:B")})]
    job.job, job.job_of = "7", {"gen": "7"}
    asyncio.run(asyncio.wait_for(job._follow("7"), 30))
    ((group, rank, cause),) = deaths
    assert (group, rank) == ("gen", None)
    assert cause.startswith(f"SLURM job 7 on cluster 'farm' ended {ended} (output: "), cause
