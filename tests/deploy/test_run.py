"""``hybridflow run`` end to end: the quick quickstart, every algorithm's example, exact resume,
a role killed mid-run, and plots — on real processes with the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from controller.tasks import arithmetic
from deploy.cli import build_parser
from roles.rules import arithmetic_reward
from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMING = ("time/", "perf/", "mem/")  # what differs between runs of the same work


def job(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.fn(args)
    return code


def quick_argv(
    example: str, run_dir: Path, overrides: Sequence[str] = (), *flags: str
) -> list[str]:
    """``run EXAMPLE --quick --set O ... --run-dir DIR FLAGS``."""
    sets = [x for o in overrides for x in ("--set", o)]
    return ["run", str(EXAMPLES / example), "--quick", *sets, "--run-dir", str(run_dir), *flags]


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summary(run_dir: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return found


def logged(run_dir: Path, step: int) -> bool:
    """Whether ``metrics.jsonl`` has a record of ``step`` (or later) yet."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(r.get("step", 0) >= step for r in records(run_dir))


def without_timing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_quick_runs_reports_and_exports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    title = Path("/proc/self/cmdline").read_bytes()
    assert job(quick_argv("quickstart.yaml", run_dir)) == 0
    # run in-process (as a script or notebook would), it leaves the caller's title alone
    assert Path("/proc/self/cmdline").read_bytes() == title
    result = summary(run_dir)
    for key in ("val_acc_init", "val_acc_before", "val_acc_after"):
        assert 0.0 <= result[key] <= 1.0
    rows = records(run_dir)
    stages = [r["stage"] for r in rows]
    assert stages[0] == "init" and "before:grpo" in stages and stages[-1] == "final"
    rl = [r for r in rows if r["stage"] == "grpo" and "stage_step" in r]
    assert [r["stage_step"] for r in rl] == list(range(1, len(rl) + 1)) and rl
    assert all(r["train/response/tokens"] > 0 and r["perf/tokens_per_s"] > 0 for r in rl)
    # each rank's peak memory per phase (here the process's resident set: > the model's 5 MB)
    assert all(0.005 < r["mem/generate_peak_gib"] < 20 for r in rl)
    assert all(0.005 < r["mem/train_peak_gib"] < 20 for r in rl)
    sft = [r for r in rows if r["stage"] == "sft" and "train/loss" in r]
    assert sft[-1]["train/loss"] < 0.6 * sft[0]["train/loss"]  # SFT learns
    assert (run_dir / "config.yaml").exists() and list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "export" / "actor" / "model.safetensors").exists()
    assert job(["report", str(run_dir)]) == 0
    plots = {p.name for p in (run_dir / "plots").iterdir()}
    assert {"reward.png", "length.png", "time.png", "sft.png"} <= plots
    assert result["precision"]["actor"] == {
        "dtype": "fp32",
        "reason": "auto: HYBRIDFLOW_AUTO_DTYPE=fp32",
    }
    check_export_in_plain_transformers(run_dir / "export" / "actor", result["val_acc_after"])


