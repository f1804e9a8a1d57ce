"""The quickstart teaches on every seed, and ``bench.seeds`` reports the spread it measures.

The fast tests check the runner's arithmetic on hand-made rows and the overrides each seed gets
(initial weights and trainer seed both vary: the stand-in for machine-to-machine float
differences). The slow ones run 3 seeds through the runner: the quickstart's ``--quick`` form
(the pipeline only), and a reduced quickstart that must show the RL gain on every seed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench import seeds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# The quickstart's story (SFT on noisy "82!" demonstrations teaches the sums, GRPO teaches the
# format) in what a slow test affords: operands up to 19 (41 held-out test problems, still in
# neither training stage), 300 SFT steps, 20 GRPO steps of 16 prompts. SFT reads the train split's
# 270 problems: the sft split has 89 at this size, which 400 steps memorize instead of
# generalizing (held-out number accuracy 0.27 on seed 0, fp32), while from the 270 the SFT model
# gets 0.39 / 0.68 / 0.56 of the held-out sums right (seeds 0-2, all in the "!" format).
# At this size SFT keeps batch 16 and AdamW lr 1e-3 (betas (0.9, 0.999), no weight decay): the
# full recipe's batch 64, lr 2e-3, beta2 0.98, weight decay 0.1 (tuned for 1,000 steps on the
# 100x100 problems) gave smaller margins here, fp32 gains 0.46 / 0.34 / 0.46 at 150 steps and
# 0.76 / 0.61 / 0.27 at 200, against 0.54 / 0.46 / 0.41 below.
ARITH = "builtin:arithmetic?max_operand=19&"
REDUCED = [
    f"stages.0.data={ARITH}n=4800&split=train&noise=0.7",
    "stages.0.steps=300",
    "stages.0.batch_size=16",
    "stages.0.optim={lr: 1.0e-3, warmup_steps: 20, schedule: cosine}",
    f"stages.1.data={ARITH}n=640&split=train",
    "stages.1.steps=20",
    "stages.1.optim.warmup_steps=2",
    "stages.1.algorithm.prompts_per_step=16",
    f"trainer.val_data={ARITH}n=41&split=test",
    "trainer.val_every=0",
    "trainer.export=false",
]


def seed_runs(
    capsys: pytest.CaptureFixture[str],
    example: str,
    count: int,
    out: Path,
    sets: Sequence[str] = (),
    *flags: str,
) -> tuple[int, dict]:
    """``bench.seeds EXAMPLE --seeds COUNT --out OUT --set S ... FLAGS``: its exit code and the
    JSON of its last line."""
    argv = [str(EXAMPLES / example), "--seeds", str(count), "--out", str(out)]
    code = seeds.main([*argv, *(x for s in sets for x in ("--set", s)), *flags])
    found: dict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, found


def row(seed: int, before: float, after: float) -> seeds.SeedResult:
    return seeds.SeedResult(seed, 0.0, before, after, after - before, 10.0, "fp32")


def test_spread_is_min_median_max_per_column() -> None:
    rows = [row(0, 0.1, 0.7), row(1, 0.2, 0.5), row(2, 0.0, 0.9)]
    found = seeds.spread(rows)
    assert found["before"] == {"min": 0.0, "median": 0.1, "max": 0.2}
    assert found["after"] == {"min": 0.5, "median": 0.7, "max": 0.9}
    assert found["gain"]["min"] == pytest.approx(0.3) and found["gain"]["max"] == pytest.approx(0.9)


def test_shortfalls_name_the_seeds_below_either_requirement() -> None:
    rows = [row(0, 0.1, 0.7), row(1, 0.4, 0.6), row(2, 0.0, 0.45)]
    assert seeds.shortfalls(rows, gain=0.25, after=None) == [1]
    assert seeds.shortfalls(rows, gain=None, after=0.5) == [2]
    assert seeds.shortfalls(rows, gain=0.25, after=0.5) == [1, 2]
    assert seeds.shortfalls(rows, gain=None, after=None) == []


def test_a_summary_without_the_rl_points_is_refused_by_name() -> None:
    summary = {"val_acc_init": 0.0, "val_acc_before": None, "val_acc_after": 0.5}
    with pytest.raises(seeds.SeedRunError, match="val_acc_before"):
        seeds.from_summary(3, summary, 1.0)
    full = {**summary, "val_acc_before": 0.25, "precision": {"actor": {"dtype": "bf16"}}}
    assert seeds.from_summary(3, full, 1.04) == seeds.SeedResult(
        3, 0.0, 0.25, 0.5, 0.25, 1.0, "bf16"
    )


def test_each_seed_varies_the_initial_weights_and_the_trainer_seed(tmp_path: Path) -> None:
    argv = seeds.run_argv(Path("x.yaml"), 5, tmp_path, quick=True, sets=["a.b=1"])
    assert argv[:4] == [sys.executable, "-m", "deploy.cli", "run"]
    sets = [argv[i + 1] for i, x in enumerate(argv) if x == "--set"]
    assert sets == ["models.base.seed=5", "trainer.seed=5", "a.b=1"]
    assert "--quick" in argv and "--json" in argv and argv[-2:] == ["--run-dir", str(tmp_path)]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runner_runs_three_quick_seeds_and_reports_their_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CI-sized form only: its 40 SFT steps learn no sums yet (number learning takes off
    # between steps 350 and 700 of the full recipe), so the gain itself is measured by the full
    # 8-seed run.
    flags = ("--quick", "--timeout", "90", "--require-after", "2.0")
    code, result = seed_runs(capsys, "quickstart.yaml", 3, tmp_path, [], *flags)
    assert code == 1 and result["failed"] == [0, 1, 2]  # no accuracy reaches 2.0
    assert [r["seed"] for r in result["seeds"]] == [0, 1, 2]
    assert {r["dtype"] for r in result["seeds"]} == {"fp32"}  # conftest forces fp32
    assert {(tmp_path / f"seed-{s}" / "summary.json").exists() for s in range(3)} == {True}
    befores = [r["before"] for r in result["seeds"]]
    assert result["spread"]["before"] == {
        "min": min(befores),
        "median": sorted(befores)[1],
        "max": max(befores),
    }


def reduced_quickstart(tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int) -> None:
    # Measured (fp32, seeds 0-2): before RL 0.000 on each, after 0.537 / 0.463 / 0.415.
    flags = ("--timeout", "300", "--require-gain", "0.25")
    code, result = seed_runs(capsys, "quickstart.yaml", count, tmp_path, REDUCED, *flags)
    assert code == 0 and result["failed"] == []
    assert {r["dtype"] for r in result["seeds"]} == {"fp32"}
    assert [r["seed"] for r in result["seeds"]] == list(range(count))
    assert all(r["before"] <= 0.1 for r in result["seeds"])  # right sums, wrong format


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_quickstart_gains_from_rl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seed 0: the story (RL teaches the format SFT got wrong) in the default tier; every seed
    of three in the extended one."""
    reduced_quickstart(tmp_path, capsys, 1)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_quickstart_gains_from_rl_on_three_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reduced_quickstart(tmp_path, capsys, 3)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_quickstart_still_gains_from_rl_at_max_staleness_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 18: reward still rises when every batch is generated one version behind (the actor
    # generates batch n+1 before training step n; colocated, in alternation). Measured (fp32,
    # seeds 0-2): after RL 0.341 / 0.439 / 0.488, against 0.537 / 0.463 / 0.415 on-policy; the
    # 0.05-on-average comparison is made at full size (the extended test below: 41 test
    # problems make one answer 0.024 here).
    sets = [*REDUCED, "stages.1.algorithm.max_staleness=1"]
    code, result = seed_runs(capsys, "quickstart.yaml", 3, tmp_path, sets, "--timeout", "300")
    assert code == 0 and [r["seed"] for r in result["seeds"]] == [0, 1, 2]
    assert all(r["gain"] >= 0.25 for r in result["seeds"]), result["seeds"]
    staleness = [
        json.loads(line).get("train/staleness_max")
        for s in range(3)
        for line in (tmp_path / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()
        if '"stage_step"' in line and '"grpo"' in line
    ]
    assert max(staleness) == 1 and staleness[0] == 0  # the first batch is on-policy


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_async_quickstart_ends_within_0_05_of_on_policy_over_three_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The criterion, full size (about 15 minutes on 2 idle cores; conftest makes it fp32).
    # Measured, seeds 0-2, after RL: fp32 on-policy 0.897 / 0.745 / 0.930, max_staleness 1
    # 0.897 / 0.672 / 0.913 (means 0.857 and 0.827); bf16 (dtype auto) 0.892 / 0.964 / 0.933
    # and 0.894 / 0.941 / 0.935 (means 0.930 and 0.923).
    means = {}
    for k in (0, 1):
        sets = [f"stages.1.algorithm.max_staleness={k}"]
        code, result = seed_runs(capsys, "quickstart.yaml", 3, tmp_path / f"{k}", sets)
        assert code == 0
        means[k] = sum(r["after"] for r in result["seeds"]) / 3
    assert abs(means[1] - means[0]) <= 0.05, means


#: the tool-use demo at about half its size: SFT 300 steps, GRPO 12, 100 held-out problems
REDUCED_TOOL_USE = [
    "stages.0.steps=300",
    "stages.0.optim.warmup_steps=30",
    "stages.1.steps=12",
    "trainer.val_every=0",
    "trainer.val_data=builtin:tool_arithmetic?n=100&split=test",
]


def reduced_tool_use(tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int) -> None:
    # RL's bar is where it ends, not how far it came: how well SFT alone does moves a lot with
    # float-level changes (seed 0 after SFT: 0.57, then 0.65 once the engine computed logits only
    # at response positions, 0.33 with them everywhere in bf16), and what RL adds moves with it
    flags = ("--timeout", "400", "--require-after", "0.6")
    code, result = seed_runs(capsys, "tool_use.yaml", count, tmp_path, REDUCED_TOOL_USE, *flags)
    assert code == 0 and result["failed"] == [], result["seeds"]
    assert all(r["gain"] > 0 for r in result["seeds"]), result["seeds"]
    assert all(r["calls_after"] >= 0.9 > r["calls_before"] for r in result["seeds"])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_tool_use_demo_learns_to_call_the_calculator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Measured (fp32, seed 0): accuracy 0.57 -> 0.80, greedy tool-call rate 0.66 -> 1.00; about
    # 85 s on 2 idle cores, up to 380 s beside the suite's other worker on a slow host. Extended:
    # the default tier's SmolLM2 tool example runs the same multi-turn calculator RL end to end,
    # and the reduced quickstart shows a held-out gain from RL.
    reduced_tool_use(tmp_path, capsys, 1)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reduced_tool_use_demo_learns_to_call_the_calculator_on_three_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Measured (fp32, seeds 0-2): accuracy 0.57 / 0.10 / 0.18 -> 0.80 / 0.66 / 0.79, greedy
    # tool-call rate 0.66 / 0.24 / 0.26 -> 1.00 on each; about 85 s a seed on 2 idle cores.
    reduced_tool_use(tmp_path, capsys, 3)
