"""Clients of the reward roles (``roles/reward.py``).

``RewardClient`` scores rows: all an RL program asks of a reward or cost role, whether it runs a
rule function (``RuleReward``) or a model (``ModelReward``). ``RewardModelClient`` adds what only
a model answers: Bradley-Terry training on preference pairs and held-out pair scores, and the
engine endpoints (checkpoints, export).
"""

from __future__ import annotations

from controller.clients.base import RoleClient
from controller.clients.engine import EngineClient
from transport.batch import TensorBatch
from transport.protocol import Transfer


class RewardClient(RoleClient):
    """A reward role (a rule function, a reward model or an LLM judge): one score per row."""

    async def compute_reward(
        self, batch: TensorBatch, *, timeout: float | None = None
    ) -> TensorBatch:
        """``scores`` ``[B]`` (plus ``reward/<key>`` extras from a rule function)."""
        return await self._call(Transfer.DP_SPLIT, "compute_reward", batch, timeout=timeout)


class RewardModelClient(EngineClient, RewardClient):
    async def train_pairs(
        self, batch: TensorBatch, *, timeout: float | None = None
    ) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss on (prompt, chosen, rejected) rows."""
        return await self._call(Transfer.DP_REDUCED, "train_pairs", batch, timeout=timeout)

    async def score_pairs(self, batch: TensorBatch, *, timeout: float | None = None) -> TensorBatch:
        """``chosen`` and ``rejected`` scores ``[N]`` for text pairs."""
        return await self._call(Transfer.DP_SPLIT, "score_pairs", batch, timeout=timeout)
