"""Client of the critic role (``roles/critic.py``): values per position and value-loss updates."""

from __future__ import annotations

from controller.clients.engine import EngineClient
from transport.batch import TensorBatch
from transport.protocol import Transfer
from transport.training import ValueLossConfig


class CriticClient(EngineClient):
    """A value model: per-token values, and value-loss updates."""

    async def compute_values(
        self, batch: TensorBatch, *, timeout: float | None = None
    ) -> TensorBatch:
        """``values`` ``[B, T]`` for the rows of a token batch."""
        return await self._call(Transfer.DP_SPLIT, "compute_values", batch, timeout=timeout)

    async def update_critic(
        self,
        batch: TensorBatch,
        loss: ValueLossConfig | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss; its metrics. ``loss`` None:
        ``ValueLossConfig()``."""
        return await self._call(Transfer.DP_REDUCED, "update_critic", batch, loss, timeout=timeout)
