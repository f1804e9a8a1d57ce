"""The critic role: a language-model backbone with a scalar value head per position.

Built from any causal-LM folder (the head starts fresh, seeded identically on every rank) or from
a critic exported earlier. Values follow the log-prob alignment of ``roles/modeling/logprob.py``: column
``t`` is the value of the state before token ``t`` — read from the hidden state at ``t - 1``.
"""

from __future__ import annotations

import torch

from roles.engine_role import EngineRole
from roles.modeling.logprob import aligned
from roles.modeling.losses import aggregate, value_loss
from roles.runtime.endpoint import DP_REDUCED, DP_SPLIT, endpoint
from transport.batch import TensorBatch
from transport.columns import ATTENTION_MASK, INPUT_IDS, RESPONSE_MASK, RETURNS, TOKENS, VALUES
from transport.training import ValueLossConfig


def values_of(scores: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
    """Per-position head outputs ``[B, T]`` → aligned values, zero on padding."""
    return aligned(scores[:, :-1].float()) * micro.tensor(ATTENTION_MASK)


class Critic(EngineRole):
    head = "token"

    @endpoint(DP_SPLIT)
    def compute_values(self, batch: TensorBatch) -> TensorBatch:
        """``values`` ``[B, T]`` for the rows of a token batch."""
        batch.require_tensors(INPUT_IDS, ATTENTION_MASK)
        return TensorBatch.from_dict({VALUES: self.engine.infer(batch, values_of)})

    @endpoint(DP_REDUCED)
    def update_critic(
        self, batch: TensorBatch, loss: ValueLossConfig | None = None
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss. Needs ``input_ids``,
        ``attention_mask``, ``response_mask``, ``values`` (the old ones) and ``returns``.
        ``loss`` None: the defaults (a controller that sends the fields as a map still works)."""
        cfg = ValueLossConfig.model_validate(loss if loss is not None else {})
        batch.require_tensors(*TOKENS, VALUES, RETURNS)

        def loss_fn(
            scores: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = values_of(scores, micro)
            mask = micro.tensor(RESPONSE_MASK)
            returns = micro.tensor(RETURNS)
            per_token = value_loss(values, micro.tensor(VALUES), returns, cfg.clip)
            error = (values.detach() - returns) ** 2
            mse = aggregate(error, mask, "token-mean", tokens, seqs)
            return aggregate(per_token, mask, cfg.agg, tokens, seqs), {"value_mse": mse}

        return self.engine.train_step(batch, loss_fn)
