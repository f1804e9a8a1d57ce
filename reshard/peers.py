"""Where a rank runs, and which path a pair of ranks uses for weights.

A rank's place is its host (``transport.channel.host_id``: machine and boot, overridable for
tests) and its cluster (``HYBRIDFLOW_CLUSTER``, which the multi-cluster launcher sets; empty
elsewhere, i.e. one cluster). For a pair of ranks ``auto`` picks:

* the same host → ``shm``: slices through shared-memory segments, descriptors over an ipc socket;
* the same cluster → ``group``: a stateless gloo process group spanning both role groups, built
  from a ``TCPStore`` with explicit ranks (never a merge of the groups' default worlds);
* otherwise → ``zmq``: ZeroMQ frames over TCP, CURVE-encrypted (no shared fabric assumed).

A forced path (``WeightSyncSettings.path``) applies to every pair; ``shm`` between two hosts is
refused, since no memory is shared.
"""

from __future__ import annotations

import os
import socket

from transport.channel import host_id, split_tcp
from transport.weight_sync import Peer  # the struct a Source and an Inbox carry

CLUSTER_ENV = "HYBRIDFLOW_CLUSTER"
ADVERTISE_ENV = "HYBRIDFLOW_ADVERTISE_HOST"
CONTROLLER_ENV = "HYBRIDFLOW_CONTROLLER"  # the rank's controller address (roles/runtime/env.py)
PATHS = ("shm", "group", "zmq")


class PathError(ValueError):
    """A forced path that cannot connect two ranks."""


def this_peer() -> Peer:
    """Where this rank runs (``Peer``, a struct of ``transport/weight_sync.py``)."""
    return Peer(host_id(), os.environ.get(CLUSTER_ENV, ""))


def choose_path(forced: str, src: Peer, dst: Peer) -> str:
    """The path between two ranks: ``forced`` unless ``auto``; see the module docstring."""
    if forced != "auto":
        if forced not in PATHS:
            raise PathError(f"weight_sync.path={forced!r}; use auto, shm, group or zmq")
        if forced == "shm" and src.host != dst.host:
            raise PathError(
                f"weight_sync.path=shm between hosts {src.host!r} and {dst.host!r}: shared "
                "memory needs one host; use auto, group or zmq"
            )
        return forced
    if src.host == dst.host:
        return "shm"
    if src.cluster == dst.cluster:
        return "group"
    return "zmq"


def reachable_host(local_only: bool) -> str:
    """The address other ranks reach this one at: loopback when every peer shares this host;
    else ``HYBRIDFLOW_ADVERTISE_HOST``; else the address this host reaches the controller from
    (the interface the route to it takes: the network the groups share); else what this host's
    name resolves to."""
    if local_only:
        return "127.0.0.1"
    override = os.environ.get(ADVERTISE_ENV)
    if override:
        return override
    outward = _toward(os.environ.get(CONTROLLER_ENV, ""))
    if outward:
        return outward
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise OSError(
            f"cannot tell which address other hosts reach this one at ({exc}); set "
            f"{ADVERTISE_ENV} to this host's address"
        ) from exc


def _toward(controller: str) -> str:
    """The local address of a route to the controller's TCP address ('' when there is none)."""
    if not controller.startswith("tcp://"):
        return ""
    try:
        host, port = split_tcp(controller)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: picks the route, sends nothing
            address = str(probe.getsockname()[0])
    except (OSError, ValueError):
        return ""
    return "" if address.startswith("127.") else address
