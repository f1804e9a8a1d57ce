"""Weight syncs between role groups: the controller sends commands, never weights.

``WeightSync.push(target, version)`` moves the source role's weights (the actor's) into a sink
role (the rollout group, the reference, a critic) rank to rank through ``reshard/``:

1. ``source.weight_source()`` once — layout, dtype, parameter shapes and splits, hosts;
2. ``target.open_receive(source, version, settings)`` — the target's ranks bind their inboxes;
3. ``source.send_weights(target, version, settings)`` and ``target.receive_weights(version)``
   together. The first failure ends the sync at once with a ``WeightSyncError`` that carries the
   role and rank at fault; the target keeps the weights it had.

A target in the source's own group (colocated roles) takes one call, ``copy_from``. Every message
is a few kilobytes (names, shapes, addresses), whatever the model's size.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import torch

from controller.clients.weights import WeightSinkClient, WeightSourceClient
from transport.errors import HybridflowError, RemoteError, RoleDeadError
from transport.structs import to_map
from transport.weight_sync import Source, WeightsReceived, WeightsSent, WeightSyncSettings

#: after one side of a sync fails, how long to wait for the other's error: a receiver names the
#: sender that stopped (it notices a closed connection within half a second), while a dead
#: group's own report may blame the rank that exited after it
OTHER_SIDE_S = 2.0


class WeightSyncError(RuntimeError):
    """A weight sync that failed; the message names the role and rank that broke it."""


class WeightSync:
    def __init__(self, source: WeightSourceClient, settings: WeightSyncSettings) -> None:
        self.source = source
        self.settings = settings
        self._described: Source | None = None

    def colocated(self, target: WeightSinkClient) -> bool:
        controller = self.source.controller
        return controller.group_of(self.source.role) is controller.group_of(target.role)

    async def push(
        self, target: WeightSinkClient, version: int, strict: bool = True
    ) -> dict[str, Any]:
        """``version`` of the source's weights into ``target`` (``strict=False``: the names both
        hold, e.g. a backbone into a critic). Returns the seconds it took, rank 0's reports
        (``WeightsSent``, ``WeightsReceived``) as maps (bytes, seconds, paths), and
        ``controller_bytes``: what crossed the controller's sockets meanwhile (the sync's
        commands, and any other call's traffic at the same time), ``controller_weight_bytes``:
        the tensor payloads of the sync's own calls, what they sent and what came back, counted
        at each crossing (0: no weight went through the controller; other calls' tensors are
        not counted)."""
        start = time.perf_counter()
        traffic = self.source.controller.traffic
        before = traffic.sent + traffic.received
        crossed = 0  # tensor bytes in the sync's own calls' arguments and answers
        settings = self.settings
        what = f"{self.source.role} -> {target.role} (weight version {version})"
        try:
            if self.colocated(target):
                copied = await target.copy_from(self.source.role, version, settings, strict)
                return {"seconds": time.perf_counter() - start, "received": to_map(copied)}
            if self._described is None:
                self._described = await self.source.weight_source()
                crossed += tensor_bytes(self._described)
            opened = await target.open_receive(self._described, version, settings, strict)
            crossed += tensor_bytes(self._described) + tensor_bytes(opened)
        except HybridflowError as exc:
            raise WeightSyncError(f"weight sync {what} failed: {describe(exc)}") from exc
        sent, got = await self._both(
            self.source.send_weights(opened, version, settings),
            target.receive_weights(version),
            what,
        )
        crossed += tensor_bytes(opened) + tensor_bytes(sent) + tensor_bytes(got)
        return {
            "seconds": time.perf_counter() - start,
            "sent": to_map(sent),
            "received": to_map(got),
            "controller_bytes": traffic.sent + traffic.received - before,
            "controller_weight_bytes": crossed,
        }

    async def _both(
        self,
        send: Coroutine[Any, Any, WeightsSent],
        receive: Coroutine[Any, Any, WeightsReceived],
        what: str,
    ) -> tuple[WeightsSent, WeightsReceived]:
        """Run both calls; the first failure cancels the other (its group reports it too)."""
        sending, receiving = asyncio.ensure_future(send), asyncio.ensure_future(receive)
        tasks: list[asyncio.Future[Any]] = [sending, receiving]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            if pending:  # the other side's error, when it follows soon, may say more
                await asyncio.wait(pending, timeout=OTHER_SIDE_S)
            errors = [t.exception() for t in tasks if t.done() and t.exception() is not None]
            for task in pending:
                task.cancel()
            reasons = "; ".join(describe(e) for e in errors if e is not None)
            raise WeightSyncError(f"weight sync {what} failed: {reasons}") from errors[0]
        return sending.result(), receiving.result()


def describe(exc: BaseException) -> str:
    """One line naming the role and rank at fault (the remote traceback stays in ``__cause__``)."""
    if isinstance(exc, RoleDeadError):
        return f"{exc.role} rank {exc.rank} {exc.cause}"
    if isinstance(exc, RemoteError):
        return f"{exc.role} rank {exc.rank} raised {exc.exc_type}: {exc.remote_message}"
    return f"{type(exc).__name__}: {exc}"


def tensor_bytes(found: Any) -> int:
    """The bytes of the tensors (torch, or numpy arrays) inside ``found``: dataclasses, maps and
    sequences are looked into; everything else holds none."""
    if isinstance(found, torch.Tensor):
        return found.numel() * found.element_size()
    if hasattr(found, "__array__") and hasattr(found, "nbytes"):
        return int(found.nbytes)
    if dataclasses.is_dataclass(found) and not isinstance(found, type):
        return sum(tensor_bytes(getattr(found, f.name)) for f in dataclasses.fields(found))
    if isinstance(found, Mapping):
        return sum(tensor_bytes(v) for v in found.values())
    if isinstance(found, list | tuple | set | frozenset):
        return sum(tensor_bytes(v) for v in found)
    return 0
