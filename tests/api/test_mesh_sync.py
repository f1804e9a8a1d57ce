"""``hf.mesh_sync``: the quickstart's groups driven from plain code without ``await`` — and from
inside a running event loop, as a Jupyter cell runs — with errors reaching the caller as raised
and nothing left running after the block."""

from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path

import pytest
import torch

import hybridflow as hf
from deploy.mesh_sync import THREAD_NAME
from tests.deploy.test_multicluster import rank_processes, settle

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
SMALL = ["placement.main.nproc=1", "logging.tensorboard=false", "trainer.val_data=null"]


def mesh_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_every_coroutine_of_the_mesh_has_a_blocking_twin_with_its_parameters() -> None:
    for name, member in inspect.getmembers(hf.Mesh, inspect.iscoroutinefunction):
        if name.startswith("_"):
            continue
        twin = hf.SyncMesh.__dict__.get(name)
        assert twin is not None, f"SyncMesh has no blocking {name}; add it to deploy/mesh_sync.py"
        assert not inspect.iscoroutinefunction(twin)
        assert inspect.signature(twin).parameters == inspect.signature(member).parameters, name


def test_a_bad_experiment_fails_in_the_callers_thread_and_leaves_no_thread(tmp_path: Path) -> None:
    before = len(mesh_threads())
    with pytest.raises(hf.ExperimentError, match="no such experiment file"):
        hf.mesh_sync(tmp_path / "nowhere.yaml")
    assert len(mesh_threads()) == before


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_blocking_mesh_samples_scores_and_trains_then_leaves_nothing(tmp_path: Path) -> None:
    async def cell() -> hf.SyncMesh:  # a notebook cell: this thread runs a loop meanwhile
        return hf.mesh_sync(QUICKSTART, *SMALL, run_dir=tmp_path / "run")

    m = asyncio.run(cell())
    assert len(mesh_threads()) == 1 and rank_processes(tmp_path)
    with m:
        prompts = hf.rows("builtin:arithmetic?n=64&split=train")[:4]
        batch = m.sample(prompts, hf.SamplingConfig(n=2, max_new_tokens=4, seed=0))
        assert len(batch) == 8 and batch.non_tensors["request"] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert batch.meta["weight_version"] == 0

        score, _ = m.score(batch)
        direct = m.reward.compute_reward(batch)  # a role client's endpoint blocks too
        assert score.shape == (8,) and torch.equal(direct.tensors["scores"].float(), score)

        mask = batch.tensors["response_mask"]
        old = m.log_probs(batch)
        assert old.shape == mask.shape
        group = torch.tensor(batch.non_tensors["request"])
        batch.tensors["advantages"] = hf.advantages.grpo(score, group, mask)
        batch.tensors["old_log_probs"] = old
        metrics = m.train_step(batch, hf.PolicyLossConfig(dual_clip=None))
        assert m.version == 1 and "loss" in metrics

        with pytest.raises(ValueError, match="no model role 'nope'"):
            m.log_probs(batch, role="nope")

        async def another_cell() -> int:
            again = m.sample(prompts[:1], hf.SamplingConfig(max_new_tokens=4))
            return int(again.meta["weight_version"])

        assert asyncio.run(another_cell()) == 1
        m.log({"score": float(score.mean())})
    assert m.closed and mesh_threads() == []
    assert settle(lambda: rank_processes(tmp_path)) == []
    assert '"score"' in (tmp_path / "run" / "metrics.jsonl").read_text()
