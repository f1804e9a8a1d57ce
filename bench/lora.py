"""LoRA against full fine-tuning: the same GRPO work on SmolLM2-135M, side by side.

``python -m bench.lora`` runs ``hybridflow run`` three times on the same data, seeds and sizes
(``--steps`` GRPO steps of 8 prompts x 8 samples, 12 new tokens, KL in the loss at 0.001): full
fine-tuning, LoRA rank 16 and LoRA rank 64 (alpha = 2 x rank, every attention and MLP
projection). Each run places the actor (with the rule reward) on one rank and a rollout group
on another, so every step has a real weight sync. Full fine-tuning loads a frozen reference
beside the actor for the KL term; a LoRA run has none (its reference is the actor with its
adapters off).

Per run, from ``metrics.jsonl`` (medians over the steps after the first):

* peak resident memory of the actor's rank while it trains (``mem/train_peak_gib``: the
  VmHWM of the process holding actor and reference) and of the rollout rank while it
  generates (``mem/generate_peak_gib``);
* bytes one weight sync moved into the rollout rank (``train/sync/bytes``);
* the step split: generate, forward (the log-prob passes: actor and reference), update
  (forward, backward and optimizer step), sync.

Then the generation side of LoRA, on the native engine: 64 prompts x 12 tokens greedily with
rank-16 adapters merged per call (what it does) against PEFT's layers applied at every step,
and the plain model with no adapters.

The last line is one JSON object: ``peak_mem_ratio`` (LoRA-16 train peak / full), ``sync_bytes_
ratio``, ``step_time_ratio`` (median step), the raw figures per run and the generation timings.
Targets: peak_mem_ratio <= 0.6, sync_bytes_ratio <= 0.05, step_time_ratio <= 0.8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "user\nWhat is {prompt}? Reply with the number only.<|im_end|>\n<|im_start|>assistant\n"
SPLIT = {"gen": "generate_s", "prepare": "forward_s", "update": "update_s", "sync": "sync_s"}


def experiment(model: Path, steps: int, rank: int | None) -> dict[str, Any]:
    """The GRPO experiment of one run: full fine-tuning (``rank`` None) or LoRA of ``rank``."""
    actor: dict[str, Any] = {"model": "smollm2", "micro_batch_size": 16}
    roles: dict[str, Any] = {
        "actor": actor,
        "reward": {"function": "roles.rules:last_number_reward"},
    }
    main = ["actor", "reward"]
    if rank is None:
        roles["reference"] = {"model": "smollm2", "micro_batch_size": 16}
        main.append("reference")
        lr = 5.0e-6
    else:
        actor["lora"] = {"rank": rank, "alpha": 2 * rank}
        lr = 5.0e-5
    roles["rollout"] = {"model": "smollm2"}
    return {
        "name": "bench-lora" if rank else "bench-full",
        "models": {"smollm2": {"path": str(model)}},
        "roles": roles,
        "placement": {"main": {"roles": main, "nproc": 1}, "gen": {"roles": ["rollout"]}},
        "stages": [
            {
                "name": "grpo",
                "kind": "rl",
                "steps": steps,
                "data": "builtin:arithmetic?n=512&split=train&max_operand=15",
                "optim": {"lr": lr},
                "algorithm": {
                    "name": "grpo",
                    "prompts_per_step": 8,
                    "n": 8,
                    "max_new_tokens": 12,
                    "kl": {"coef": 0.001, "mode": "loss"},
                    "loss": {"dual_clip": None},
                },
            }
        ],
        "trainer": {"seed": 0, "prompt_template": TEMPLATE, "export": False},
    }


def run_one(work: Path, model: Path, steps: int, rank: int | None) -> dict[str, Any]:
    name = "full" if rank is None else f"lora{rank}"
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(experiment(model, steps, rank), sort_keys=False))
    run_dir = work / name
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", str(config), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60 * 30,
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps_rows = [r for r in rows if r.get("stage") == "grpo" and "stage_step" in r][1:]

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in steps_rows)

    found: dict[str, Any] = {
        "wall_s": round(time.perf_counter() - start, 1),
        "train_peak_gib": round(median("mem/train_peak_gib"), 3),
        "generate_peak_gib": round(median("mem/generate_peak_gib"), 3),
        "sync_bytes": int(median("train/sync/bytes")),
        "step_s": round(median("time/step_s"), 3),
    }
    for stage, key in SPLIT.items():
        found[key] = round(median(f"time/{stage}_s"), 3)
    return found


def generation_timings(model: Path, repeats: int = 3) -> dict[str, float]:
    """Seconds to generate 64 prompts x 12 tokens greedily on the native engine (one thread):
    the plain model, rank-16 adapters merged per call, and PEFT's layers at every step."""
    import torch

    from roles.engines.generation.native import NativeEngine
    from roles.modeling.lora import LoraSettings, attach
    from roles.modeling.models import load_causal_lm, load_tokenizer
    from transport.sampling import SamplingConfig

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model)
    module = load_causal_lm(model).eval()
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(TEMPLATE.format(prompt=f"{a}+{b}="))]
        for a in range(8)
        for b in range(8)
    ]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)

    def timed(engine: NativeEngine) -> float:
        best = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate(prompts, sampling)
            best.append(time.perf_counter() - start)
        return round(statistics.median(best), 3)

    out = {"plain_s": timed(NativeEngine(module, tokenizer.eos_token_id))}
    torch.manual_seed(0)
    attach(module, LoraSettings(rank=16, alpha=32))
    with torch.no_grad():  # trained-looking adapters: B away from zero
        for name, param in module.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.01)
    out["merged_s"] = timed(NativeEngine(module, tokenizer.eos_token_id))
    out["runtime_s"] = timed(NativeEngine(module, tokenizer.eos_token_id, lora_at_runtime=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (first skipped)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (kept)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    from roles.modeling.models import import_gguf

    model = work / "smollm2"
    if not (model / "config.json").exists():
        import_gguf(model)
    runs = {}
    for rank in (None, 16, 64):
        name = "full" if rank is None else f"lora{rank}"
        runs[name] = run_one(work, model, args.steps, rank)
        print(name, json.dumps(runs[name]), flush=True)
    gen = generation_timings(model)
    print("generation", json.dumps(gen), flush=True)
    full, lora = runs["full"], runs["lora16"]
    result = {
        "peak_mem_ratio": round(lora["train_peak_gib"] / full["train_peak_gib"], 3),
        "sync_bytes_ratio": round(lora["sync_bytes"] / full["sync_bytes"], 4),
        "step_time_ratio": round(lora["step_s"] / full["step_s"], 3),
        "runs": runs,
        "generation": gen,
        "work": str(work),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
