"""A group over several nodes, before any process starts: its sizes are checked by field, the
SLURM layout puts ``nproc / nodes`` ranks on each of its nodes (rank 0 first), launchers that
cannot lay a group over nodes refuse it, and a rank knows when its links leave the host (CURVE
with the group's key pair) and which interface gloo must use. The run itself, on a two-node
SLURM cluster: ``tests/deploy/test_slurm_nodes.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller.placement import GroupSpec, RoleSpec
from deploy.clusters import ClusterSpec, check_spec
from deploy.experiment import ExperimentError
from deploy.launchers.local import LocalLauncher
from deploy.launchers.sbatch import group_nodes, group_steps, node_ranks, overfull, tasks_per_node
from roles.runtime.env import GroupEnv, RankPlace
from roles.runtime.rank import interface_towards
from tests.deploy.test_clusters import experiment
from tests.deploy.test_pipeline_placement import error_of, run_dir  # noqa: F401 - a fixture
from transport.protocol import Layout
from transport.security import CurveClient, LinkClient, LinkServer
from transport.settings import Timeouts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["placement.main.nproc=4", "placement.main.nodes=3"],
            "placement.main: group 'main': nodes=3 does not divide nproc=4",
        ),
        (
            ["placement.main.nproc=4", "placement.main.nodes=4", "placement.main.tp=2"],
            "tp=2 does not divide a node's share of the group (nproc=4 / nodes=4 = 1 a node)",
        ),
        (
            ["placement.main.nproc=4", "placement.main.nodes=2", "placement.main.fanout=rpc"],
            "fanout=rpc (torch rpc, unencrypted) cannot span nodes",
        ),
    ],
)
def test_sizes_that_cannot_span_nodes_name_the_field(
    run_dir: Path,  # noqa: F811
    overrides: list[str],
    message: str,
) -> None:
    assert message in error_of(run_dir, *overrides)


def spread(name: str, nproc: int, nodes: int) -> GroupSpec:
    return GroupSpec(name=name, roles={name: RoleSpec(cls="a:B")}, nproc=nproc, nodes=nodes)


def test_a_group_over_k_nodes_takes_the_next_k_with_its_share_on_each() -> None:
    groups = {"actor": spread("actor", 4, 2), "reward": spread("reward", 1, 1)}
    assert group_nodes(groups, 3, controller=True) == [[1, 2], [0]]
    assert node_ranks(groups, 3, controller=True) == [
        ["controller", "reward"],
        ["actor"],
        ["actor"],
    ]
    assert tasks_per_node(groups, 3, controller=True) == 2
    assert group_nodes(groups, 3, controller=False) == [[0, 1], [2]]
    too_small = str(overfull(groups, 3, 1, controller=False))
    assert "node 0 of the job would run 2 tasks (actor) but a node holds 1" in too_small
    why = overfull(groups, 1, 8, controller=False)
    assert why is not None and "group 'actor' spans 2 nodes but the job has 1" in why
    steps = "\n".join(group_steps(groups, 3, "tcp://h:1", "/run", "python", "", True))
    actor = steps.split("# group actor")[1].split("# group reward")[0]
    assert "--nodes=2 --ntasks=4 --ntasks-per-node=2 --distribution=block" in actor
    assert "--nodelist=${nodes[1]},${nodes[2]}" in actor
    assert "--master-addr @step" in actor  # each rank asks SLURM where task 0 runs
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1" in steps.split("# group reward")[1]


def test_launchers_that_cannot_lay_a_group_over_nodes_refuse_it(tmp_path: Path) -> None:
    launcher = LocalLauncher("ipc:///x", "", tmp_path, tmp_path, Timeouts(), lambda *a: None)

    async def start() -> None:
        launcher.start([spread("actor", 4, 2)])

    with pytest.raises(ValueError, match="spans 2 nodes, and this launcher starts every rank") as e:
        asyncio.run(start())
    assert "a slurm, ray or remote (hosts:) cluster" in str(e.value)  # every kind that can
    assert launcher.procs == []
    exp = experiment("placement.main.nproc=4", "placement.main.nodes=2")
    spec: dict[str, Any] = {
        "controller": {"bind": "tcp://127.0.0.1:0"},
        "clusters": {"home": {"kind": "local"}, "farm": {"kind": "slurm", "tasks_per_node": 4}},
        "groups": {"main": "home", "gen": "farm"},
    }
    with pytest.raises(
        ExperimentError, match="only a slurm or ray cluster or a remote one with hosts lays out"
    ):
        check_spec(ClusterSpec.model_validate(spec), exp, probe=False)
    spec["groups"] = {"main": "farm", "gen": "home"}
    with pytest.raises(ExperimentError, match="spans nodes, so links between its ranks need"):
        check_spec(ClusterSpec.model_validate(spec), exp, probe=False)


def env_at(master: str, world: int, curve: bool, tmp_path: Path) -> GroupEnv:
    keys = None
    if curve:
        secret = tmp_path / "main.key_secret"
        public, key = zmq.curve_keypair()
        secret.write_text(
            f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{key.decode()}"\n'
        )
        keys = CurveClient(secret, secret)
    return GroupEnv(
        place=RankPlace(0, world, local_rank=0, master_port=29500, master_addr=master),
        group="main",
        roles=("actor",),
        controller="tcp://10.0.0.1:5555",
        layout=Layout(dp=world),
        timeouts=Timeouts(),
        curve=keys,
    )


def test_links_that_leave_the_host_go_over_curve_with_the_groups_key_pair(tmp_path: Path) -> None:
    assert env_at("127.0.0.1", 4, True, tmp_path).link_kind == "socket"  # one host
    assert env_at("10.0.0.2", 1, True, tmp_path).link_kind == "socket"  # nobody to reach
    assert env_at("10.0.0.2", 4, False, tmp_path).link_kind == "socket"  # by hand, no keys
    far = env_at("10.0.0.2", 4, True, tmp_path)
    assert far.spans_hosts and far.link_kind == "zmq"
    server, client = far.link_curve(True), far.link_curve(False)
    assert isinstance(server, LinkServer) and isinstance(client, LinkClient)
    ctx = zmq.Context()
    try:  # the rank insists on the group's public key; a coordinator without it is not heard
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        server.apply(router)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client.apply(dealer)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello over curve")
        assert router.poll(10_000) and router.recv_multipart()[1] == b"hello over curve"
        impostor = ctx.socket(zmq.ROUTER)  # another key pair at the group's address
        public, secret = zmq.curve_keypair()
        impostor.curve_server, impostor.curve_publickey, impostor.curve_secretkey = (
            True, public, secret,
        )  # fmt: skip
        port = impostor.bind_to_random_port("tcp://127.0.0.1")
        fooled = ctx.socket(zmq.DEALER)
        client.apply(fooled)
        fooled.connect(f"tcp://127.0.0.1:{port}")
        fooled.send(b"a batch", zmq.NOBLOCK)
        assert not impostor.poll(1_000)  # the handshake fails: nothing reaches the impostor
    finally:
        ctx.destroy(linger=0)


def test_gloo_is_given_the_interface_that_reaches_rank_0() -> None:
    assert interface_towards("127.0.0.1", 29500) == "lo"
