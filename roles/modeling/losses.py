"""Policy, value and KL losses for RL fine-tuning: pure tensor functions, no distributed code.

The training engine splits a batch into micro-batches (and data-parallel ranks), calls these
functions once per micro-batch and sums the gradients. For that sum to equal the gradient of the
whole batch's loss, every micro-batch divides by the *global* counts of the batch — the engine
takes them once with `count(whole_mask)` (summed over ranks) and passes them as `tokens` and
`seqs`. Each call then returns its share; shares add up to the batch loss, and the metrics are
normalised the same way so that summing them over micro-batches and ranks gives the batch value.

All per-token tensors are [B, T]; `mask` is a [B, T] 0/1 tensor (bool or float) marking the
tokens that count (response tokens, not prompt or padding). The settings (`PolicyLossConfig`,
`ValueLossConfig`) come from the controller with the call: they live in `transport/training.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from transport.imports import import_path
from transport.training import AggMode, KLKind, PolicyKind, PolicyLossConfig, ValueLossConfig

__all__ = [  # the loss settings are the controller's too: they live in transport/training.py
    "AggMode",
    "KLKind",
    "PolicyKind",
    "PolicyLossConfig",
    "PolicyTerms",
    "ValueLossConfig",
    "aggregate",
    "bradley_terry_loss",
    "cispo_terms",
    "count",
    "entropy_from_logits",
    "gspo_terms",
    "kl_penalty",
    "load_policy_term",
    "policy_loss",
    "ppo_policy_terms",
    "truncated_is_weight",
    "value_loss",
]

_KL_ALIASES: dict[str, str] = {"mse": "k2", "low_var_kl": "k3"}
# exp() of a log-ratio beyond this overflows float32 into inf, whose backward is NaN even where a
# later clamp makes the forward value irrelevant; ratios of e^20 are far outside any trust region.
_MAX_LOG_RATIO = 20.0


def count(mask: Tensor) -> tuple[float, float]:
    """(tokens, sequences) that count: the mask's sum and the rows with at least one token."""
    per_row = mask.float().sum(dim=-1)
    return float(per_row.sum()), float((per_row > 0).sum())


