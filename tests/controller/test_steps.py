"""The step programs (``controller/algorithms.py``) on hand-made batches, with hand-computed
advantages: the role clients are fakes that answer with fixed log-probs, values and scores and
record what the step asked and trained on (real roles run the same programs in
``tests/deploy/``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from controller.advantages import overlong_penalty
from controller.agent import SAMPLE_BUDGET
from controller.algorithm_config import AlgorithmConfig
from controller.algorithms import distill_step, group_step, remax_step, safe_rlhf_step
from controller.rollouts import RolloutPipeline
from controller.steps import Roles, State
from transport.batch import TensorBatch

# two rows after a one-token prompt: row 0 has 3 response tokens, row 1 has 2
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])


@dataclass
class Model:
    """A model role's client: fixed per-token log-probs (or values); calls recorded."""

    role: str
    log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    asked: list[str] = field(default_factory=list)
    trained: list[tuple[TensorBatch, Any]] = field(default_factory=list)

    async def compute_log_prob(self, batch: TensorBatch, **_: Any) -> TensorBatch:
        self.asked.append("compute_log_prob")
        assert self.log_probs is not None
        return TensorBatch.from_dict({"log_probs": self.log_probs})

    async def compute_values(self, batch: TensorBatch, **_: Any) -> TensorBatch:
        self.asked.append("compute_values")
        assert self.values is not None
        return TensorBatch.from_dict({"values": self.values})

    async def update_policy(self, batch: TensorBatch, loss: Any, **_: Any) -> dict[str, float]:
        self.trained.append((batch, loss))
        return {"loss": 0.0}

    async def update_critic(self, batch: TensorBatch, loss: Any, **_: Any) -> dict[str, float]:
        self.trained.append((batch, loss))
        return {"loss": 0.0}


def rows(scores: list[float], mask: torch.Tensor = MASK, **columns: torch.Tensor) -> TensorBatch:
    """Generated rows, their reward role's scores already in the batch (as a streamed batch
    brings them: no reward call), one prompt per row unless ``uid`` says otherwise."""
    count = mask.shape[0]
    ids = torch.ones_like(mask)
    ids[:, 0] = torch.arange(count)  # the prompt token numbers the row (updates shuffle rows)
    return TensorBatch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(mask),
            "response_mask": mask,
            "log_probs": torch.zeros(mask.shape),
            "reward:scores": torch.tensor(scores),
            **columns,
        },
        {"uid": list(range(count))},
    )


def run_step(step: Any, roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig) -> tuple:
    state = State.initial(cfg)
    metrics = asyncio.run(step(roles, batch, cfg, state, 0))
    return metrics, state


def trained_advantages(actor: Model) -> torch.Tensor:
    """The advantages the actor trained on, in the batch's row order."""
    ((batch, _),) = actor.trained
    order = batch.tensors["input_ids"][:, 0].argsort()
    return batch.tensors["advantages"][order]


def test_distill_applies_the_kl_to_the_reference_in_the_advantages_and_moves_its_controller() -> (
    None
):
    """Per token: A = -distill_coef (log pi - log teacher) - kl.coef (log pi - log ref)."""
    old = torch.tensor([[0.0, -1.0, -2.0, -1.0], [0.0, -1.0, -1.0, 0.0]])
    teacher = torch.tensor([[0.0, -0.5, -2.0, -2.0], [0.0, -1.0, -3.0, 0.0]])
    ref = torch.tensor([[0.0, -2.0, -2.0, -1.0], [0.0, -2.0, -1.0, 0.0]])
    actor = Model("actor", log_probs=old)
    roles = Roles(
        actor=actor,  # type: ignore[arg-type]
        reward=Model("reward"),  # type: ignore[arg-type]
        teacher=Model("teacher", log_probs=teacher),  # type: ignore[arg-type]
        reference=Model("reference", log_probs=ref),  # type: ignore[arg-type]
    )
    cfg = AlgorithmConfig(
        name="distill",
        n=1,
        distill_coef=2.0,
        kl={"coef": 0.5, "target": 0.1, "target_unit": "token", "horizon": 10},
    )
    metrics, state = run_step(distill_step, roles, rows([0.0, 1.0]), cfg)
    reverse = (old - teacher) * MASK
    kl = (old - ref) * MASK
    torch.testing.assert_close(trained_advantages(actor), -2.0 * reverse - 0.5 * kl)
    ((_, loss),) = actor.trained
    assert loss.kl_coef == 0.0  # in the reward, not also in the loss
    # per-token KL 1/3 and 1/2 are above the target 0.1: the coefficient moves up by the
    # largest step, 0.2 x 2 rows / horizon 10
    assert state.kl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))
    assert metrics["kl_coef"] == pytest.approx(state.kl.value)
    assert metrics["kl"] == pytest.approx(1.0)  # each row's KL sums to 1

    actor = Model("actor", log_probs=old)
    roles.actor = actor  # type: ignore[assignment]
    cfg = AlgorithmConfig(name="distill", n=1, kl={"coef": 0.5, "mode": "loss"})
    run_step(distill_step, roles, rows([0.0, 1.0]), cfg)
    ((batch, loss),) = actor.trained
    torch.testing.assert_close(trained_advantages(actor), -reverse)  # the loss carries the KL
    assert loss.kl_coef == 0.5
    order = batch.tensors["input_ids"][:, 0].argsort()
    torch.testing.assert_close(batch.tensors["ref_log_probs"][order], ref)


