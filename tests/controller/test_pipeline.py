"""Staleness-bounded asynchronous rollout (``algorithm.max_staleness``) through real role groups.

Each run starts fresh groups from the same tiny model: an actor on one rank, a rollout group on
one rank (or none: the actor generates), a rule reward on one rank. k = 0 must equal a plain
synchronous loop written here from the public pieces of ``controller/algorithms.py``; k = 1, 2
must train on batches at most k policy versions old, and with a rollout group the generation of
step n+1 must overlap the training of step n (from the metrics' timeline).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.algorithm_config import AlgorithmConfig
from controller.algorithms import STEPS
from controller.clients import ActorClient, RewardClient, RolloutClient
from controller.steps import Roles, State
from controller.sync import WeightSync
from controller.tasks import arithmetic
from controller.trainer import RLStage, Trainer, TrainerConfig, epoch_batches, request_seed
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from transport.batch import TensorBatch
from transport.protocol import PEAK_MEMORY
from transport.weight_sync import WeightSyncSettings

STEPS_PER_RUN = 4
PROMPTS, SAMPLES = 4, 2
ALGORITHM: dict[str, Any] = {
    "name": "grpo",
    "prompts_per_step": PROMPTS,
    "n": SAMPLES,
    "max_new_tokens": 8,
}
ROWS = arithmetic(32, "train", seed=0)


def placement(model: Path, rollout: bool) -> list[Any]:
    engine = {"model": str(model), "micro_batch_size": 8, "optim": {"lr": 1e-2}}
    groups = [
        group("a", 1, actor=("roles.actor:Actor", engine)),
        group("w", 1, reward=("roles.reward:RuleReward", {"function": REWARD})),
    ]
    if rollout:
        groups.append(group("r", 1, rollout=("roles.rollout:Rollout", {"model": str(model)})))
    return groups


REWARD = "tests.controller.test_pipeline:varied_reward"


def varied_reward(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """A score that differs between samples of an untrained model, so GRPO has a signal."""
    return float(len(response) % 3)


def roles_of(c: Any, rollout: bool) -> Roles:
    return Roles(
        actor=ActorClient(c, "actor"),
        reward=RewardClient(c, "reward"),
        rollout=RolloutClient(c, "rollout") if rollout else None,
    )


async def weights(actor: ActorClient) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = await actor.state_dict()
    return found


def trainer_run(model: Path, run_dir: Path, k: int, rollout: bool) -> dict[str, Any]:
    algorithm = AlgorithmConfig.model_validate({**ALGORITHM, "max_staleness": k})
    stage = RLStage(name="grpo", steps=STEPS_PER_RUN, data="train", algorithm=algorithm)

    async def main() -> dict[str, Any]:
        async with local_session(placement(model, rollout), TEST_TIMEOUTS) as c:
            roles = roles_of(c, rollout)
            records: list[dict[str, Any]] = []
            trainer = Trainer(
                TrainerConfig(seed=0, export=False),
                [stage],
                roles,
                roles.engines(),
                {"train": ROWS},
                run_dir,
                ["actor"],
                sinks=[records.append],
            )
            await trainer.run()
            return {"records": records, "weights": await weights(roles.actor)}

    found: dict[str, Any] = run(main)
    return found


def plain_prompts(k: int) -> TensorBatch:
    """The prompts of step k as the trainer draws them (seed 0, stage 0)."""
    (picked,) = epoch_batches(len(ROWS), ALGORITHM["prompts_per_step"], 0, k, 1)
    rows = [ROWS[i] for i in picked]
    columns = sorted({c for row in rows for c in row if c != "response"})
    batch = TensorBatch.from_dict(non_tensors={c: [row.get(c) for row in rows] for c in columns})
    batch.non_tensors["uid"] = list(range(len(rows)))
    batch.non_tensors["seed"] = [request_seed(0, k, i) for i in range(len(rows))]
    return batch


def plain_run(model: Path) -> dict[str, Any]:
    """Generate, learn, push the weights to the rollout group: the on-policy loop by hand."""
    cfg = AlgorithmConfig.model_validate(ALGORITHM)

    async def main() -> dict[str, Any]:
        async with local_session(placement(model, True), TEST_TIMEOUTS) as c:
            roles = roles_of(c, True)
            assert roles.rollout is not None
            sync = WeightSync(roles.actor, WeightSyncSettings())
            state = State.initial(cfg)
            found = []
            for k in range(STEPS_PER_RUN):
                sampling = cfg.sampling(request_seed(0, k, -1))
                batch = await roles.rollout.generate(plain_prompts(k), sampling, k)
                found.append(await STEPS[cfg.name](roles, batch, cfg, state, k))
                await sync.push(roles.rollout, k + 1)  # policy version k + 1: k + 1 steps
            return {"metrics": found, "weights": await weights(roles.actor)}

    result: dict[str, Any] = run(main)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline")
    model = init_model(root / "tiny", "tiny", seed=0)
    return {
        "plain": plain_run(model),
        "k0": trainer_run(model, root / "k0", 0, rollout=True),
        "k1": trainer_run(model, root / "k1", 1, rollout=True),
        "k2": trainer_run(model, root / "k2", 2, rollout=True),
        "k2_colocated": trainer_run(model, root / "k2c", 2, rollout=False),
    }


def steps_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["records"] if "stage_step" in r]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_k0_equals_the_plain_synchronous_loop_bitwise(runs: dict[str, Any]) -> None:
    plain, k0 = runs["plain"], runs["k0"]
    assert plain["weights"].keys() == k0["weights"].keys()
    assert all(plain["weights"][n].equal(k0["weights"][n]) for n in plain["weights"])
    records = steps_of(k0)
    assert len(records) == STEPS_PER_RUN
    for record, metrics in zip(records, plain["metrics"], strict=True):
        assert record["mem/train_peak_gib"] > 0  # the trainer moves the peak to mem/
        metrics = {n: v for n, v in metrics.items() if not n.endswith(PEAK_MEMORY)}
        assert {f"train/{n}": v for n, v in metrics.items()} == {
            f"train/{n}": record[f"train/{n}"] for n in metrics
        }
        assert record["train/staleness"] == record["train/staleness_max"] == 0
    # and equality is not trivial: one step of lag already gives other weights
    lagged = runs["k1"]["weights"]
    assert any(not lagged[n].equal(k0["weights"][n]) for n in lagged)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("run", "k"), [("k1", 1), ("k2", 2), ("k2_colocated", 2)])
def test_no_batch_is_older_than_k_versions(runs: dict[str, Any], run: str, k: int) -> None:
    records = steps_of(runs[run])
    rows = ALGORITHM["prompts_per_step"] * ALGORITHM["n"]
    # batches 0..k were all sampled with the first weights; later ones exactly k steps behind
    expected = [min(n, k) for n in range(STEPS_PER_RUN)]
    assert [r["train/staleness_max"] for r in records] == expected
    assert [r["train/staleness"] for r in records] == expected  # one version per batch
    for record, behind in zip(records, expected, strict=True):
        histogram = [record[f"staleness/k={i}"] for i in range(k + 1)]
        assert histogram == [rows if i == behind else 0 for i in range(k + 1)]
    # the same prompts and seeds for every k: only the weights that sampled them differ
    if run != "k2_colocated":
        first_k0, first = steps_of(runs["k0"])[0], records[0]
        assert first["train/reward/mean"] == first_k0["train/reward/mean"]


def span(record: dict[str, Any], stage: str) -> tuple[float, float]:
    start = record["time/timeline/step_start_s"]
    keys = [k for k in record if k.startswith(f"time/timeline/{stage}@") and k.endswith("_start_s")]
    (key,) = keys
    return start + record[key], start + record[key.replace("_start_s", "_end_s")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generation_of_the_next_step_overlaps_training_with_a_rollout_group(
    runs: dict[str, Any],
) -> None:
    for name, k in (("k1", 1), ("k2", 2)):  # batch n+k is generated while step n trains
        records = steps_of(runs[name])
        for before, after in zip(records, records[k:], strict=False):
            trained = (span(before, "prepare")[0], span(before, "update")[1])
            generated = span(after, "generate")
            assert generated[0] < trained[1] and generated[1] > trained[0], (name, before["step"])
            assert "time/timeline/generate@rollout_start_s" in after
    # on-policy: the next batch is generated only after the step trained and synced
    records = steps_of(runs["k0"])
    for before, after in itertools.pairwise(records):
        assert span(after, "generate")[0] >= span(before, "update")[1]
