"""``hybridflow run examples/smollm2_tools.yaml --quick`` with every SFT row a tool demonstration:
a real chat model (SmolLM2-135M-Instruct with LoRA) learns the hermes call from a few SFT steps,
then GRPO runs multi-turn rollouts in which its JSON calls reach the calculator in the env group
and the results come back as ``<tool_response>`` turns; the trajectory viewer shows both. Its
LoRA exports (the merged folder, the PEFT adapters over the base) load in plain Hugging Face
code and compute the same model."""

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
    assert all(r["train/sync/bytes"] == 0 for r in rl)  # colocated: no sync at all
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
    exports_compute_alike(run_dir)


def exports_compute_alike(run_dir: Path) -> None:
    """The merged export and the PEFT folder over the base give the same next-token logits."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roles.modeling.lora import adapter_folder

    merged_dir = run_dir / "export" / "actor"
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(run_dir / "models" / "base", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, adapter_folder(merged_dir)).eval()
    ids = tokenizer("<|im_start|>user\nWhat is 12*34?<|im_end|>\n", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = merged(ids).logits[0, -1], adapted(ids).logits[0, -1]
        untrained = adapted.get_base_model()
        with adapted.disable_adapter():
            c = untrained(ids).logits[0, -1]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a - c).abs().max() > 1e-3  # the adapters trained: not the base model
