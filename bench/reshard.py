"""Reshard benchmark: training layout → generation layout on 4 gloo ranks, four schemes.

``python -m bench.reshard`` (a few minutes) or ``--quick`` (the synthetic set only, 64 MB, and
fewer repetitions: about a minute). For each layout
pair (p-t-d → p_g-t_g-d_g) and each scheme (``hybridflow``, ``hybridflow-v``, ``naive``,
``verl``) on the same 4 ranks, in the same processes, interleaved rep by rep:

* ``seconds``: the transfer's wall time, the slowest rank's, median over the repetitions;
* ``recv_mb``: parameter bytes each rank receives (MB = 1e6 bytes; the plan's, which the engine
  executes piece by piece; the max over ranks) and ``table_mb``, the paper's formula for it;
* ``peak_extra_mb``: the rank's peak memory increase during the transfer — ``VmHWM`` after
  ``echo 5 > /proc/self/clear_refs`` minus ``VmRSS`` before (max over ranks, median over reps).
  ``MALLOC_MMAP_THRESHOLD_`` is fixed so freed buffers return to the OS and each rep starts even.

Parameter sets: a synthetic one of column- and row-split matrices only (the table's case; 256 MB,
``--quick`` 64 MB) and the ≈20M tiny Llama as the FSDP engine lays it out (embeddings and norms
replicated over tp). Targets (checked on the synthetic set; ``targets`` in the JSON):

* time: HybridFlow ≤ 1.2 x (its table volume / naive's) x naive's time + 20 ms;
* memory: HybridFlow's peak ≤ (1/(t_g·p_g) - 1/(t·p))·M + one bucket;
* bytes: received equal the table within 1%;
* HybridFlow faster than verl-style on every pair that moves bytes.

The last stdout line is one JSON object: ``{"runs": [...], "targets": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reshard.layout import GenLayout, Param, params_from_layout, parse_layout
from reshard.plan import SCHEMES, make_plan, table_bytes
from reshard.transfer import Transfer, gather_group, release
from tests.fixtures.ranks import run_ranks
from transport.protocol import Layout

PAIRS = [("1-4-1", "1-2-2"), ("1-4-1", "1-1-4"), ("1-2-2", "1-1-2"), ("1-2-2", "1-2-1")]
WORLD = 4
MB = 1e6
COLUMNS = (
    "set",
    "train",
    "gen",
    "scheme",
    "model_mb",
    "seconds",
    "recv_mb",
    "table_mb",
    "peak_extra_mb",
)


def synthetic(total_bytes: int, layers: int = 8) -> list[Param]:
    """Column and row matrices of a Llama-like layer stack, ``total_bytes`` in fp32."""
    hidden = 1024
    per_layer = total_bytes // (4 * layers)
    rows = max(64, (per_layer // (2 * hidden)) // 64 * 64)
    out = []
    for i in range(layers):
        out.append(Param(f"layers.{i}.up", (rows, hidden), "column"))
        out.append(Param(f"layers.{i}.down", (hidden, rows), "row"))
    return out


def tiny_llama_params(size: str) -> list[Param]:
    from roles.engines.training.common import TP_PLAN
    from roles.modeling.models import _model_config, build_tokenizer

    config = _model_config(size, build_tokenizer())
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layout: dict[str, dict[str, object]] = {}
    for name, p in model.named_parameters():
        kind = next((k for suffix, k in TP_PLAN.items() if f".{suffix}." in f".{name}"), None)
        layout[name] = {
            "shape": list(p.shape),
            "tp_dim": {"colwise": 0, "rowwise": 1, None: None}[kind],
        }
    return params_from_layout(layout)


def _rss() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _measure(plan: Any, rank: int, group: Any, train: dict[str, torch.Tensor]) -> tuple[float, int]:
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before, _ = _rss()
    start = time.perf_counter()
    gen = Transfer(plan, rank, group).run(train, reuse=plan.scheme == "hybridflow")
    elapsed = time.perf_counter() - start
    _, peak = _rss()
    release(train, gen)
    slowest = torch.tensor([elapsed])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest), peak - before


def _pair(
    rank: int, world: int, params: list[Param], pair: tuple[str, str], reps: int, bucket: int
) -> dict[str, Any]:
    p, t, d = parse_layout(pair[0])
    p_g, t_g, _ = parse_layout(pair[1])
    train_layout, gen = Layout(dp=d, tp=t, pp=p), GenLayout(tp=t_g, pp=p_g)
    plans = {s: make_plan(params, train_layout, gen, s, bucket_bytes=bucket) for s in SCHEMES}
    groups = {s: gather_group(plan) for s, plan in plans.items()}
    first = plans["naive"]
    train = {
        prm.name: torch.randn([b - a for a, b in box])
        for i, prm in enumerate(params)
        if (box := first.held_box(i, rank)) is not None
    }
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    peaks: dict[str, list[int]] = {s: [] for s in SCHEMES}
    for _ in range(reps):
        for scheme in SCHEMES:
            seconds, peak = _measure(plans[scheme], rank, groups[scheme], train)
            times[scheme].append(seconds)
            peaks[scheme].append(peak)
    return {
        s: {
            "seconds": statistics.median(times[s]),
            "peak": statistics.median(peaks[s]),
            "recv": plans[s].recv_bytes(rank),
        }
        for s in SCHEMES
    }


def run_pair(
    params: list[Param], pair: tuple[str, str], reps: int, bucket: int, label: str
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_ranks(_pair, WORLD, Path(folder), params, pair, reps, bucket)
    p, t, d = parse_layout(pair[0])
    p_g, t_g, _ = parse_layout(pair[1])
    model = sum(x.nbytes for x in params)
    runs = []
    for scheme in SCHEMES:
        runs.append(
            {
                "set": label,
                "train": pair[0],
                "gen": pair[1],
                "scheme": scheme,
                "model_mb": round(model / MB, 1),
                "seconds": round(per_rank[0][scheme]["seconds"], 4),
                "recv_mb": round(max(r[scheme]["recv"] for r in per_rank) / MB, 2),
                "table_mb": round(
                    table_bytes(scheme, Layout(dp=d, tp=t, pp=p), GenLayout(tp=t_g, pp=p_g), model)
                    / MB,
                    2,
                ),
                "peak_extra_mb": round(max(r[scheme]["peak"] for r in per_rank) / MB, 1),
            }
        )
    return runs


def check_targets(runs: list[dict[str, Any]], bucket: int) -> dict[str, bool]:
    found: dict[str, bool] = {}
    for train, gen in PAIRS:
        by = {
            r["scheme"]: r
            for r in runs
            if (r["train"], r["gen"]) == (train, gen) and r["set"] == "synthetic"
        }
        hf, naive, verl = by["hybridflow"], by["naive"], by["verl"]
        p, t, _ = parse_layout(train)
        p_g, t_g, _ = parse_layout(gen)
        key = f"{train}->{gen}"
        ratio = hf["table_mb"] / naive["table_mb"] if naive["table_mb"] else 0.0
        found[f"time {key}"] = hf["seconds"] <= 1.2 * ratio * naive["seconds"] + 0.020
        limit = (1 / (t_g * p_g) - 1 / (t * p)) * hf["model_mb"] + bucket / MB
        found[f"memory {key}"] = hf["peak_extra_mb"] <= limit
        found[f"bytes {key}"] = all(
            abs(r["recv_mb"] - r["table_mb"]) <= 0.01 * max(r["table_mb"], 1e-9)
            for r in by.values()
        )
        if hf["table_mb"] > 0:
            found[f"beats verl {key}"] = hf["seconds"] < verl["seconds"]
    return found


def sync_20m(repeats: int) -> dict[str, Any]:
    """A separate rollout group's sync of the ~20M tiny Llama, 2 -> 2 ranks on this host, per
    path, against the old path through the controller (``bench/sync_paths.py``)."""
    from bench.sync_paths import sync_seconds
    from roles.modeling.models import init_model

    with tempfile.TemporaryDirectory() as folder:
        model = init_model(Path(folder) / "small", "small", seed=0)
        found: dict[str, Any] = sync_seconds(str(model), repeats=repeats)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=32)
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    bucket = int(args.bucket_mb * MB)
    size = 64 if args.quick else 256
    reps = 3 if args.quick else 5
    sets = {"synthetic": synthetic(int(size * MB))}
    if not args.quick:
        sets["llama-20m"] = tiny_llama_params("small")
    runs: list[dict[str, Any]] = []
    for label, params in sets.items():
        for pair in PAIRS:
            print(f"{label} {pair[0]} -> {pair[1]} ...", file=sys.stderr, flush=True)
            runs.extend(run_pair(params, pair, reps, bucket, label))
    sync = sync_20m(3 if args.quick else 5)
    targets = check_targets(runs, bucket)
    targets["sync_20m shm >= 2x controller"] = sync["shm_s"] * 2 <= sync["controller_s"]
    _table(runs, targets)
    print(f"sync_20m (2 -> 2 ranks, this host): {sync}", file=sys.stderr)
    print(
        json.dumps(
            {
                "runs": runs,
                "sync_20m": sync,
                "bucket_mb": args.bucket_mb,
                "targets": targets,
                "targets_met": all(targets.values()),
            }
        )
    )
    return 0


def _table(runs: list[dict[str, Any]], targets: dict[str, bool]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="reshard: 4 gloo ranks")
    for column in COLUMNS:
        table.add_column(column)
    for r in runs:
        table.add_row(*(str(r[c]) for c in COLUMNS))
    console = Console()
    console.print(table)
    for name, ok in targets.items():
        console.print(f"{'PASS' if ok else 'FAIL'}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
