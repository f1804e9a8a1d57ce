"""Client of the rollout role (``roles/rollout.py``): a generation group fed the actor's weights."""

from __future__ import annotations

import torch

from controller.clients.base import by_request
from controller.clients.weights import WeightSinkClient
from transport.batch import TensorBatch
from transport.protocol import Transfer
from transport.sampling import SamplingConfig
from transport.turns import TurnRequest, TurnResult


class RolloutClient(WeightSinkClient):
    """A generation group apart from the actor: samples on the weights it was last given."""

    async def generate(
        self,
        batch: TensorBatch,
        sampling: SamplingConfig | None = None,
        min_version: int = 0,
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        """Samples for the prompts of ``batch`` on weights of version ``min_version`` or newer
        (older ones: an error); ``meta["weight_version"]`` says whose weights."""
        reply: TensorBatch = await self._call(
            Transfer.DP_RAGGED, "generate", batch, sampling, min_version, timeout=timeout
        )
        return by_request(reply, sampling)

    async def exchange(
        self,
        channel: str,
        requests: list[TurnRequest],
        sampling: SamplingConfig | None = None,
        wait_s: float = 0.0,
        min_version: int = 0,
        *,
        timeout: float | None = None,
    ) -> list[TurnResult]:
        """Iteration-level serving (native engine, tp = 1): ``requests`` join the running decode
        batch of the dp rank each names (``replica``); returns ``channel``'s finished turns, in
        any order, waiting up to ``wait_s`` for the first while any are out."""
        return await self._call(
            Transfer.DP_ROUTED,
            "exchange",
            channel,
            requests,
            sampling,
            wait_s,
            min_version,
            timeout=timeout,
        )

    async def prompt_logits(
        self, batch: TensorBatch, *, timeout: float | None = None
    ) -> TensorBatch:
        """``logits`` ``[B, V]`` of the next token after each prompt."""
        return await self._call(Transfer.DP_SPLIT, "prompt_logits", batch, timeout=timeout)

    async def load_weights(
        self, state: dict[str, torch.Tensor], version: int, *, timeout: float | None = None
    ) -> int:
        """Replace every weight with ``state`` (full tensors, through the controller: the
        baseline path; ``controller/sync.py`` moves weights rank to rank); returns the version."""
        return await self._call(
            Transfer.ONE_TO_ALL, "load_weights", state, version, timeout=timeout
        )

    async def drop_sessions(self, keys: list[str], *, timeout: float | None = None) -> int:
        """Forget the kept KV of these trajectories (ended); how many rank 0 held."""
        return await self._call(Transfer.ONE_TO_ALL, "drop_sessions", keys, timeout=timeout)

    async def weight_version(self, *, timeout: float | None = None) -> int:
        """The policy version of the weights it now serves (0: the initial ones)."""
        return await self._call(Transfer.ONE_TO_ALL, "weight_version", timeout=timeout)

    async def precision(self, *, timeout: float | None = None) -> dict[str, str]:
        """``{"dtype": "fp32" | "bf16", "reason": ...}``: the dtype the weights generate in."""
        return await self._call(Transfer.RANK_ZERO, "precision", timeout=timeout)
