"""Advantage estimators and KL-coefficient controllers: what the controller computes between
generation and the policy update. Pure tensor functions on the controller's CPU; no model code.

Conventions (as in the losses): per-token tensors are [B, T] aligned with ``input_ids`` (column t
holds the reward/value/log-prob of token t); ``response_mask`` [B, T] (0/1, bool or float) marks
the generated tokens; a sequence score is [B], one scalar per response, and sits on the row's
LAST response token when a per-token reward is needed. ``group`` [B] holds an int per row: rows
with the same id are samples of the same prompt. Every result is zero outside the mask.

Estimators (r = sequence score, r_t = per-token reward, V_t = critic value before token t):

* GAE (PPO, Schulman et al. 2016) -- needs a critic. Over response tokens only, right to left:
      delta_t = r_t + gamma * V_next - V_t          (V_next = 0 after the last response token)
      A_t     = delta_t + gamma * lam * A_next
      returns = A + V (the critic's target), advantages whitened over the batch mask.
  The KL penalty sits inside r_t: r_t = -kl_coef * kl_t, plus r on the last token.
* GRPO (DeepSeekMath) -- no critic: A = (r - mean_group) / (std_group + eps), unbiased std,
  the same value on every response token. Dr. GRPO style: normalize_std=False gives r - mean.
* RLOO (Ahmadian et al. 2024) -- A_i = r_i - mean of the other samples of i's group.
* ReMax (Li et al. 2023) -- A = r - r_greedy: one extra greedy generation per prompt whose
  reward is the baseline.
* REINFORCE++ (Hu 2025) -- A_t = whiten(sum_{s>=t} gamma^(s-t) r_s) over the batch, KL penalty
  inside r_t; no critic, no groups. The -baseline variant first subtracts the group mean of r
  (no std division), then adds the KL penalties, takes the return-to-go (gamma = 1) and whitens.

Reward shaping: ``overlong_penalty`` (DAPO's soft overlong punishment, Yu et al. 2025, eq. 13)
adds to a response's score, with L = its length, L_max the generation limit and L_cache the
buffer before it:
      0                                  if L <= L_max - L_cache
      ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
      -1                                 if L > L_max
times a factor (1 in the paper).

KL controllers set kl_coef between steps: FixedKL keeps it; AdaptiveKL (Ziegler et al. 2019)
moves it proportionally towards a target KL, measured by ``kl_measure`` in the unit the config
names: the KL summed over each response (``sequence``) or its mean per response token (``token``,
verl's ``kl_ctrl.target_kl``); the two differ by the response length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1]")


def _check_mask(response_mask: Tensor, **tensors: Tensor | None) -> None:
    """The mask is [B, T]; every named tensor has its shape."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != response_mask.shape:
            raise ValueError(
                f"{name} must have response_mask's shape {tuple(response_mask.shape)}, "
                f"got {tuple(tensor.shape)}"
            )


