"""The host a run or the test suite ran on, in two numbers anyone can compare: the fp32 matmul
rate of one thread (one 1024^3 product, the best of a few) and the CPU's vector flags. Hosts of
the CI's kind differ: an AVX512 host multiplied at 173-180 GFLOP/s, an AVX2-only one at 68, and
the suite took 38 and 68 minutes on them. So every suite time is printed with the rate beside it
(``tests/conftest.py``'s header) and ``.ci/run`` projects the suite's time to the slowest host
kind seen, warning when the projection leaves too little of CI's limit:

    python -m bench.host                         # the rate and flags, as JSON
    python -m bench.host --suite-seconds 1500    # and the suite's time projected (last line)

The projection: part of the suite's time scales with the matmul rate (model compute), the rest
does not (process starts, imports, sockets, sleeps of the code under test). Fitted to the two
hosts above (38 min at 173 GFLOP/s, 67.8 at 68) the scaling share is about one half. It was
fitted on serial runs; ``make test`` now runs two workers, which fill the waits with other
tests' compute, so a larger share of its time may scale than this fit says.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

#: the slowest host kind seen (AVX2 only, no AVX512): one thread's fp32 1024^3 rate, GFLOP/s
SLOWEST_GFLOPS = 68.0
#: the share of the suite's time that scales with the matmul rate (fitted; see the docstring)
MATMUL_SHARE = 0.5
#: CI's limit is 90 minutes; past this projection a new slow test is likely to break it
WARN_S = 60 * 60
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def matmul_peak(dtype: str = "fp32", n: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of the best ``n``^3 product on one thread, in ``dtype`` (fp32 or bf16)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kind = torch.bfloat16 if dtype == "bf16" else torch.float32
        a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(threads)


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``FLAGS`` it has (empty where /proc/cpuinfo is not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", []
    lines = text.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return model or "unknown", [f for f in FLAGS if f in flags]


def projected_s(seconds: float, gflops: float, to_gflops: float = SLOWEST_GFLOPS) -> float:
    """``seconds`` measured on a host of ``gflops``, projected to a host of ``to_gflops``
    (never below ``seconds``: a faster host is not projected)."""
    scale = max(1.0, gflops / to_gflops)
    return seconds * ((1 - MATMUL_SHARE) + MATMUL_SHARE * scale)


def describe() -> str:
    """One line: the rate and the flags (the test suite's header)."""
    model, flags = cpu()
    return (
        f"host: fp32 matmul {matmul_peak():.0f} GFLOP/s on one thread (1024^3); "
        f"{model}; flags {' '.join(flags) or 'none of ' + ' '.join(FLAGS)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite-seconds", type=float, help="a suite's wall time on this host")
    args = parser.parse_args()
    rate = matmul_peak()
    model, flags = cpu()
    found: dict[str, object] = {"fp32_gflops": round(rate, 1), "cpu": model, "flags": flags}
    if args.suite_seconds is not None:
        slowest = projected_s(args.suite_seconds, rate)
        found.update(
            suite_s=round(args.suite_seconds),
            projected_slowest_s=round(slowest),
            slowest_gflops=SLOWEST_GFLOPS,
            warn=slowest > WARN_S,
        )
        if slowest > WARN_S:
            print(
                f"WARNING: the suite took {args.suite_seconds / 60:.1f} min here ({rate:.0f} "
                f"GFLOP/s); on the slowest host kind seen ({SLOWEST_GFLOPS:.0f} GFLOP/s) that "
                f"projects to {slowest / 60:.1f} min, over {WARN_S // 60} of CI's 90: move "
                "near-duplicate slow tests to the extended tier"
            )
    print(json.dumps({"bench": "host", **found}))


if __name__ == "__main__":
    main()