def aggregate(values: Tensor, mask: Tensor, mode: AggMode, tokens: float, seqs: float) -> Tensor:
    """Scalar: this micro-batch's share of the batch loss, normalised by the batch's counts.

    token-mean:           sum(values * mask) / tokens
    seq-mean-token-sum:   sum over rows of (sum_t values * mask) / seqs
    seq-mean-token-mean:  sum over rows of (sum_t values * mask / max(row tokens, 1)) / seqs
    A zero denominator (nothing counts) gives 0.0 with a graph, so backward yields zero grads.
    """
    if mode not in get_args(AggMode):
        raise ValueError(f"mode={mode!r} is not one of {get_args(AggMode)}")
    keep = mask.bool()
    # where(), not values * mask: padding may hold inf or NaN (e.g. log-probs of pad tokens).
    masked = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    denominator = tokens if mode == "token-mean" else seqs
    if denominator <= 0:
        return masked.sum() * 0.0
    if mode == "token-mean":
        return masked.sum() / tokens
    row_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return row_sums.sum() / seqs
    row_tokens = keep.sum(dim=-1).clamp(min=1).to(values.dtype)
    return (row_sums / row_tokens).sum() / seqs


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3)."""
    estimator = _KL_ALIASES.get(kind, kind)
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kind={kind!r} is not one of {get_args(KLKind)}")


@dataclass(frozen=True)
class PolicyTerms:
    loss: Tensor  # [B, T] per-token surrogate loss, still to be aggregated
    ratio: Tensor  # [B, T] exp(logp - old_logp)
    clipped: Tensor  # [B, T] bool: the clipped term was strictly larger and taken
    dual_clipped: Tensor  # [B, T] bool: the dual-clip cap was applied


def ppo_policy_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> PolicyTerms:
    """PPO clipped surrogate, ratio clamped to [1 - clip_low, 1 + clip_high], with dual clip.

    Dual clip (Ye et al. 2020) caps the loss of a negative-advantage token at -A * dual_clip, so a
    huge ratio on a bad token cannot dominate the batch.
    """
    if clip_low < 0:
        raise ValueError(f"clip_low={clip_low} must be >= 0")
    if clip_high < 0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None to disable)")
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    return PolicyTerms(loss=loss, ratio=ratio, clipped=clipped, dual_clipped=dual_clipped)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """[B]: the mean over each row's counted tokens of log(pi / pi_old), i.e. the log of the
    geometric mean of the token ratios (0 for a row with no counted token)."""
    keep = mask.bool()
    log_ratio = torch.where(keep, logp - old_logp, torch.zeros((), dtype=logp.dtype))
    return log_ratio.sum(-1) / keep.sum(-1).clamp(min=1).to(logp.dtype)


def gspo_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    token_level: bool = False,
) -> PolicyTerms:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio of a whole response,

        s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(mean_t log(pi_t / pi_old_t)),

    clipped per sequence: loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)),
    A_i being the row's advantage (the mean over its tokens: GRPO's are equal along a row).
    Every token of row i carries loss_i, so ``seq-mean-token-mean`` gives the paper's mean over
    responses. ``token_level`` is GSPO-token: s_i,t = sg[s_i] * pi_t / sg[pi_t] (the value of
    s_i, the gradient of one token) with the token's own advantage A_i,t; with equal
    advantages along a row it equals GSPO in value and gradient."""
    keep = mask.bool()
    seq = sequence_log_ratio(logp, old_logp, mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if token_level:
        ratio = (seq.detach()[:, None] + logp - logp.detach()).exp()
        adv = advantages
    else:
        ratio = seq.exp()[:, None].expand_as(logp)
        zero = torch.zeros((), dtype=advantages.dtype)
        row_adv = torch.where(keep, advantages, zero).sum(-1) / keep.sum(-1).clamp(min=1)
        adv = row_adv[:, None].expand_as(logp)
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    nothing = torch.zeros_like(keep)
    return PolicyTerms(
        loss=loss, ratio=ratio, clipped=clipped_loss > unclipped, dual_clipped=nothing
    )


def cispo_terms(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> PolicyTerms:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update,

        loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi_t,  r_t = pi_t / pi_old_t,

    so every token keeps a gradient (PPO drops those whose ratio left the trust region); the
    paper aggregates over all tokens of the batch (``token-mean``) and sets no lower bound
    (``clip_ratio_low: 1``). ``clipped`` marks tokens whose weight was cut."""
    ratio = (logp - old_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages * logp
    return PolicyTerms(
        loss=loss,
        ratio=ratio,
        clipped=weight != ratio,
        dual_clipped=torch.zeros_like(ratio, dtype=torch.bool),
    )


def importance_sampling_terms(logp: Tensor, old_logp: Tensor, advantages: Tensor) -> PolicyTerms:
    """The unclipped importance-sampled policy gradient, loss_t = -A_t * pi_t / pi_old_t (the
    REINFORCE gradient when pi_old is the sampler's policy; at pi = pi_old its gradient is
    -A_t * grad log pi_t). Nothing is clipped."""
    ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    nothing = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyTerms(loss=-advantages * ratio, ratio=ratio, clipped=nothing, dual_clipped=nothing)


def dro_terms(logp: Tensor, old_logp: Tensor, advantages: Tensor, beta: float) -> PolicyTerms:
    """DRO's per-token loss (Richemond et al. 2024; Tinker's ``dro``): the log-likelihood
    weighted by the advantage, held near the sampler by a quadratic penalty instead of a clip,

        loss_t = -(A_t log pi_t - beta / 2 (log pi_t - log pi_old_t)^2),

    whose gradient in log pi_t is -A_t + beta (log pi_t - log pi_old_t). Nothing is clipped."""
    ratio = (logp - old_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    loss = -(advantages * logp - 0.5 * beta * (logp - old_logp).square())
    nothing = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyTerms(loss=loss, ratio=ratio, clipped=nothing, dual_clipped=nothing)


#: a policy-gradient term of a user's own (``PolicyLossConfig.custom``): (logp, old_logp,
#: advantages, mask, cfg) -> the per-token loss [B, T] to aggregate by ``cfg.agg``, or
#: (that loss, {metric name: per-token values [B, T]}), each metric reported as a token mean
PolicyTermFn = Callable[..., Tensor | tuple[Tensor, dict[str, Tensor]]]


@cache
def load_policy_term(path: str) -> PolicyTermFn:
    """The function at ``package.module:function``; ValueError saying what is wrong."""
    found: PolicyTermFn = import_path(path, "policy loss", "function", callable)
    return found


def _custom_terms(
    path: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    out = load_policy_term(path)(logp, old_logp, advantages, mask, cfg)
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, Tensor) or loss.shape != logp.shape:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"policy loss {path} returned {shape}; it must return the per-token loss with the "
            f"shape of logp {tuple(logp.shape)} (and optionally a dict of per-token metrics)"
        )
    return loss, metrics


def policy_terms(
    kind: PolicyKind,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    ratio_mask: Tensor | None = None,
) -> PolicyTerms:
    """The per-token policy-gradient term of ``kind`` with ``cfg``'s clip ranges; GSPO's
    sequence ratio over the tokens of ``mask`` that ``ratio_mask`` keeps (None: all)."""
    low, high = cfg.clip_ratio_low, cfg.clip_high
    if kind == "ppo":
        return ppo_policy_terms(logp, old_logp, advantages, low, high, cfg.dual_clip)
    if kind in ("gspo", "gspo-token"):
        in_ratio = mask if ratio_mask is None else mask * ratio_mask
        return gspo_terms(logp, old_logp, advantages, in_ratio, low, high, kind == "gspo-token")
    if kind == "cispo":
        return cispo_terms(logp, old_logp, advantages, low, high)
    if kind == "importance_sampling":
        return importance_sampling_terms(logp, old_logp, advantages)
    if kind == "dro":
        return dro_terms(logp, old_logp, advantages, cfg.dro_beta)
    raise ValueError(f"kind={kind!r} is not one of {get_args(PolicyKind)}")


def truncated_is_weight(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """Per-token min(pi_old / pi_rollout, cap), no gradient: truncated importance sampling (TIS),
    which reweights tokens the generator sampled from its own, slightly different distribution
    (another engine's kernels or precision) toward the trainer's pi_old."""
    log_ratio = (old_logp - rollout_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp().clamp(max=cap)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Per-token value loss 0.5 * (v - R)^2, pessimistic over v clipped to old_v +- clip."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped
    if clip < 0:
        raise ValueError(f"clip={clip} must be >= 0 (or None to disable)")
    moved = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(unclipped, (moved - returns).square())


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim, [..., V] -> [...], computed in float32."""
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Per-pair reward-model loss -log sigmoid(r_chosen - r_rejected), shape [N]."""
    return -F.logsigmoid(chosen - rejected)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    tokens: float,
    seqs: float,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    ratio_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(this micro-batch's loss share, metrics): agg(pg) - entropy_coef*agg(H) + kl_coef*agg(KL),
    with pg weighted per token by the behaviour weight min(pi_old / pi_rollout, cap) when
    ``cfg.tis_cap`` or ``cfg.decoupled`` is set (``PolicyLossConfig.behaviour_cap``).

    Loss terms use cfg.agg; the diagnostic fractions and ppo_kl are per-token means.
    """
    cap = cfg.behaviour_cap
    if cap is not None and rollout_logp is None:
        raise ValueError(
            f"tis_cap={cfg.tis_cap}, decoupled={cfg.decoupled} need rollout_logp "
            "(rollout_log_probs); pass it or turn them off"
        )
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs entropy; pass it or set 0")
    if cfg.kl_coef != 0 and ref_logp is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp (ref_log_probs); pass it or set 0")

    def agg(values: Tensor, mode: AggMode = cfg.agg) -> Tensor:
        return aggregate(values, mask, mode, tokens, seqs)

    extra: dict[str, Tensor] = {}
    if cfg.custom is not None:
        per_token, custom = _custom_terms(cfg.custom, logp, old_logp, advantages, mask, cfg)
        extra = {name: agg(v.detach().float(), "token-mean") for name, v in custom.items()}
        nothing = torch.zeros_like(mask, dtype=torch.bool)
        terms = PolicyTerms(per_token, (logp - old_logp).detach().exp(), nothing, nothing)
    else:
        terms = policy_terms(cfg.kind, logp, old_logp, advantages, mask, cfg, ratio_mask)
    per_token = terms.loss
    if cap is not None and rollout_logp is not None:
        weight = truncated_is_weight(old_logp, rollout_logp, cap)
        per_token = per_token * weight
        extra["tis_weight"] = agg(weight, "token-mean")
        extra["tis_capped_frac"] = agg((weight >= cap).float(), "token-mean")
    loss = agg(per_token)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": agg(terms.clipped.float(), "token-mean"),
        "pg_dualclip_frac": agg(terms.dual_clipped.float(), "token-mean"),
        "ppo_kl": agg((old_logp - logp).detach(), "token-mean"),
        **extra,
    }
    if entropy is not None:
        entropy_term = agg(entropy)
        metrics["entropy"] = entropy_term.detach()
        loss = loss - cfg.entropy_coef * entropy_term
    if ref_logp is not None and cfg.kl_coef != 0:
        kl_term = agg(kl_penalty(logp, ref_logp, cfg.kl_type))
        metrics["kl"] = kl_term.detach()
        loss = loss + cfg.kl_coef * kl_term
    return loss, metrics