def test_safe_rlhf_whiten_false_leaves_the_cost_advantages_unwhitened() -> None:
    """gamma = lam = 1 and zero values: every response token's advantage is its row's score.
    lambda 1: A = (A_reward - A_cost) / 2 = (r - c) / 2 per row."""
    zeros = torch.zeros(MASK.shape)
    actor = Model("actor", log_probs=zeros)
    critic, cost_critic = Model("critic", values=zeros), Model("cost_critic", values=zeros)
    roles = Roles(
        actor=actor,  # type: ignore[arg-type]
        reward=Model("reward"),  # type: ignore[arg-type]
        critic=critic,  # type: ignore[arg-type]
        cost=Model("cost"),  # type: ignore[arg-type]
        cost_critic=cost_critic,  # type: ignore[arg-type]
    )
    cfg = AlgorithmConfig(
        name="safe_rlhf", n=1, whiten=False, gamma=1.0, lam=1.0, safe={"lambda_init": 1.0}
    )
    batch = rows([1.0, 3.0], **{"cost:scores": torch.tensor([3.0, 1.0])})
    run_step(safe_rlhf_step, roles, batch, cfg)
    expected = torch.tensor([[-1.0], [1.0]]) * MASK
    torch.testing.assert_close(trained_advantages(actor), expected)
    ((costs, _),) = cost_critic.trained
    order = costs.tensors["input_ids"][:, 0].argsort()
    returns = costs.tensors["returns"][order]
    torch.testing.assert_close(returns, torch.tensor([[3.0], [1.0]]) * MASK)


class Greedy:
    """A generator whose greedy answers have the given response lengths; their scores come in
    the batch (as the reward role would give them)."""

    role = "actor"

    def __init__(self, lengths: list[int], scores: list[float]) -> None:
        self.lengths, self.scores = lengths, scores

    async def generate(self, prompts: TensorBatch, sampling: Any, version: int) -> TensorBatch:
        mask = torch.tensor([[0] + [1] * n + [0] * (6 - n) for n in self.lengths])
        out = rows(self.scores, mask)
        out.non_tensors["uid"] = list(prompts.non_tensors["uid"])
        return out


def test_remax_with_overlong_a_sample_equal_to_the_greedy_answer_has_no_advantage() -> None:
    """Overlong window of 2 below max_new_tokens 6: a 5-token response loses 1/2 point, a
    3-token one nothing. The baseline carries the same penalty as the sample it is compared
    with."""
    cfg = AlgorithmConfig(name="remax", n=2, max_new_tokens=6, overlong={"cache": 2})
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]])
    samples = rows([1.0, 1.0], mask)
    samples.non_tensors["uid"] = [0, 0]
    generator = Greedy(lengths=[5], scores=[1.0])  # the greedy answer: 5 tokens, score 1
    roles = SimpleNamespace(rollout=None, generator=generator, reward=Model("reward"))
    pipeline = RolloutPipeline(roles, weights=None)  # type: ignore[arg-type]
    baseline = asyncio.run(pipeline._greedy_baseline(samples, cfg, 0, 0))
    assert baseline.tolist() == [0.5, 0.5]

    actor = Model("actor", log_probs=torch.zeros(mask.shape))
    step_roles = Roles(actor=actor, reward=Model("reward"))  # type: ignore[arg-type]
    batch = samples.select(list(samples.tensors), list(samples.non_tensors))
    batch.tensors["remax_baseline"] = baseline
    run_step(remax_step, step_roles, batch, cfg)
    # row 0 equals the greedy answer (5 tokens, score 1): A = 0; row 1 (3 tokens): 1 - 0.5
    torch.testing.assert_close(trained_advantages(actor), torch.tensor([[0.0], [0.5]]) * mask)


