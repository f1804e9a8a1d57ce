"""The library API with agents: ``m.sample`` on an experiment whose env role names an agent
written against the OpenAI API runs it once per trajectory and returns the trajectories as
training rows, which the trainer re-scores to the sampler's log-probs (nothing re-tokenized) and
the reward role scores with the agents' returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hybridflow as hf
from tests.deploy.test_run import EXAMPLES


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sample_runs_the_agents_and_the_rows_rescore_as_sampled(tmp_path: Path) -> None:
    async def main() -> tuple[Any, Any, Any]:
        experiment = EXAMPLES / "agents" / "tool_use.yaml"
        async with hf.mesh(experiment, "roles.actor.dtype=fp32", run_dir=tmp_path / "run") as m:
            rows = hf.rows("builtin:tool_arithmetic?n=8&split=test")[:4]
            batch = await m.sample(rows, hf.SamplingConfig(n=2, max_new_tokens=24, seed=3))
            score, _ = await m.score(batch)
            return batch, score, await m.log_probs(batch)

    batch, score, log_probs = hf.run(main)
    assert len(batch) == 8 and batch.non_tensors["request"] == [0, 0, 1, 1, 2, 2, 3, 3]
    mask = batch.tensors["response_mask"].bool()
    assert mask.any(-1).all()  # every agent called the model
    gap = (log_probs - batch.tensors["log_probs"])[mask].abs().max()
    assert float(gap) < 1e-4, gap
    assert score.tolist() == batch.non_tensors["env_reward"]
    assert all(s[0][0] == "sampled" for s in batch.non_tensors["segments"])
    assert batch.meta["agent"]["agent/faults"] == 0
