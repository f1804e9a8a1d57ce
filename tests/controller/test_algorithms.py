"""The algorithm programs' pure pieces: config rules, prompt bookkeeping, KL and state."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from pydantic import ValidationError

from controller.advantages import AdaptiveKL, FixedKL
from controller.algorithm_config import AlgorithmConfig
from controller.clients import ActorClient, CriticClient, RewardClient, RolloutClient
from controller.rollouts import first_of_each, index_of
from controller.server import Controller
from controller.steps import (
    Roles,
    State,
    group_stats,
    kl_of,
    logprob_gap,
    summarize,
)
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig
from transport.training import PolicyLossConfig


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="n >= 2"):
        AlgorithmConfig(name="grpo", n=1)
    with pytest.raises(ValidationError, match=r"kl\.mode: loss"):
        AlgorithmConfig.model_validate({"name": "remax", "n": 1, "kl": {"coef": 0.1}})
    assert AlgorithmConfig(name="ppo", n=1).needed_roles() == {"actor", "reward", "critic"}
    safe = AlgorithmConfig.model_validate({"name": "safe_rlhf", "n": 1, "kl": {"coef": 0.1}})
    assert safe.safe is not None
    assert safe.needed_roles() == {"actor", "reward", "critic", "cost", "cost_critic", "reference"}
    loss_kl = AlgorithmConfig.model_validate({"kl": {"coef": 0.2, "mode": "loss"}})
    assert loss_kl.policy_loss(0.2) == PolicyLossConfig(kl_coef=0.2, kl_type="low_var_kl")
    assert AlgorithmConfig().policy_loss(0.2) == PolicyLossConfig()  # kl in the reward: none
    assert AlgorithmConfig().sampling(7, greedy=True) == SamplingConfig(
        temperature=0.0, n=1, max_new_tokens=32
    )
    assert AlgorithmConfig().sampling(7).seed == 7
    assert isinstance(
        AlgorithmConfig.model_validate(
            {"kl": {"target": 1.0, "target_unit": "token"}}
        ).kl.controller(),
        AdaptiveKL,
    )


def samples() -> TensorBatch:
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 0]])
    return TensorBatch.from_dict(
        {"response_mask": mask},
        {
            "uid": [5, 5, 9, 9],
            "prompt": ["a", "a", "b", "b"],
            "answer": ["1", "1", "2", "2"],
            "response": ["x", "y", "z", "w"],
            "finish": ["stop", "length", "stop", "stop"],
            "request": [0, 0, 1, 1],
        },
    )


def test_prompts_of_a_batch_and_back() -> None:
    batch = samples()
    prompts = first_of_each(batch)
    assert prompts.non_tensors == {"uid": [5, 9], "prompt": ["a", "b"], "answer": ["1", "2"]}
    assert index_of(batch, prompts).tolist() == [0, 0, 1, 1]


def test_summary_and_group_stats_by_hand() -> None:
    batch = samples()
    score = torch.tensor([1.0, 0.0, 1.0, 1.0])
    old = torch.full((4, 4), -1.0)
    ref = torch.full((4, 4), -1.5)
    kl = kl_of(old, ref, batch.tensors["response_mask"])
    assert kl is not None and kl.sum().item() == pytest.approx(0.5 * 8)
    found = summarize(batch, score, kl)
    assert found["reward/mean"] == 0.75
    assert found["response/length"] == 2.0 and found["response/tokens"] == 8.0
    assert found["response/clipped"] == 0.25
    assert found["kl"] == pytest.approx(1.0)  # mean over rows of the summed token kl
    groups = group_stats(score, torch.tensor([5, 5, 9, 9]))
    assert groups == {"groups/all_solved": 0.5, "groups/none_solved": 0.0}


def test_state_round_trip() -> None:
    state = State(kl=FixedKL(0.1), lagrange=0.7)
    other = State(kl=FixedKL(0.0))
    other.load_state_dict(state.state_dict())
    assert (other.kl.value, other.lagrange) == (0.1, 0.7)


def test_each_stage_starts_the_state_of_its_own_settings() -> None:
    """A second RL stage's kl and safe settings are its own, not the first stage's."""
    first = State.initial(AlgorithmConfig.model_validate({"kl": {"coef": 0.1}}))
    adaptive = {"coef": 0.3, "target": 6.0, "target_unit": "sequence"}
    second = State.initial(
        AlgorithmConfig.model_validate(
            {"name": "safe_rlhf", "kl": adaptive, "safe": {"lambda_init": 2.5}}
        )
    )
    assert isinstance(first.kl, FixedKL) and first.kl.value == 0.1 and first.lagrange == 0.0
    assert isinstance(second.kl, AdaptiveKL) and second.kl.value == 0.3
    assert second.lagrange == 2.5


class _Placed:
    """Stands in for a controller: which roles its placement names."""

    def __init__(self, *roles: str) -> None:
        self.role_group = {role: "g" for role in roles}

    def group_of(self, role: str) -> object:
        if role not in self.role_group:
            raise KeyError(f"no role {role!r} in this placement")
        return object()


def test_placed_roles_get_the_client_of_their_kind_and_absent_ones_none() -> None:
    placed = _Placed("actor", "reward", "critic", "cost_critic", "rollout")
    roles = Roles.placed(cast(Controller, placed))
    assert type(roles.actor) is ActorClient and type(roles.reward) is RewardClient
    assert type(roles.critic) is CriticClient and roles.critic.role == "critic"
    assert type(roles.rollout) is RolloutClient and roles.generator is roles.rollout
    assert roles.reference is None and roles.cost is None
    assert sorted(roles.engines()) == ["actor", "cost_critic", "critic"]
    assert Roles.placed(cast(Controller, _Placed("actor", "reward"))).generator.role == "actor"
    with pytest.raises(KeyError, match="no role 'reward'"):
        Roles.placed(cast(Controller, _Placed("actor")))


def test_logprob_gap_is_over_response_tokens_only() -> None:
    generated = torch.tensor([[0.0, -1.0, -2.0, 9.0], [0.0, -0.5, -0.25, -3.0]])
    old = torch.tensor([[0.0, -1.5, -2.0, 0.0], [5.0, -0.25, -0.5, -3.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    found = logprob_gap(generated, old, mask)  # gaps 0.5, 0, 0.25, 0.25, 0
    assert found == pytest.approx({"rollout/logprob_gap_max": 0.5, "rollout/logprob_gap_mean": 0.2})
    assert logprob_gap(generated, old, torch.zeros_like(mask)) == {}


def test_truncated_importance_sampling_needs_recomputed_old_log_probs() -> None:
    AlgorithmConfig(name="grpo", loss={"tis_cap": 2.0})
    with pytest.raises(ValidationError, match="tis_cap"):
        AlgorithmConfig(name="grpo", loss={"tis_cap": 2.0}, old_log_probs="rollout")
