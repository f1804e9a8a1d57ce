"""Clients of the weight-transfer endpoints (``roles/weight_sync.py``).

``WeightSinkClient`` speaks to roles that take weights (the rollout, and every engine role);
``WeightSourceClient`` to roles that give them (every engine role). The controller carries only
the small descriptions these return (layouts, parameter shapes, inbox addresses, the version);
``controller/sync.py`` strings the calls together.
"""

from __future__ import annotations

from typing import Any

from controller.clients.base import RoleClient
from transport.protocol import Transfer


class WeightSinkClient(RoleClient):
    async def open_receive(
        self,
        source: dict[str, Any],
        version: int,
        settings: dict[str, Any],
        strict: bool = True,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Open every rank's inbox for weights ``version`` from ``source`` (a source's
        ``weight_source``); returns the target description ``send_weights`` takes."""
        return await self._call(
            Transfer.ONE_TO_ALL, "open_receive", source, version, settings, strict, timeout=timeout
        )

    async def receive_weights(
        self, version: int, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Take the buckets a source sends and swap them in; rank 0's version and bytes."""
        return await self._call(Transfer.ONE_TO_ALL, "receive_weights", version, timeout=timeout)

    async def copy_from(
        self,
        role: str,
        version: int,
        settings: dict[str, Any],
        strict: bool = True,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Weights of ``role``, a role of the same group (a colocated copy)."""
        return await self._call(
            Transfer.ONE_TO_ALL, "copy_from", role, version, settings, strict, timeout=timeout
        )


class WeightSourceClient(RoleClient):
    async def weight_source(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Layout, dtype, parameter shapes and splits, and where each rank runs."""
        return await self._call(Transfer.ONE_TO_ALL, "weight_source", timeout=timeout)

    async def send_weights(
        self,
        target: dict[str, Any],
        version: int,
        settings: dict[str, Any],
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send weights ``version`` to the ranks of ``target`` (a sink's ``open_receive``)."""
        return await self._call(
            Transfer.ONE_TO_ALL, "send_weights", target, version, settings, timeout=timeout
        )
