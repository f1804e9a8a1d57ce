"""The one definition of a token's log-probability, shared by training and generation engines.

Both engines must report the same number for the same token, or PPO's importance ratio is biased
from the first step. The definition, used everywhere in hybridflow:

* a sequence is one row of ``input_ids`` ``[B, T]`` with ``attention_mask`` (1 = real token, pad
  anywhere, left or right); positions count real tokens only (``position_ids``);
* the log-probability of token ``t`` is read from the logits at ``t - 1`` divided by the sampling
  temperature, under the full softmax — no top-k/top-p filtering, computed in float32;
* results are aligned with ``input_ids``: column ``t`` belongs to token ``t``; column 0 and padding
  hold 0. A ``response_mask`` ``[B, T]`` says which columns were generated (and count in losses).

Values of a critic follow the same alignment: column ``t`` is the value of the state *before*
token ``t`` is emitted.
"""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row (padding repeats its neighbour's value)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[B, T, V]`` logits of a forward pass over ``input_ids`` ``[B, T]`` → ``[B, T]`` log-probs
    of each token under the temperature-scaled distribution (column 0 is 0)."""
    scaled = logits[:, :-1].float() / temperature
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return aligned(picked - torch.logsumexp(scaled, dim=-1))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled next-token distribution, aligned like the log-probs."""
    scaled = logits[:, :-1].float() / temperature
    log_p = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    return aligned(-(log_p.exp() * log_p).sum(-1))


def aligned(from_second: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` values for tokens 1..T-1 (read at positions 0..T-2) → ``[B, T]`` aligned with
    the tokens, column 0 zero."""
    return torch.cat([torch.zeros_like(from_second[:, :1]), from_second], dim=1)
