"""Where an e2e_vs_trl step goes, stage by stage, and what the same design gives on 4 ranks.

``bench.e2e_vs_trl`` calls ``stage_report`` for each hybridflow runner and ``project`` once;
``python -m bench.e2e_stages WORK`` redoes both from a kept ``--work`` folder (its peaks are then
measured now, not during the runs: say so when quoting them).

**Stages.** Per runner, the median over steps after the first of each timeline span
(``time/timeline/<stage>@<role>``): ``generate`` (on the rollout rank when there is one, else
every rank of the actor group), ``prepare`` (rewards, advantages), ``update`` (the actor's
forward, backward and optimizer step), ``sync`` (weights to a rollout rank). For ``update`` and
``generate`` the report gives the FLOPs of the step and the rate each rank achieved against the
core's matrix-multiply peak, measured in the same run in the runner's dtype (one thread, a
1024^3 product, best of 5). Training FLOPs per step = 3 x (forward FLOPs of every prompt and
response position), the forward counted as in ``bench.generate.Shape.forward_flops`` with the
output head on every position; prompt lengths are the tokenizer's, response tokens the run's.

**Projection to 4 ranks** (arithmetic from measured stage costs, not a run: this machine has
2 cores). Measured per step: ``U`` = update core-seconds (update time x training ranks), ``G`` =
generation core-seconds (generate time x generating ranks), ``S`` = the sync's wall time. On R
ranks, assuming each stage's core-seconds stay what they were (linear scaling: optimistic for
both sides, as a smaller share of the batch runs at lower efficiency):

- on-policy, all R ranks generate then train: step = (G + U) / R (+ S = 0);
- async (max_staleness >= 1), r ranks generate while R - r train: step = max(U / (R - r),
  G / r) + S, best r;
- TRL on R cores: its measured 2-thread rate x (its measured 2-thread / 1-thread speed-up) per
  doubling of cores (what its scaling did here), and the linear bound R x its 1-thread rate.

The ratios printed are ours / TRL's at the same R.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.generate import Shape
from bench.host import matmul_peak

STAGES = ("generate", "prepare", "update", "sync")


def _busy_core(dtype: str, n: int, seconds: float, start: Any, out: Any, slot: int) -> None:
    """One process of ``matmul_peak_cores``: warm up, wait for the others, multiply for
    ``seconds``, report this process's GFLOP/s in ``out[slot]``."""
    torch.set_num_threads(1)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
    a @ b
    start.wait()
    products, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        a @ b
        products += 1
    out[slot] = 2 * n**3 * products / elapsed / 1e9


