"""Where a rank sits: its group, rank, layout, controller address and settings, read from the
environment its launcher set (torchrun, SLURM or hybridflow's own launchers)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transport.channel import host_id
from transport.device import DeviceKind
from transport.protocol import PROTOCOL_VERSION, Layout
from transport.security import CurveClient
from transport.settings import Timeouts

FANOUT_BACKENDS = ("socket", "zmq", "rpc")
#: the store key under which the coordinator publishes its fan-out address to the other ranks
FANOUT_KEY = "hybridflow/fanout"


@dataclass
class GroupEnv:
    group: str
    roles: list[str]
    controller: str
    token: str
    rank: int
    world_size: int
    local_rank: int  # the rank's index on its machine (which GPU it takes)
    device: DeviceKind
    master_addr: str
    master_port: int
    layout: Layout
    fanout: str
    timeouts: Timeouts
    socket_dir: Path
    curve: CurveClient | None

    @property
    def link_kind(self) -> str:
        """The coordinator↔rank links: ZeroMQ for the zmq backend, plain sockets otherwise
        (the rpc backend uses them for hello, liveness and shutdown)."""
        return "zmq" if self.fanout == "zmq" else "socket"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> GroupEnv:
        e = dict(os.environ if env is None else env)

        def need(name: str) -> str:
            if name not in e:
                raise ValueError(
                    f"environment variable {name} is not set (launch ranks with hybridflow)"
                )
            return e[name]

        rank = int(e.get("RANK", e.get("SLURM_PROCID", "0")))
        world = int(e.get("WORLD_SIZE", e.get("SLURM_NTASKS", "1")))
        layout = Layout.for_world(
            world,
            tp=int(e.get("HYBRIDFLOW_TP", "1")),
            pp=int(e.get("HYBRIDFLOW_PP", "1")),
            gen_tp=int(e.get("HYBRIDFLOW_GEN_TP", "0")),
            gen_pp=int(e.get("HYBRIDFLOW_GEN_PP", "0")),
        )
        fanout = _one_of(e, "HYBRIDFLOW_FANOUT", "socket", FANOUT_BACKENDS)
        device = _one_of(e, "HYBRIDFLOW_DEVICE", DeviceKind.CPU, tuple(DeviceKind))
        curve = None
        if e.get("HYBRIDFLOW_CURVE_SECRET"):
            curve = CurveClient(
                Path(e["HYBRIDFLOW_CURVE_SECRET"]), Path(need("HYBRIDFLOW_CURVE_SERVER_KEY"))
            )
        return cls(
            group=need("HYBRIDFLOW_GROUP"),
            roles=[r for r in need("HYBRIDFLOW_ROLES").split(",") if r],
            controller=need("HYBRIDFLOW_CONTROLLER"),
            token=e.get("HYBRIDFLOW_TOKEN", ""),
            rank=rank,
            world_size=world,
            local_rank=int(e.get("LOCAL_RANK", e.get("SLURM_LOCALID", str(rank)))),
            device=DeviceKind(device),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(need("MASTER_PORT")),
            layout=layout,
            fanout=fanout,
            timeouts=Timeouts.from_env(),
            socket_dir=Path(e.get("HYBRIDFLOW_SOCKET_DIR", "/tmp")),
            curve=curve,
        )


def _one_of(e: dict[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = e.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}; use one of {', '.join(choices)}")
    return value


def hello_body(env: GroupEnv) -> dict[str, Any]:
    return {
        "roles": env.roles,
        "world_size": env.world_size,
        "layout": env.layout.to_wire(),
        "version": PROTOCOL_VERSION,
        "token": env.token,
        "host": host_id(),
        "pid": os.getpid(),
        "rank": env.rank,
        "group": env.group,
    }
