"""Endpoints that move weights between role groups, rank to rank (``reshard/remote.py``).

``WeightSource`` is mixed into roles whose weights others take (every ``EngineRole``: the actor
for the rollout group, the reference and the critics); ``WeightSink`` into roles that take them
(the rollout, and every ``EngineRole``). The controller (``controller/sync.py``) passes only small
commands between them:

1. ``source.weight_source()`` — the source's layout, dtype, parameter shapes and splits, and where
   each rank runs (asked once);
2. ``sink.open_receive(source, version, settings)`` — each sink rank binds its inbox and draws a
   token; the group answers with every rank's inbox (and the stateless group's meeting point);
3. ``source.send_weights(target, version, settings)`` and ``sink.receive_weights(version)`` at the
   same time: slices go straight from source ranks to sink ranks; the sink swaps them in only
   when every bucket has arrived.

Roles of one group (colocated) use ``sink.copy_from(role, version, settings)`` instead: one call,
the same machinery between the group's own ranks (shared memory on one host, ZeroMQ between hosts).

A role says what it holds and how it takes weights by eight hooks. As a source, three:
``held_weights`` (this rank's pieces in the layout it reports), ``weight_specs`` (name, shape, tp
dim, dp dim, pipeline stage) and ``weight_dtype``. As a sink, five: ``sink_layout`` (the pieces
each rank takes), ``sink_names`` (the parameters it holds), ``adopt`` (swap staged pieces in), and
two with defaults: ``sink_splits`` (the dim each split parameter is cut along; none) and
``check_staged`` (refuse staged pieces before any rank swaps; accepts all).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from reshard.channels import drop_store, group_store
from reshard.peers import reachable_host, this_peer
from reshard.remote import Receiver, TransferError, dtype_name, send
from roles.base import RoleContext
from roles.runtime.endpoint import ONE_TO_ALL, endpoint
from transport.protocol import Layout
from transport.weight_sync import (
    Source,
    Target,
    WeightsReceived,
    WeightsSent,
    WeightSyncSettings,
)

#: roles in this process that can give weights, by role name (for colocated copies)
_sources: dict[str, WeightSource] = {}


def gather(ctx: RoleContext, value: Any) -> list[Any]:
    """``value`` from every rank of the role's group, in rank order (a collective)."""
    if ctx.world_size == 1:
        return [value]
    found: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(found, value, group=ctx.process_group)
    return found


def socket_dir() -> str:
    return os.environ.get("HYBRIDFLOW_SOCKET_DIR") or tempfile.gettempdir()


class WeightSource:
    """Gives this role's weights to other groups' ranks."""

    ctx: RoleContext

    def register_source(self) -> None:
        _sources[self.ctx.role] = self

    def held_weights(self) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """Name → this rank's piece of each parameter (its tp shard, whole over dp)."""
        raise NotImplementedError

    def weight_specs(self) -> list[dict[str, Any]]:
        """``[{"name", "shape", "tp_dim", "dp_dim", "stage"}]`` of every parameter, full shapes
        (``dp_dim`` and ``stage`` may be left out: whole over dp, stage 0)."""
        raise NotImplementedError

    def weight_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def describe_source(self) -> Source:
        """This role as a source (made once: layout, shapes and hosts do not change)."""
        found: Source | None = getattr(self, "_described_source", None)
        if found is None:
            found = Source(
                self.ctx.role,
                self.ctx.layout,
                dtype_name(self.weight_dtype()),
                self.weight_specs(),
                gather(self.ctx, this_peer()),
            )
            self._described_source = found
        return found

    @endpoint(ONE_TO_ALL)
    def weight_source(self) -> Source:
        """Layout, dtype, parameter shapes and splits, and where each rank runs: what a sink
        needs to plan a transfer from this role."""
        return self.describe_source()

    @endpoint(ONE_TO_ALL)
    def send_weights(
        self, target: Target, version: int, settings: WeightSyncSettings
    ) -> WeightsSent:
        """Send this group's weights (``version``) to the ranks of ``target`` (what its
        ``open_receive`` answered); returns rank 0's bytes, seconds and paths."""
        chosen = WeightSyncSettings.model_validate(settings)  # (a map from an older controller)
        start = time.perf_counter()
        source = self.describe_source()
        with self.held_weights() as held:
            ready = time.perf_counter()
            stats = send(source, target, self.ctx.rank, held, version, chosen)
        paths = {str(k): v for k, v in stats["paths"].items()}
        return WeightsSent(stats["bytes"], stats["seconds"], paths, ready - start)


