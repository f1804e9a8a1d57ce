"""``EngineClient``: what every model-holding role answers (``roles/engine_role.py``).

Checkpoints and in-memory snapshots, a fresh optimizer per training stage, whole weights from
another role, export to a Hugging Face folder, the parameter layout, and weights rank to rank
(``clients/weights.py``).
The reference, actor, critic and reward-model clients extend it with the endpoints of their own
role class.
"""

from __future__ import annotations

import torch

from controller.clients.weights import WeightSinkClient, WeightSourceClient
from transport.protocol import Transfer
from transport.training import OptimConfig


class EngineClient(WeightSourceClient, WeightSinkClient):
    """What every role that holds a trained model answers: optimizer, checkpoints, snapshots,
    whole-weight loads and export."""

    async def save(self, path: str, *, timeout: float | None = None) -> str:
        """Sharded checkpoint (model, optimizer, schedule, RNG) under ``path``; returns it."""
        return await self._call(Transfer.ONE_TO_ALL, "save", path, timeout=timeout)

    async def configure_optim(self, optim: OptimConfig, *, timeout: float | None = None) -> int:
        """A fresh optimizer and schedule; returns the optimizer steps taken so far."""
        return await self._call(Transfer.ONE_TO_ALL, "configure_optim", optim, timeout=timeout)

    async def load(self, path: str, *, timeout: float | None = None) -> int:
        """Restore a checkpoint written by ``save`` at the same layout; returns its step."""
        return await self._call(Transfer.ONE_TO_ALL, "load", path, timeout=timeout)

    async def snapshot(self, folder: str, step: int, *, timeout: float | None = None) -> int:
        """The role's training state into shared-memory files under ``folder`` as the snapshot
        of ``step`` (every rank its own); returns the bytes rank 0 wrote."""
        return await self._call(Transfer.ONE_TO_ALL, "snapshot", folder, step, timeout=timeout)

    async def restore_snapshot(
        self, folder: str, step: int, *, timeout: float | None = None
    ) -> int:
        """The snapshot of ``step`` under ``folder`` back into every rank; returns its step."""
        return await self._call(
            Transfer.ONE_TO_ALL, "restore_snapshot", folder, step, timeout=timeout
        )

    async def load_state(
        self, state: dict[str, torch.Tensor], strict: bool = True, *, timeout: float | None = None
    ) -> int:
        """Whole weights from another role (``strict=False``: a backbone into a critic)."""
        return await self._call(Transfer.ONE_TO_ALL, "load_state", state, strict, timeout=timeout)

    async def export(self, path: str, *, timeout: float | None = None) -> str:
        """The full weights as a plain Hugging Face folder at ``path``; returns it."""
        return await self._call(Transfer.ONE_TO_ALL, "export", path, timeout=timeout)

    async def progress(self, *, timeout: float | None = None) -> dict[str, int]:
        """``{"step": optimizer steps taken, "accumulated": forward_backward calls waiting for
        the next step}``: what a caller whose call was cancelled reads to learn what ran."""
        return await self._call(Transfer.RANK_ZERO, "progress", timeout=timeout)

    async def discard_gradients(self, *, timeout: float | None = None) -> None:
        """Drop the gradients ``forward_backward`` accumulated on every rank."""
        return await self._call(Transfer.ONE_TO_ALL, "discard_gradients", timeout=timeout)

    async def precision(self, *, timeout: float | None = None) -> dict[str, str]:
        """``{"dtype": "fp32" | "bf16", "reason": ...}``: what the engine computes in (its
        ``dtype: auto`` resolved on the ranks) and why."""
        return await self._call(Transfer.RANK_ZERO, "precision", timeout=timeout)

    async def param_layout(self, *, timeout: float | None = None) -> dict[str, dict[str, object]]:
        """Per parameter: full shape, the dim split over tp and the dim split over dp."""
        return await self._call(Transfer.RANK_ZERO, "param_layout", timeout=timeout)
