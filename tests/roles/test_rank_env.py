"""The rank environment (``roles/runtime/env.py``): what a launcher writes is what a rank reads.

``RankEnv.to_env`` → ``RankEnv.from_env`` gives back the same value; a missing or unusable
variable fails with an error naming it; srun's names stand in for torchrun's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from roles.runtime.env import GroupEnv, RankEnv, RankEnvError, RankPlace, RankVar, curve_env
from transport.device import DeviceKind
from transport.protocol import Layout

STARTED = RankEnv(
    place=RankPlace(rank=5, world_size=8, local_rank=1, master_port=29500, master_addr="node3"),
    group="actor+ref",
    roles=("actor", "ref"),
    controller="tcp://10.0.0.1:5555",
    token="secret",
    tp=2,
    pp=2,
    gen_tp=1,
    gen_pp=1,
    fanout="zmq",
    device=DeviceKind.CUDA,
    socket_dir=Path("/run/hf"),
    threads="4",
    parent_pid=4242,
)


def test_what_a_launcher_writes_a_rank_reads_back() -> None:
    env = STARTED.to_env()
    assert all(type(name) is str for name in env)  # plain names, as os.environ holds them
    assert RankEnv.from_env(env) == STARTED
    no_parent = RankEnv(STARTED.place, "g", ("r",), "ipc:///c")
    assert RankVar.PARENT_PID not in no_parent.to_env()
    assert RankEnv.from_env(no_parent.to_env()) == no_parent


def test_the_group_env_is_the_rank_env_resolved(tmp_path: Path) -> None:
    secret, server = tmp_path / "g.key_secret", tmp_path / "controller.key"
    group = GroupEnv.from_env({**STARTED.to_env(), **curve_env(secret, server)})
    assert (group.group, group.roles, group.rank, group.world_size) == (
        "actor+ref",
        ("actor", "ref"),
        5,
        8,
    )
    assert (group.master_addr, group.master_port, group.local_rank) == ("node3", 29500, 1)
    assert group.layout == Layout(dp=2, tp=2, pp=2, gen_tp=1, gen_pp=1)
    assert group.curve is not None and group.curve.secret_file == secret


@pytest.mark.parametrize(
    "name", [RankVar.GROUP, RankVar.ROLES, RankVar.CONTROLLER, RankVar.MASTER_PORT]
)
def test_a_missing_variable_is_named(name: RankVar) -> None:
    env = STARTED.to_env()
    del env[name]
    with pytest.raises(RankEnvError, match=f"environment variable {name} is not set"):
        RankEnv.from_env(env)


def test_a_value_it_cannot_use_is_named() -> None:
    with pytest.raises(RankEnvError, match=r"HYBRIDFLOW_TP='two' is not a whole number"):
        RankEnv.from_env({**STARTED.to_env(), RankVar.TP: "two"})
    with pytest.raises(RankEnvError, match=r"HYBRIDFLOW_FANOUT='tcp'; use one of socket, zmq"):
        RankEnv.from_env({**STARTED.to_env(), RankVar.FANOUT: "tcp"})
    env = {**STARTED.to_env(), "HYBRIDFLOW_CURVE_SECRET": "/keys/g.key_secret"}
    with pytest.raises(RankEnvError, match="HYBRIDFLOW_CURVE_SERVER_KEY is not set"):
        GroupEnv.from_env(env)


def test_srun_names_stand_in_for_torchrun_names() -> None:
    env = {
        k: v for k, v in STARTED.to_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="2")
    assert RankPlace.from_env(env) == RankPlace(3, 4, 2, 29500, "node3")
    assert RankPlace.from_env({**env, "RANK": "0"}).rank == 0  # torchrun's first
    with pytest.raises(RankEnvError, match=r"SLURM_NTASKS='' is not a whole number"):
        RankPlace.from_env({**env, "SLURM_NTASKS": ""})
    alone = RankPlace.from_env({"MASTER_PORT": "1"})  # neither launcher: one rank of one
    assert alone == RankPlace(0, 1, 0, 1, "127.0.0.1")