class WeightSink:
    """Takes weights from another group's ranks (or a colocated role's)."""

    ctx: RoleContext
    _receiver: Receiver | None = None
    _target: Target | None = None
    _strict: bool = True
    _store: tuple[str, str] | None = None  # (host:port, random key part), on rank 0

    def sink_layout(self) -> Layout:
        """The layout the pieces are cut for: rank ``r`` takes ``Param.box(tp, j)``."""
        raise NotImplementedError

    def sink_names(self) -> set[str]:
        """The parameter names this role holds."""
        raise NotImplementedError

    def sink_splits(self) -> dict[str, int]:
        """Name → the dim ``sink_layout``'s tp splits, for the parameters it splits."""
        return {}

    def adopt(self, staged: dict[str, torch.Tensor], strict: bool, version: int) -> None:
        """Swap complete staged pieces in (nothing is touched before they all are checked)."""
        raise NotImplementedError

    def accept(self, source: Source, strict: bool) -> list[str]:
        offered = [str(p["name"]) for p in source.params]
        own = self.sink_names()
        taken = [n for n in offered if n in own]
        if strict and (set(offered) != own):
            extra, lacking = sorted(set(offered) - own), sorted(own - set(offered))
            raise TransferError(
                f"{self.ctx.role} cannot take {source.role}'s weights strictly: names only the "
                f"source has {extra[:3]}, only this role has {lacking[:3]}"
            )
        if not taken:
            raise TransferError(f"{self.ctx.role} shares no parameter name with {source.role}")
        return taken

    @endpoint(ONE_TO_ALL)
    def open_receive(
        self, source: Source, version: int, settings: WeightSyncSettings, strict: bool = True
    ) -> Target:
        """Open this group's inboxes for weights ``version`` from ``source`` (what its
        ``weight_source`` answered); ``strict=False`` takes only the names both hold. Returns
        the target description the source's ``send_weights`` takes."""
        chosen = WeightSyncSettings.model_validate(settings)  # (a map from an older controller)
        taken = self.accept(source, strict)
        self.close_receive()
        layout, splits, ctx = self.sink_layout(), self.sink_splits(), self.ctx
        receiver = Receiver(
            source, layout, ctx.rank, taken, splits, version, chosen, ctx.role, socket_dir()
        )
        self._receiver, self._strict = receiver, strict
        target = Target(ctx.role, layout, taken, splits, gather(ctx, receiver.inbox()))
        if receiver.route.uses_group(target.inboxes):
            store, key = self._meeting_point(source)
            target = replace(target, store=store, group_key=key)
        self._target = target
        return target

    def _meeting_point(self, source: Source) -> tuple[str, str]:
        """Rank 0 keeps one TCPStore for stateless groups; the key names the source group, so
        each pair of groups meets under its own prefix. Broadcast to every rank."""
        if self.ctx.rank == 0:
            if self._store is None:
                everyone_local = all(p.host == this_peer().host for p in source.peers)
                suffix = secrets.token_hex(6)
                self._store = (group_store(suffix, reachable_host(everyone_local)), suffix)
            chosen: list[str | None] = [self._store[0], f"{self._store[1]}-{source.role}"]
        else:
            chosen = [None, None]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(chosen, src=0, group=self.ctx.process_group)
        return str(chosen[0]), f"{chosen[1]}-{source.layout.world_size}"

    @endpoint(ONE_TO_ALL)
    def receive_weights(self, version: int) -> WeightsReceived:
        """Take the buckets the source sends, then swap them in; returns rank 0's version,
        bytes and seconds. The receiver opened by ``open_receive`` is used once."""
        receiver, target = self._receiver, self._target
        if receiver is None or target is None or receiver.version != version:
            opened = None if receiver is None else receiver.version
            raise TransferError(
                f"{self.ctx.role} rank {self.ctx.rank} has no receiver open for version "
                f"{version} (open: {opened}); call open_receive first"
            )
        self._receiver = None
        staged: dict[str, torch.Tensor] | None = None
        failure: BaseException | None = None
        start = time.perf_counter()
        try:
            staged = receiver.run(target)
        except Exception as exc:
            failure = exc
            if self._store is not None:  # a broken group: the next transfer meets afresh
                drop_store(self._store[1])
                self._store = None
        received = time.perf_counter()
        self._swap_together(staged, failure, self._strict, version)
        got = receiver.route.plan.recv_bytes(self.ctx.rank)
        swapped = time.perf_counter() - received
        return WeightsReceived(version, got, received - start, swapped)

    def check_staged(self, staged: dict[str, torch.Tensor]) -> None:
        """Raise if staged pieces cannot be swapped in (before any rank swaps)."""

    def _swap_together(
        self,
        staged: dict[str, torch.Tensor] | None,
        failure: BaseException | None,
        strict: bool,
        version: int,
    ) -> None:
        """Swap in only if every rank of the group has all its pieces: a transfer that failed
        anywhere leaves every rank on its old weights."""
        if failure is None and staged is not None:
            try:
                self.check_staged(staged)
            except Exception as exc:
                failure = exc
        reasons = gather(
            self.ctx, None if failure is None else f"{type(failure).__name__}: {failure}"
        )
        if failure is not None:
            raise failure
        bad = [(rank, why) for rank, why in enumerate(reasons) if why is not None]
        if bad or staged is None:
            rank, why = bad[0] if bad else (self.ctx.rank, "nothing staged")
            raise TransferError(
                f"{self.ctx.role} rank {rank} did not get all its weights ({why}); every rank "
                f"of {self.ctx.role} keeps its old weights"
            )
        self.adopt(staged, strict, version)

    def close_receive(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    @endpoint(ONE_TO_ALL)
    def copy_from(
        self, role: str, version: int, settings: WeightSyncSettings, strict: bool = True
    ) -> WeightsReceived:
        """Weights of ``role``, a role of this same group: each rank receives its pieces in a
        thread while it sends its own (shared memory on one host, ZeroMQ between hosts)."""
        giver = _sources.get(role)
        if giver is None:
            raise TransferError(
                f"{role!r} is not a weight source in {self.ctx.role}'s group; a role of another "
                "group sends with send_weights"
            )
        source = giver.describe_source()
        one_host = len({p.host for p in source.peers}) == 1
        chosen = WeightSyncSettings.model_validate(settings).model_copy(
            update={"path": "shm" if one_host else "zmq"}
        )
        target = self.open_receive(source, version, chosen, strict)
        receiver = self._receiver
        assert receiver is not None  # open_receive just made it
        self._receiver = None
        taking = _Taking(receiver, target)
        failure: BaseException | None = None
        with giver.held_weights() as held:
            taking.start()
            try:
                send(source, target, self.ctx.rank, held, version, chosen)
            except Exception as exc:
                failure = exc
            finally:
                taking.join()
        self._swap_together(taking.staged, failure or taking.error, strict, version)
        return WeightsReceived(version, receiver.route.plan.recv_bytes(self.ctx.rank))


class _Taking(threading.Thread):
    """A receiver run in a thread (a colocated copy sends from the main thread meanwhile)."""

    def __init__(self, receiver: Receiver, target: Target) -> None:
        super().__init__(name="reshard-take", daemon=True)
        self.receiver, self.target = receiver, target
        self.staged: dict[str, torch.Tensor] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.staged = self.receiver.run(self.target)
        except BaseException as exc:  # raised on the calling thread by copy_from
            self.error = exc


def local_piece(param: torch.Tensor) -> torch.Tensor:
    """A parameter's piece on this rank (its DTensor shard, or itself)."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
