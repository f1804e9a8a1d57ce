"""Rollout batches generated ahead of training (``AlgorithmConfig.max_staleness``).

With ``max_staleness: k`` the trainer generates the batches of steps n+1..n+k while step n trains.
Each batch carries the policy version it was sampled with, per row (``policy_version``, an int64
column the loss side can read): the number of RL and SFT steps the generator's weights reflect.
A batch is trained on at step n only if no row is more than k versions behind the learner
(``check_staleness``), and the batches still pending when a checkpoint is written go into it
(``save_pending`` / ``load_pending``), so a resumed run trains on exactly the batches the straight
run would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from transport.batch import TensorBatch
from transport.protocol import PEAK_MEMORY

VERSION = "policy_version"


class StalenessError(RuntimeError):
    """A batch older than ``max_staleness`` reached training: a bug in the pipeline, not input."""


def stamp(batch: TensorBatch, version: int) -> TensorBatch:
    """``batch`` with a ``policy_version`` column: the generator's weight version, per row."""
    column = torch.full((len(batch),), version, dtype=torch.long)
    return TensorBatch(
        {**batch.tensors, VERSION: column}, dict(batch.non_tensors), dict(batch.meta)
    )


def check_staleness(batch: TensorBatch, learner: int, limit: int, step: int) -> torch.Tensor:
    """Per-row staleness (learner version - sampled version); raises if any row exceeds
    ``limit`` or was sampled from weights newer than the learner's."""
    behind = learner - batch.tensors[VERSION]
    if len(behind) and (int(behind.max()) > limit or int(behind.min()) < 0):
        raise StalenessError(
            f"step {step}: the batch was sampled with policy versions "
            f"{sorted(set(batch.tensors[VERSION].tolist()))} but the learner is at {learner}; "
            f"algorithm.max_staleness={limit} allows 0..{limit} versions behind"
        )
    return behind


def memory_metrics(batch: TensorBatch, metrics: dict[str, float]) -> dict[str, float]:
    """``mem/generate_peak_gib`` and ``mem/train_peak_gib``: the peak memory of the step's
    generation (of the rank whose meta the batch carries) and of its largest policy update,
    which is taken out of ``metrics`` (it is no result of training: runs of the same work
    differ in it, as in timings)."""
    found = {}
    if PEAK_MEMORY in batch.meta:
        found["mem/generate_peak_gib"] = float(batch.meta[PEAK_MEMORY]) / 2**30
    train = metrics.pop(f"actor/{PEAK_MEMORY}", None)
    if train is not None:
        found["mem/train_peak_gib"] = float(train) / 2**30
    return found


def staleness_metrics(behind: torch.Tensor, limit: int) -> dict[str, float]:
    """Mean and max staleness, and how many rows were 0, 1, .., ``limit`` versions behind."""
    if behind.numel() == 0:
        return {"train/staleness": 0.0, "train/staleness_max": 0.0}
    found = {
        "train/staleness": float(behind.float().mean()),
        "train/staleness_max": float(behind.max()),
    }
    counts = torch.bincount(behind, minlength=limit + 1)
    found.update({f"staleness/k={i}": float(counts[i]) for i in range(limit + 1)})
    return found


def save_pending(folder: Path, stage: int, batches: dict[int, TensorBatch]) -> None:
    """Each batch as ``<step>.safetensors`` (tensors) + ``<step>.json`` (text columns, meta)."""
    folder.mkdir(parents=True, exist_ok=True)
    for step, batch in batches.items():
        tensors = {k: v.contiguous() for k, v in batch.tensors.items()}
        save_file(tensors, str(folder / f"{step}.safetensors"))
        rest = {"stage": stage, "non_tensors": batch.non_tensors, "meta": batch.meta}
        (folder / f"{step}.json").write_text(json.dumps(rest))


def load_pending(folder: Path) -> tuple[int | None, dict[int, TensorBatch]]:
    """(stage, step -> batch) as ``save_pending`` wrote them; (None, {}) when there are none."""
    found: dict[int, TensorBatch] = {}
    stage: int | None = None
    if not folder.is_dir():
        return None, found
    for path in sorted(folder.glob("*.json")):
        rest: dict[str, Any] = json.loads(path.read_text())
        stage = int(rest["stage"])
        tensors = load_file(str(path.with_suffix(".safetensors")))
        found[int(path.stem)] = TensorBatch(tensors, rest["non_tensors"], rest["meta"])
    return stage, found
