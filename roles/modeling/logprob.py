"""The one definition of a token's log-probability, shared by training and generation engines.

Both engines must report the same number for the same token, or PPO's importance ratio is biased
from the first step. The definition, used everywhere in hybridflow:

* a sequence is one row of ``input_ids`` ``[B, T]`` with ``attention_mask`` (1 = real token, pad
  anywhere, left or right); positions count real tokens only (``position_ids``);
* the log-probability of token ``t`` is read from the logits at ``t - 1`` divided by the sampling
  temperature, under the full softmax — no top-k/top-p filtering, computed in float32; a
  temperature of 0 (greedy decoding) reads them at 1, as every generation engine reports them;
* results are aligned with ``input_ids``: column ``t`` belongs to token ``t``; column 0 and padding
  hold 0. A ``response_mask`` ``[B, T]`` says which columns were generated (and count in losses).

Values of a critic follow the same alignment: column ``t`` is the value of the state *before*
token ``t`` is emitted.
"""

from __future__ import annotations

import math

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row (padding repeats its neighbour's value)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[B, K, V]`` logits of a forward pass over ``input_ids`` ``[B, T]`` → ``[B, T]`` log-probs
    of each token under the temperature-scaled distribution (column 0 is 0). ``K`` is ``T``, or
    less when the pass computed logits only at the last ``K`` positions (``logits_kept``): the
    columns it cannot read then hold 0."""
    scaled = logits[:, :-1].float() / softmax_temperature(temperature)
    start = input_ids.shape[1] - logits.shape[1]
    picked = scaled.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1)
    return aligned(picked - torch.logsumexp(scaled, dim=-1), start + 1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, width: int = 0) -> torch.Tensor:
    """Entropy of the temperature-scaled next-token distribution, aligned like the log-probs
    (``width``: the row's length ``T`` when the logits cover only its last positions)."""
    scaled = logits[:, :-1].float() / softmax_temperature(temperature)
    log_p = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    start = max(width - logits.shape[1], 0)
    return aligned(-(log_p.exp() * log_p).sum(-1), start + 1)


def softmax_temperature(temperature: float) -> float:
    """What the logits are divided by for a sampling ``temperature``: itself, or 1 for 0
    (greedy decoding samples no distribution; its log-probs are reported at 1). ValueError for
    a negative or non-finite one."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature {temperature} is not a temperature; give one >= 0")
    return temperature or 1.0


def aligned(from_second: torch.Tensor, first: int = 1) -> torch.Tensor:
    """``[B, T-first]`` values for tokens ``first``..T-1 → ``[B, T]`` aligned with the tokens,
    the columns before ``first`` zero."""
    return torch.cat([from_second.new_zeros((from_second.shape[0], first)), from_second], dim=1)


def read_columns(attention_mask: torch.Tensor, response_mask: torch.Tensor | None) -> torch.Tensor:
    """Where a log-prob pass reports values: every real token, or, given a ``response_mask``,
    each row's real tokens from its first response token on (the pass computes logits only
    there; ``logits_kept``)."""
    if response_mask is None:
        return attention_mask
    return attention_mask * (response_mask.cumsum(-1) > 0)


def logits_kept(response_mask: torch.Tensor) -> int:
    """How many of a batch's last positions a pass needs logits at to score its response tokens:
    from the position before the earliest response token of any row (0: every position). The
    prompt's positions are never scored, and their vocabulary projection and softmax are the
    largest part of a small model's step on a large vocabulary."""
    columns = response_mask.bool().any(0).nonzero()
    if not len(columns):
        return 0
    first = int(columns[0])
    return 0 if first <= 1 else response_mask.shape[1] - first + 1
