"""The Ray launcher on a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and a second raylet, each its own node to Ray's scheduler).

One run of the shortened quickstart puts the actor's group over both Ray nodes (a rank each, a
placement group of two bundles spread over distinct nodes) and the reward group on the one-node
SLURM cluster, one controller for both. Midway, the Ray node that is not the head is lost (its
raylet and workers killed) and another joins: the death is reported, the group restarts once
Ray has placed its placement group again, the run rolls back to its checkpoint and ends with the
same weights, bit for bit, as the same run with every group local. Afterwards Ray holds no actor
and no placement group of the run. A relative run folder keeps the ranks' logs on their node
and their last error comes back from it. A
group that asks more than any node has is refused before a rank starts, with what it asked; one
the cluster is too busy to place in time is refused with Ray's state of it. A restart that waits
for Ray leaves the controller's event loop running; ``address: auto`` on a host with two Ray
clusters says which it joined."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_system
from tests.deploy.test_deploy_docs import QUICKSTART, block_with, blocks
from tests.deploy.test_slurm import cluster_up
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "deploy.cli"]
SETS = [
    "placement.main={roles: [actor], nproc: 2, restart: {max: 2, backoff_s: [0.0]}}",
    "placement.score={roles: [reward], nproc: 1}",
    "stages.0.steps=6",
    "stages.1.steps=2",
    "trainer.val_every=100",
    "trainer.save_every=2",
    "logging.tensorboard=false",
]


def ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def two_ray_nodes_cluster() -> Iterator[Any]:
    """A two-node Ray cluster on this machine (2 CPUs a node, no dashboard): Ray's ``Cluster``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 80 << 20},
    )
    try:
        add_worker(cluster)
        yield cluster
    finally:
        cluster.shutdown()


def add_worker(cluster: Any) -> None:
    cluster.add_node(num_cpus=2, object_store_memory=80 << 20)
    cluster.wait_for_nodes()


@contextmanager
def two_ray_nodes() -> Iterator[str]:
    """``two_ray_nodes_cluster``'s address; for ``bench/launch.py`` too."""
    with two_ray_nodes_cluster() as cluster:
        yield str(cluster.address)


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[Any]:
    """``two_ray_nodes_cluster``, up for this module (a test may replace its worker node)."""
    require_system("Ray", ray_installed(), "pip install -e '.[ray]'")
    with two_ray_nodes_cluster() as cluster:
        yield cluster


@pytest.fixture
def ray_cluster(ray_nodes: Any) -> str:
    return str(ray_nodes.address)


def run(tmp_path: Path, name: str, clusters: dict[str, Any] | None, *sets: str) -> Any:
    """``hybridflow run quickstart --quick`` with ``SETS`` (and ``sets``), on ``clusters``."""
    argv = [*CLI, "run", str(ROOT / "examples" / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--run-dir", str(tmp_path / name)]
    if clusters is not None:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump(clusters))
        argv += ["--clusters", str(spec)]
    for override in [*SETS, *sets]:
        argv += ["--set", override]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "stage_step" in r]