def matmul_peak_cores(dtype: str, cores: int = 2, n: int = 1024, seconds: float = 3.0) -> float:
    """GFLOP/s of ``cores`` one-thread processes multiplying ``n``^3 products at the same time,
    summed: the host's matmul limit with every core busy (shared caches and memory bandwidth
    make it less than ``cores`` x ``matmul_peak``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(cores), ctx.Array("d", cores)
    procs = [
        ctx.Process(target=_busy_core, args=(dtype, n, seconds, start, out, i))
        for i in range(cores)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.exitcode != 0:
            raise RuntimeError(f"matmul_peak_cores: a process ended with {proc.exitcode}")
    return float(sum(out[:]))


def prompt_tokens(model_dir: Path, prompts: list[str]) -> list[int]:
    from roles.modeling.models import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    return [len(tokenizer(p)["input_ids"]) for p in prompts]


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if "stage_step" in r][1:]  # the first step pays start-up costs


def _span(record: dict[str, Any], stage: str) -> tuple[str, float] | None:
    for key, value in record.items():
        if key.startswith(f"time/timeline/{stage}@") and key.endswith("_start_s"):
            where = key[len(f"time/timeline/{stage}@") : -len("_start_s")]
            end = record[f"time/timeline/{stage}@{where}_end_s"]
            return where, float(end) - float(value)
    return None


def stage_report(
    run_dir: Path,
    shape: Shape,
    prompt_lengths: list[int],
    samples: int,
    ranks: dict[str, int],
    peak_gflops: float,
) -> dict[str, Any]:
    """Median seconds per stage, and the update's / generation's FLOP rate per rank.

    ``prompt_lengths``: one per prompt of a step, each sampled ``samples`` times; ``ranks``:
    role ("actor", "rollout") -> cores doing that role's compute (ranks x intra-op threads; the
    per-"rank" rates are then per core)."""
    steps = _steps(run_dir)
    found: dict[str, Any] = {"step_s": statistics.median(r["time/step_s"] for r in steps)}
    response = statistics.median(r["train/response/tokens"] for r in steps)
    positions = samples * sum(prompt_lengths) + response
    per_position = shape.forward_flops(1, 0, 1)  # blocks + output head, no attention
    mean_len = positions / (samples * len(prompt_lengths))
    attention = 2 * 2 * shape.layers * shape.attn * (mean_len + 1) / 2  # per position, causal
    train_flops = 3 * positions * (per_position + attention)
    gen_flops = (positions - samples * len(prompt_lengths)) * (per_position + attention)
    gen_flops += samples * sum(prompt_lengths) * (per_position + attention)  # prefill
    for stage in STAGES:
        spans = [s for r in steps if (s := _span(r, stage)) is not None]
        if not spans:
            continue
        where = spans[0][0]
        seconds = statistics.median(s for _, s in spans)
        row: dict[str, Any] = {"where": where, "s": round(seconds, 4)}
        flops = {"update": train_flops, "generate": gen_flops}.get(stage)
        if flops is not None and seconds > 0:
            n = ranks.get(where, 1)
            rate = flops / seconds / n / 1e9
            row |= {
                "ranks": n,
                "core_s": round(seconds * n, 4),
                "gflop": round(flops / 1e9, 2),
                "gflops_per_rank": round(rate, 1),
                "of_peak": round(rate / peak_gflops, 3),
            }
        found[stage] = row
    found["peak_gflops"] = round(peak_gflops, 1)
    found["positions_per_step"] = int(positions)
    return found


def project(
    on_policy: dict[str, Any] | None,
    asynchronous: dict[str, Any] | None,
    trl_by_threads: dict[int, float],
    tokens_per_step: float,
    ranks: int = 4,
) -> dict[str, Any]:
    """Ours on ``ranks`` ranks from the measured core-seconds of an on-policy and an async
    runner's stage reports (module docstring), against TRL's projected rate on as many cores."""
    one, two = trl_by_threads[1], trl_by_threads[2]
    doublings = max(0, (ranks.bit_length() - 1) - 1)  # 2 -> 4 cores: one doubling
    trl_scaled = max(one, two) * max(1.0, two / one) ** doublings
    found: dict[str, Any] = {
        "ranks": ranks,
        "trl_tok_s_scaled": round(trl_scaled, 1),
        "trl_tok_s_linear": round(ranks * one, 1),
    }
    if on_policy is not None:
        step = (on_policy["generate"]["core_s"] + on_policy["update"]["core_s"]) / ranks
        found["on_policy_tok_s"] = round(tokens_per_step / step, 1)
    if asynchronous is not None:
        update = asynchronous["update"]["core_s"]
        gen = asynchronous["generate"]["core_s"]
        sync = asynchronous.get("sync", {}).get("s", 0.0)
        splits = {r: max(update / (ranks - r), gen / r) + sync for r in range(1, ranks)}
        best_r = min(splits, key=lambda r: splits[r])
        found["async_tok_s"] = round(tokens_per_step / splits[best_r], 1)
        found["async_generating_ranks"] = best_r
    for mode in ("on_policy", "async"):
        if f"{mode}_tok_s" in found:
            ours = found[f"{mode}_tok_s"]
            found[f"{mode}_vs_trl_scaled"] = round(ours / trl_scaled, 2)
            found[f"{mode}_vs_trl_linear"] = round(ours / found["trl_tok_s_linear"], 2)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="an e2e_vs_trl --work folder")
    ap.add_argument("--trl", type=float, nargs=2, metavar=("TOK_S_1", "TOK_S_2"), required=True)
    args = ap.parse_args(argv)
    import yaml
    from transformers import AutoConfig

    from controller.data import PROMPT_COLUMNS, read_rows

    shape = Shape.of(AutoConfig.from_pretrained(str(args.work / "sft")))
    report: dict[str, Any] = {}
    peaks = {d: matmul_peak(d) for d in ("fp32", "bf16")}
    for run_dir in sorted(args.work.glob("run-*")):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        stage = config["stages"][0]
        algorithm = stage["algorithm"]
        rows = read_rows(stage["data"], PROMPT_COLUMNS)[: algorithm["prompts_per_step"]]
        lengths = prompt_tokens(args.work / "sft", [r["prompt"] for r in rows])
        nproc = {g: spec["nproc"] for g, spec in config["placement"].items()}
        ranks = {"actor": 1, "rollout": 1}
        for spec in config["placement"].values():
            for role in spec["roles"]:
                ranks[role] = spec["nproc"]
        dtype = "bf16" if config["roles"]["actor"].get("dtype") != "fp32" else "fp32"
        report[run_dir.name] = stage_report(
            run_dir, shape, lengths, algorithm["n"], ranks, peaks[dtype]
        ) | {"nproc": nproc}
    on_policy = report.get("run-best-k0", report.get("run-hybridflow"))
    runs = dict(report)
    asyncs = [r for r in runs.values() if r.get("generate", {}).get("where") == "rollout"]
    tokens = statistics.median(
        r["train/response/tokens"] for d in args.work.glob("run-*") for r in _steps(d)
    )
    report["projection"] = project(
        on_policy, asyncs[0] if asyncs else None, {1: args.trl[0], 2: args.trl[1]}, tokens
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
