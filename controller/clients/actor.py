"""Clients of the actor and reference roles (``roles/actor.py``): log-probs, generation, PPO
updates and supervised fine-tuning.

``ActorClient`` is a ``ReferenceClient``: wherever a program needs log-probs of a frozen model it
can take the actor too.
"""

from __future__ import annotations

from typing import Literal

import torch

from controller.clients.base import by_request
from controller.clients.engine import EngineClient
from transport.batch import TensorBatch
from transport.protocol import Transfer
from transport.sampling import SamplingConfig
from transport.training import AdamStep, PolicyLossConfig, Reduction


class ReferenceClient(EngineClient):
    """A frozen model role (``reference``, ``teacher``): per-token log-probs of given tokens."""

    async def compute_log_prob(
        self,
        batch: TensorBatch,
        temperature: float = 1.0,
        entropy: bool = False,
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        """``log_probs`` (and ``entropy``) ``[B, T]`` aligned with ``input_ids``."""
        return await self._call(
            Transfer.DP_SPLIT, "compute_log_prob", batch, temperature, entropy, timeout=timeout
        )


class ActorClient(ReferenceClient):
    """The trained policy: log-probs, policy-loss updates (whole steps or ``forward_backward``
    then ``optim_step``), SFT steps, generation when no rollout group is placed, and the
    engine's checkpoints and weight syncs."""

    async def compute_ref_log_prob(
        self,
        batch: TensorBatch,
        temperature: float = 1.0,
        entropy: bool = False,
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        """``compute_log_prob`` of the reference of a LoRA run: the actor with its adapters
        switched off (the base model), or as ``rebase_reference`` froze them."""
        return await self._call(
            Transfer.DP_SPLIT, "compute_ref_log_prob", batch, temperature, entropy, timeout=timeout
        )

    async def rebase_reference(self, *, timeout: float | None = None) -> None:
        """A LoRA actor's adapters as they are now become its reference's (an RL stage's start
        after SFT)."""
        return await self._call(Transfer.ONE_TO_ALL, "rebase_reference", timeout=timeout)

    async def generate(
        self,
        batch: TensorBatch,
        sampling: SamplingConfig | None = None,
        min_version: int = 0,
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        """Samples for the prompts of ``batch`` on the actor's own weights (colocated), which
        are always the newest: ``min_version`` is their policy version, echoed in
        ``meta["weight_version"]`` (the call a ``RolloutClient`` takes too). ``sampling`` None:
        ``SamplingConfig()``."""
        reply: TensorBatch = await self._call(
            Transfer.MICRO_DP, "generate", batch, sampling, min_version, timeout=timeout
        )
        return by_request(reply, sampling)

    async def state_dict(self, *, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The full weights, e.g. for a rollout group's ``load_weights``."""
        return await self._call(Transfer.ONE_TO_ALL, "state_dict", timeout=timeout)

    async def update_policy(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | None = None,
        temperature: float = 1.0,
        *,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the clipped surrogate on the whole batch; its metrics.
        ``loss`` None: ``PolicyLossConfig()``."""
        return await self._call(
            Transfer.DP_REDUCED, "update_policy", batch, loss, temperature, timeout=timeout
        )

    async def forward_backward(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | None = None,
        temperature: float = 1.0,
        reduction: Reduction = "mean",
        *,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """The policy loss's forward and backward on ``batch``; the gradients add up until
        ``optim_step`` (``reduction``: each call normalised by its own batch, or summed). The
        loss's metrics. A call that fails drops every pending gradient, its own part and those
        of the calls before it (the error says how many): run those again."""
        return await self._call(
            Transfer.DP_REDUCED,
            "forward_backward",
            batch,
            loss,
            temperature,
            reduction,
            timeout=timeout,
        )

    async def drop_sessions(self, keys: list[str], *, timeout: float | None = None) -> int:
        """Forget the kept KV of these trajectories (ended); how many rank 0 held."""
        return await self._call(Transfer.ONE_TO_ALL, "drop_sessions", keys, timeout=timeout)

    async def forward_backward_kept(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | Literal["cross_entropy"],
        temperature: float = 1.0,
        reduction: Reduction = "mean",
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        """``forward_backward`` or, with ``"cross_entropy"``, ``forward_backward_nll``, and the
        log-probs its loss saw in the same forward: ``log_probs`` ``[B, T]``, the loss's metrics
        in ``meta["metrics"]``."""
        return await self._call(
            Transfer.DP_SPLIT,
            "forward_backward_kept",
            batch,
            loss,
            temperature,
            reduction,
            timeout=timeout,
        )

    async def forward_backward_nll(
        self, batch: TensorBatch, reduction: Reduction = "mean", *, timeout: float | None = None
    ) -> dict[str, float]:
        """Cross-entropy's forward and backward on token rows (``response_mask`` marks the
        trained tokens, an optional ``weights`` column weighs them); the gradients add up until
        ``optim_step``. ``loss``: the batch's weighted mean next-token loss (its sum with
        ``reduction="sum"``)."""
        return await self._call(
            Transfer.DP_REDUCED, "forward_backward_nll", batch, reduction, timeout=timeout
        )

    async def optim_step(
        self, adam: AdamStep | None = None, *, timeout: float | None = None
    ) -> dict[str, float]:
        """One optimizer step on the gradients accumulated so far (``adam``: this step's own
        AdamW settings): ``grad_norm``, ``lr``, ``skipped`` (1: the norm was not finite, and the
        step left the weights as they were)."""
        return await self._call(Transfer.ONE_TO_ALL, "optim_step", adam, timeout=timeout)

    async def sft_step(
        self,
        batch: TensorBatch,
        response_only: bool = True,
        pack: bool = False,
        scale: float = 1.0,
        *,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step of next-token loss on text rows (``prompt``, ``response``)."""
        return await self._call(
            Transfer.DP_REDUCED,
            "sft_step",
            batch,
            response_only,
            pack,
            scale,
            timeout=timeout,
        )

    async def sft_eval(
        self,
        batch: TensorBatch,
        response_only: bool = True,
        pack: bool = False,
        *,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """Token-mean next-token loss on text rows, no update: ``loss`` and ``tokens``."""
        return await self._call(
            Transfer.DP_REDUCED, "sft_eval", batch, response_only, pack, timeout=timeout
        )
