"""Clients of the weight-transfer endpoints (``roles/weight_sync.py``).

``WeightSinkClient`` speaks to roles that take weights (the rollout, and every engine role);
``WeightSourceClient`` to roles that give them (every engine role). The controller carries only
the small descriptions these return — the structs of ``transport/weight_sync.py``: a ``Source``
(layout, dtype, parameter shapes, hosts), a ``Target`` (inbox addresses), the reports — never a
weight; ``controller/sync.py`` strings the calls together.
"""

from __future__ import annotations

from controller.clients.base import RoleClient
from transport.protocol import Transfer
from transport.weight_sync import (
    Source,
    Target,
    WeightsReceived,
    WeightsSent,
    WeightSyncSettings,
)


class WeightSinkClient(RoleClient):
    """A role that takes weights from another group, rank to rank (``reshard/``)."""

    async def open_receive(
        self,
        source: Source,
        version: int,
        settings: WeightSyncSettings,
        strict: bool = True,
        *,
        timeout: float | None = None,
    ) -> Target:
        """Open every rank's inbox for weights ``version`` from ``source`` (a source's
        ``weight_source``); returns the target description ``send_weights`` takes."""
        return await self._call(
            Transfer.ONE_TO_ALL, "open_receive", source, version, settings, strict, timeout=timeout
        )

    async def receive_weights(
        self, version: int, *, timeout: float | None = None
    ) -> WeightsReceived:
        """Take the buckets a source sends and swap them in; rank 0's version, bytes, seconds."""
        return await self._call(Transfer.ONE_TO_ALL, "receive_weights", version, timeout=timeout)

    async def copy_from(
        self,
        role: str,
        version: int,
        settings: WeightSyncSettings,
        strict: bool = True,
        *,
        timeout: float | None = None,
    ) -> WeightsReceived:
        """Weights of ``role``, a role of the same group (a colocated copy)."""
        return await self._call(
            Transfer.ONE_TO_ALL, "copy_from", role, version, settings, strict, timeout=timeout
        )


class WeightSourceClient(RoleClient):
    """A role whose weights other groups take, rank to rank (``reshard/``)."""

    async def weight_source(self, *, timeout: float | None = None) -> Source:
        """Layout, dtype, parameter shapes and splits, and where each rank runs."""
        return await self._call(Transfer.ONE_TO_ALL, "weight_source", timeout=timeout)

    async def send_weights(
        self,
        target: Target,
        version: int,
        settings: WeightSyncSettings,
        *,
        timeout: float | None = None,
    ) -> WeightsSent:
        """Send weights ``version`` to the ranks of ``target`` (a sink's ``open_receive``)."""
        return await self._call(
            Transfer.ONE_TO_ALL, "send_weights", target, version, settings, timeout=timeout
        )
