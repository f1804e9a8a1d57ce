"""What every rank process runs (``python -m roles.runtime`` calls ``main``).

A rank reads its place from the environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` as torchrun sets them, or ``SLURM_PROCID``/``SLURM_NTASKS``, plus ``HYBRIDFLOW_*``
variables the launcher sets), joins its torch.distributed group with a bounded timeout, and then
either coordinates (rank 0: talks to the controller, fans calls out) or works (other ranks: run
what the coordinator sends). Every rank runs every call SPMD-style on its own role instances.
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import traceback

import torch
import torch.distributed as dist

from roles.runtime.coordinator import Coordinator
from roles.runtime.device import RankDevice, rank_device
from roles.runtime.env import GroupEnv, RankVar
from roles.runtime.host import RoleHost
from roles.runtime.status import ENDED, report
from roles.runtime.worker import Worker
from transport.device import DeviceKind

log = logging.getLogger("hybridflow.rank")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (even by ``kill -9``); exit
    now if the parent is already gone (the race between fork and this call)."""
    parent = os.environ.get(RankVar.PARENT_PID)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != int(parent):
        print(f"RuntimeError: the launcher (pid {parent}) is gone already", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_towards(host: str, port: int) -> str:
    """The name of this host's network interface whose address routes to ``host``: gloo's
    ranks on other nodes must reach this rank on it. Gloo's own choice (the address this
    host's name resolves to, else loopback) fails where node names do not resolve."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # no packet: the kernel only picks the route
        mine = probe.getsockname()[0]
    for _, name in socket.if_nameindex():
        if interface_address(name) == mine:
            return name
    raise RuntimeError(f"no interface here holds {mine}, the address that reaches {host}")


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), None when it has none."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), 0x8915, request)  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def init_group(env: GroupEnv) -> tuple[dist.ProcessGroup, dist.Store, RankDevice]:
    """Decide this rank's device (``roles/runtime/device.py``; a group asking for a device this
    machine lacks fails here, before it waits on anyone), then join the group's torch.distributed
    process group with that device's backend and a bounded timeout. The store also carries the
    coordinator's fan-out address to the other ranks."""
    device = rank_device(env.device, env.local_rank, env.group)
    device.activate()
    timeout = datetime.timedelta(seconds=env.timeouts.group_init_s)
    # Under torchrun the agent already serves a store on MASTER_PORT; every rank joins it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store: dist.Store
    if env.world_size == 1 and not agent_store:  # nobody to meet: no listener, no port to lose
        store = dist.HashStore()
    else:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0 and not agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
    if device.kind == DeviceKind.CPU and env.spans_hosts and GLOO_IFNAME not in os.environ:
        try:
            os.environ[GLOO_IFNAME] = interface_towards(env.master_addr, env.master_port)
        except (OSError, RuntimeError) as exc:  # gloo then picks as it does by itself
            log.warning(
                "no interface found towards %s (%s); set %s", env.master_addr, exc, GLOO_IFNAME
            )
    dist.init_process_group(
        device.backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )

    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed gave no WORLD group after init_process_group")
    return group, store, device


def main() -> None:
    die_with_parent()
    env = GroupEnv.from_env()
    torch.set_num_threads(env.intra_op_threads)
    logging.basicConfig(
        level=os.environ.get("HYBRIDFLOW_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {env.group}[{env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    # which process is which: the log's first line, and the title ps shows when the local
    # launcher started this rank (it passes the title as the argument, which makes room for
    # it); a rank started otherwise (srun, hybridflow role --launcher env) keeps its command
    # line, which names its group already. Over the command line only: the environment stays
    # readable in /proc (SPT_NOENV)
    title = f"hybridflow {env.group}:{env.rank} ({','.join(env.roles)})"
    if sys.argv[1:] == [title]:
        os.environ.setdefault("SPT_NOENV", "1")
        import setproctitle

        setproctitle.setproctitle(f"{title} python -m roles.runtime")
        # the short name (/proc/PID/stat, top): no space or parenthesis, which SLURM's process
        # tracking cannot read (a rank named so would outlive scancel)
        short = "".join(
            c if c.isalnum() or c in "-_.:" else "_" for c in f"hf-{env.group}:{env.rank}"
        )
        setproctitle.setthreadtitle(short[:15])
    print(
        f"{title}: pid {os.getpid()}, launched by pid {os.getppid()}", file=sys.stderr, flush=True
    )
    pg, store, device = init_group(env)
    host = RoleHost(env.group, env.rank, env.layout, pg, device)
    if env.rank == 0:
        try:
            coordinator = Coordinator(env, host, store)
        except Exception as exc:  # never joined (refused, no answer, ranks missing): say why
            report(ENDED, group=env.group, code=1, reason=f"{type(exc).__name__}: {exc}")
            # then exit at once, as the coordinator's own ending does: an interpreter shutdown
            # would tear down the half-built sockets and process group in an undefined order
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        coordinator.serve()
    else:
        Worker(env, host, store).serve()
