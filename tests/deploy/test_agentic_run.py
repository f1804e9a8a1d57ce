"""``hybridflow run examples/tool_use.yaml`` end to end: SFT on conversations, GRPO over multi-turn
rollouts with the calculator in an env group; exact resume with trajectories generated ahead; the
trajectory viewer on the run folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.deploy.test_run import job, quick_argv, records, summary

#: what differs between two runs of the same work: timings, and the agent's timings and batching
TIMED = ("time/", "perf/", "mem/", "agent/seconds", "agent/traj_per_s", "agent/generate_calls",
         "agent/generator_idle_share", "agent/tool_latency")  # fmt: skip

SHORT = [
    "stages.0.steps=10",
    "stages.1.steps=3",
    "trainer.val_every=0",  # validation at the stages' ends only
    "trainer.val_data=builtin:tool_arithmetic?n=16&split=test",
    "trainer.keep_last=1",
    "trainer.agent.serving=lockstep",  # calls the same whatever the timing: bitwise runs
    "trainer.log_samples.every=1",
]
AHEAD = [
    "roles.rollout={model: base}",
    "placement.gen={roles: [rollout], nproc: 1}",
    "placement.main.nproc=1",
    "stages.1.algorithm.max_staleness=1",
]


def untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multi_turn_resume_with_trajectories_generated_ahead_equals_the_straight_run(
    tmp_path: Path,
) -> None:
    """max_staleness 1: stopped after the first GRPO step (the next batch of trajectories already
    generated on the older weights and stored with the checkpoint), resumed: the same weights and
    records as the straight run. Also: the run's multi-turn metrics and its trajectories."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    sets = [*SHORT, *AHEAD]
    assert job(quick_argv("tool_use.yaml", straight, sets)) == 0
    assert job(quick_argv("tool_use.yaml", split, sets, "--stop-after", "11")) == 0
    pending = split / "checkpoints" / "step_000011" / "pending"
    assert sorted(p.name for p in pending.iterdir()) == ["1.json", "1.safetensors"]
    assert job(["run", "--resume", "--run-dir", str(split)]) == 0
    a = load_file(straight / "export" / "actor" / "model.safetensors")
    b = load_file(split / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert untimed(records(straight)) == untimed(records(split))

    rl = [r for r in records(straight) if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 3 and all(r["agent/turns"] >= 1 for r in rl)
    assert all(0 <= r["agent/tool_call_rate"] <= 1 for r in rl)
    assert [r["train/staleness_max"] for r in rl] == [0, 1, 1]
    done = summary(straight)
    assert 0 <= done["val_tool_calls_after"] <= 1 and done["val_tool_calls_before"] is not None

    shown = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "trajectories", str(straight), "--count", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "rollout trajectories logged" in shown.stdout and "turns" in shown.stdout
