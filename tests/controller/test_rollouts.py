"""Batches generated ahead (``controller/rollouts.py``): versions, staleness, pending storage."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from controller.algorithm_config import AlgorithmConfig
from controller.rollouts import (
    RolloutPipeline,
    StalenessError,
    check_staleness,
    load_pending,
    save_pending,
    staleness_metrics,
    stamp,
)
from transport.batch import TensorBatch


def batch(rows: int = 3) -> TensorBatch:
    return TensorBatch.from_dict(
        {
            "input_ids": torch.arange(rows * 4).view(rows, 4),
            "log_probs": torch.randn(rows, 4).to(torch.bfloat16),
            "done": torch.tensor([True, False, True][:rows]),
            "odd": torch.randn(4, rows).t(),  # not contiguous
        },
        {
            "uid": list(range(rows)),
            "response": ["a", "b", None][:rows],
            "request": [0, 0, 1][:rows],
        },
        {"weight_version": 7, "pad_values": {"input_ids": 0}},
    )


def test_config_max_staleness_and_its_overlap_alias() -> None:
    assert AlgorithmConfig().max_staleness == 0
    assert AlgorithmConfig(overlap=True).max_staleness == 1
    assert AlgorithmConfig(overlap=True, max_staleness=1).max_staleness == 1
    assert AlgorithmConfig(max_staleness=3).max_staleness == 3
    with pytest.raises(ValidationError, match="max_staleness=-1 must be >= 0"):
        AlgorithmConfig(max_staleness=-1)
    with pytest.raises(ValidationError, match="overlap: true means max_staleness: 1"):
        AlgorithmConfig(overlap=True, max_staleness=2)
    with pytest.raises(ValidationError, match="decoupled"):
        AlgorithmConfig(loss={"decoupled": True}, old_log_probs="rollout")
    assert AlgorithmConfig(loss={"decoupled": True}).behaviour_weighted


def test_staleness_is_counted_per_row_and_bounded() -> None:
    rows = TensorBatch.concat([stamp(batch(2), 5), stamp(batch(1), 4)])
    behind = check_staleness(rows, learner=6, limit=2, step=9)
    assert behind.tolist() == [1, 1, 2]
    assert staleness_metrics(behind, 2) == {
        "train/staleness": pytest.approx(4 / 3),
        "train/staleness_max": 2.0,
        "staleness/k=0": 0.0,
        "staleness/k=1": 2.0,
        "staleness/k=2": 1.0,
    }
    with pytest.raises(StalenessError, match=r"step 9: .* versions \[4, 5\] .* learner is at 6"):
        check_staleness(rows, learner=6, limit=1, step=9)
    with pytest.raises(StalenessError, match="max_staleness=0"):  # newer than the learner
        check_staleness(rows, learner=4, limit=0, step=9)


def test_pending_batches_round_trip_exactly(tmp_path: Path) -> None:
    pending = {4: stamp(batch(), 2), 5: stamp(batch(2), 3)}
    save_pending(tmp_path / "pending", 1, pending)
    stage, loaded = load_pending(tmp_path / "pending")
    assert stage == 1 and loaded.keys() == pending.keys()
    for step, original in pending.items():
        got = loaded[step]
        assert got.tensors.keys() == original.tensors.keys()
        for name, tensor in original.tensors.items():
            assert got.tensors[name].dtype == tensor.dtype and got.tensors[name].equal(tensor)
        assert got.non_tensors == original.non_tensors and got.meta == original.meta
    assert load_pending(tmp_path / "none") == (None, {})


class Rollout:
    """A rollout group's client as the pipeline sees it: which weights it holds."""

    role = "rollout"
    controller = SimpleNamespace(supervisor=None)

    def __init__(self, holds: int) -> None:
        self.holds = holds


class Pushes:
    """WeightSync's push, recorded: the actor's version ``version`` into ``target``."""

    def __init__(self) -> None:
        self.pushed: list[int] = []

    async def push(self, target: Rollout, version: int, strict: bool = True) -> dict[str, Any]:
        self.pushed.append(version)
        target.holds = version
        return {}


def test_a_fresh_pipeline_pushes_before_its_first_batch_whatever_the_rollout_group_holds() -> None:
    """After a rollback with nothing to roll back to, a new pipeline starts at version 0 while
    the rollout group still holds the failed attempt's weights (version 3): the first sync must
    push, or rows stamped 0 would be sampled from version 3."""
    rollout, weights = Rollout(holds=3), Pushes()
    roles = SimpleNamespace(rollout=rollout, actor=None)
    pipeline = RolloutPipeline(roles, weights)  # type: ignore[arg-type]

    async def main() -> None:
        await pipeline.sync()
        assert weights.pushed == [0] and rollout.holds == 0 and pipeline.held == 0
        await pipeline.sync()  # known to hold version 0 now: nothing to push
        assert weights.pushed == [0]
        pipeline.trained()
        await pipeline.sync()
        assert weights.pushed == [0, 1] and pipeline.held == 1

    asyncio.run(main())
