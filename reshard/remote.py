"""Weights from one role group to another, rank to rank, never through the controller.

A transfer has three steps, each a small command from the controller (``controller/sync.py``):

1. the source group describes itself once (``Source``: role, layout, dtype, parameter shapes and
   splits, where each rank runs);
2. every rank of the target group opens a ``Receiver`` (sockets bound, a token drawn) and the
   group answers with a ``Target`` (its layout, the parameter names it takes, each rank's inbox,
   and, when a pair uses the ``group`` path, where the stateless group meets);
3. the controller runs ``send`` on every source rank and ``Receiver.run`` on every target rank at
   the same time.

Both sides compute the same ``Route`` — the point-to-point plan (``reshard/p2p.py``) over the
names the target takes, and the path of each pair (``reshard/peers.py``) — so nothing but
addresses and the version crosses the controller. Slices travel in buckets of at most
``bucket_mb``; every bucket carries the weight version (and, on sockets, the target's token).
A receiver fills staging tensors and hands them over only when every bucket has arrived: an
interrupted transfer raises ``TransferError`` naming the role and rank, and the weights in use
stay as they were.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.channels import (
    GroupOutlet,
    TransferError,
    ZmqInlet,
    ZmqOutlet,
    arena,
    drop_group,
    short,
    stateless_group,
)
from reshard.layout import Param
from reshard.p2p import (
    TP_DIM_SPLIT,
    Move,
    P2PPlan,
    dp_dims_from_wire,
    make_p2p_plan,
    pair_buckets,
    params_from_wire,
)
from reshard.peers import Peer, choose_path, reachable_host, this_peer
from reshard.slices import box_shape, check_held, cut, region, unpack
from transport.device import in_host_memory
from transport.protocol import Layout
from transport.weight_sync import Inbox, Source, Target, WeightSyncSettings

# Source, Target and Inbox are the structs the controller passes between the groups
# (transport/weight_sync.py); they are re-exported here, where they are used
__all__ = ["Inbox", "Receiver", "Route", "Source", "Target", "TransferError", "send"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise TransferError(f"weights of dtype {dtype} cannot be transferred; use fp32, bf16 or fp16")


def source_dtype(source: Source) -> torch.dtype:
    found = _DTYPES.get(source.dtype)
    if found is None:
        raise TransferError(f"source dtype {source.dtype!r}: expected one of {list(_DTYPES)}")
    return found


@dataclass
class Route:
    """The plan and the paths, as both sides compute them."""

    source: Source
    layout: Layout  # the target's
    accept: list[str]
    splits: dict[str, int]  # the target's tp dims
    settings: WeightSyncSettings
    plan: P2PPlan = field(init=False)

    def __post_init__(self) -> None:
        taken = set(self.accept)
        every = params_from_wire(self.source.params, source_dtype(self.source).itemsize)
        theirs = {n: TP_DIM_SPLIT[d] for n, d in self.splits.items() if d in TP_DIM_SPLIT}
        if len(theirs) != len(self.splits):
            raise TransferError(f"target splits {self.splits}: tp dims must be 0 or 1")
        names = [p.name for p in every]
        dp_dims = dict(zip(names, dp_dims_from_wire(self.source.params), strict=True))
        mine = [p for p in every if p.name in taken]
        sharded = [dp_dims[p.name] for p in mine]
        self.plan = make_p2p_plan(mine, self.source.layout, self.layout, theirs, sharded)
        self._pairs = self.plan.pairs()

    def path(self, src: int, dst: Peer) -> str:
        return choose_path(self.settings.path, self.source.peers[src], dst)

    def buckets(self, src: int, dst: int) -> list[list[Move]]:
        moves = self._pairs.get((src, dst), [])
        return pair_buckets(moves, self.plan.params, self.settings.bucket_bytes)

    def uses_group(self, inboxes: list[Inbox]) -> bool:
        return any(self.path(s, inboxes[d].peer) == "group" for s, d in self._pairs)

    def world(self) -> int:
        return self.source.layout.world_size + self.layout.world_size


# -- the sending side ------------------------------------------------------------------------------


def send(
    source: Source,
    target: Target,
    rank: int,
    held: Mapping[str, torch.Tensor],
    version: int,
    settings: WeightSyncSettings,
) -> dict[str, Any]:
    """Send this source rank's slices to every target rank that needs them; returns what was
    sent (bytes, seconds, path per target rank)."""
    start = time.perf_counter()
    route = Route(source, target.layout, target.accept, target.splits, settings)
    plan = route.plan
    boxes = {p.name: plan.held_box(i, rank) for i, p in enumerate(plan.params)}
    mine = {k: v for k, v in boxes.items() if v is not None}
    check_held(plan.params, mine, held, source_dtype(source))
    dsts = sorted({m.dst for m in plan.sends(rank)})
    paths = {d: route.path(rank, target.inboxes[d].peer) for d in dsts}
    try:
        pg = _group(route, target, rank) if route.uses_group(target.inboxes) else None
        outlets = {d: _outlet(route, target, rank, d, paths[d], pg, version) for d in dsts}
        _send_round_robin(route, rank, outlets, held)
    except Exception:
        drop_group(target.group_key)
        raise
    sent = sum(plan.bytes_between(rank, d) for d in dsts)
    return {"bytes": sent, "seconds": time.perf_counter() - start, "paths": paths}


def _in_host(part: torch.Tensor) -> torch.Tensor:
    """Every path carries host memory (gloo sends no CUDA tensors; CUDA IPC is not built yet):
    a slice on a device is copied to the host first."""
    return part if in_host_memory(part) else part.cpu()


def _group(route: Route, target: Target, rank: int) -> Any:
    if target.store is None or target.group_key is None:
        raise TransferError(f"{target.role} opened no stateless group, but a pair needs one")
    return stateless_group(
        target.group_key, target.store, rank, route.world(), route.settings.stall_s
    )


def _outlet(
    route: Route, target: Target, rank: int, dst: int, path: str, pg: Any, version: int
) -> ZmqOutlet | GroupOutlet:
    peer = f"{target.role} rank {dst}"
    stall = route.settings.stall_s
    if path == "group":
        count = len(route.buckets(rank, dst))
        return GroupOutlet(pg, route.source.layout.world_size + dst, version, count, stall, peer)
    inbox = target.inboxes[dst]
    local = inbox.peer.host == route.source.peers[rank].host
    address = inbox.ipc if local else inbox.tcp
    if address is None:
        raise TransferError(f"{peer} opened no {'ipc' if local else 'tcp'} inbox for {path}")
    shm = arena(route.settings.bucket_bytes) if path == "shm" else None
    key = None if local else inbox.key
    return ZmqOutlet(address, key, inbox.token, version, rank, shm, stall, peer)


def _send_round_robin(
    route: Route,
    rank: int,
    outlets: Mapping[int, ZmqOutlet | GroupOutlet],
    held: Mapping[str, torch.Tensor],
) -> None:
    """Bucket 0 to every target rank, then bucket 1, ...: no receiver waits behind another."""
    queues = {d: route.buckets(rank, d) for d in outlets}
    try:
        for index in range(max((len(q) for q in queues.values()), default=0)):
            for dst, buckets in queues.items():
                if index < len(buckets):
                    parts = cut(buckets[index], route.plan.params, held)
                    outlets[dst].send(index, [_in_host(p) for p in parts])
        for outlet in outlets.values():
            outlet.finish()
    finally:
        for outlet in outlets.values():
            outlet.close()


# -- the receiving side ----------------------------------------------------------------------------


class Receiver:
    """One target rank's side of a transfer: opened (sockets bound) before the senders start,
    run while they send; ``run`` returns staging tensors, name → this rank's piece, complete."""

    def __init__(
        self,
        source: Source,
        layout: Layout,
        rank: int,
        accept: list[str],
        splits: dict[str, int],
        version: int,
        settings: WeightSyncSettings,
        role: str,
        ipc_dir: str,
    ) -> None:
        self.route = Route(source, layout, accept, splits, settings)
        self.rank, self.version, self.role = rank, version, role
        self.peer = this_peer()
        self.token = secrets.token_hex(16)
        sources = sorted({m.src for m in self.route.plan.receives(rank)})
        self.paths = {s: self.route.path(s, self.peer) for s in sources}
        local = [s for s, p in self.paths.items() if p != "group" and self._local(s)]
        remote = [s for s, p in self.paths.items() if p == "zmq" and not self._local(s)]
        everyone_local = all(self._local(s) for s in range(source.layout.world_size))
        self.inlet = ZmqInlet(
            ipc_dir if local else None,
            reachable_host(everyone_local) if remote else None,
            self.token,
            version,
        )

    def _local(self, src: int) -> bool:
        return self.route.source.peers[src].host == self.peer.host

    def inbox(self) -> Inbox:
        i = self.inlet
        return Inbox(self.peer, self.token, i.ipc, i.tcp, i.key)

    def staging(self) -> dict[str, torch.Tensor]:
        plan, dtype = self.route.plan, source_dtype(self.route.source)
        found = {}
        for index, p in enumerate(plan.params):
            box = plan.need_box(index, self.rank)
            if box is not None:
                found[p.name] = torch.empty(box_shape(box), dtype=dtype)
        return found

    def run(self, target: Target) -> dict[str, torch.Tensor]:
        """Every bucket into staging; TransferError (naming the sender) if one stops coming."""
        staging = self.staging()
        try:
            threads = self._start_group(target, staging)
            self._take_sockets(staging, threads)
            for thread in threads:
                thread.join()
                thread.check()
        except Exception:
            drop_group(target.group_key)
            raise
        finally:
            self.inlet.close()
        return staging

    def close(self) -> None:
        self.inlet.close()

    def _start_group(self, target: Target, staging: dict[str, torch.Tensor]) -> list[_GroupReceive]:
        route = self.route
        if not route.uses_group(target.inboxes):
            return []
        if target.store is None or target.group_key is None:
            raise TransferError(f"{self.role} opened no stateless group, but a pair needs one")
        first = route.source.layout.world_size
        pg = stateless_group(
            target.group_key, target.store, first + self.rank, route.world(), route.settings.stall_s
        )
        threads = []
        for src, path in self.paths.items():
            if path == "group":
                buckets = route.buckets(src, self.rank)
                name = f"{route.source.role} rank {src}"
                threads.append(_GroupReceive(pg, src, buckets, self, staging, name))
        for thread in threads:
            thread.start()
        return threads

    def _take_sockets(self, staging: dict[str, torch.Tensor], threads: list[_GroupReceive]) -> None:
        """Buckets from the shm and zmq senders, as they come, until none is missing."""
        params = self.route.plan.params
        expected = {
            (s, i): b
            for s, p in self.paths.items()
            if p != "group"
            for i, b in enumerate(self.route.buckets(s, self.rank))
        }
        last, gone = time.monotonic(), dict[int, float]()
        while expected or any(t.is_alive() for t in threads):
            for src, index, data in self.inlet.poll(5):
                bucket = expected.pop((src, index), None)
                if bucket is not None:
                    unpack(bucket, params, data, staging)
                    last = time.monotonic()
                del data  # a shared-memory view: releasing it frees the sender's segment
            for src in self.inlet.lost():
                gone.setdefault(src, time.monotonic())
            self._check_progress(expected, gone, last, threads)

    def _check_progress(
        self,
        expected: dict[tuple[int, int], list[Move]],
        gone: dict[int, float],
        last: float,
        threads: list[_GroupReceive],
    ) -> None:
        for thread in threads:
            if not thread.is_alive():
                thread.check()
        now, who = time.monotonic(), self.route.source.role
        waiting = sorted({s for s, _ in expected})
        for src in waiting:
            if src in gone and now - gone[src] > DISCONNECT_GRACE_S:
                missing = sum(1 for s, _ in expected if s == src)
                raise TransferError(
                    f"{who} rank {src} disconnected from {self.role} rank {self.rank} with "
                    f"{missing} of {len(self.route.buckets(src, self.rank))} buckets of weight "
                    f"version {self.version} unsent (it exited or was killed)"
                )
        if waiting and now - last > self.route.settings.stall_s:
            raise TransferError(
                f"no weights from {who} ranks {waiting} reached {self.role} rank {self.rank} "
                f"for {self.route.settings.stall_s:.1f} s ({len(expected)} buckets of version "
                f"{self.version} missing; weight_sync.stall_s)"
            )


