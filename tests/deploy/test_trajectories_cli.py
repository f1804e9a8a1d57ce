"""``hybridflow trajectories``: logged trajectories printed with observations marked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deploy.commands.trajectories import CLOSE, OPEN, read_trajectories, render

ROW = {
    "step": 3,
    "stage": "grpo",
    "kind": "rollout",
    "prompt": "12*34=",
    "response": "408",
    "reward": 1.0,
    "turns": 2,
    "tool_calls": 1,
    "finish": "stop",
    "segments": [
        ["sampled", "[calculator 12*34]"],
        ["observation", " = 408\n"],
        ["sampled", "408"],
    ],
}


def write(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_render_marks_observations_only() -> None:
    assert render(ROW, colour=False) == f"12*34=[calculator 12*34]{OPEN} = 408\n{CLOSE}408"


def test_the_last_step_is_the_default_and_other_kinds_are_left_out(tmp_path: Path) -> None:
    plain = {k: v for k, v in ROW.items() if k != "segments"}  # a single-turn run's sample
    write(tmp_path, [ROW, {**ROW, "step": 5}, {**ROW, "step": 5, "kind": "validation"}, plain])
    step, rows = read_trajectories(tmp_path, "rollout", None)
    assert step == 5 and len(rows) == 1
    assert read_trajectories(tmp_path, "validation", None)[0] == 5
    assert read_trajectories(tmp_path, "rollout", 3)[1][0]["step"] == 3


def test_the_command_prints_them_and_names_what_is_missing(tmp_path: Path) -> None:
    write(tmp_path / "run", [ROW])
    cmd = [sys.executable, "-m", "deploy.cli", "trajectories"]
    ok = subprocess.run([*cmd, str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "reward 1.0, turns 2, tool_calls 1, finish stop" in ok.stdout
    assert f"{OPEN} = 408" in ok.stdout
    bad = subprocess.run(
        [*cmd, str(tmp_path / "run"), "--step", "9"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "logged at steps [3]" in bad.stderr
    none = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no samples logged" in none.stderr
