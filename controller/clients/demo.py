"""Client of the demo role ``roles.demo:LinearRegressor`` (``controller/demo.py`` drives it).

``train_step`` is dp-split and returns a dict per rank, so the controller receives one dict per
dp rank (all equal: the ranks reduce the loss over the group).
"""

from __future__ import annotations

import torch

from controller.clients.base import RoleClient
from transport.batch import TensorBatch
from transport.protocol import Transfer


class LinearRegressorClient(RoleClient):
    async def train_step(
        self, batch: TensorBatch, *, timeout: float | None = None
    ) -> list[dict[str, float]]:
        """One SGD step on the global batch; each dp rank's copy of the loss before the step."""
        return await self._call(Transfer.DP_SPLIT, "train_step", batch, timeout=timeout)

    async def predict(self, batch: TensorBatch, *, timeout: float | None = None) -> TensorBatch:
        return await self._call(Transfer.DP_SPLIT, "predict", batch, timeout=timeout)

    async def weights(self, *, timeout: float | None = None) -> dict[str, torch.Tensor]:
        return await self._call(Transfer.RANK_ZERO, "weights", timeout=timeout)

    async def replicas_agree(self, *, timeout: float | None = None) -> bool:
        """True when every rank holds bit-identical weights."""
        return await self._call(Transfer.ONE_TO_ALL, "replicas_agree", timeout=timeout)

    async def info(self, *, timeout: float | None = None) -> dict[str, int]:
        return await self._call(Transfer.ONE_TO_ALL, "info", timeout=timeout)
