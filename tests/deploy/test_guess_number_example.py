"""``hybridflow run examples/guess_number.yaml --quick``: SFT on demonstrated games, then GRPO over
games of GuessNumber played in an env group (a stateful environment: every turn goes to its step);
the run completes, its games last several turns, and the trajectory viewer marks the game's
observations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploy.commands.trajectories import CLOSE, OPEN
from tests.deploy.test_run import job, quick_argv, records, summary


@pytest.mark.extended  # its checks run in the default tier on a vLLM rollout group (test_vllm.py)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_game_runs_multi_turn_and_shows_the_games_observations(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert job(quick_argv("guess_number.yaml", run_dir)) == 0
    done = summary(run_dir)
    for key in ("val_acc_init", "val_acc_before", "val_acc_after"):
        assert 0.0 <= done[key] <= 1.0  # the share of the 16 secrets won, greedily

    rows = records(run_dir)
    rl = [r for r in rows if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 2
    for r in rl:
        # a game is over on the right guess or after 5: a quick run's player is rarely right at
        # once, so the mean game is well over one turn, and never over max_turns
        assert 1 < r["agent/turns"] <= 5
        assert r["agent/tool_calls"] == 0  # an environment is not a tool: no calls are counted
        assert 0.0 <= r["train/reward/mean"] <= 1.0  # env_reward: 1 for a game won, else 0

    shows_the_games(run_dir)


def shows_the_games(run_dir: Path) -> None:
    """``hybridflow trajectories`` on a guess-number run: the game's first observation follows
    the prompt, and its replies follow the guesses."""
    shown = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "trajectories", str(run_dir), "--count", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"Game: {OPEN}Guess my number from 1 to 16.{CLOSE}" in shown.stdout
    assert shown.stdout.count(OPEN) >= 4 and shown.stdout.count(CLOSE) >= 4
    assert "rollout trajectories logged" in shown.stdout
