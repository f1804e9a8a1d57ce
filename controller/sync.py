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
import time
from collections.abc import Coroutine
from typing import Any

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
        ``controller_bytes``: what crossed the controller's sockets meanwhile (the commands),
        ``controller_weight_bytes``: of that, tensor payloads (0: no weight went through it)."""
        start = time.perf_counter()
        traffic = self.source.controller.traffic
        before, tensors_before = traffic.sent + traffic.received, traffic.tensors
        settings = self.settings
        what = f"{self.source.role} -> {target.role} (weight version {version})"
        try:
            if self.colocated(target):
                copied = await target.copy_from(self.source.role, version, settings, strict)
                return {"seconds": time.perf_counter() - start, "received": to_map(copied)}
            if self._described is None:
                self._described = await self.source.weight_source()
            opened = await target.open_receive(self._described, version, settings, strict)
        except HybridflowError as exc:
            raise WeightSyncError(f"weight sync {what} failed: {describe(exc)}") from exc
        sent, got = await self._both(
            self.source.send_weights(opened, version, settings),
            target.receive_weights(version),
            what,
        )
        return {
            "seconds": time.perf_counter() - start,
            "sent": to_map(sent),
            "received": to_map(got),
            "controller_bytes": traffic.sent + traffic.received - before,
            "controller_weight_bytes": traffic.tensors - tensors_before,
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
