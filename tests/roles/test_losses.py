"""Loss functions against hand-computed values; micro-batch shares add up to the batch loss."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from roles.modeling.losses import (
    PolicyLossConfig,
    ValueLossConfig,
    aggregate,
    bradley_terry_loss,
    count,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    ppo_policy_terms,
    truncated_is_weight,
    value_loss,
)

LOG2 = math.log(2.0)
# values 1..16 in four rows of four; row 1 is fully masked out
VALUES = torch.arange(1.0, 17.0).reshape(4, 4)
MASK = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
# masked row sums: 1+2=3, 0, 9+10+11+12=42, 13 -> total 58 over 7 tokens and 3 sequences
EXPECTED = {
    "token-mean": 58 / 7,  # 8.2857
    "seq-mean-token-sum": 58 / 3,  # 19.333
    "seq-mean-token-mean": (3 / 2 + 42 / 4 + 13 / 1) / 3,  # 25/3 = 8.3333
}


def test_count_skips_all_masked_rows() -> None:
    assert count(MASK) == (7.0, 3.0)
    assert count(MASK.float()) == (7.0, 3.0)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_whole_batch_and_uneven_micro_batches(mode: str) -> None:
    tokens, seqs = count(MASK)
    whole = aggregate(VALUES, MASK, mode, tokens, seqs)  # type: ignore[arg-type]
    shares = [
        aggregate(VALUES[rows], MASK[rows], mode, tokens, seqs)  # type: ignore[arg-type]
        for rows in (slice(0, 1), slice(1, 4))
    ]
    assert whole.item() == pytest.approx(EXPECTED[mode])
    assert sum(s.item() for s in shares) == pytest.approx(EXPECTED[mode])


def test_aggregate_ignores_nan_and_inf_in_padding() -> None:
    values = VALUES.clone().requires_grad_(True)
    padded = torch.where(MASK, values, torch.tensor(float("nan")))
    padded = torch.where(MASK | (VALUES < 8), padded, torch.tensor(float("-inf")))
    out = aggregate(padded, MASK, "token-mean", *count(MASK))
    out.backward()
    assert out.item() == pytest.approx(58 / 7)
    assert torch.equal(values.grad, MASK.float() / 7)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_all_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    values = VALUES.clone().requires_grad_(True)
    mask = torch.zeros(4, 4)
    out = aggregate(values, mask, mode, *count(mask))  # type: ignore[arg-type]
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(4, 4))  # type: ignore[arg-type]


def test_aggregate_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        aggregate(VALUES, MASK, "sum", 7.0, 3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # logp = log 0.5, ref = log 0.25 -> logp - ref = log 2
        ("k1", LOG2),
        ("abs", LOG2),
        ("k2", 0.5 * LOG2**2),  # 0.240227
        ("mse", 0.5 * LOG2**2),
        ("k3", 0.5 + LOG2 - 1),  # exp(-log 2) - (-log 2) - 1 = 0.193147
        ("low_var_kl", 0.5 + LOG2 - 1),
    ],
)
def test_kl_penalty_hand_values(kind: str, expected: float) -> None:
    out = kl_penalty(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), kind)  # type: ignore[arg-type]
    assert out.item() == pytest.approx(expected)


def test_kl_penalty_sign_and_clamp() -> None:
    # logp = log 0.25, ref = log 0.5: k1 is negative, abs is not, k3 = 2 - log 2 - 1 = 0.306853
    logp, ref = torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-LOG2)
    assert kl_penalty(logp, ref, "abs").item() == pytest.approx(LOG2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(1 - LOG2)
    far = torch.tensor([0.0, -100.0], requires_grad=True)
    out = kl_penalty(far, torch.tensor([30.0, 0.0]), "k3")
    out.sum().backward()
    assert out[0].item() == 10.0  # e^30 capped
    assert out[1].item() == 10.0  # log-ratio 100, first held at 20 so exp stays finite
    assert torch.isfinite(far.grad).all()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def _terms(ratios: list[float], advs: list[float], low: float, high: float, dual: float | None):
    logp = torch.tensor(ratios).log()
    return ppo_policy_terms(logp, torch.zeros(len(ratios)), torch.tensor(advs), low, high, dual)


def test_ppo_symmetric_clip_and_dual_clip() -> None:
    terms = _terms(
        ratios=[1.1, 1.5, 0.5, 1.1, 5.0, 5.0, 2.0],
        advs=[1.0, 1.0, -1.0, -1.0, -2.0, 2.0, -1.0],
        low=0.2,
        high=0.2,
        dual=3.0,
    )
    expected = [
        -1.1,  # A>0 inside the range: -A*r
        -1.2,  # A>0 above: -A*(1+0.2)
        0.8,  # A<0 below: max(0.5, 0.8)
        1.1,  # A<0 inside
        6.0,  # A<0, r=5: max(10, 2.4) = 10, capped at -A*dual = 6
        -2.4,  # A>0, r=5: -2*1.2, no dual clip for A>0
        2.0,  # A<0, r=2: 2 < cap 3, untouched
    ]
    assert terms.loss.tolist() == pytest.approx(expected)
    assert terms.ratio.tolist() == pytest.approx([1.1, 1.5, 0.5, 1.1, 5.0, 5.0, 2.0])
    assert terms.clipped.tolist() == [False, True, True, False, False, True, False]
    assert terms.dual_clipped.tolist() == [False, False, False, False, True, False, False]


def test_ppo_asymmetric_clip_without_dual() -> None:
    terms = _terms(
        ratios=[1.5, 1.25, 0.5, 5.0], advs=[1.0, 1.0, -1.0, -2.0], low=0.2, high=0.28, dual=None
    )
    # ceiling 1.28, floor 0.8; r=1.25 is inside (it would be clipped at 0.2); no dual cap -> 10
    assert terms.loss.tolist() == pytest.approx([-1.28, -1.25, 0.8, 10.0])
    assert terms.clipped.tolist() == [True, False, True, False]
    assert not terms.dual_clipped.any()


@pytest.mark.parametrize(
    ("low", "high", "dual", "name"),
    [(-0.1, 0.2, 3.0, "clip_low"), (0.2, -0.1, 3.0, "clip_high"), (0.2, 0.2, 1.0, "dual_clip")],
)
def test_ppo_rejects_bad_arguments(low: float, high: float, dual: float, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _terms([1.0], [1.0], low, high, dual)


def test_value_loss_clipped_and_unclipped() -> None:
    v, old, ret = (
        torch.tensor([1.0, 1.5, 3.0]),
        torch.tensor([0.0, 1.0, 0.0]),
        torch.tensor([2.0, 1.0, 3.0]),
    )
    # unclipped: 0.5*(v-R)^2 = 0.5, 0.125, 0
    assert value_loss(v, old, ret, None).tolist() == pytest.approx([0.5, 0.125, 0.0])
    # clipped v = old + clamp(v-old, +-0.5) = 0.5, 1.5, 0.5 -> 0.5*max(1, 2.25), 0.125, 0.5*6.25
    assert value_loss(v, old, ret, 0.5).tolist() == pytest.approx([1.125, 0.125, 3.125])


def test_entropy_from_logits() -> None:
    uniform = entropy_from_logits(torch.zeros(2, 3, 8, dtype=torch.bfloat16))
    assert uniform.shape == (2, 3) and uniform.dtype == torch.float32
    assert torch.allclose(uniform, torch.full((2, 3), math.log(8)))
    peaked = torch.zeros(4, 8)
    peaked[:, 0] = 100.0
    assert entropy_from_logits(peaked).abs().max().item() < 1e-6


def test_bradley_terry_loss() -> None:
    out = bradley_terry_loss(torch.tensor([0.5, 2.0, 0.0]), torch.tensor([0.5, 1.0, 1.0]))
    # -log sigmoid(d): d=0 -> log 2, d=1 -> log(1+e^-1) = 0.313262, d=-1 -> log(1+e) = 1.313262
    assert out.tolist() == pytest.approx([LOG2, math.log1p(math.exp(-1)), math.log1p(math.e)])


def _policy_batch() -> dict[str, torch.Tensor]:
    return {
        "logp": torch.tensor([[math.log(1.5), 0.0], [0.0, 0.0]], requires_grad=True),
        "old_logp": torch.zeros(2, 2),
        "advantages": torch.tensor([[1.0, -1.0], [2.0, 5.0]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    }


def test_policy_loss_combines_terms() -> None:
    b = _policy_batch()
    entropy = torch.tensor([[0.5, 1.0], [1.5, 9.0]])
    ref_logp = torch.tensor([[math.log(1.5) - 1.0, 0.0], [0.5, 7.0]])  # k1 = 1, 0, -0.5
    cfg = PolicyLossConfig(entropy_coef=0.1, kl_coef=0.2, kl_type="k1")
    loss, metrics = policy_loss(
        **b, cfg=cfg, tokens=3.0, seqs=2.0, entropy=entropy, ref_logp=ref_logp
    )
    # pg per token: -1.2 (r=1.5 clipped), 1, -2 -> -2.2/3; entropy 3/3 = 1; kl 0.5/3
    # loss = -0.73333 - 0.1*1 + 0.2*0.16667 = -0.8
    assert loss.item() == pytest.approx(-0.8)
    assert metrics["pg_loss"].item() == pytest.approx(-2.2 / 3)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["pg_dualclip_frac"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(1.5) / 3)
    assert metrics["entropy"].item() == pytest.approx(1.0)
    assert metrics["kl"].item() == pytest.approx(0.5 / 3)
    assert not any(m.requires_grad for m in metrics.values())
    loss.backward()
    # d/dlogp: clipped token has no pg grad, only kl 0.2/3; token (0,1): A=-1 -> 1/3 + 0.2/3
    expected_grad = torch.tensor([[0.2, 1.2], [-2 + 0.2, 0.0]]) / 3
    assert torch.allclose(b["logp"].grad, expected_grad)  # type: ignore[arg-type]


def test_policy_loss_missing_inputs_raise() -> None:
    b = _policy_batch()
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(**b, cfg=PolicyLossConfig(entropy_coef=0.01), tokens=3.0, seqs=2.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(**b, cfg=PolicyLossConfig(kl_coef=0.01), tokens=3.0, seqs=2.0)
    _, metrics = policy_loss(**b, cfg=PolicyLossConfig(), tokens=3.0, seqs=2.0)
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "pg_dualclip_frac", "ppo_kl"}


def test_truncated_importance_sampling_weights_each_token() -> None:
    b = _policy_batch()
    # pi_old / pi_rollout: 2 (capped at 1.5), 0.5, 1; the last token is masked out
    rollout = torch.tensor([[math.log(0.5), math.log(2.0)], [0.0, 9.0]])
    weight = truncated_is_weight(b["old_logp"], rollout, cap=1.5)
    assert weight[:, 0].tolist() == pytest.approx([1.5, 1.0])
    assert weight[0, 1].item() == pytest.approx(0.5)
    cfg = PolicyLossConfig(tis_cap=1.5)
    loss, metrics = policy_loss(**b, cfg=cfg, tokens=3.0, seqs=2.0, rollout_logp=rollout)
    # pg per token -1.2, 1, -2 weighted by 1.5, 0.5, 1: (-1.8 + 0.5 - 2) / 3
    assert loss.item() == pytest.approx(-1.1)
    assert metrics["tis_weight"].item() == pytest.approx(1.0)
    assert metrics["tis_capped_frac"].item() == pytest.approx(1 / 3)
    loss.backward()  # the weight carries no gradient: the clipped token none, the others A*r*w
    expected = torch.tensor([[0.0, 0.5], [-2.0, 0.0]]) / 3
    assert torch.allclose(b["logp"].grad, expected)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(**_policy_batch(), cfg=cfg, tokens=3.0, seqs=2.0)


def test_decoupled_ppo_on_a_two_by_three_batch_by_hand() -> None:
    """Decoupled PPO (AReaL): clip r = pi / pi_prox, weight by w = pi_prox / pi_behav, here
    uncapped; with tis_cap the same formula caps w (TIS is decoupled PPO with a finite cap)."""
    log = math.log
    prox = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    # r = 1, 1.5, 0.5 / 1.1, 0.9, 1 (masked)
    logp = prox + torch.tensor([[0.0, log(1.5), log(0.5)], [log(1.1), log(0.9), 0.0]])
    logp.requires_grad_(True)
    # w = 2, 0.5, 4 / 1, 3, 7 (masked)
    behav = prox - torch.tensor([[log(2.0), log(0.5), log(4.0)], [0.0, log(3.0), log(7.0)]])
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-2.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cfg = PolicyLossConfig(decoupled=True, dual_clip=None)
    assert cfg.behaviour_cap == math.inf
    args = (logp, prox, advantages, mask)
    loss, metrics = policy_loss(*args, cfg=cfg, tokens=5.0, seqs=2.0, rollout_logp=behav)
    # per token max(-A r, -A clip(r, 0.8, 1.2)) * w:
    #   -1 * 2, -1.2 * 0.5 (clipped), 0.8 * 4 (clipped) / 2.2 * 1, -1.8 * 3 -> sum -2.6 over 5
    assert loss.item() == pytest.approx(-0.52)
    assert metrics["tis_weight"].item() == pytest.approx(2.1)  # (2 + 0.5 + 4 + 1 + 3) / 5
    assert metrics["tis_capped_frac"].item() == 0.0
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    loss.backward()  # -A r w where the unclipped term is taken, 0 where clipped
    expected = torch.tensor([[-2.0, 0.0, 0.0], [2.2, -5.4, 0.0]]) / 5
    assert torch.allclose(logp.grad, expected)  # type: ignore[arg-type]
    capped = PolicyLossConfig(decoupled=True, dual_clip=None, tis_cap=3.0)
    loss, metrics = policy_loss(*args, cfg=capped, tokens=5.0, seqs=2.0, rollout_logp=behav)
    assert loss.item() == pytest.approx(-0.68)  # 0.8 * 4 becomes 0.8 * 3
    assert metrics["tis_capped_frac"].item() == pytest.approx(2 / 5)  # w = 4 -> 3, and w = 3
    with pytest.raises(ValueError, match="decoupled=True need rollout_logp"):
        policy_loss(*args, cfg=cfg, tokens=5.0, seqs=2.0)
    assert PolicyLossConfig().behaviour_cap is None


@pytest.mark.parametrize(
    ("model", "kwargs", "field"),
    [
        (PolicyLossConfig, {"clip_ratio_low": -0.1}, "clip_ratio_low"),
        (PolicyLossConfig, {"clip_ratio_high": -0.1}, "clip_ratio_high"),
        (PolicyLossConfig, {"dual_clip": 0.5}, "dual_clip=0.5 must be > 1"),
        (PolicyLossConfig, {"kl_coef": -1.0}, "kl_coef"),
        (PolicyLossConfig, {"kl_type": "k4"}, "kl_type"),
        (PolicyLossConfig, {"tis_cap": 0.0}, "tis_cap"),
        (PolicyLossConfig, {"clip_ratio": 0.2}, "clip_ratio"),
        (ValueLossConfig, {"clip": -1.0}, "clip"),
        (ValueLossConfig, {"agg": "sum"}, "agg"),
    ],
)
def test_configs_reject_bad_values(model: type, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        model(**kwargs)


def test_config_clip_high_defaults_to_low() -> None:
    assert PolicyLossConfig(clip_ratio_low=0.1).clip_high == 0.1
    assert PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3).clip_high == 0.3
