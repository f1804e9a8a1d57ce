"""The reward role: rule-based functions or a learned reward (or cost) model, one score per row.

* **Rule-based**: ``{"function": "package.module:function"}``. The function is called per row as
  ``fn(prompt, response, metadata)`` and returns a float or a dict with a ``score`` (other numeric
  keys come back as extra columns ``reward/<key>``). A function that raises fails the call with
  its name and the row — the role stays up and the next call works. A function declares the
  columns it reads with ``roles.rules.needs``; the experiment loader checks the data for them
  before a run starts, and a row that still arrives without one (null) fails here, by name.
* **Model-based**: an ``EngineConfig`` (``{"model": PATH, ...}``): an LM backbone with a scalar
  head, read on the last real token of each row. A cost model (Safe-RLHF) is the same role under
  another name. With an ``optim`` section the model trains on preference pairs by Bradley-Terry.

Rows arrive as text (non-tensor columns ``prompt`` and ``response``, plus anything else as the
row's metadata) or as tokens (``input_ids``, ``attention_mask``, ``response_mask``), which are
decoded with the model's tokenizer (``tokenizer: PATH`` for rule functions fed with tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from roles.base import RoleContext
from roles.engine_role import EngineRole
from roles.modeling.losses import aggregate, bradley_terry_loss
from roles.modeling.models import load_tokenizer
from roles.modeling.text import encode_rows, last_token_index
from roles.rule_reward import RewardError, RuleReward, load_function, metadata, text_rows
from roles.runtime.endpoint import DP_REDUCED, DP_SPLIT, endpoint
from transport.batch import TensorBatch
from transport.columns import IDLE


class ModelReward(EngineRole):
    """A reward (or cost) model: a scalar head on the last real token of each row."""

    head = "token"

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx, **config)
        self.tokenizer = load_tokenizer(self.engine.cfg.model)
        if self.engine.cfg.optim is not None and self.engine.cfg.micro_batch_size % 2:
            raise ValueError(
                f"micro_batch_size={self.engine.cfg.micro_batch_size} must be even when the "
                "reward model trains: each micro-batch holds whole (chosen, rejected) pairs"
            )

    def _tokens(self, batch: TensorBatch) -> TensorBatch:
        if "input_ids" in batch.tensors:
            return batch
        prompts, responses = text_rows(batch, self.tokenizer)
        limit = int(self.engine.model_config.max_position_embeddings)
        return encode_rows(self.tokenizer, prompts, responses, limit)[0]

    @endpoint(DP_SPLIT)
    def compute_reward(self, batch: TensorBatch) -> TensorBatch:
        """``scores`` ``[B]``: the head's output on each row's last real token."""
        return TensorBatch.from_dict({"scores": self.engine.infer(self._tokens(batch), last_score)})

    def _pairs(self, batch: TensorBatch) -> TensorBatch:
        """Text pairs (``prompt``, ``chosen``, ``rejected``) → token rows chosen0, rejected0, ...;
        ``pair`` is 1 on each counted pair's chosen row (a pair ``idle`` marks counts none)."""
        prompts = batch.non_tensor("prompt")
        chosen, rejected = batch.non_tensor("chosen"), batch.non_tensor("rejected")
        twice = [p for p in prompts for _ in range(2)]
        answers = [r for pair in zip(chosen, rejected, strict=True) for r in pair]
        limit = int(self.engine.model_config.max_position_embeddings)
        rows = encode_rows(self.tokenizer, twice, answers, limit)[0]
        is_chosen = (torch.arange(len(rows)) % 2 == 0).long()
        idle = batch.tensors.get(IDLE)
        if idle is not None:
            is_chosen = is_chosen * (1 - idle.long().repeat_interleave(2))
        return rows.union(TensorBatch.from_dict({"pair": is_chosen[:, None]}))

    @endpoint(DP_REDUCED)
    def train_pairs(self, batch: TensorBatch) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), averaged
        over all pairs of the batch; also reports the pairwise accuracy."""

        def loss_fn(
            scores: torch.Tensor, micro: TensorBatch, pairs: float, _: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            both = last_score(scores, micro).view(-1, 2)
            per_pair = bradley_terry_loss(both[:, 0], both[:, 1])[:, None]
            counted = micro.tensor("pair").view(-1, 2)[:, :1]  # 0: an idle copy
            accuracy = (both[:, 0] > both[:, 1]).float()[:, None]
            return aggregate(per_pair, counted, "token-mean", pairs, pairs), {
                "accuracy": aggregate(accuracy, counted, "token-mean", pairs, pairs)
            }

        return self.engine.train_step(self._pairs(batch), loss_fn, count_key="pair")

    @endpoint(DP_SPLIT)
    def score_pairs(self, batch: TensorBatch) -> TensorBatch:
        """``chosen`` and ``rejected`` scores ``[N]`` for text pairs (held-out ranking)."""
        scores = self.engine.infer(self._pairs(batch), last_score).view(-1, 2)
        return TensorBatch.from_dict({"chosen": scores[:, 0], "rejected": scores[:, 1]})


def last_score(scores: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
    """Per-position head outputs ``[B, T]`` → the output at each row's last real token ``[B]``."""
    index = last_token_index(micro.tensor("attention_mask"))
    return scores.float().gather(1, index[:, None]).squeeze(1)


#: the rule reward lives in ``roles/rule_reward.py`` (no model code); its names stay here too
__all__ = ["ModelReward", "RewardError", "RuleReward", "load_function", "metadata", "text_rows"]
