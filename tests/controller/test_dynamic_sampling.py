"""DAPO's two additions by hand: dynamic sampling (``RolloutPipeline._informative``) on scripted
rounds of scored groups, and the soft overlong penalty at its edges."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from controller.advantages import overlong_penalty
from controller.algorithm_config import AlgorithmConfig
from controller.rollouts import RolloutPipeline, StageRollouts, informative_groups
from transport.batch import TensorBatch

N = 2  # samples per prompt
# per round, the scores of 4 prompts x 2 samples; informative groups: round 0: uids 1, 3;
# round 1: none; round 2: uids 0, 1, 3
ROUNDS = [
    [1, 1, 0, 1, 0, 0, 1, 0],
    [0, 0, 1, 1, 0, 0, 0, 0],
    [1, 0, 0, 1, 1, 1, 0, 1],
    [0, 1, 0, 1, 0, 1, 0, 1],
]


def scored_round(r: int) -> TensorBatch:
    """Round r's generated rows: 8 rows of width 3 + r (rounds differ in width), each row's
    first token says which round and row it is, the reward role's scores stashed in it."""
    rows = len(ROUNDS[r])
    ids = torch.zeros(rows, 3 + r, dtype=torch.long)
    ids[:, 0] = 100 * r + torch.arange(rows)
    mask = torch.zeros_like(ids)
    mask[:, 1:] = 1  # 2 + r response tokens per row
    return TensorBatch.from_dict(
        {
            "input_ids": ids,
            "response_mask": mask,
            "reward:scores": torch.tensor(ROUNDS[r], dtype=torch.float),
        },
        {"uid": [i // N for i in range(rows)]},
        {"weight_version": 3, "pad_values": {"input_ids": 0}},
    )


class Scripted(RolloutPipeline):
    """The pipeline with generation replaced by the scripted rounds (what is under test is
    which groups are kept and when drawing stops; generation and scoring are real elsewhere)."""

    def __init__(self) -> None:
        self.roles = SimpleNamespace(reward=SimpleNamespace(role="reward"))  # type: ignore[assignment]
        self.calls: list[Any] = []

    async def _generate(self, prompts: Any, cfg: Any, seed: int, version: int) -> TensorBatch:
        self.calls.append(prompts)
        return scored_round(prompts)


def sample(max_rounds: int, first: int = 0) -> tuple[TensorBatch, list[Any]]:
    cfg = AlgorithmConfig(
        name="grpo", n=N, prompts_per_step=4, dynamic_sampling={"max_rounds": max_rounds}
    )
    plan = StageRollouts(cfg, 10, 0, lambda k: first, lambda k, r: first + r)
    pipeline = Scripted()
    out = asyncio.run(pipeline._informative(scored_round(first), plan, 0, 3))
    return out, pipeline.calls


def test_uninformative_groups_are_replaced_until_the_batch_is_full() -> None:
    out, calls = sample(max_rounds=3)
    assert calls == [1, 2]  # two extra rounds, then full: round 3 is never drawn
    assert out.tensors["input_ids"][:, 0].tolist() == [2, 3, 6, 7, 200, 201, 202, 203]
    assert out.non_tensors["uid"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.tensors["input_ids"].shape[1] == 5  # padded to the widest round
    assert out.meta["dynamic"] == {
        "rollout/dynamic/rounds": 3.0,
        "rollout/dynamic/drawn_groups": 12.0,
        "rollout/dynamic/informative_frac": 5 / 12,
        "rollout/dynamic/kept_groups": 4.0,
        # rounds of 8 rows x 2, 3, 4 response tokens were generated; kept: 4 rows of round 0
        # and 4 of round 2 (padded to round 2's width, the mask keeps each row's own)
        "rollout/dynamic/generated_tokens": 8.0 * (2 + 3 + 4),
        "rollout/dynamic/kept_token_share": (4 * 2 + 4 * 4) / (8.0 * (2 + 3 + 4)),
    }
    assert out.tensors["reward:scores"].tolist() == [0, 1, 1, 0, 1, 0, 0, 1]  # still stashed


def test_drawing_stops_at_the_cap_with_the_informative_groups_found() -> None:
    out, calls = sample(max_rounds=1)
    assert calls == [1]
    assert out.non_tensors["uid"] == [0, 0, 1, 1]
    assert out.meta["dynamic"]["rollout/dynamic/kept_groups"] == 2.0


def test_a_step_without_any_informative_group_trains_on_its_first_batch() -> None:
    out, calls = sample(max_rounds=0, first=1)
    assert calls == [] and len(out) == 8
    assert out.meta["dynamic"]["rollout/dynamic/kept_groups"] == 0.0


def test_informative_groups_by_hand() -> None:
    scores = torch.tensor([0.5, 0.5, 0.2, 0.7, 1.0, 1.0])
    assert informative_groups(scores, [4, 4, 9, 9, 2, 2]) == [9]


def test_dynamic_sampling_needs_groups() -> None:
    with pytest.raises(ValidationError, match="dynamic_sampling"):
        AlgorithmConfig(name="ppo", dynamic_sampling={})
    with pytest.raises(ValidationError, match="max_rounds"):
        AlgorithmConfig(name="grpo", n=2, dynamic_sampling={"max_rounds": -1})


def test_overlong_penalty_at_its_edges() -> None:
    """L_max 20, L_cache 4: no penalty up to 16 tokens, then -1/4 per token, -1 at 20."""
    lengths = torch.tensor([0, 16, 17, 18, 20, 21])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, factor=0.5).tolist()[4] == -0.5
    with pytest.raises(ValueError, match="cache=0"):
        overlong_penalty(lengths, 20, 0)
    with pytest.raises(ValidationError, match=r"overlong\.cache=40 must be at most"):
        AlgorithmConfig(max_new_tokens=32, overlong={"cache": 40})
