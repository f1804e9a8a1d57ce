"""Two RL stages in one run: each has its own KL controller, and a checkpoint keeps the state of
the stage it was written in.

Real role groups from a tiny model: an actor and a reference on one rank, a rule reward on
another. Stage one has a fixed KL coefficient of 0.1; stage two an adaptive controller starting
at 0.4, which moves every step. The records must show each stage's own coefficient, and a run
stopped inside stage two and resumed must continue stage two's controller where it stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.algorithm_config import AlgorithmConfig
from controller.clients import ActorClient, ReferenceClient, RewardClient
from controller.steps import Roles
from controller.trainer import RLStage, Trainer, TrainerConfig
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.controller.test_pipeline import ALGORITHM, REWARD, ROWS

ADAPTIVE = {"coef": 0.4, "target": 0.01, "target_unit": "sequence", "horizon": 16}


def stages() -> list[RLStage]:
    fixed = AlgorithmConfig.model_validate({**ALGORITHM, "kl": {"coef": 0.1}})
    adaptive = AlgorithmConfig.model_validate({**ALGORITHM, "kl": ADAPTIVE})
    return [
        RLStage(name="one", steps=1, data="train", algorithm=fixed),
        RLStage(name="two", steps=3, data="train", algorithm=adaptive),
    ]


def rl_records(model: Path, run_dir: Path, stop_after: int | None) -> list[dict[str, Any]]:
    """The step records of a run (and of its resumed second half, when ``stop_after``)."""
    engine = {"model": str(model), "micro_batch_size": 8, "optim": {"lr": 1e-2}}
    placement = [
        group(
            "a",
            1,
            actor=("roles.actor:Actor", engine),
            reference=("roles.actor:Reference", {"model": str(model)}),
        ),
        group("w", 1, reward=("roles.reward:RuleReward", {"function": REWARD})),
    ]

    async def main() -> list[dict[str, Any]]:
        async with local_session(placement, TEST_TIMEOUTS) as c:
            roles = Roles(
                actor=ActorClient(c, "actor"),
                reward=RewardClient(c, "reward"),
                reference=ReferenceClient(c, "reference"),
            )
            records: list[dict[str, Any]] = []
            for resume, stop in ((False, stop_after), (True, None)):
                trainer = Trainer(
                    TrainerConfig(seed=0, export=False),
                    stages(),
                    roles,
                    roles.engines(),
                    {"train": ROWS},
                    run_dir,
                    ["actor"],
                    sinks=[records.append],
                    stop_after=stop,
                )
                await trainer.run(resume=resume)
                if stop_after is None:
                    break
            return [r for r in records if "stage_step" in r]

    found: list[dict[str, Any]] = run(main)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_rl_stage_has_its_own_kl_controller_across_a_resume(tmp_path: Path) -> None:
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    straight = rl_records(model, tmp_path / "straight", None)
    coefs = [(r["stage"], r["train/kl_coef"]) for r in straight]
    assert coefs[0] == ("one", pytest.approx(0.1))
    two = [c for s, c in coefs if s == "two"]
    assert len(two) == 3 and two[0] != pytest.approx(0.1)
    # the adaptive controller started at 0.4 and moved each step (by at most 20% of a step)
    assert all(0.4 * 0.8**3 <= c <= 0.4 * 1.2**3 for c in two)
    assert len(set(two)) == 3
    resumed = rl_records(model, tmp_path / "cut", stop_after=3)  # inside stage two
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/kl_coef"] for r in resumed] == pytest.approx([c for _, c in coefs])
