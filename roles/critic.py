"""The critic role: a language-model backbone with a scalar value head per position.

Built from any causal-LM folder (the head starts fresh, seeded identically on every rank) or from
a critic exported earlier. Values follow the log-prob alignment of ``roles/modeling/logprob.py``: column
``t`` is the value of the state before token ``t`` — read from the hidden state at ``t - 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from roles.engine_role import TOKENS, EngineRole
from roles.modeling.logprob import aligned
from roles.modeling.losses import ValueLossConfig, aggregate, value_loss
from roles.runtime.endpoint import DP_REDUCED, DP_SPLIT, endpoint
from transport.batch import TensorBatch


def values_of(scores: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
    """Per-position head outputs ``[B, T]`` → aligned values, zero on padding."""
    return aligned(scores[:, :-1].float()) * micro.tensor("attention_mask")


class Critic(EngineRole):
    head = "token"

    @endpoint(DP_SPLIT)
    def compute_values(self, batch: TensorBatch) -> TensorBatch:
        """``values`` ``[B, T]`` for the rows of a token batch."""
        batch.require_tensors("input_ids", "attention_mask")
        return TensorBatch.from_dict({"values": self.engine.infer(batch, values_of)})

    @endpoint(DP_REDUCED)
    def update_critic(
        self, batch: TensorBatch, loss: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss. Needs ``input_ids``,
        ``attention_mask``, ``response_mask``, ``values`` (the old ones) and ``returns``."""
        cfg = ValueLossConfig.model_validate(loss or {})
        batch.require_tensors(*TOKENS, "values", "returns")

        def loss_fn(
            scores: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = values_of(scores, micro)
            mask = micro.tensor("response_mask")
            returns = micro.tensor("returns")
            per_token = value_loss(values, micro.tensor("values"), returns, cfg.clip)
            error = (values.detach() - returns) ** 2
            mse = aggregate(error, mask, "token-mean", tokens, seqs)
            return aggregate(per_token, mask, cfg.agg, tokens, seqs), {"value_mse": mse}

        return self.engine.train_step(batch, loss_fn)