def _check_rows(response_mask: Tensor, **tensors: Tensor) -> None:
    """Every named tensor is [B], one entry per row of the mask."""
    rows = response_mask.shape[0]
    for name, tensor in tensors.items():
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must be [B] = ({rows},), got {tuple(tensor.shape)}")


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _spread(per_row: Tensor, response_mask: Tensor) -> Tensor:
    """[B] -> [B, T]: each row's value on its response tokens, zero elsewhere."""
    return torch.where(response_mask.bool(), per_row[:, None], torch.zeros_like(per_row[:, None]))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over the entries where mask is 1 (over ``dim``, or all); an empty mask gives 0."""
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x))  # where(): padding may hold inf/NaN
    if dim is None:
        return total.sum() / keep.sum().clamp(min=1)
    return total.sum(dim) / keep.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (population variance); with
    shift_mean=False the mean is added back, so only the scale changes. Zero outside the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def token_rewards(
    scores: Tensor, response_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """[B, T] rewards: -kl_coef * kl on every response token plus the score on the row's last
    response token. A row without response tokens gets nothing."""
    _check_mask(response_mask, kl=kl)
    _check_rows(response_mask, scores=scores)
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0")
    if kl is None and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs the per-token kl [B, T]; pass kl or kl_coef=0")
    keep = response_mask.bool()
    scores = _float(scores)
    rewards = torch.zeros(keep.shape, dtype=scores.dtype, device=scores.device)
    if kl is not None:
        rewards = torch.where(keep, -kl_coef * kl.to(scores.dtype), rewards)
    if keep.shape[1] == 0:
        return rewards
    columns = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    last = torch.where(keep, columns, -1).amax(dim=1)
    rows = (last >= 0).nonzero().squeeze(1)
    rewards[rows, last[rows]] += scores[rows]
    return rewards


def gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) by generalized advantage estimation over response tokens only: a
    masked position is skipped, so V_next of a row's last response token is 0."""
    _check_mask(response_mask, token_rewards=token_rewards, values=values)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    keep = response_mask.bool()
    rewards, values = _float(token_rewards), values.to(_float(token_rewards).dtype)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(keep[:, t], advantage, 0.0)
        # A masked position leaves the carried V_next and A_next untouched: it is skipped.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
    returns = torch.where(keep, advantages + values, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _return_to_go(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """sum_{s >= t} gamma^(s-t) r_s over the response tokens s of the row (masked ones skipped)."""
    keep = response_mask.bool()
    rewards = _float(rewards)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, 0.0)
    return returns


def _group_stats(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: (size, sum, sum of squared deviations from the mean) of the row's group."""
    _, index = torch.unique(group, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    size = scores.new_zeros(n_groups).index_add_(0, index, torch.ones_like(scores))
    total = scores.new_zeros(n_groups).index_add_(0, index, scores)
    deviation = (scores - (total / size)[index]).square()
    squares = scores.new_zeros(n_groups).index_add_(0, index, deviation)
    return size[index], total[index], squares[index]


def _check_groups(scores: Tensor, group: Tensor, response_mask: Tensor) -> Tensor:
    _check_mask(response_mask)
    _check_rows(response_mask, scores=scores, group=group)
    if group.is_floating_point():
        raise ValueError(f"group must be an int tensor of prompt ids, got dtype {group.dtype}")
    return _float(scores)


def reverse_kl(student: Tensor, teacher: Tensor, response_mask: Tensor) -> Tensor:
    """[B, T]: log pi_student - log pi_teacher of each sampled response token (0 elsewhere),
    the per-token estimate of KL(student || teacher) on-policy distillation minimises."""
    return torch.where(
        response_mask.bool(), student - teacher, torch.zeros((), dtype=student.dtype)
    )


def overlong_penalty(
    lengths: Tensor, max_len: int | Tensor, cache: int, factor: float = 1.0
) -> Tensor:
    """[B]: DAPO's soft overlong penalty of responses of ``lengths`` tokens (module docstring).
    ``max_len``: the limit, one for the batch or one per row (a multi-turn row's budget of
    sampled tokens); a row whose limit is under ``cache`` has its whole budget as the window."""
    if isinstance(max_len, int) and not 0 < cache <= max_len:
        raise ValueError(f"cache={cache} must be in 1..max_len={max_len}")
    if cache < 1:
        raise ValueError(f"cache={cache} must be >= 1")
    limit = torch.as_tensor(max_len, dtype=torch.float32).expand(lengths.shape)
    start = (limit - cache).clamp(min=0)
    window = (limit - start).clamp(min=1)
    over = lengths.float() - start
    penalty = torch.where(over > 0, -over / window, torch.zeros_like(over))
    penalty = torch.where(lengths > limit, torch.full_like(over, -1.0), penalty)
    return factor * penalty


def grpo(
    scores: Tensor,
    group: Tensor,
    response_mask: Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """(r - mean_group) / (std_group + eps) with the unbiased std, on every response token. A
    group of one has no baseline and gets 0; a group of equal scores gets 0."""
    scores = _check_groups(scores, group, response_mask)
    size, total, squares = _group_stats(scores, group)
    centred = scores - total / size  # exactly 0 for a group of one (and for equal scores)
    if normalize_std:
        std = (squares / (size - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    return _spread(centred, response_mask)


def rloo(scores: Tensor, group: Tensor, response_mask: Tensor) -> Tensor:
    """r_i minus the mean of the other samples of its group (leave-one-out); group of one -> 0."""
    scores = _check_groups(scores, group, response_mask)
    size, total, _ = _group_stats(scores, group)
    others = (total - scores) / (size - 1).clamp(min=1)
    return _spread(torch.where(size > 1, scores - others, 0.0), response_mask)


def remax(scores: Tensor, baseline_scores: Tensor, response_mask: Tensor) -> Tensor:
    """r - r_greedy: the reward of the greedy response to the same prompt is the baseline."""
    _check_mask(response_mask)
    _check_rows(response_mask, scores=scores, baseline_scores=baseline_scores)
    return _spread(_float(scores) - baseline_scores.to(_float(scores).dtype), response_mask)


def reinforce_pp(
    token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """(advantages, returns): the discounted return-to-go of the token rewards (KL penalty
    included), whitened over the whole batch mask."""
    _check_mask(response_mask, token_rewards=token_rewards)
    _check_unit("gamma", gamma)
    returns = _return_to_go(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def reinforce_pp_baseline(
    scores: Tensor,
    group: Tensor,
    response_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """REINFORCE++-baseline: group-mean-centred scores (no std division) on the last token,
    -kl_coef * kl on every token, return-to-go with gamma = 1, whitened over the batch mask."""
    scores = _check_groups(scores, group, response_mask)
    size, total, _ = _group_stats(scores, group)
    rewards = token_rewards(scores - total / size, response_mask, kl, kl_coef)
    return masked_whiten(_return_to_go(rewards, response_mask, 1.0), response_mask)


def kl_measure(kl: torch.Tensor, mask: torch.Tensor, unit: str) -> float:
    """The batch's KL in the unit of the adaptive controller's target, averaged over rows:
    ``sequence``: sum over each row's response tokens; ``token``: that sum / the row's response
    length (a row with no response token counts 0), as verl measures it."""
    per_row = (kl * mask).sum(-1)
    if unit == "token":
        per_row = per_row / mask.sum(-1).clamp(min=1)
    elif unit != "sequence":
        raise ValueError(f"KL unit {unit!r}: use 'sequence' or 'token'")
    return float(per_row.mean())


class FixedKL:
    """A KL coefficient that never moves."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to do: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _loaded_value(state)


class AdaptiveKL:
    """Ziegler et al. 2019: a proportional controller that moves kl_coef towards a target KL.

    error = clip(current_kl / target - 1, -0.2, 0.2);  value *= 1 + error * n_steps / horizon.
    ``n_steps`` is the number of samples since the last update (the batch size), so ``horizon``
    counts samples: the coefficient changes by ~e^(0.2) at most every ``horizon`` samples.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0")
        if target <= 0:
            raise ValueError(f"target={target} must be > 0 (the KL to steer towards)")
        if horizon <= 0:
            raise ValueError(f"horizon={horizon} must be > 0 (samples)")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps} must be >= 0")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The moving state only; target and horizon come from the config."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _loaded_value(state)


def _loaded_value(state: dict[str, float]) -> float:
    if "value" not in state:
        raise ValueError(f"state must hold 'value' (the kl_coef), got keys {sorted(state)}")
    return float(state["value"])
