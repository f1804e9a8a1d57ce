"""The library against the command: ``examples/api/grpo.py`` (the quickstart's SFT then GRPO as
the user's own loop, ``hybridflow.mesh``) and ``hybridflow run examples/quickstart.yaml`` (the
built-in program) on the same work, one after the other on this machine.

    python -m bench.api                 # the full quickstart each way (~2 x 2.5 min on 2 cores)
    python -m bench.api --quick         # 40 SFT steps, 6 GRPO steps, 64 held-out prompts

The last line is a JSON object: ``api_step_s`` and ``run_step_s`` (median GRPO step time),
``api_step_ratio`` (target <= 1.05), ``api_acc`` and ``run_acc`` (held-out greedy accuracy after
GRPO; target within 0.05), and from ``bench/api_chaos.py`` (a loop of the same primitives, with
gradient accumulation, on a placement with one group per kind, run undisturbed and with a rank of
each group killed): ``api_chaos_equal`` (the final weights, every step's reward and the policy
version equal),
``api_chaos_kills``, ``api_chaos_rollbacks``; ``mesh_start_s``: the seconds ``hf.mesh`` takes to
start the quickstart's groups (models made, ranks started and registered), the best of two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hybridflow as hf
from bench.api_chaos import compare

ROOT = Path(__file__).resolve().parents[1]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def mesh_start(folder: Path) -> float:
    """Seconds from ``hf.mesh`` to its first call: the file checked, its models made, every
    group started and registered."""
    began = time.perf_counter()
    async with hf.mesh(ROOT / "examples" / "quickstart.yaml", run_dir=folder) as m:
        await m.sync_weights()
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sft, steps, val = (40, 6, 64) if args.quick else (1000, 30, 992)
    with tempfile.TemporaryDirectory() as tmp:
        api_dir, run_dir = Path(tmp) / "api", Path(tmp) / "run"
        script = ROOT / "examples" / "api" / "grpo.py"
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--run-dir",
                str(api_dir),
                "--sft-steps",
                str(sft),
                "--steps",
                str(steps),
                "--val",
                str(val),
            ],
            check=True,
        )
        sets = [
            f"stages.0.steps={sft}",
            f"stages.0.optim.warmup_steps={min(100, sft)}",
            f"stages.1.steps={steps}",
            f"trainer.val_data=builtin:arithmetic?n={val}&split=test",
            "trainer.val_every=0",
            "trainer.export=false",
            "logging.live=false",
        ]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "run",
                str(ROOT / "examples" / "quickstart.yaml"),
                "--run-dir",
                str(run_dir),
                *[x for s in sets for x in ("--set", s)],
            ],
            check=True,
        )
        api = records(api_dir)
        run = records(run_dir)
        api_steps = [r["time/step_s"] for r in api if "time/step_s" in r and r["step"] > sft]
        run_steps = [
            r["time/step_s"] for r in run if r.get("stage") == "grpo" and "stage_step" in r
        ]
        api_acc = next(r["val/score"] for r in reversed(api) if "val/score" in r)
        run_acc = json.loads((run_dir / "summary.json").read_text())["val_acc_after"]
        (Path(tmp) / "chaos").mkdir()
        chaos = asyncio.run(compare(Path(tmp) / "chaos", steps=3))
        starts = [asyncio.run(mesh_start(Path(tmp) / f"start{i}")) for i in range(2)]
    found = {
        "bench": "api",
        "api_step_s": round(statistics.median(api_steps), 3),
        "run_step_s": round(statistics.median(run_steps), 3),
        "api_step_ratio": round(statistics.median(api_steps) / statistics.median(run_steps), 3),
        "api_acc": round(api_acc, 3),
        "run_acc": round(run_acc, 3),
        **chaos,
        "mesh_start_s": round(min(starts), 2),
    }
    print(json.dumps(found))


if __name__ == "__main__":
    main()