def check_export_in_plain_transformers(export: Path, val_score: float) -> None:
    """The exported model, asked the validation problems the way a Hugging Face user asks them
    (default tokenizer call with padding, greedy ``generate``, then a ``pipeline``), answers
    exactly as the run's own final validation did: the same exact-answer score."""
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    rows = arithmetic(64, "test")  # the quick run's trainer.val_data
    prompts = [row["prompt"] for row in rows]
    inputs = tok(prompts, return_tensors="pt", padding=True)
    assert (inputs["input_ids"][:, 0] == tok.bos_token_id).any()  # BOS without being asked
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    answers = tok.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    score = sum(arithmetic_reward(p, a, r) for p, a, r in zip(prompts, answers, rows, strict=True))
    assert score / len(rows) == pytest.approx(val_score, abs=1e-6)
    generate = pipeline("text-generation", model=model, tokenizer=tok)
    piped = generate(prompts[:8], do_sample=False, max_new_tokens=8, return_full_text=False)
    assert [p[0]["generated_text"] for p in piped] == answers[:8]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_raises_reward_on_an_easy_target(tmp_path: Path) -> None:
    """Reward 1 when the answer starts with '1': a few GRPO steps must raise it."""
    run_dir = tmp_path / "run"
    overrides = [
        "roles.reward.function=tests.fixtures.roles:starts_with_one",
        "stages.0.steps=30",
        "stages.1.steps=12",
        "stages.1.optim={lr: 1.0e-3, warmup_steps: 2}",
        "stages.1.algorithm.prompts_per_step=16",
        "trainer.val_data=null",
    ]
    assert job(quick_argv("quickstart.yaml", run_dir, overrides)) == 0
    rewards = [r["train/reward/mean"] for r in records(run_dir) if r["stage"] == "grpo"]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "example, extra",
    [
        ("remax.yaml", []),
        ("safe_rlhf.yaml", []),
        ("rloo.yaml", []),
        ("reinforce_pp.yaml", []),
        ("reinforce_pp.yaml", ["stages.1.algorithm.name=reinforce_pp_baseline"]),
    ],
)
def test_every_algorithm_example_runs(example: str, extra: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv(example, run_dir, extra)) == 0
    rows = [r for r in records(run_dir) if "train/actor/loss" in r]
    assert len(rows) == 2
    assert all(abs(r["train/kl"]) < 0.5 for r in rows)  # the reference starts at the SFT actor
    if example == "safe_rlhf.yaml":
        assert all("train/lambda" in r and "train/cost_critic/loss" in r for r in rows)
        assert rows[0]["train/lambda"] != 0.5  # the multiplier moved


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_generates_at_another_tp_through_the_hybrid_engine(tmp_path: Path) -> None:
    """Training at tp 2, generating at tp 1 on the same 2 ranks (two micro-DP replicas): the
    weights are resharded for every generate and the run learns as the quick run does."""
    run_dir = tmp_path / "run"
    overrides = ["placement.main.tp=2", "placement.main.gen_tp=1"]
    assert job(quick_argv("quickstart.yaml", run_dir, overrides)) == 0
    rl = [r for r in records(run_dir) if r["stage"] == "grpo" and "train/reward/mean" in r]
    assert len(rl) == 6 and all(r["time/reshard_s"] > 0 for r in rl)
    sft = [r for r in records(run_dir) if r["stage"] == "sft" and "train/loss" in r]
    assert sft[-1]["train/loss"] < 0.6 * sft[0]["train/loss"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_with_a_reward_model_trained_by_hybridflow_rm(tmp_path: Path) -> None:
    from roles.modeling.models import init_model

    base = init_model(tmp_path / "tiny", "tiny", seed=0)
    rm = tmp_path / "rm"
    argv = ["rm", "--model", str(base), "--out", str(rm), "--steps", "4", "--eval-every", "0"]
    assert (
        job(
            [
                *argv,
                "--run-dir",
                str(tmp_path / "rm-run"),
                "--val",
                "builtin:preference?n=16&split=test",
            ]
        )
        == 0
    )
    run_dir = tmp_path / "run"
    assert job(quick_argv("ppo.yaml", run_dir, [f"roles.reward.model={rm}"])) == 0
    rows = [r for r in records(run_dir) if "train/critic/loss" in r]
    assert len(rows) == 2 and all("train/kl_coef" in r for r in rows)
    # a reward model's mean score is no accuracy, and the summary does not call it one
    done = summary(run_dir)
    assert done["val_score_is"] == "rm_score" and "val_acc_after" not in done
    assert isinstance(done["val_rm_score_after"], float)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlap_generates_on_a_rollout_group_one_step_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = [
        "roles.rollout={model: base}",
        "placement.gen={roles: [rollout], nproc: 1}",
        "placement.main.nproc=1",
        "stages.1.steps=4",
    ]
    assert job(quick_argv("quickstart.yaml", run_dir, sets)) == 0
    rl = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    assert [r["train/staleness"] for r in rl] == [0, 0, 0, 0]  # synced before each generation
    overlap = [*sets, "stages.1.algorithm.overlap=true"]
    assert job(quick_argv("quickstart.yaml", tmp_path / "o", overlap)) == 0
    rl = [r for r in records(tmp_path / "o") if r["stage"] == "grpo" and "stage_step" in r]
    assert [r["train/staleness"] for r in rl] == [0, 1, 1, 1]  # the next batch was already out
    # the policy version counts training steps, the quick run's 40 SFT steps too
    assert [r["train/weight_version"] for r in rl] == [41, 42, 43, 44]


RESUME = [
    "stages.0.steps=2",
    "stages.0.optim.warmup_steps=1",
    "stages.1.steps=3",
    "trainer.val_every=2",
    "trainer.val_data=builtin:arithmetic?n=16&split=test",
    "trainer.keep_last=1",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_reproduces_the_straight_run_bitwise(tmp_path: Path) -> None:
    """SFT 2 + GRPO 3 straight vs. stopped after step 3 (mid-GRPO) and resumed."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert job(quick_argv("quickstart.yaml", straight, RESUME)) == 0
    assert job(quick_argv("quickstart.yaml", split, RESUME, "--stop-after", "3")) == 0
    assert not (split / "export").exists()
    assert [p.name for p in (split / "checkpoints").iterdir()] == ["step_000003"]
    assert job(["run", "--resume", "--run-dir", str(split)]) == 0
    a = load_file(straight / "export" / "actor" / "model.safetensors")
    b = load_file(split / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert without_timing(records(straight)) == without_timing(records(split))
    assert summary(straight)["val_acc_after"] == summary(split)["val_acc_after"]


ASYNC = [
    "roles.rollout={model: base}",
    "placement.gen={roles: [rollout], nproc: 1}",
    "placement.main.nproc=1",
    "stages.1.algorithm.max_staleness=1",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_resume_trains_on_the_stored_pending_batch_bitwise(tmp_path: Path) -> None:
    """max_staleness 1 on a rollout group: stopped after step 3 (the first GRPO step, batch 2 of
    the stage already generated on the older weights), resumed, equal to the straight run."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    sets = [*RESUME, *ASYNC]
    assert job(quick_argv("quickstart.yaml", straight, sets)) == 0
    assert job(quick_argv("quickstart.yaml", split, sets, "--stop-after", "3")) == 0
    pending = split / "checkpoints" / "step_000003" / "pending"
    assert sorted(p.name for p in pending.iterdir()) == ["1.json", "1.safetensors"]
    assert job(["run", "--resume", "--run-dir", str(split)]) == 0
    a = load_file(straight / "export" / "actor" / "model.safetensors")
    b = load_file(split / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert without_timing(records(straight)) == without_timing(records(split))
    rl = [r for r in records(split) if r["stage"] == "grpo" and "stage_step" in r]
    assert [r["train/staleness_max"] for r in rl] == [0, 1, 1]


def rank_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [g for c in children for g in rank_pids(c)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_role_ends_the_run_with_a_clear_error_and_resume_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = [
        "stages.0.steps=4",
        "stages.0.optim.warmup_steps=1",
        "stages.1.steps=200",
        "trainer.save_every=2",
        "trainer.val_data=null",
        "logging.tensorboard=false",
    ]
    cmd = [sys.executable, "-m", "deploy.cli", "run", str(EXAMPLES / "quickstart.yaml"), "--quick"]
    cmd += [x for o in sets for x in ("--set", o)] + ["--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: logged(run_dir, 7), 120, "step 7 in metrics.jsonl", proc=proc)
        victims = rank_pids(proc.pid)
        assert len(victims) >= 2  # the group's two ranks (and any helpers)
        killed_at = time.monotonic()
        os.kill(victims[-1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    assert took < 20, took
    assert "failed" in output and "rank" in output and "actor" in output, output
    assert "--resume" in output
    assert not rank_pids(proc.pid) and all(not _alive(p) for p in victims)
    done = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())
    assert done >= 6
    resume = ["run", "--resume", "--run-dir", str(run_dir), "--set", "stages.1.steps=10"]
    assert job(resume) == 0
    steps = [r["step"] for r in records(run_dir) if "stage_step" in r]
    assert steps == list(range(1, 15))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_run_killed_mid_step_resumes_without_losing_or_repeating_a_sample(
    tmp_path: Path,
) -> None:
    """max_staleness 1 on a rollout group, checkpoint every 2 steps: kill -9 the controller and
    its ranks in the middle of GRPO, resume; every step once, weights equal to the straight run."""
    sets = [
        *ASYNC,
        "stages.0.steps=2",
        "stages.0.optim.warmup_steps=1",
        "stages.1.steps=6",
        "trainer.save_every=2",
        "trainer.val_data=null",
        "logging.tensorboard=false",
    ]
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert job(quick_argv("quickstart.yaml", straight, sets)) == 0
    cmd = [sys.executable, "-m", "deploy.cli", *quick_argv("quickstart.yaml", run_dir, sets)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # step 5 logged: checkpoint 4 holds a pending batch
        wait_for(lambda: logged(run_dir, 5), 180, "step 5 in metrics.jsonl", proc=proc)
        victims = rank_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        for pid in victims:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (run_dir / "checkpoints" / "step_000004" / "pending").is_dir()
    assert not (run_dir / "export").exists()
    assert job(["run", "--resume", "--run-dir", str(run_dir)]) == 0
    steps = [r["step"] for r in records(run_dir) if "stage_step" in r]
    assert steps == list(range(1, 9))
    assert without_timing(records(straight)) == without_timing(records(run_dir))
    a = load_file(straight / "export" / "actor" / "model.safetensors")
    b = load_file(run_dir / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
