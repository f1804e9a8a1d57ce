"""The environment a rank process is started with, written by the launchers and read by the rank.

``RankEnv`` is its one definition: each launcher writes it (``to_env``:
``deploy/launchers/local.py`` for the ranks it starts, ``deploy/commands/role.py`` for a rank
that torchrun or srun started) and the rank reads it back (``from_env``). Its place in the torch.distributed group (``RankPlace``) has torchrun's
names, SLURM's as fallbacks. ``RankVar`` names every variable, for launchers that write them in
scripts and command lines (``deploy/launchers/``). ``GroupEnv`` is what the rank runtime
works with: the same, resolved (the layout, the timeouts, the CURVE keys of a TCP link).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from transport.channel import host_id
from transport.device import DeviceKind
from transport.protocol import PROTOCOL_VERSION, Layout
from transport.security import CurveClient, CurveSide, LinkClient, LinkServer
from transport.settings import Timeouts

Fanout = Literal["socket", "zmq", "rpc"]
FANOUT_BACKENDS: tuple[Fanout, ...] = ("socket", "zmq", "rpc")
#: the store key under which the coordinator publishes its fan-out address to the other ranks
FANOUT_KEY = "hybridflow/fanout"


class RankVar(StrEnum):
    """The variables of a rank's environment, by name."""

    RANK = "RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"  # the rank's index on its machine (which GPU it takes)
    MASTER_ADDR = "MASTER_ADDR"  # the group's store, on rank 0's host
    MASTER_PORT = "MASTER_PORT"
    THREADS = "OMP_NUM_THREADS"  # read by OpenMP when the process starts
    GROUP = "HYBRIDFLOW_GROUP"
    ROLES = "HYBRIDFLOW_ROLES"  # comma-separated
    CONTROLLER = "HYBRIDFLOW_CONTROLLER"  # the controller's address
    TOKEN = "HYBRIDFLOW_TOKEN"
    TP = "HYBRIDFLOW_TP"
    PP = "HYBRIDFLOW_PP"
    GEN_TP = "HYBRIDFLOW_GEN_TP"
    GEN_PP = "HYBRIDFLOW_GEN_PP"
    FANOUT = "HYBRIDFLOW_FANOUT"
    DEVICE = "HYBRIDFLOW_DEVICE"
    SOCKET_DIR = "HYBRIDFLOW_SOCKET_DIR"
    PARENT_PID = "HYBRIDFLOW_PARENT_PID"  # the local launcher: the rank dies with it
    CURVE_SECRET = "HYBRIDFLOW_CURVE_SECRET"  # this group's secret key file (a TCP link)
    CURVE_SERVER_KEY = "HYBRIDFLOW_CURVE_SERVER_KEY"  # the controller's public key file


#: what srun sets where torchrun's variable is missing
SLURM_NAMES = {
    RankVar.RANK: "SLURM_PROCID",
    RankVar.WORLD_SIZE: "SLURM_NTASKS",
    RankVar.LOCAL_RANK: "SLURM_LOCALID",
}


