"""GSPO, GSPO-token, CISPO and a policy loss by import path, against hand-computed values.

One batch throughout: two responses after a one-token prompt (column 0 is not counted).
Row 0: token ratios pi / pi_old = 2 and 0.5 (their geometric mean s_0 = 1); row 1: one token
of ratio 1.5 (s_1 = 1.5)."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from roles.modeling.losses import PolicyLossConfig, policy_loss, sequence_log_ratio

log = math.log
OLD = torch.tensor([[-1.0, log(0.25), log(0.8)], [-1.0, log(0.6), -3.0]])
LOGP = torch.tensor([[-1.0, log(0.5), log(0.4)], [-1.0, log(0.9), -3.0]])
MASK = torch.tensor([[0, 1, 1], [0, 1, 0]])
TOKENS, SEQS = 3.0, 2.0


def close(grad: torch.Tensor, expected: list[list[float]]) -> bool:
    return torch.allclose(grad, torch.tensor(expected), atol=1e-6)


def run(cfg: PolicyLossConfig, advantages: torch.Tensor) -> tuple[float, dict, torch.Tensor]:
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, OLD, advantages, MASK, cfg, TOKENS, SEQS)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), metrics, logp.grad


def test_the_sequence_ratio_is_the_geometric_mean_of_the_token_ratios() -> None:
    assert sequence_log_ratio(LOGP, OLD, MASK).exp().tolist() == pytest.approx([1.0, 1.5])


def test_gspo_clips_a_whole_response() -> None:
    """A = +1 on both rows, eps 0.2: s_0 = 1 is inside [0.8, 1.2], loss_0 = -1; s_1 = 1.5 is
    clipped, loss_1 = max(-1.5, -1.2) = -1.2 with no gradient. seq-mean-token-mean: the mean
    over responses, (-1 - 1.2) / 2. Gradient of loss_0 = -s_0 * exp(mean log ratio): each of
    its 2 tokens gets -s_0 / 2, then / 2 responses."""
    cfg = PolicyLossConfig(kind="gspo", agg="seq-mean-token-mean")
    loss, metrics, grad = run(cfg, torch.ones(2, 3))
    assert loss == pytest.approx(-1.1)
    assert close(grad, [[0.0, -0.25, -0.25], [0.0, 0.0, 0.0]])
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3)  # row 1's one token
    # A = -1: s_1 = 1.5 is not clipped from above for a negative advantage (max takes 1.5)
    loss, _, grad = run(cfg, -torch.ones(2, 3))
    assert loss == pytest.approx((1.0 + 1.5) / 2)
    assert close(grad, [[0.0, 0.25, 0.25], [0.0, 0.75, 0.0]])


def test_gspo_token_equals_gspo_with_equal_advantages_and_weights_tokens_otherwise() -> None:
    seq = PolicyLossConfig(kind="gspo", agg="seq-mean-token-mean")
    tok = PolicyLossConfig(kind="gspo-token", agg="seq-mean-token-mean")
    even = torch.tensor([[9.0, 1.0, 1.0], [9.0, -1.0, 9.0]])  # columns 0 and 2 of row 1 not counted
    a, b = run(seq, even), run(tok, even)
    assert a[0] == pytest.approx(b[0]) and torch.allclose(a[2], b[2])
    # row 0 advantages 1 and 3, s_0 = 1 (unclipped): token losses -1, -3, the row's mean -2;
    # each token's gradient is its own -A * s_0 / 2 tokens / 2 responses
    uneven = torch.tensor([[0.0, 1.0, 3.0], [0.0, -1.0, 0.0]])
    loss, _, grad = run(tok, uneven)
    assert loss == pytest.approx((-2.0 + 1.5) / 2)
    assert grad[0].tolist() == pytest.approx([0.0, -0.25, -0.75])


def test_a_ratio_mask_narrows_the_sequence_ratio_to_the_tokens_it_marks() -> None:
    """GSPO-token summed as Tinker's ``gspo`` (``token-mean`` times the tokens): row 0's ratios
    are 2 and 0.5, so s_0 = 1 over both (loss -1 a token) but s_0 = 2 over the first alone,
    clipped to 1.2 with no gradient; row 1's one counted token has s_1 = 1.5, clipped."""
    cfg = PolicyLossConfig(kind="gspo-token", agg="token-mean")
    ones = torch.ones(2, 3)
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, OLD, ones, MASK, cfg, TOKENS, SEQS)
    assert loss.item() == pytest.approx((-1.0 - 1.0 - 1.2) / 3)
    first = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = policy_loss(logp, OLD, ones, MASK, cfg, TOKENS, SEQS, ratio_mask=first)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert logp.grad is not None and close(logp.grad, [[0.0] * 3, [0.0] * 3])


def test_cispo_weights_log_pi_by_the_clipped_ratio_without_its_gradient() -> None:
    """No lower bound (clip_ratio_low 1), upper 1 + 0.28: weights 2 -> 1.28, 0.5, 1.5 -> 1.28;
    A = +1 on row 0, -1 on row 1; token-mean over the 3 tokens of -w * A * log pi."""
    cfg = PolicyLossConfig(kind="cispo", clip_ratio_low=1.0, clip_ratio_high=0.28)
    advantages = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]])
    loss, metrics, grad = run(cfg, advantages)
    expected = (-1.28 * log(0.5) - 0.5 * log(0.4) + 1.28 * log(0.9)) / 3
    assert loss == pytest.approx(expected)
    assert close(grad, [[0.0, -1.28 / 3, -0.5 / 3], [0.0, 1.28 / 3, 0.0]])
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    # unlike PPO, a token whose ratio left the range keeps a gradient: PPO drops row 0's first
    _, _, ppo = run(PolicyLossConfig(clip_ratio_high=0.28, dual_clip=None), advantages)
    assert ppo[0, 1].item() == 0.0 and ppo[0, 2].item() == pytest.approx(-0.5 / 3)


