"""hybridflow as a library: the public names, and ``examples/api/grpo.py`` run as a user runs it
(its own process, the quickstart's groups started from the file, SFT then GRPO in the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hybridflow as hf

ROOT = Path(__file__).resolve().parents[2]


def test_the_public_names_are_there_and_nothing_else() -> None:
    public = {n for n in dir(hf) if not n.startswith("_")}
    assert set(hf.__all__) <= public
    # ``steps``: the submodule ``hybridflow.steps``, an attribute once it is imported
    assert public - set(hf.__all__) <= {"annotations", "steps"}, public - set(hf.__all__)
    assert callable(hf.mesh) and callable(hf.run)


def test_a_file_without_stages_is_a_mesh_not_a_run(tmp_path: Path) -> None:
    from deploy.experiment import ExperimentError, check, load

    raw = (ROOT / "examples" / "quickstart.yaml").read_text().split("\nstages:")[0]
    path = tmp_path / "groups.yaml"
    path.write_text(raw + "\n")
    exp = load(path)
    check(exp, run=False)  # what hf.mesh checks
    with pytest.raises(ExperimentError, match="stages: hybridflow run runs the file's stages"):
        check(exp)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_grpo_example_trains_in_the_users_own_script(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "examples" / "api" / "grpo.py"), "--run-dir", str(run_dir)]
    argv += ["--sft-steps", "40", "--steps", "3", "--prompts", "8", "--n", "4", "--val", "32"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("held-out accuracy at the start: ")
    assert [line.split(":")[0] for line in lines[-4:]] == [
        "GRPO step 1",
        "GRPO step 2",
        "GRPO step 3",
        "after GRPO",
    ]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in records if "train/loss" in r]
    grpo = [r for r in records if "train/reward/mean" in r and r["step"] > 40]
    assert len(sft) == 40 and sft[-1]["train/loss"] < sft[0]["train/loss"]
    assert [r["step"] for r in grpo] == [41, 42, 43]  # the policy version counts every step
    assert all("loss" in r and "grad_norm" in r for r in grpo)


def test_a_bad_program_path_is_refused_by_field_before_any_process_starts() -> None:
    from deploy.experiment import ExperimentError, check, load

    quick = ROOT / "examples" / "quickstart.yaml"
    for path, why in (
        ("tests.fixtures.programs:nothing", "has no async function 'nothing'"),
        ("tests.fixtures.programs:not_async", "has no async function 'not_async'"),
        ("tests.fixtures.nowhere:step", "cannot import 'tests.fixtures.nowhere'"),
    ):
        exp = load(quick, [f"stages.1.algorithm.program={path}"])
        with pytest.raises(ExperimentError, match=f"stages.1.algorithm.program: .*{why}"):
            check(exp)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_program_of_your_own_runs_as_a_stage(tmp_path: Path) -> None:
    """The quickstart's GRPO stage with the program of ``tests/fixtures/programs.py`` instead:
    stages, checkpoints, records and the live view come with it."""
    from tests.deploy.test_run import job, quick_argv, records

    program = "stages.1.algorithm.program=tests.fixtures.programs:mean_baseline"
    assert job(quick_argv("quickstart.yaml", tmp_path / "run", [program])) == 0
    rl = [r for r in records(tmp_path / "run") if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 6
    assert all(r["train/baseline"] == pytest.approx(r["train/reward/mean"]) for r in rl)
    assert all("train/actor/loss" in r for r in rl)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rejection_sampling_example_keeps_and_fine_tunes_on_the_best_answers(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    script = ROOT / "examples" / "api" / "rejection_sampling.py"
    argv = [sys.executable, str(script), "--run-dir", str(run_dir), "--sft-steps", "40"]
    argv += ["--rounds", "2", "--prompts", "32", "--n", "4", "--val", "32"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and done.stdout.splitlines()[-1].startswith("after rejection")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [0 <= r["raft/kept_share"] <= 1 for r in records] == [True, True]
