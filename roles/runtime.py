"""Entry point of every rank process: ``python -m roles.runtime``.

A rank reads its place from the environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` as torchrun sets them, or ``SLURM_PROCID``/``SLURM_NTASKS``, plus ``HYBRIDFLOW_*``
variables the launcher sets), joins its torch.distributed group with a bounded timeout, and then
either coordinates (rank 0: talks to the controller, fans calls out) or works (other ranks: run
what the coordinator sends). Every rank runs every call SPMD-style on its own role instances.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from roles.base import RoleHost
from transport.protocol import Layout
from transport.security import CurveClient
from transport.settings import Timeouts

log = logging.getLogger("hybridflow.rank")

FANOUT_BACKENDS = ("socket", "zmq", "rpc")


@dataclass
class GroupEnv:
    group: str
    roles: list[str]
    controller: str
    token: str
    rank: int
    world_size: int
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
            world, tp=int(e.get("HYBRIDFLOW_TP", "1")), pp=int(e.get("HYBRIDFLOW_PP", "1"))
        )
        fanout = e.get("HYBRIDFLOW_FANOUT", "socket")
        if fanout not in FANOUT_BACKENDS:
            raise ValueError(
                f"HYBRIDFLOW_FANOUT={fanout!r}; use one of {', '.join(FANOUT_BACKENDS)}"
            )
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
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(need("MASTER_PORT")),
            layout=layout,
            fanout=fanout,
            timeouts=Timeouts.from_env(),
            socket_dir=Path(e.get("HYBRIDFLOW_SOCKET_DIR", "/tmp")),
            curve=curve,
        )


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (even by ``kill -9``); exit
    now if the parent is already gone (the race between fork and this call)."""
    parent = os.environ.get("HYBRIDFLOW_PARENT_PID")
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)


def init_group(env: GroupEnv) -> tuple[dist.ProcessGroup, dist.Store]:
    """Join the group's torch.distributed process group (gloo) with a bounded timeout; the
    store also carries the coordinator's fan-out address to the other ranks."""
    timeout = datetime.timedelta(seconds=env.timeouts.group_init_s)
    # Under torchrun the agent already serves a store on MASTER_PORT; every rank joins it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0 and not agent_store,
        timeout=timeout,
        wait_for_workers=False,
    )
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    group = dist.group.WORLD
    assert group is not None
    return group, store


def main() -> None:
    die_with_parent()
    torch.set_num_threads(int(os.environ.get("HYBRIDFLOW_THREADS", "1")))
    env = GroupEnv.from_env()
    logging.basicConfig(
        level=os.environ.get("HYBRIDFLOW_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {env.group}[{env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    pg, store = init_group(env)
    host = RoleHost(env.group, env.rank, env.layout, pg)
    from roles.coordinator import Coordinator
    from roles.worker import Worker

    if env.rank == 0:
        Coordinator(env, host, store).serve()
    else:
        Worker(env, host, store).serve()


if __name__ == "__main__":
    main()