DISCONNECT_GRACE_S = 0.5  # buckets a sender sent just before closing may still be in flight


class _GroupReceive(threading.Thread):
    """The buckets of one sender over the stateless group (gloo ``recv`` blocks: one thread per
    sender). ``check`` re-raises what went wrong."""

    def __init__(
        self,
        pg: Any,
        src: int,
        buckets: list[list[Move]],
        receiver: Receiver,
        staging: dict[str, torch.Tensor],
        name: str,
    ) -> None:
        super().__init__(name=f"reshard-recv-{src}", daemon=True)
        self.pg, self.src, self.buckets, self.staging = pg, src, buckets, staging
        self.params: list[Param] = receiver.route.plan.params
        self.version, self.stall_s, self.peer = (
            receiver.version,
            receiver.route.settings.stall_s,
            name,
        )
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._receive()
        except BaseException as exc:  # handed to the receiving thread by check()
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _receive(self) -> None:
        head = torch.zeros(2, dtype=torch.int64)
        self._wait(self.pg.recv([head], self.src, 0))
        if head.tolist() != [self.version, len(self.buckets)]:
            raise TransferError(
                f"{self.peer} sent version {int(head[0])} in {int(head[1])} buckets; expected "
                f"version {self.version} in {len(self.buckets)}"
            )
        for index, bucket in enumerate(self.buckets):
            direct = _direct(bucket, self.params, self.staging)
            size = sum(m.nbytes(self.params) for m in bucket)
            buf = direct if direct is not None else torch.empty(size, dtype=torch.uint8)
            self._wait(self.pg.recv([buf], self.src, index + 1))
            if direct is None:
                unpack(bucket, self.params, buf, self.staging)

    def _wait(self, work: Any) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.stall_s))
        except RuntimeError as exc:
            raise TransferError(f"weights from {self.peer} stopped coming: {short(exc)}") from exc


def _direct(
    bucket: list[Move], params: list[Param], staging: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """A one-slice bucket whose staging region is contiguous: received in place, as bytes."""
    if len(bucket) != 1:
        return None
    view = region(staging[params[bucket[0].param].name], bucket[0].dst_box)
    return view.reshape(-1).view(torch.uint8) if view.is_contiguous() else None
