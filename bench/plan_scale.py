"""The planner at the paper's scale, on paper: PPO on Llama 7B-70B with 16-128 A100-80GB.

``python -m bench.plan_scale [--sizes llama2-7b,...] [--gpus 16,32,64,96,128]`` (under a minute).

For each model size (all four PPO models at that size, as in the paper's evaluation) and device
count: 1,024 prompts of 1,024 tokens with 1,024-token responses, 8 devices per node, the
``a100`` profile. Printed per case: the best plan, its predicted step, the best plan with more
than one group and how much slower it is, and the seconds the search took. This is the table in
docs/plan.md. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from deploy.commands.plan import PlanOptions, describe, workload
from deploy.experiment import load
from deploy.plan.profiles import load_profile
from deploy.plan.search import Plan, PlanError, Planner

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "examples/ppo.yaml"
SIZES = ("llama2-7b", "llama2-13b", "llama-34b", "llama2-70b")
GPUS = (16, 32, 64, 96, 128)


def label(plan: Plan) -> str:
    parts = []
    for group, cost in zip(plan.groups, plan.costs, strict=True):
        s = cost.strategy
        parts.append(
            f"{{{'+'.join(group)}}} {s.p * s.t * s.d}: {s.p}-{s.t}-{s.d}, gen tp {s.gen_t}"
        )
    return " + ".join(parts)


def case(size: str, gpus: int, profile: str) -> dict[str, Any]:
    opts = PlanOptions(EXPERIMENT, gpus, 8, None, profile, size, 1024, 1024, 1024, 1000, True, None)
    wl = workload(load(EXPERIMENT), opts)
    start = time.perf_counter()
    try:
        plans = Planner(wl, gpus, 8, load_profile(profile), allow_pp=True).plans(top=1000)
    except PlanError:
        return {"size": size, "gpus": gpus, "fits": False}
    seconds = time.perf_counter() - start
    best = plans[0]
    split = next((p for p in plans if len(p.groups) > 1), None)
    return {
        "size": size,
        "gpus": gpus,
        "fits": True,
        "best": label(best),
        "best_groups": len(best.groups),
        "step_s": best.total,
        "split": label(split) if split else None,
        "split_step_s": split.total if split else None,
        "split_slower": split.total / best.total - 1 if split else None,
        "plan_s": seconds,
        "detail": describe(best),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
    ap.add_argument("--profile", default="a100")
    args = ap.parse_args(argv)
    rows = [
        case(size, int(g), args.profile)
        for size in args.sizes.split(",")
        for g in args.gpus.split(",")
    ]
    print(
        "| model | GPUs | best plan (devices: p-t-d) | step s | best split plan | split slower by | plan s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["fits"]:
            print(f"| {r['size']} | {r['gpus']} | does not fit (80 GB) | | | | |")
            continue
        split = f"{r['split']} ({r['split_step_s']:.1f} s)" if r["split"] else "none fits"
        slower = f"{100 * r['split_slower']:.0f}%" if r["split"] else ""
        print(
            f"| {r['size']} | {r['gpus']} | {r['best']} | {r['step_s']:.1f} | {split} | "
            f"{slower} | {r['plan_s']:.2f} |"
        )
    summary = {
        "bench": "plan_scale",
        "profile": args.profile,
        "max_plan_s": max((r["plan_s"] for r in rows if r["fits"]), default=0.0),
        "colocate_all_best": {
            f"{r['size']}@{r['gpus']}": r["best_groups"] == 1 for r in rows if r["fits"]
        },
        "rows": [{k: v for k, v in r.items() if k != "detail"} for r in rows],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