def rank_pid(group: str, rank: int, run_dir: Path) -> int | None:
    """The pid of ``group``'s rank ``rank`` of the run at ``run_dir`` (its ``hybridflow role``
    process, which the Ray actor started)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"role" in argv and str(run_dir).encode() in argv and group.encode() in argv:
            if f"RANK={rank}".encode() in env:
                return int(entry)
    return None


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def ancestors(pid: int) -> list[int]:
    found = []
    while pid > 1:
        pid = parent_of(pid)
        found.append(pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_over_two_ray_nodes_survives_a_node_lost_and_equals_the_local_run(
    ray_nodes: Any, tmp_path: Path
) -> None:
    """Midway, the Ray node that is not the head (it hosts one of the group's two ranks) is
    removed, its raylet and workers killed, and a new node joins: the group's restart waits for
    Ray to place its placement group again, then its ranks start, the run rolls back and ends
    with every step once and the local run's weights. The run is docs/deploy.md's Ray block:
    its cluster spec and its run line, with the substitutions this machine needs."""
    require_system("SLURM", cluster_up(), "start a one-node cluster with .ci/slurm-up")
    ray_cluster = str(ray_nodes.address)
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keys", str(keys), "--clients", "main,score"], check=True)
    # docs/deploy.md's Ray block: its spec and its run line's overrides, with this machine's
    # cluster, no GPUs, a controller on loopback, and the reward's group on SLURM beside it
    _, (_, line) = block_with("ray start --head")
    (spec_text,) = [t for _, t in blocks("yaml") if "kind: ray" in t and "cpus_per_rank" in t]
    spec = yaml.safe_load(spec_text)
    spec["controller"] = {"bind": "tcp://127.0.0.1:0", "wait": 120}
    spec["keys"] = str(keys)
    spec["clusters"]["pool"].update(address=ray_cluster)
    del spec["clusters"]["pool"]["gpus_per_rank"]  # the doc's is for GPU nodes
    spec["clusters"]["farm"] = {"kind": "slurm"}
    spec["groups"]["score"] = "farm"
    sets = [line[i + 1] for i, word in enumerate(line) if word == "--set"]
    assert line[:3] == ["hybridflow", "run", QUICKSTART] and sets == ["placement.main.nodes=2"]
    on_ray = tmp_path / "ray"
    proc = run(tmp_path, "ray", spec, *sets)
    try:
        wait_for(lambda: 3 in steps_logged(on_ray), 240, "step 3 on Ray", proc=proc)
        ranks = [wait_for(partial(rank_pid, "main", r, on_ray), 10, f"rank {r}") for r in (0, 1)]
        (node,) = ray_nodes.worker_nodes
        raylet = node.all_processes["raylet"][0].process.pid
        lost = [r for r, pid in enumerate(ranks) if raylet in ancestors(pid)]
        assert len(lost) == 1, (ranks, raylet)  # STRICT_SPREAD: one rank on each node
        ray_nodes.remove_node(node, allow_graceful=False)  # the node is lost
        add_worker(ray_nodes)  # and another joins, where the lost share is placed again
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "class_name:" not in err, err[-4000:]  # a failed start is one line, not Ray's dump
    summary = json.loads(out.splitlines()[-1])
    assert summary["steps"] == 8 and steps_logged(on_ray) == list(range(1, 9))
    events = [json.loads(x) for x in (on_ray / "metrics.jsonl").read_text().splitlines()]
    faults = [e for e in events if e.get("event") == "fault"]
    # the first to see the death wins: Ray's word on the actor, or the mesh's own (rank 1 lost:
    # rank 0 loses its link to it and ends; rank 0 lost: the controller loses the coordinator);
    # any ends the incarnation, once
    assert faults and faults[0]["group"] == "main", faults
    ray_saw = "on Ray cluster 'pool', node" in faults[0]["cause"]
    mesh_saw = ("connection to the coordinator closed", "(the coordinator) lost its connection")
    assert ray_saw or any(m in faults[0]["cause"] for m in mesh_saw), faults[0]
    if ray_saw:
        assert faults[0]["rank"] == lost[0] and "its Ray actor died" in faults[0]["cause"]
    assert [e["group"] for e in events if e.get("event") == "rollback"] == ["main"]
    logs = on_ray / "logs"
    assert (logs / "main-0.log").exists() and (logs / "main-1.log").exists()
    listed = json.loads((on_ray / "processes.json").read_text())["ranks"]
    actors = sorted(r["actor"].rsplit(":", 1)[0] for r in listed if r.get("cluster") == "pool")
    # each rank's Ray node named; the lost node's share now on the node that joined
    assert len({r["ray_node"] for r in listed if r.get("cluster") == "pool"}) == 2, listed
    assert actors == ["hybridflow:pool:main:0", "hybridflow:pool:main:1"], listed

    local = run(tmp_path, "local", None)
    out, err = local.communicate(timeout=300)
    assert local.returncode == 0, err[-4000:]
    weights = [
        (tmp_path / name / "export" / "actor" / "model.safetensors").read_bytes()
        for name in ("ray", "local")
    ]
    assert weights[0] == weights[1]  # the same bits after a rollback over two Ray nodes

    # nothing of the run is left on the cluster: no live actor, no placement group
    import ray

    ray.init(address=ray_cluster, log_to_driver=False, configure_logging=False)
    try:
        table = ray.util.placement_group_table()
        ours = [pg for pg in table.values() if pg["name"].startswith("hybridflow-pool-")]
        assert len(ours) == 1 and ours[0]["state"] == "REMOVED", ours  # the actor group's
        named = ray.util.list_named_actors(all_namespaces=True)
        assert [a for a in named if a["name"].startswith("hybridflow:")] == [], named
    finally:
        ray.shutdown()


@pytest.mark.timeout(180)
def test_a_relative_run_folder_and_an_error_printed_on_the_rank_s_node(
    ray_cluster: str, tmp_path: Path
) -> None:
    """``--run-dir rel``, relative as ``hybridflow run``'s default is: the rank's log goes under
    its working folder on its node (the cluster's ``workdir``), not the Ray worker's folder; the
    error the rank printed there comes back with its death, though this side cannot read that
    log (the controller's ``rel`` holds none)."""
    node = tmp_path / "node"  # the checkout "on the node": another folder than the controller's
    node.mkdir()
    python = tmp_path / "python"  # a node whose python cannot run the rank
    python.write_text("#!/bin/sh\necho 'RuntimeError: no torch on this node' >&2\nexit 3\n")
    python.chmod(0o755)
    spec = tmp_path / "clusters.yaml"
    pool = {"kind": "ray", "address": ray_cluster, "python": str(python), "workdir": str(node)}
    spec.write_text(
        yaml.safe_dump(
            {
                "controller": {"bind": "tcp://127.0.0.1:0", "wait": 60},
                "clusters": {"home": {"kind": "local"}, "pool": pool},
                "groups": {"main": "home", "score": "pool"},
            }
        )
    )
    argv = [*CLI, "run", str(ROOT / "examples" / "quickstart.yaml"), "--quick"]
    argv += ["--run-dir", "rel", "--clusters", str(spec)]
    for override in SETS:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert done.returncode != 0
    said = " ".join(done.stderr.split())
    assert "exited with 3: RuntimeError: no torch on this node" in said, done.stderr[-3000:]
    # the run's first lines name the cluster it joined
    assert re.search(
        r"cluster 'pool': joined the Ray cluster at \S+:\d+ \(2 live node\(s\)\)", said
    )
    log = node / "rel" / "logs" / "score-0.log"
    assert "RuntimeError: no torch on this node" in log.read_text()
    assert not (tmp_path / "rel" / "logs" / "score-0.log").exists()


@pytest.mark.timeout(180)
def test_a_group_no_node_can_hold_is_refused_with_what_it_asked(
    ray_cluster: str, tmp_path: Path
) -> None:
    spec = {
        "controller": {"bind": "tcp://127.0.0.1:0", "wait": 30},
        "clusters": {
            "home": {"kind": "local"},
            "pool": {"kind": "ray", "address": ray_cluster, "gpus_per_rank": 4},
        },
        "groups": {"main": "home", "score": "pool"},
    }
    proc = run(tmp_path, "refused", spec)
    _, err = proc.communicate(timeout=150)
    assert proc.returncode != 0
    said = " ".join(err.split())
    assert "group 'score' cannot be placed on Ray cluster 'pool'" in said, err[-3000:]
    assert "it needs 1 node(s) with CPU 1, GPU 4 each" in said
    assert "0 of its 2 live node(s) have that" in said
    assert not (tmp_path / "refused" / "logs" / "score-0.log").exists()  # no rank started


@pytest.mark.timeout(180)
def test_a_group_the_busy_cluster_does_not_place_in_time_is_refused_with_ray_s_state(
    ray_cluster: str, tmp_path: Path
) -> None:
    """The cluster could hold the group, but something else holds every CPU: Ray leaves the
    group's placement group pending, and the run stops after ``placement_timeout_s``, naming
    the setting and Ray's state of it, and removes it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(address=ray_cluster, log_to_driver=False, configure_logging=False)
    try:
        earlier = set(ray.util.placement_group_table())  # an earlier test's, removed
        hog = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")
        ray.get(hog.ready(), timeout=60)
        spec = {
            "controller": {"bind": "tcp://127.0.0.1:0", "wait": 30},
            "clusters": {
                "home": {"kind": "local"},
                "pool": {"kind": "ray", "address": ray_cluster, "placement_timeout_s": 3},
            },
            "groups": {"main": "home", "score": "pool"},
        }
        proc = run(tmp_path, "busy", spec)
        _, err = proc.communicate(timeout=150)
        table = ray.util.placement_group_table()
        remove_placement_group(hog)
    finally:
        ray.shutdown()
    assert proc.returncode != 0
    said = " ".join(err.split())
    assert "group 'score' was not placed on Ray cluster 'pool' within 3 s" in said, err[-3000:]
    assert "(clusters.pool.placement_timeout_s): Ray says its placement group is PENDING" in said
    ours = [
        pg
        for key, pg in table.items()
        if pg["name"] == "hybridflow-pool-score" and key not in earlier
    ]
    assert [pg["state"] for pg in ours] == ["REMOVED"], ours


@pytest.mark.timeout(180)
def test_a_restart_waiting_for_ray_leaves_the_controller_s_loop_free(
    ray_cluster: str, tmp_path: Path
) -> None:
    """A restart waits for Ray to place the group again (here never: its placement group is
    gone) in a thread: the controller's event loop keeps running the other groups' calls
    meanwhile, and the wait ends after ``placement_timeout_s`` naming the setting."""
    import asyncio
    import time

    import ray

    from controller.placement import GroupSpec, RoleSpec
    from deploy.clusters import RayCluster
    from deploy.launchers.ray import RayLauncher
    from deploy.launchers.rayplace import PlacementError
    from transport.settings import Timeouts

    python = tmp_path / "python"  # a rank that only waits: the restart is what is measured
    python.write_text("#!/bin/sh\nexec sleep 600\n")
    python.chmod(0o755)
    cluster = RayCluster(kind="ray", address=ray_cluster, python=str(python), placement_timeout_s=4)
    spec = GroupSpec(name="main", roles={"actor": RoleSpec(cls="roles.actor:Actor")})
    deaths: list[tuple[str, int | None, str]] = []
    ticks: list[float] = []

    async def tick() -> None:  # what the loop's other work stands for
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def main() -> tuple[float, float, str]:
        launcher = RayLauncher(
            "pool",
            cluster,
            tmp_path / "run",
            None,
            Timeouts(),
            lambda group, rank, cause: deaths.append((group, rank, cause)),
            "tcp://127.0.0.1:1",
            "token",
        )
        launcher.start([spec])
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(launcher.groups["main"].placement)  # never placed again
            ticker = asyncio.create_task(tick())
            began = time.monotonic()
            with pytest.raises(PlacementError) as refused:
                await launcher.restart(spec)
            ended = time.monotonic()
            ticker.cancel()
        finally:
            await launcher.stop()
        return began, ended, str(refused.value)

    try:
        began, ended, said = asyncio.run(main())
    finally:
        ray.shutdown()
    assert "group 'main' was not placed again on Ray cluster 'pool' within 4 s" in said
    assert "(clusters.pool.placement_timeout_s)" in said
    assert ended - began >= 4
    during = [t for t in ticks if began + 1 < t < ended - 1]
    assert len(during) >= 5, (len(ticks), began, ended)  # the loop ran while Ray was waited on


@pytest.mark.timeout(180)
def test_address_auto_with_two_clusters_on_the_host_says_which_it_joined(
    ray_cluster: str,
) -> None:
    """``address: auto`` on a host where two Ray clusters run: Ray takes the newest; the run
    says so, names both and the setting that chooses."""
    from ray.cluster_utils import Cluster

    newest = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 << 20},
    )
    address = str(newest.address)
    code = (
        "import logging, ray\n"
        "from deploy.clusters import RayCluster\n"
        "from deploy.launchers.rayplace import connect\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "connect(ray, 'pool', RayCluster(kind='ray'))\n"
        "ray.shutdown()\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    finally:
        newest.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert f"cluster 'pool': joined the Ray cluster at {address} (1 live node(s))" in said
    assert "address: auto, and 2 Ray clusters run on this host" in said, said[-2000:]
    assert ray_cluster in said and f"it joined {address}, the newest" in said
    assert "set clusters.pool.address to choose" in said
