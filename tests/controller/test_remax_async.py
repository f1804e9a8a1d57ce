"""ReMax at max_staleness 1: the greedy baseline comes from the weights that sampled the batch.

The colocated actor generates step 2's batch before step 1 trains, so both the samples and the
greedy responses of step 2 must come from the initial weights. The test generates those greedy
responses itself, on the initial weights and before the trainer starts, scores them with the same
rule, and requires step 2's logged baseline to be their mean. A baseline generated at training
time (after step 1's update at lr 1e-2) comes from other weights and gives other responses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.algorithm_config import AlgorithmConfig
from controller.scoring import scores
from controller.trainer import RLStage, Trainer, TrainerConfig
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, run
from tests.controller.test_pipeline import ALGORITHM, ROWS, placement, plain_prompts, roles_of


@pytest.mark.slow
def test_remax_baseline_at_k1_is_the_greedy_reward_of_the_sampling_weights(
    tmp_path: Path,
) -> None:
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    algorithm = AlgorithmConfig.model_validate(
        {**ALGORITHM, "name": "remax", "n": 2, "max_staleness": 1, "max_new_tokens": 12}
    )
    stage = RLStage(name="remax", steps=3, data="train", algorithm=algorithm)

    async def main() -> dict[str, Any]:
        async with local_session(placement(model, False), TEST_TIMEOUTS) as c:
            roles = roles_of(c, False)
            expected = []
            for k in (1, 2):  # before any training: the initial weights
                sampling = algorithm.sampling(k, greedy=True)
                greedy = await roles.generator.generate(plain_prompts(k), sampling)
                base, _ = await scores(roles.reward, greedy)
                expected.append(float(base.mean()))
            records: list[dict[str, Any]] = []
            trainer = Trainer(
                TrainerConfig(seed=0, export=False),
                [stage],
                roles,
                roles.engines(),
                {"train": ROWS},
                tmp_path / "run",
                ["actor"],
                sinks=[records.append],
            )
            await trainer.run()
            return {"expected": expected, "records": records}

    found = run(main)
    steps = [r for r in found["records"] if r.get("stage") == "remax" and "stage_step" in r]
    assert [r["train/staleness_max"] for r in steps] == [0, 1, 1]
    # step 2's batch (index 1) was generated, with its baseline, before step 1 trained
    assert steps[1]["train/baseline"] == pytest.approx(found["expected"][0], abs=1e-6)
