"""``hybridflow run examples/smollm2_tools.yaml --quick`` with every SFT row a tool demonstration:
a real chat model (SmolLM2-135M-Instruct with LoRA) learns the hermes call from a few SFT steps,
then GRPO runs multi-turn rollouts in which its JSON calls reach the calculator in the env group
and the results come back as ``<tool_response>`` turns; the trajectory viewer shows both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploy.commands.trajectories import CLOSE, OPEN
from tests.deploy.test_run import job, quick_argv, records, summary

CALLING = "builtin:tool_arithmetic?n=64&split=sft&tool_share=1.0&calls=hermes"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_calls_the_calculator_in_hermes_format_through_rl(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [f"stages.0.data={CALLING}", "stages.0.steps=8"]
    assert job(quick_argv("smollm2_tools.yaml", run_dir, overrides)) == 0
    done = summary(run_dir)
    assert done["val_acc_init"] == 0.0  # the base model multiplies none of them right
    # after 8 steps of demonstrations the greedy model calls, and copying the result scores
    assert done["val_tool_calls_before"] >= 0.5
    assert done["val_acc_before"] >= 0.5

    rl = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 2
    for r in rl:
        # sampled at temperature 1 some calls are malformed JSON (counted, answered with an
        # error observation); most reach the calculator, and copying its result scores
        assert r["agent/tool_calls"] > 0.25 and r["train/reward/mean"] > 0

    shown = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "trajectories", str(run_dir), "--count", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "' in text
    assert f"{OPEN}<|im_end|>\n<|im_start|>user\n<tool_response>\n" in text
    assert "</tool_response><|im_end|>\n<|im_start|>assistant\n" + CLOSE in text
