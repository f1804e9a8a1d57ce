"""A verifiers environment learns: ``examples/agents/verifiers_arithmetic.yaml`` (the
quickstart's task through ``verifiers_env.py``'s ``vf.SingleTurnEnv`` and ``vf.Rubric``) at the
reduced size of ``test_seeds.py``'s quickstart, seed 0, fp32. The rubric's reward, which is the
run's reward, rises over the GRPO steps and the held-out accuracy gains, with no trajectory
faulted. (Extended tier: the default one shows the verifiers tool environment training bitwise
as the plain OpenAI agent, ``test_agents_run.py``.) Measured: reward 0.09 over the first five
steps, 0.18 over the last five; held-out 0.000 -> 0.415."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.test_run import job, records, summary
from tests.deploy.test_seeds import REDUCED

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "verifiers_arithmetic.yaml"


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_verifiers_single_turn_env_s_rubric_reward_rises(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = [*REDUCED, "models.base.seed=0", "trainer.seed=0", "roles.actor.dtype=fp32"]
    argv = ["run", str(EXAMPLE), "--run-dir", str(run_dir)]
    assert job([*argv, *(x for s in sets for x in ("--set", s))]) == 0
    rows = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    rewards = [r["train/reward/mean"] for r in rows]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.05, rewards
    assert all(r["agent/faults"] == 0 for r in rows)
    # the run's reward is the rubric's, as the environment reported it
    for r in rows:
        assert r["agent/user/vf/exact_answer"] == pytest.approx(r["train/reward/mean"])
        assert r["agent/user/vf/num_turns"] <= 1
    found = summary(run_dir)
    assert found["val_acc_after"] >= found["val_acc_before"] + 0.25, found
