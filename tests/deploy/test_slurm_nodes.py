"""SLURM over several nodes: a private SLURM cluster (its own slurmctld, a slurmd a node) whose
nodes are network namespaces with their own addresses and, through a UTS namespace each, their
own hostnames, joined by a bridge; munge is shared through the filesystem as on a real cluster.
``hybridflow slurm --nodes N --keys`` runs the quick quickstart with the controller on the first
node and groups over the others, over CURVE; the links between the nodes carry the run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from deploy.launchers.sbatch import FAILED_STEPS
from tests.deploy.test_deploy_docs import PLAN_BLOCK, block_with, substituted
from tests.deploy.test_netns import netns_available, veth_bytes_of
from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLI = [sys.executable, "-m", "deploy.cli"]

CONF = """\
ClusterName=hfnodes
SlurmctldHost=hfnode1({head})
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def daemons_available() -> bool:
    have = all(shutil.which(b) for b in ("slurmctld", "slurmd", "sinfo", "nsenter", "unshare"))
    munge = subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
    return have and munge and netns_available()


def node_ns(n: int) -> str:
    """The network namespace of node ``n`` (1-based) of this process's test cluster."""
    return f"hf{n}n{os.getpid()}"


def node_address(n: int) -> str:
    """The address of node ``n`` (1-based) of the test cluster."""
    return f"10.231.30.{n}"


