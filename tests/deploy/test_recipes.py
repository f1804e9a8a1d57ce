"""The recipes end to end on real ranks with the tiny model: DAPO's example, GSPO / CISPO and a
policy loss by import path on the quickstart, each ``--quick``; a bad loss path is refused
before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.experiment import ExperimentError, check, parse
from tests.deploy.test_pipeline_placement import base
from tests.deploy.test_run import job, quick_argv, records


def rl_rows(run_dir: Path, stage: str) -> list[dict]:
    return [r for r in records(run_dir) if r["stage"] == stage and "train/actor/loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dapo_example_samples_dynamically_and_shapes_long_answers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("dapo.yaml", run_dir)) == 0
    rows = rl_rows(run_dir, "dapo")
    assert len(rows) == 6
    for r in rows:
        assert 1 <= r["rollout/dynamic/rounds"] <= 4  # max_rounds 3 extra
        assert r["rollout/dynamic/drawn_groups"] == 32 * r["rollout/dynamic/rounds"]
        kept = r["rollout/dynamic/kept_groups"]
        assert kept <= 32 and (kept == 32 or r["rollout/dynamic/rounds"] == 4)
        assert r["train/reward/overlong_penalty"] <= 0.0
    assert sum(r["rollout/dynamic/kept_groups"] for r in rows) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dynamic_sampling_rounds_are_generated_ahead_with_a_rollout_group(tmp_path: Path) -> None:
    """max_staleness 1 with a rollout group: step k+1's batch, extra rounds included, is
    generated while step k trains; each step still trains on up to 32 informative groups."""
    run_dir = tmp_path / "run"
    overrides = [
        "stages.1.algorithm.max_staleness=1",
        "roles.rollout={model: base}",
        "placement={main: {roles: [actor, reward], nproc: 1}, gen: {roles: [rollout], nproc: 1}}",
    ]
    assert job(quick_argv("dapo.yaml", run_dir, overrides)) == 0
    rows = rl_rows(run_dir, "dapo")
    assert len(rows) == 6
    assert all(r["rollout/dynamic/kept_groups"] <= 32 for r in rows)
    assert all(r["rollout/dynamic/rounds"] >= 1 for r in rows)
    assert any(r["train/staleness_max"] == 1 for r in rows)  # trained on a batch made ahead


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "loss",
    [
        # the built-in kinds ride the same wire field as a custom loss (checked by hand in
        # tests/roles/test_policy_kinds.py): their runs are the extended tier's
        pytest.param(
            "{kind: gspo, agg: seq-mean-token-mean, clip_ratio_low: 3.0e-4, clip_ratio_high: 4.0e-4}",
            marks=pytest.mark.extended,
        ),
        pytest.param(
            "{kind: cispo, clip_ratio_low: 1.0, clip_ratio_high: 0.28, dual_clip: null}",
            marks=pytest.mark.extended,
        ),
        "{custom: 'tests.fixtures.losses:reinforce'}",
    ],
)
def test_each_policy_loss_trains_the_quickstart(loss: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("quickstart.yaml", run_dir, [f"stages.1.algorithm.loss={loss}"])) == 0
    rows = rl_rows(run_dir, "grpo")
    # the quick SFT leaves most groups all wrong (zero advantages): some steps have signal
    assert len(rows) == 6 and any(r["train/actor/grad_norm"] > 0 for r in rows)
    if "custom" in loss:  # the function ran in the actor's ranks: its metric came back
        assert all("train/actor/advantage" in r for r in rows)


def test_a_policy_loss_path_is_checked_before_any_process_starts() -> None:
    raw = base()
    raw["stages"][1]["algorithm"]["loss"] = {"custom": "tests.fixtures.losses:missing"}
    with pytest.raises(ExperimentError, match=r"stages\.1\.algorithm\.loss\.custom: .*no function"):
        check(parse(raw))