def test_a_policy_loss_by_import_path() -> None:
    cfg = PolicyLossConfig(custom="tests.fixtures.losses:reinforce")
    advantages = torch.tensor([[0.0, 1.0, 2.0], [0.0, -1.0, 0.0]])
    loss, metrics, grad = run(cfg, advantages)
    assert loss == pytest.approx((-log(0.5) - 2 * log(0.4) + log(0.9)) / 3)
    assert close(grad, [[0.0, -1 / 3, -2 / 3], [0.0, 1 / 3, 0.0]])
    assert metrics["advantage"].item() == pytest.approx(2 / 3)  # token mean of 1, 2, -1
    with pytest.raises(ValueError, match="wrong_shape returned \\(\\); it must return"):
        run(PolicyLossConfig(custom="tests.fixtures.losses:wrong_shape"), advantages)
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        run(PolicyLossConfig(custom="tests.fixtures.losses:nothing"), advantages)


def test_unknown_kinds_are_refused_by_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="kind"):
        PolicyLossConfig(kind="grpo")  # type: ignore[arg-type]


def test_gspo_defaults_to_the_mean_over_responses_and_an_explicit_agg_wins() -> None:
    """At pi = pi_old every token's loss is -A of its response. Rows of 2 and 1 counted tokens
    with A = 1 and 4: the mean over responses is -(1 + 4) / 2 = -2.5 (the paper's objective);
    the token mean would weigh row 0 twice, -(1 + 1 + 4) / 3 = -2."""
    advantages = torch.tensor([[0.0, 1.0, 1.0], [0.0, 4.0, 0.0]])
    for kind in ("gspo", "gspo-token"):
        cfg = PolicyLossConfig(kind=kind)
        assert cfg.agg == "seq-mean-token-mean"
        assert PolicyLossConfig.model_validate({"kind": kind}).agg == "seq-mean-token-mean"
        loss, _ = policy_loss(OLD, OLD, advantages, MASK, cfg, TOKENS, SEQS)
        assert loss.item() == pytest.approx(-2.5)
        explicit = PolicyLossConfig(kind=kind, agg="token-mean")
        loss, _ = policy_loss(OLD, OLD, advantages, MASK, explicit, TOKENS, SEQS)
        assert loss.item() == pytest.approx(-2.0)
    assert PolicyLossConfig(kind="ppo").agg == "token-mean"
    assert PolicyLossConfig(kind="cispo").agg == "token-mean"


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage() -> None:
    """-(A r) token-mean: -(1 x 2 + 1 x 0.5 - 2 x 1.5) / 3 = 1/6; its gradient -A r / 3 per
    token, the ratio 2 kept whole (PPO would clip it at 1.2 and pass no gradient there)."""
    advantages = torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, 0.0]])
    loss, metrics, grad = run(PolicyLossConfig(kind="importance_sampling"), advantages)
    assert loss == pytest.approx(1 / 6)
    assert close(grad, [[0.0, -2 / 3, -1 / 6], [0.0, 1.0, 0.0]])
    assert float(metrics["pg_clipfrac"]) == 0.0
    _, _, ppo_grad = run(PolicyLossConfig(kind="ppo", dual_clip=None), advantages)
    assert ppo_grad[0, 1] == 0.0  # the contrast: PPO's clip drops that token


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.fixtures.nowhere:fn", "cannot import 'tests.fixtures.nowhere'"),
        ("tests.fixtures.losses:nothing", "has no function 'nothing'"),
        ("tests.fixtures.losses", "must look like package.module:function"),
    ],
)
def test_a_bad_loss_path_is_refused_when_the_config_is_made(path: str, message: str) -> None:
    """Not at the first forward_backward in the ranks, after a mesh started and a stage ran."""
    with pytest.raises(pydantic.ValidationError, match=f"custom[\\s\\S]*{message}"):
        PolicyLossConfig(custom=path)


def test_dro_is_the_advantage_weighted_log_likelihood_with_a_quadratic_penalty() -> None:
    """beta 0.5, token-mean over 3 tokens. Log-ratios log 2, log 0.5, log 1.5; advantages 1, 1,
    -2: loss = -[1 (log 0.5 - 1/4 log^2 2) + 1 (log 0.4 - 1/4 log^2 2) - 2 log 0.9
    - 1/4 log^2 1.5] / 3; gradient (-A + beta log r) / 3 per token (no clip: ratio 2 keeps it)."""
    advantages = torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, 0.0]])
    loss, metrics, grad = run(PolicyLossConfig(kind="dro", dro_beta=0.5), advantages)
    quad = 0.25 * (log(2) ** 2 + log(2) ** 2 + log(1.5) ** 2)
    assert loss == pytest.approx(-(log(0.5) + log(0.4) - 2 * log(0.9) - quad) / 3)
    expected = [
        [0.0, (-1 + 0.5 * log(2)) / 3, (-1 + 0.5 * log(0.5)) / 3],
        [0.0, (2 + 0.5 * log(1.5)) / 3, 0.0],
    ]
    assert close(grad, expected)
    assert float(metrics["pg_clipfrac"]) == 0.0
    with pytest.raises(pydantic.ValidationError, match="dro_beta"):
        PolicyLossConfig(kind="dro", dro_beta=-1.0)