@contextmanager
def slurm_nodes(count: int = 2) -> Iterator[tuple[list[str], dict[str, str], str]]:
    """The cluster of ``count`` nodes (``two_nodes``; a benchmark's too, ``bench/multinode.py``):
    each node a network namespace whose link ``v<ns>`` goes to a bridge in a switch namespace,
    so every pair of nodes talks through its own two links. Yields (a command prefix that runs
    on node 1, the environment naming this cluster's config, node 2's network namespace)."""
    d = Path(tempfile.mkdtemp(prefix="hfs-"))  # short: slurmd's socket paths are limited
    names = [f"hfnode{n}" for n in range(1, count + 1)]
    ns = {name: node_ns(n) for n, name in enumerate(names, 1)}
    switch = f"hfsw{os.getpid()}"
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run(["ip", "netns", "add", switch], check=True)
        subprocess.run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"], check=True)
        subprocess.run(["ip", "-n", switch, "link", "set", "br0", "up"], check=True)
        for n, name in enumerate(names, 1):
            node = ns[name]
            subprocess.run(["ip", "netns", "add", node], check=True)
            subprocess.run(["ip", "-n", node, "link", "set", "lo", "up"], check=True)
            peer = ["type", "veth", "peer", f"s{node}", "netns", switch]
            subprocess.run(["ip", "link", "add", f"v{node}", "netns", node, *peer], check=True)
            subprocess.run(["ip", "-n", switch, "link", "set", f"s{node}", "master", "br0"])
            subprocess.run(["ip", "-n", switch, "link", "set", f"s{node}", "up"], check=True)
            addr = f"{node_address(n)}/24"
            subprocess.run(["ip", "-n", node, "addr", "add", addr, "dev", f"v{node}"], check=True)
            subprocess.run(["ip", "-n", node, "link", "set", f"v{node}", "up"], check=True)
            (d / f"spool-{name}").mkdir()
        (d / "state").mkdir()
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={node_address(n)} CPUs=4 RealMemory=8000 State=UNKNOWN"
            for n, name in enumerate(names, 1)
        )
        conf = d / "slurm.conf"
        conf.write_text(CONF.format(d=d, head=node_address(1), nodes=nodes))

        def on(name: str) -> list[str]:
            # network namespace only: the node keeps /sys/fs/cgroup, which slurmd needs
            return ["nsenter", f"--net=/run/netns/{ns[name]}"]

        def start(name: str, daemon: str) -> None:
            line = f"hostname {name} && exec {daemon} -D -f {conf}"
            log = open(d / f"{daemon}-{name}.out", "wb")  # the daemon's stdout
            daemons.append(
                subprocess.Popen(
                    [*on(name), "unshare", "--uts", "sh", "-c", line], stdout=log, stderr=log
                )
            )

        start("hfnode1", "slurmctld")
        for name in names:
            start(name, "slurmd")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                [*on("hfnode1"), "sinfo", "-h", "-o", "%T %D"],
                capture_output=True,
                text=True,
                env=env,
            )
            if done.stdout.split() == ["idle", str(count)]:
                break
            assert time.monotonic() < deadline, (done.stdout, done.stderr, list(d.iterdir()))
            time.sleep(0.3)
        yield on("hfnode1"), env, ns["hfnode2"]
    finally:
        for proc in daemons:  # TERM first: slurmctld reaps its own helpers
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in [*ns.values(), switch]:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_over_two_slurm_nodes(
    two_nodes: tuple[list[str], dict[str, str], str], tmp_path: Path
) -> None:
    node1, env, node2 = two_nodes
    keys, run_dir = tmp_path / "keys", tmp_path / "run"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    before = veth_bytes_of(node2, f"v{node2}")
    argv = ["slurm", str(EXAMPLES / "quickstart.yaml"), "--quick", "--nodes", "2"]
    argv += ["--keys", str(keys), "--run-dir", str(run_dir), "--submit"]
    done = subprocess.run(
        [*node1, *CLI, *argv], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "COMPLETED" in done.stdout
    script = (run_dir / "job.sbatch").read_text()
    assert "--nodelist=${nodes[0]}" in script.split("deploy.cli controller")[0]
    assert "--nodelist=${nodes[1]}" in script.split("# group main")[1]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 46
    crossed = veth_bytes_of(node2, f"v{node2}") - before
    print(f"bytes between the nodes: {crossed}")
    assert crossed > 1_000_000, crossed


def slurm_run(
    node1: list[str],
    env: dict[str, str],
    run_dir: Path,
    exp: Path,
    *sets: str,
    nodes: int = 2,
    argv: list[str] | None = None,
) -> str:
    """``hybridflow slurm EXP --quick --nodes N --submit`` (or ``argv``, a command's words after
    ``deploy.cli``, with ``--quick`` added), shortened; its output."""
    if argv is None:
        argv = ["slurm", str(exp), "--nodes", str(nodes)]
        argv += ["--keys", str(run_dir.parent / "keys"), "--submit"]
    argv = [*argv, "--quick", "--run-dir", str(run_dir)]
    for override in ["stages.0.steps=6", "stages.1.steps=2", "trainer.val_every=100", *sets]:
        argv += ["--set", override]
    done = subprocess.run(
        [*node1, *CLI, *argv], capture_output=True, text=True, env=env, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "COMPLETED" in done.stdout
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_planned_group_over_two_nodes_trains_bitwise_as_on_one(
    two_nodes: tuple[list[str], dict[str, str], str], tmp_path: Path
) -> None:
    """docs/deploy.md's plan block, its commands as the doc has them: ``hybridflow plan --gpus 4
    --gpus-per-node 2 --write`` puts the quickstart's group on two nodes; ``hybridflow slurm``
    runs the written file as it is: two ranks a node (one node also runs the controller),
    gloo's all-reduce over the link between the nodes, CURVE on the group's own links. It
    trains to the same bits as the same four ranks on one node. As the doc says for CPU nodes,
    the quickstart says ``device: cpu`` and the submission leaves out ``--gpus-per-node``."""
    node1, env, node2 = two_nodes
    planned, keys = tmp_path / "planned.yaml", tmp_path / "keys"
    _, (plan, keygen, submit) = block_with(PLAN_BLOCK)
    paths = {"examples_quickstart_yaml": on_cpu(tmp_path), "planned_yaml": planned, "keys": keys}
    for argv in (plan, keygen):
        subprocess.run(substituted(argv, **paths), check=True, capture_output=True)
    ((name, group),) = yaml.safe_load(planned.read_text())["placement"].items()
    assert (group["nproc"], group["nodes"]) == (4, 2), group
    at = submit.index("--gpus-per-node")  # CPU nodes have no GPUs to ask for
    submit = substituted(submit[:at] + submit[at + 2 :], **paths)[3:]  # after ``deploy.cli``
    before = veth_bytes_of(node2, f"v{node2}")
    slurm_run(node1, env, tmp_path / "spread", planned, argv=submit)
    crossed = veth_bytes_of(node2, f"v{node2}") - before
    slurm_run(node1, env, tmp_path / "one", planned, f"placement.{name}.nodes=1", argv=submit)
    script = (tmp_path / "spread" / "job.sbatch").read_text()
    steps = script.split(f"# group {name}")[1]
    assert "--nodes=2 --ntasks=4 --ntasks-per-node=2 --distribution=block" in steps
    assert "--nodelist=${nodes[1]},${nodes[0]}" in steps
    assert "--master-addr @step" in steps  # where SLURM put task 0, asked by each rank
    alone = (tmp_path / "one" / "job.sbatch").read_text().split(f"# group {name}")[1]
    assert "--nodes=1 --ntasks=4" in alone and "--master-addr 127.0.0.1" in alone
    spread, one = (
        (tmp_path / run / "export" / "actor" / "model.safetensors").read_bytes()
        for run in ("spread", "one")
    )
    assert spread == one  # bitwise: the same weights after the SFT and GRPO steps
    summaries = [json.loads((tmp_path / r / "summary.json").read_text()) for r in ("spread", "one")]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 8
    print(f"bytes between the nodes with the group spread: {crossed}")
    assert crossed > 1_000_000, crossed  # the gradients crossed between the nodes


def on_cpu(tmp_path: Path) -> Path:
    """The quickstart with its group's ``device: cpu`` said: the plan (for A100s by default,
    which it would write as cuda) keeps the device the file says, so the nodes here run it."""
    source = (EXAMPLES / "quickstart.yaml").read_text()
    group = "main: {roles: [actor, reward], nproc: 2}"
    assert group in source
    path = tmp_path / "quickstart.yaml"
    path.write_text(source.replace(group, group[:-1] + ", device: cpu}"))
    return path


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "stage_step" in r]


def kill_node(ns: str, run_dir: Path) -> list[int]:
    """SIGKILL at once every rank of the run at ``run_dir`` on the node of network namespace
    ``ns``: the node is lost (its slurmd stays, as a rebooted node's comes back)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    mine = []
    for pid in map(int, pids.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"role" in argv and any(str(run_dir).encode() in a for a in argv):
            mine.append(pid)
    for pid in mine:
        os.kill(pid, signal.SIGKILL)
    return mine


def lose_a_node(
    node1: list[str], env: dict[str, str], node2: str, work: Path, rl_steps: int = 2
) -> tuple[int, str, list[int], Path]:
    """The controller on the first node (``hybridflow run --clusters``), the actor's group of 4
    ranks over both nodes in a job of the cluster, a checkpoint every 2 steps; after step 3 the
    second node's ranks are killed at once. (exit status, output, the pids killed, run dir)."""
    keys, run_dir = work / "keys", work / "run"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main"], check=True, capture_output=True)
    spec = {
        "controller": {"bind": f"tcp://{node_address(1)}:0", "wait": 120},
        "keys": str(keys),
        "clusters": {"pair": {"kind": "slurm", "nodes": 2, "tasks_per_node": 2}},
        "groups": {"main": "pair"},
    }
    (work / "clusters.yaml").write_text(yaml.safe_dump(spec))
    sets = [
        "placement.main={roles: [actor, reward], nproc: 4, nodes: 2, "
        "restart: {max: 2, backoff_s: [0.0]}}",
        "stages.0.steps=6",
        f"stages.1.steps={rl_steps}",
        "trainer.val_every=100",
        "trainer.save_every=2",
    ]
    argv = [*CLI, "run", str(EXAMPLES / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--clusters", str(work / "clusters.yaml"), "--run-dir", str(run_dir)]
    argv += [x for s in sets for x in ("--set", s)]
    out = work / "run.out"
    with (
        open(out, "w") as sink,
        subprocess.Popen(
            [*node1, *argv], stdout=sink, stderr=subprocess.STDOUT, env=env, text=True
        ) as proc,
    ):
        try:
            wait_for(
                lambda: 3 in steps_logged(run_dir),
                240,
                "step 3",
                proc=proc,
                detail=lambda: out.read_text()[-5000:],
            )
            killed = kill_node(node2, run_dir)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    return proc.returncode, out.read_text(), killed, run_dir


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_lost_midway_rolls_back_and_the_group_returns_in_its_job(
    two_nodes: tuple[list[str], dict[str, str], str], tmp_path: Path
) -> None:
    """The group is stateful: the run rolls back to its checkpoint, the group comes back as a
    new step of the same job over the same two nodes, and the run completes, each step once."""
    code, said, killed, run_dir = lose_a_node(*two_nodes, tmp_path)
    assert code == 0, said[-5000:]
    assert len(killed) == 2, killed  # the group's two ranks on that node
    assert steps_logged(run_dir) == list(range(1, 9))  # each step once
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["group"] for e in events if e.get("event") == "rollback"] == ["main"], said[-3000:]
    assert [e["group"] for e in events if e.get("event") == "fault"][:1] == ["main"]
    outputs = sorted((run_dir / "pair").glob("slurm-*.out"))
    assert len(outputs) == 1, outputs  # one job: the group came back as a step of it
    job = outputs[0].name.removeprefix("slurm-").removesuffix(".out")
    node1, env, _ = two_nodes
    state = subprocess.run(
        [*node1, "scontrol", "show", "job", job, "-o"], capture_output=True, text=True, env=env
    )
    # the kill -9 failed a step without ending the job, which completed with the run and says
    # which group's step failed (the script's comment on the job)
    assert "hybridflow: a step failed (137)" in outputs[0].read_text()
    assert "JobState=COMPLETED" in state.stdout, state.stdout + state.stderr
    assert f"Comment={FAILED_STEPS}main=137" in state.stdout


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_plan_for_four_nodes_of_two_runs_as_written(
    four_nodes: tuple[list[str], dict[str, str], str], tmp_path: Path
) -> None:
    """``hybridflow plan --gpus 8 --gpus-per-node 2 --write`` lays the quickstart's group over
    four nodes; ``hybridflow slurm --nodes 4`` runs the file as written: one step of 8 tasks,
    2 a node, and the ring all-reduce of its gradients goes through every node's link."""
    node1, env, _ = four_nodes
    planned = tmp_path / "planned.yaml"
    argv = ["plan", str(on_cpu(tmp_path)), "--gpus", "8", "--gpus-per-node", "2"]
    subprocess.run([*CLI, *argv, "--write", str(planned)], check=True, capture_output=True)
    ((name, group),) = yaml.safe_load(planned.read_text())["placement"].items()
    assert (group["nproc"], group["nodes"]) == (8, 4), group
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", name], check=True, capture_output=True)
    links = [(node_ns(n), f"v{node_ns(n)}") for n in range(1, 5)]
    before = [veth_bytes_of(*link) for link in links]
    slurm_run(node1, env, tmp_path / "run", planned, nodes=4)
    crossed = [veth_bytes_of(*link) - b for link, b in zip(links, before, strict=True)]
    steps = (tmp_path / "run" / "job.sbatch").read_text().split(f"# group {name}")[1]
    assert "--nodes=4 --ntasks=8 --ntasks-per-node=2 --distribution=block" in steps
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 8
    print(f"bytes through each node's link: {crossed}")
    assert all(c > 1_000_000 for c in crossed), crossed  # every node took part in the ring
