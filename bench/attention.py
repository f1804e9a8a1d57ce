"""Which attention kernel trains faster here: torch's fused SDPA or plain matmuls (eager).

``python -m bench.attention [--quick] [--widths 32,64,...]`` (a few minutes; ``--quick`` ~1).

One training step (forward, log-softmax, backward) of the 17.6M "small" Llama on one thread, on
right-padded rows (every third row one-sixth padding, as RL batches are), about 2,048 tokens per
step at every width, in fp32 and in bf16 autocast, under each kernel. Time is the best of
``--repeats`` in thread CPU seconds, so other processes on the machine disturb it less than wall
time would. The peer is torch's own fused kernel (what transformers picks by default); the
engines' ``attention: auto`` (``roles/runtime/device.py``, ``attention_kernel``) is set from this
table: eager for bf16 on CPU up to ``EAGER_MAX_WIDTH`` tokens a row.

Measured on this 2-core VM (under load from other jobs; thread seconds per step):

    width  fp32 sdpa / eager   bf16 sdpa / eager
       32     2.81 / 3.06         1.66 / 1.52
       64     3.35 / 2.92         1.80 / 1.50
      128     3.29 / 3.02         1.75 / 1.53
      256     3.13 / 3.25         1.72 / 1.54
      384     2.95 / 2.95         1.92 / 1.54
      512     3.25 / 3.42         2.00 / 1.83

In bf16 the fused kernel's backward runs at a few GFLOP/s on CPU (a profile of one step at width
40 gave it 16% of the step for under 2% of the FLOPs). In fp32 neither kernel wins everywhere.
The last line is a JSON object: ``widths`` -> dtype -> kernel -> seconds, and ``eager_speedup``
(sdpa / eager) per dtype and width.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from roles.modeling.models import SIZES

TOKENS = 2048


def thread_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def step_time(model: Any, width: int, dtype: str, kernel: str, repeats: int) -> float:
    rows = max(1, TOKENS // width)
    gen = torch.Generator().manual_seed(width)
    ids = torch.randint(3, int(model.config.vocab_size), (rows, width), generator=gen)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[::3, width - max(1, width // 6) :] = 0
    model.config._attn_implementation = kernel

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logits.float().log_softmax(-1).mean().backward()

    return thread_seconds(step, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two widths, tiny model, 1 repeat")
    ap.add_argument("--widths", default="32,64,128,256,384,512")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    size = "tiny" if args.quick else "small"
    widths = [32, 128] if args.quick else [int(w) for w in args.widths.split(",")]
    repeats = 1 if args.quick else args.repeats
    torch.manual_seed(0)
    shape = {**SIZES[size], "max_position_embeddings": max(widths), "vocab_size": 259}
    model = LlamaForCausalLM(LlamaConfig(**shape))
    found: dict[int, dict[str, dict[str, float]]] = {}
    for width in widths:
        found[width] = {
            dtype: {
                k: round(step_time(model, width, dtype, k, repeats), 4) for k in ("sdpa", "eager")
            }
            for dtype in ("fp32", "bf16")
        }
        print(f"width {width}: {found[width]}", file=sys.stderr, flush=True)
    table = Table(title=f"one training step, {size} Llama, ~{TOKENS} tokens, thread seconds")
    for column in ("width", "fp32 sdpa", "fp32 eager", "bf16 sdpa", "bf16 eager"):
        table.add_column(column, justify="right")
    for width, by in found.items():
        cells = [f"{by[d][k]:.3f}" for d in ("fp32", "bf16") for k in ("sdpa", "eager")]
        table.add_row(str(width), *cells)
    Console(stderr=True).print(table)
    speedup = {
        d: {w: round(by[d]["sdpa"] / by[d]["eager"], 3) for w, by in found.items()}
        for d in ("fp32", "bf16")
    }
    print(
        json.dumps({"bench": "attention", "model": size, "widths": found, "eager_speedup": speedup})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
