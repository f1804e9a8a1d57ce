"""``hybridflow run examples/agents/tool_use.yaml``: the calculator agent, a plain ``openai`` SDK
tool-calling loop, trained through the env group's OpenAI-compatible endpoint; and the same
calculator as a verifiers environment (``examples/agents/verifiers_tool_use.yaml``).

Its messages are rendered plainly (the tiny model trained on raw text), so each call's context is
the token stream the env role's own calculator gives (``examples/tool_use.yaml``): on the same
seeds, in lock step, fp32, the two runs sample the same tokens, score them alike and train the
same weights. (One RL step: after the quick run's 20 SFT steps the model writes no well-formed call
yet, and where one is malformed the two differ by design: the env role answers it with an error
observation and the model samples again, while an OpenAI agent gets the text as content and its
loop ends; so later steps sample differently. ``tests/roles/test_agent_host.py`` covers calls.) What is trained is what was sampled, with nothing re-tokenized: the
trainer's log-probs of the recorded tokens equal the sampler's. Agents that fail (raise, hang,
return no reward, never call) are counted and the run goes on."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from safetensors.torch import load_file

from tests.deploy.test_run import TIMING, job, quick_argv, records, summary

SAME = [
    "roles.actor.dtype=fp32",
    "trainer.agent.serving=lockstep",
    "stages.1.algorithm.prompts_per_step=8",
    "stages.1.steps=1",
]
COUNT = itertools.count()


async def unruly(client: openai.AsyncOpenAI, row: dict[str, Any]) -> Any:
    """Every fifth agent misbehaves in turn (the env group runs them all in one process, so a
    counter there names them); the others run examples/agents/calculator_agent.py's loop."""
    import calculator_agent  # the example's folder is the experiment's import root

    k = next(COUNT)
    if k % 5 == 1:
        raise RuntimeError("an agent's own bug")
    if k % 5 == 2:
        await asyncio.sleep(3600)
    if k % 5 == 3:
        return "not a reward"
    if k % 5 == 4:
        return 1.0  # never called the model
    return await calculator_agent.run(client, row)


def rl_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A run's RL records without timings, the agent's serving figures, and the share of rows
    that ended at a length limit: a malformed call ("[[[]") ends an OpenAI agent's loop (no
    tool_calls: its answer is that text), while the env role answers it with an error whose
    tokens fill the trajectory's max_total_tokens, so its row ends "length" on the same sampled
    tokens (the observation is not trained)."""
    rows = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    skip = (*TIMING, "agent/", "train/response/clipped")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_agent_trains_as_the_env_roles_own_tool_and_faults_are_counted(tmp_path: Path) -> None:
    env_run, agent_run = tmp_path / "env", tmp_path / "agent"
    assert job(quick_argv("tool_use.yaml", env_run, SAME)) == 0
    assert job(quick_argv("agents/tool_use.yaml", agent_run, SAME)) == 0
    want, got = rl_rows(env_run), rl_rows(agent_run)
    assert len(got) == len(want) == 1
    # the same tokens sampled (lengths, turns, tool calls), scored the same (reward), trained
    # the same (loss, KL, the trainer's log-probs against the sampler's)
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    assert max(r["train/rollout/logprob_gap_max"] for r in got) < 1e-4
    a = load_file(agent_run / "export" / "actor" / "model.safetensors")
    b = load_file(env_run / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert summary(agent_run)["val_acc_after"] == summary(env_run)["val_acc_after"]
    # the trajectories view shows the agents' turns as it shows the env role's
    shown = [
        subprocess.run(
            [sys.executable, "-m", "deploy.cli", "trajectories", str(d), "--step", "21"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        for d in (agent_run, env_run)
    ]  # fmt: skip
    assert "rollout trajectories logged" in shown[0]
    assert shown[0].count("--- reward") == shown[1].count("--- reward") > 0

    # the calculator as a verifiers vf.ToolEnv with a vf.Rubric (examples/agents/
    # verifiers_env.py): verifiers' own rollout through the endpoint samples, scores and trains
    # what the plain agent does
    vf_run = tmp_path / "verifiers"
    assert job(quick_argv("agents/verifiers_tool_use.yaml", vf_run, SAME)) == 0
    got = rl_rows(vf_run)
    assert len(got) == 1 and got[0] == pytest.approx(rl_rows(agent_run)[0], abs=1e-6)
    c = load_file(vf_run / "export" / "actor" / "model.safetensors")
    assert c.keys() == a.keys() and all(c[k].equal(a[k]) for k in a)
    (vf_row,) = [r for r in records(vf_run) if r["stage"] == "grpo" and "stage_step" in r]
    assert vf_row["agent/faults"] == 0 and vf_row["agent/template_drift"] == 0
    assert vf_row["agent/user/vf/exact_answer"] == pytest.approx(vf_row["train/reward/mean"])
    assert 0 < vf_row["agent/user/vf/num_turns"] <= 3  # an empty answer is no turn to verifiers

    # the same run with agents that fail: each counted by kind, the run completes
    unruly_run = tmp_path / "unruly"
    sets = [
        *SAME,
        "roles.env.agent=tests.deploy.test_agents_run:unruly",
        "roles.env.agent_timeout_s=10",
        # not in lock step, where every call waits for every live agent: the hanging ones too
        "trainer.agent.serving=continuous",
        "trainer.val_data=null",
    ]
    assert job(quick_argv("agents/tool_use.yaml", unruly_run, sets)) == 0
    # a failed agent's reward is 0 whatever it returned (the silent ones return 1.0), so only
    # the calculator agents score
    (row,) = [r for r in records(unruly_run) if r["stage"] == "grpo" and "stage_step" in r]
    per = 64 / 5  # 8 prompts x 8 samples, every fifth agent of each kind
    for kind in ("raised", "timeout", "bad_return", "no_call"):
        assert abs(row[f"agent/faults/{kind}"] - per) <= 1, (kind, row)
    assert row["agent/faults"] == sum(
        row[f"agent/faults/{k}"] for k in ("raised", "timeout", "bad_return", "no_call")
    )
    assert row["train/reward/mean"] <= 13 / 64