class RankEnvError(ValueError):
    """A rank's environment lacks a variable or holds a value it cannot use."""


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in its group's torch.distributed group, as torchrun names it."""

    rank: int
    world_size: int
    local_rank: int
    master_port: int
    master_addr: str = "127.0.0.1"

    def to_env(self) -> dict[str, str]:
        return _named(
            {
                RankVar.RANK: str(self.rank),
                RankVar.WORLD_SIZE: str(self.world_size),
                RankVar.LOCAL_RANK: str(self.local_rank),
                RankVar.MASTER_ADDR: self.master_addr,
                RankVar.MASTER_PORT: str(self.master_port),
            }
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankPlace:
        """torchrun's variables, else srun's; one rank of one when neither launcher set them."""
        rank = _int(env, RankVar.RANK, 0)
        return cls(
            rank=rank,
            world_size=_int(env, RankVar.WORLD_SIZE, 1),
            local_rank=_int(env, RankVar.LOCAL_RANK, rank),
            master_port=_int(env, RankVar.MASTER_PORT),
            master_addr=env.get(RankVar.MASTER_ADDR, "127.0.0.1"),
        )


@dataclass(frozen=True)
class RankEnv:
    """Everything a launcher tells a rank: its place, its group and the group's settings."""

    place: RankPlace
    group: str
    roles: tuple[str, ...]
    controller: str
    token: str = ""
    tp: int = 1
    pp: int = 1
    gen_tp: int = 0  # 0: as tp
    gen_pp: int = 0  # 0: as pp
    fanout: Fanout = "socket"
    device: DeviceKind = DeviceKind.CPU
    socket_dir: Path = Path("/tmp")
    threads: str = "1"  # OpenMP's value as is (a count, or a list for nested levels)
    parent_pid: int | None = None  # None: no launcher process to die with

    @property
    def intra_op_threads(self) -> int:
        """``threads`` as torch's intra-op thread count: OpenMP's first level, at least 1."""
        return thread_count(self.threads)

    def to_env(self) -> dict[str, str]:
        env: dict[RankVar, str] = {
            RankVar.THREADS: self.threads,
            RankVar.GROUP: self.group,
            RankVar.ROLES: ",".join(self.roles),
            RankVar.CONTROLLER: self.controller,
            RankVar.TOKEN: self.token,
            RankVar.TP: str(self.tp),
            RankVar.PP: str(self.pp),
            RankVar.GEN_TP: str(self.gen_tp),
            RankVar.GEN_PP: str(self.gen_pp),
            RankVar.FANOUT: self.fanout,
            RankVar.DEVICE: str(self.device),
            RankVar.SOCKET_DIR: str(self.socket_dir),
        }
        if self.parent_pid is not None:
            env[RankVar.PARENT_PID] = str(self.parent_pid)
        return {**self.place.to_env(), **_named(env)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        """The rank's environment (``os.environ`` by default); ``RankEnvError`` naming the
        variable that is missing or holds a value it cannot use."""
        e = os.environ if env is None else env
        return cls(
            place=RankPlace.from_env(e),
            group=_need(e, RankVar.GROUP),
            roles=tuple(r for r in _need(e, RankVar.ROLES).split(",") if r),
            controller=_need(e, RankVar.CONTROLLER),
            token=e.get(RankVar.TOKEN, ""),
            tp=_int(e, RankVar.TP, 1),
            pp=_int(e, RankVar.PP, 1),
            gen_tp=_int(e, RankVar.GEN_TP, 0),
            gen_pp=_int(e, RankVar.GEN_PP, 0),
            fanout=_one_of(e, RankVar.FANOUT, "socket", FANOUT_BACKENDS),
            device=DeviceKind(_one_of(e, RankVar.DEVICE, DeviceKind.CPU, tuple(DeviceKind))),
            socket_dir=Path(e.get(RankVar.SOCKET_DIR, "/tmp")),
            threads=e.get(RankVar.THREADS, "1"),
            parent_pid=_int(e, RankVar.PARENT_PID) if RankVar.PARENT_PID in e else None,
        )


def curve_env(secret: Path, server_key: Path) -> dict[str, str]:
    """The variables that make a group's coordinator a CURVE client of the controller: its own
    secret key file and the controller's public key file (``hybridflow keys``)."""
    return _named({RankVar.CURVE_SECRET: str(secret), RankVar.CURVE_SERVER_KEY: str(server_key)})


def thread_count(threads: str) -> int:
    """OpenMP's thread setting (a count, or a list for nested levels) as one count: its first
    level, at least 1."""
    head = threads.split(",")[0].strip()
    return max(1, int(head)) if head.isdigit() else 1


def inherited_threads(env: Mapping[str, str]) -> str:
    """The OpenMP threads a launcher's own environment asks for, else one per rank (ranks of a
    group share the machine's cores)."""
    return env.get(RankVar.THREADS, "1")


@dataclass(frozen=True, kw_only=True)
class GroupEnv(RankEnv):
    """A rank's environment resolved, as the rank runtime works with it: the group's layout, the
    timeouts (``transport/settings.py``) and the CURVE keys of a TCP link to the controller."""

    layout: Layout
    timeouts: Timeouts
    curve: CurveClient | None = None

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size

    @property
    def local_rank(self) -> int:
        return self.place.local_rank

    @property
    def master_addr(self) -> str:
        return self.place.master_addr

    @property
    def master_port(self) -> int:
        return self.place.master_port

    @property
    def spans_hosts(self) -> bool:
        """Whether the group's ranks meet over the network (rank 0's node is not loopback)."""
        host = self.master_addr
        return self.world_size > 1 and not (host in {"localhost", "::1"} or host.startswith("127."))

    @property
    def link_kind(self) -> str:
        """The coordinator↔rank links: ZeroMQ for the zmq backend and for a group over several
        hosts that has CURVE keys (``link_curve``), plain sockets otherwise (the rpc backend
        uses them for hello, liveness and shutdown). The launchers here give a group over
        several nodes keys or refuse it; a group started by hand over hosts without keys talks
        in the clear, as before."""
        encrypted = self.spans_hosts and self.curve is not None
        return "zmq" if self.fanout == "zmq" or encrypted else "socket"

    def link_curve(self, coordinator: bool) -> CurveSide | None:
        """The CURVE side of this rank's links when they leave the host: the group's own key
        pair (``transport/security.py``, ``LinkServer``/``LinkClient``); None on one host, and
        None without keys (the coordinator's bind then refuses, naming ``hybridflow keys``)."""
        if not self.spans_hosts or self.curve is None:
            return None
        if coordinator:
            return LinkServer(self.curve.secret_file)
        return LinkClient(self.curve.secret_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GroupEnv:
        e = os.environ if env is None else env
        started = RankEnv.from_env(e)
        curve = None
        if e.get(RankVar.CURVE_SECRET):
            curve = CurveClient(
                Path(e[RankVar.CURVE_SECRET]), Path(_need(e, RankVar.CURVE_SERVER_KEY))
            )
        layout = Layout.for_world(
            started.place.world_size, started.tp, started.pp, started.gen_tp, started.gen_pp
        )
        return cls(**vars(started), layout=layout, timeouts=Timeouts.from_env(), curve=curve)


def _named(env: dict[RankVar, str]) -> dict[str, str]:
    """Plain names (what ``os.environ`` and ``subprocess`` hold), not ``RankVar`` members."""
    return {name.value: value for name, value in env.items()}


def _missing(name: RankVar) -> RankEnvError:
    return RankEnvError(f"environment variable {name} is not set (launch ranks with hybridflow)")


def _need(env: Mapping[str, str], name: RankVar) -> str:
    if name not in env:
        raise _missing(name)
    return env[name]


def _int(env: Mapping[str, str], name: RankVar, default: int | None = None) -> int:
    """A whole-number variable; where torchrun's name is missing, SLURM's, then ``default``
    (None: the variable must be set)."""
    slurm = SLURM_NAMES.get(name)
    found = name if name in env else slurm if slurm is not None and slurm in env else None
    if found is None:
        if default is None:
            raise _missing(name)
        return default
    try:
        return int(env[found])
    except ValueError:
        raise RankEnvError(f"{found}={env[found]!r} is not a whole number") from None


def _one_of(env: Mapping[str, str], name: RankVar, default: str, choices: tuple[str, ...]) -> Any:
    value = env.get(name, default)
    if value not in choices:
        raise RankEnvError(f"{name}={value!r}; use one of {', '.join(choices)}")
    return value


def hello_body(env: GroupEnv) -> dict[str, Any]:
    return {
        "roles": list(env.roles),
        "world_size": env.world_size,
        "layout": env.layout.to_wire(),
        "version": PROTOCOL_VERSION,
        "token": env.token,
        "host": host_id(),
        "pid": os.getpid(),
        "rank": env.rank,
        "group": env.group,
    }