def test_overlong_on_multi_turn_rows_measures_the_trajectory_budget() -> None:
    """Two untruncated turns of 20 sampled tokens (per-turn limit 32, cache 8) in a trajectory
    of max_total_tokens 256 with 30 prompt and observation tokens: the budget of sampled tokens
    is 226, 40 is nowhere near it: no penalty (measured against the turn's 32 it scored -1)."""
    lengths = torch.tensor([40, 222, 230])
    budget = torch.tensor([226, 226, 226])
    got = overlong_penalty(lengths, budget, cache=8)
    assert got.tolist() == pytest.approx([0.0, -0.5, -1.0])
    assert overlong_penalty(lengths[:1], 32, cache=8).tolist() == [-1.0]  # the old measure

    mask = torch.zeros(2, 64, dtype=torch.long)
    mask[:, 1:41] = 1  # 40 sampled tokens each
    cfg = AlgorithmConfig(name="grpo", n=2, max_new_tokens=32, overlong={"cache": 8})
    actor = Model("actor", log_probs=torch.zeros(mask.shape))
    roles = Roles(actor=actor, reward=Model("reward"))  # type: ignore[arg-type]
    batch = rows([1.0, 0.0], mask, **{SAMPLE_BUDGET: torch.tensor([226, 44])})
    batch.non_tensors["uid"] = [0, 0]
    metrics, _ = run_step(group_step, roles, batch, cfg)
    # row 1's budget is 44: 40 tokens are 4 into the window of 8, -0.5
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.25)
    assert metrics["reward/mean"] == pytest.approx((1.0 + -0.5) / 2)


def test_no_reference_pass_when_nothing_reads_it() -> None:
    """kl.coef 0: the reference (a LoRA actor's adapters-off pass, or a reference role) is not
    asked; kl.coef > 0: it is, once."""
    reference = Model("reference", log_probs=torch.zeros(MASK.shape))
    actor = Model("actor", log_probs=torch.zeros(MASK.shape))
    roles = Roles(actor=actor, reward=Model("reward"), reference=reference)  # type: ignore[arg-type]
    batch = rows([1.0, 0.0])
    batch.non_tensors["uid"] = [0, 0]
    metrics, _ = run_step(group_step, roles, batch, AlgorithmConfig(name="grpo", n=2))
    assert reference.asked == [] and "kl" not in metrics
    actor.trained.clear()
    cfg = AlgorithmConfig(name="grpo", n=2, kl={"coef": 0.1})
    metrics, _ = run_step(group_step, roles, batch, cfg)
    assert reference.asked == ["compute_log_prob"] and metrics["kl"] == 0.0


def test_a_score_that_is_not_finite_is_refused_for_its_row_and_counted() -> None:
    """Scores 1, nan, 0, inf in one GRPO group: the two bad rows count 0 for the baseline,
    their advantages are zeroed, and reward/non_finite is 2 / 4."""
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[:, 0] = 0
    actor = Model("actor", log_probs=torch.zeros(mask.shape))
    roles = Roles(actor=actor, reward=Model("reward"))  # type: ignore[arg-type]
    batch = rows([1.0, float("nan"), 0.0, float("inf")], mask)
    batch.non_tensors["uid"] = [0, 0, 0, 0]
    metrics, _ = run_step(group_step, roles, batch, AlgorithmConfig(name="grpo", n=4))
    advantages = trained_advantages(actor)
    assert torch.isfinite(advantages).all()
    assert advantages[1].abs().sum() == 0 and advantages[3].abs().sum() == 0
    # scores (1, 0, 0, 0): mean 1/4, unbiased std 1/2: row 0 (1 - 1/4) / (1/2), row 2 -1/2
    assert advantages[0, 1].item() == pytest.approx(1.5, abs=1e-5)
    assert advantages[2, 1].item() == pytest.approx(-0.5, abs=1e-5)
    assert metrics["reward/non_finite"] == 0.5
    assert metrics["reward/mean"] == 0.25
