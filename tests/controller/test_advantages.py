"""Advantage estimators and KL controllers against hand-computed values."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from controller.advantages import (
    AdaptiveKL,
    FixedKL,
    gae,
    grpo,
    masked_mean,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    token_rewards,
)

INF = math.inf
ROOT3 = math.sqrt(3.0)
HALF_ROOT2 = math.sqrt(0.5)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected: torch.Tensor | list[list[float]]) -> None:
    want = expected if isinstance(expected, torch.Tensor) else t(*expected)
    torch.testing.assert_close(actual, want.to(actual.dtype), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ masked statistics


def test_masked_mean_ignores_masked_entries_even_inf() -> None:
    x = t([1, 2, INF], [INF, 5, 6])
    mask = t([1, 1, 0], [0, 1, 0])
    assert masked_mean(x, mask).item() == pytest.approx(8 / 3)  # (1 + 2 + 5) / 3
    close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_by_hand() -> None:
    x = t([2, 6, INF])  # masked: mean 4, population var 4, std 2
    mask = t([1, 1, 0]).bool()
    close(masked_whiten(x, mask), [[-1, 1, 0]])
    close(masked_whiten(x, mask, shift_mean=False), [[3, 5, 0]])  # scaled, mean added back


# ------------------------------------------------------------------ token rewards

# Row 0: prompt, prompt, response, response, pad.  Row 1: prompt, then 4 response tokens.
# Row 2: no response at all (its score has nowhere to go).
SPANS = t([0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0])
KL = t([9, 9, 1, 2, 9], [9, 3, 4, 5, 6], [9, 9, 9, 9, 9])  # 9: outside the mask, never charged


def test_score_lands_on_last_response_token() -> None:
    rewards = token_rewards(torch.tensor([1.0, 2, 3]), SPANS)
    close(rewards, [[0, 0, 0, 1, 0], [0, 0, 0, 0, 2], [0, 0, 0, 0, 0]])


def test_kl_penalty_on_every_response_token() -> None:
    rewards = token_rewards(torch.tensor([1.0, 2, 3]), SPANS, kl=KL, kl_coef=0.1)
    close(rewards, [[0, 0, -0.1, 0.8, 0], [0, -0.3, -0.4, -0.5, 1.4], [0, 0, 0, 0, 0]])


# ------------------------------------------------------------------ GAE

# gamma = 0.9, lam = 0.8 (gamma * lam = 0.72); rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
#   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A = 0.3
#   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A = 0.03 + 0.72*0.3   = 0.246
#   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A = 0.04 + 0.72*0.246 = 0.21712
#   returns = A + V = [0.71712, 0.846, 1.0]
GAE_A = [0.21712, 0.246, 0.3]
GAE_R = [0.71712, 0.846, 1.0]


def test_gae_by_hand() -> None:
    advantages, returns = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]), 0.9, 0.8, False)
    close(advantages, [GAE_A])
    close(returns, [GAE_R])


def test_gae_skips_prompt_gap_and_padding() -> None:
    # prompt | resp | resp | gap (e.g. tool output) | resp | pad ; masked columns hold junk
    mask = t([0, 1, 1, 0, 1, 0])
    rewards = t([100, 0, 0, 100, 1, 100])
    values = t([100, 0.5, 0.6, 100, 0.7, 100])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    a0, a1, a2 = GAE_A
    r0, r1, r2 = GAE_R
    close(advantages, [[0, a0, a1, 0, a2, 0]])
    close(returns, [[0, r0, r1, 0, r2, 0]])


def test_gae_whitened_has_mean_zero_std_one_over_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    advantages, returns = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert masked_mean(advantages, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_mean(advantages.square(), mask).item() == pytest.approx(1.0, abs=1e-5)
    assert advantages[mask == 0].abs().sum() == 0
    _, raw_returns = gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten=False)
    close(returns, raw_returns)  # returns are taken before whitening


# ------------------------------------------------------------------ group baselines

MASK3 = t([0, 1, 1], [0, 1, 0], [1, 1, 1])  # broadcast goes to response tokens only


def test_grpo_group_of_three_unbiased_std() -> None:
    # mean 1/3; deviations [2/3, -1/3, -1/3]; unbiased var = (6/9) / 2 = 1/3, std = 1/sqrt(3)
    advantages = grpo(torch.tensor([1.0, 0, 0]), torch.tensor([0, 0, 0]), MASK3)
    a, b = 2 / 3 * ROOT3, -1 / 3 * ROOT3
    close(advantages, [[0, a, a], [0, b, 0], [b, b, b]])


def test_grpo_without_std() -> None:
    advantages = grpo(torch.tensor([1.0, 0, 0]), torch.tensor([0, 0, 0]), MASK3, False)
    close(advantages, [[0, 2 / 3, 2 / 3], [0, -1 / 3, 0], [-1 / 3, -1 / 3, -1 / 3]])


def test_grpo_group_of_one_and_equal_rewards_give_zero() -> None:
    ones = torch.ones(4, 2)
    advantages = grpo(torch.tensor([1.0, 0, 0, 5]), torch.tensor([0, 0, 0, 7]), ones)
    assert advantages[3].abs().sum() == 0 and advantages[0, 0] > 0
    flat = grpo(torch.tensor([2.0, 2, 2]), torch.tensor([1, 1, 1]), torch.ones(3, 2))
    assert torch.equal(flat, torch.zeros(3, 2))  # 0 / (0 + eps), no NaN


def test_grpo_interleaved_groups() -> None:
    # group 5: {1, 3} mean 2, std sqrt(2); group 2: {4, 2} mean 3, std sqrt(2)
    scores, group = torch.tensor([1.0, 4, 3, 2]), torch.tensor([5, 2, 5, 2])
    advantages = grpo(scores, group, torch.ones(4, 1))
    close(advantages, [[-HALF_ROOT2], [HALF_ROOT2], [HALF_ROOT2], [-HALF_ROOT2]])


def test_rloo_leave_one_out() -> None:
    scores, group = torch.tensor([1.0, 0, 0, 5]), torch.tensor([3, 3, 3, 4])
    advantages = rloo(scores, group, torch.tensor([[0, 1], [1, 1], [1, 0], [1, 1]]))
    close(advantages, [[0, 1], [-0.5, -0.5], [-0.5, 0], [0, 0]])


def test_remax_subtracts_greedy_reward_on_mask() -> None:
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    advantages = remax(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 1.0]), mask)
    close(advantages, [[0, 0.75, 0.75], [-0.5, -0.5, 0]])


# ------------------------------------------------------------------ REINFORCE++

RPP_MASK = t([0, 1, 1, 1], [1, 1, 0, 0])
RPP_REWARDS = t([100, 1, 2, 3], [1, -1, 9, 9])


def test_reinforce_pp_return_to_go_gamma_one() -> None:
    advantages, returns = reinforce_pp(RPP_REWARDS, RPP_MASK)
    hand = t([0, 6, 5, 3], [0, -1, 0, 0])  # 1+2+3, 2+3, 3 | 1-1, -1
    close(returns, hand)
    close(advantages, masked_whiten(hand, RPP_MASK))


def test_reinforce_pp_discounted() -> None:
    _, returns = reinforce_pp(RPP_REWARDS, RPP_MASK, gamma=0.5)
    close(returns, [[0, 1 + 0.5 * 3.5, 2 + 0.5 * 3, 3], [1 - 0.5, -1, 0, 0]])


def test_reinforce_pp_baseline_by_hand() -> None:
    # group 0: scores [1, 0, 0] -> centred [2/3, -1/3, -1/3]; group 1: [3] -> 0.
    # kl = 1 everywhere, kl_coef = 0.1: -0.1 per response token; return-to-go with gamma = 1.
    mask = t([1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1])
    advantages = reinforce_pp_baseline(
        torch.tensor([1.0, 0, 0, 3]), torch.tensor([0, 0, 0, 1]), mask, torch.ones(4, 3), 0.1
    )
    u, d = 2 / 3, -1 / 3
    hand = t(
        [u - 0.3, u - 0.2, u - 0.1],
        [d - 0.2, d - 0.1, 0],
        [d - 0.3, d - 0.2, d - 0.1],
        [-0.3, -0.2, -0.1],
    )
    close(advantages, masked_whiten(hand, mask))


# ------------------------------------------------------------------ KL controllers


def test_fixed_kl_stays_and_round_trips() -> None:
    ctl = FixedKL(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKL(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_clips_error_both_ways() -> None:
    ctl = AdaptiveKL(0.1, target=6.0, horizon=100)  # n_steps / horizon = 0.1 below
    ctl.update(current_kl=9.0, n_steps=10)  # 9/6 - 1 = 0.5 -> clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=6.6, n_steps=10)  # 0.1, inside the clip
    assert ctl.value == pytest.approx(0.1 * 1.02 * 1.01)
    ctl.update(current_kl=0.0, n_steps=10)  # -1 -> clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 1.01 * 0.98)
    restored = AdaptiveKL(0.5, target=6.0, horizon=100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="value"):
        restored.load_state_dict({})


# ------------------------------------------------------------------ bad arguments

ONE = torch.ones(2, 3)
IDS = torch.tensor([0, 0])
VEC = torch.ones(2)

BAD: list[tuple[str, Callable[[], object]]] = [
    ("gamma", lambda: gae(ONE, ONE, ONE, gamma=1.5, lam=0.9)),
    ("lam", lambda: gae(ONE, ONE, ONE, gamma=0.9, lam=-0.1)),
    ("values", lambda: gae(ONE, torch.ones(2, 4), ONE, gamma=1.0, lam=1.0)),
    ("gamma", lambda: reinforce_pp(ONE, ONE, gamma=2.0)),
    ("response_mask", lambda: remax(VEC, VEC, torch.ones(3))),
    ("scores", lambda: token_rewards(torch.ones(3), ONE)),
    ("kl", lambda: token_rewards(VEC, ONE, kl=torch.ones(2, 2), kl_coef=0.1)),
    ("kl_coef", lambda: token_rewards(VEC, ONE, kl_coef=0.1)),
    ("group", lambda: grpo(VEC, torch.tensor([0, 0, 1]), ONE)),
    ("group", lambda: rloo(VEC, torch.tensor([0.0, 1.0]), ONE)),
    ("baseline_scores", lambda: remax(VEC, torch.ones(3), ONE)),
    ("target", lambda: AdaptiveKL(0.1, target=0.0, horizon=10)),
    ("horizon", lambda: AdaptiveKL(0.1, target=6.0, horizon=0)),
    ("kl_coef", lambda: FixedKL(-1.0)),
]


@pytest.mark.parametrize(("name", "call"), BAD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_name_themselves(name: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


# -- multi-turn rows: observation tokens (mask 0) between sampled turns -------------------------

#: prompt (2), turn 1 (2 sampled), observation (2), turn 2 (1 sampled), padding (1)
TURNS_MASK = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1, 1, 0]])


def test_grpo_over_trajectories_touches_only_the_sampled_tokens() -> None:
    # group of two: scores 1 and 0 -> mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.70711 = +-0.70711
    found = grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), TURNS_MASK)
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor([[0, 0, a, a, 0, 0, a, 0], [0, 0, -a, 0, 0, -a, -a, 0]])
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=0)


def test_the_score_lands_on_the_last_sampled_token_and_gae_skips_observations() -> None:
    rewards = token_rewards(torch.tensor([2.0, 3.0]), TURNS_MASK)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 2, 0]
    assert rewards[1].tolist() == [0, 0, 0, 0, 0, 0, 3, 0]
    # values on the sampled tokens of row 0: 0.5, 1.0, 1.5 (observations hold 9, never read)
    values = torch.tensor([[9, 9, 0.5, 1.0, 9, 9, 1.5, 9], [0.0] * 8])
    adv, returns = gae(rewards, values, TURNS_MASK, gamma=1.0, lam=1.0, whiten=False)
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t over the row's sampled tokens
    assert adv[0].tolist() == [0, 0, 1.5, 1.0, 0, 0, 0.5, 0]
    assert returns[0].tolist() == [0, 0, 2.0, 2.0, 0, 0, 2.0, 0]
