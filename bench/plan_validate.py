"""The planner's predicted RL step time against measured runs, on this machine, per placement.

``python -m bench.plan_validate [--quick] [--profiles vm-2core,calibrate]`` (a few minutes).

For the quickstart (GRPO on the 1.1M Llama, a rule reward) and the PPO example (actor,
reference, critic and a reward model, all 1.1M), several placements that fit 2 cores each run
the experiment with SFT cut to a few steps and a short RL stage. The measured step is the
median ``time/step_s`` of the RL steps after the first; the predicted one is
``deploy.commands.plan.predict`` under each profile, with each run's own workload (prompt length: the
builtin task's, about 16 tokens). ``calibrate`` is a profile measured at the start of the run
(``hybridflow plan --calibrate``, deploy/plan/calibrate.py), on idle cores. Placements of one experiment run in turn, twice over
(A B C A B C), and each keeps the faster of its two, so the VM's drift hits them alike.

Printed: per placement and profile the predicted and measured seconds and their ratio, and
whether the predicted order of the placements is the measured one. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16

QUICKSTART = {
    "one group, 2 ranks (dp 2)": {"main": {"roles": ["actor", "reward"], "nproc": 2}},
    "one group, 1 rank": {"main": {"roles": ["actor", "reward"], "nproc": 1}},
    "one group, 2 ranks at tp 2": {"main": {"roles": ["actor", "reward"], "nproc": 2, "tp": 2}},
}
PPO = {
    "all four on 2 ranks (dp 2)": {
        "main": {"roles": ["actor", "reference", "critic", "reward"], "nproc": 2}
    },
    "actor+reference, critic+reward: 1 rank each": {
        "main": {"roles": ["actor", "reference"], "nproc": 1},
        "value": {"roles": ["critic", "reward"], "nproc": 1},
    },
    "all four on 1 rank": {
        "main": {"roles": ["actor", "reference", "critic", "reward"], "nproc": 1}
    },
}


def cli(argv: list[str], timeout: float = 900) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"hybridflow {' '.join(argv[:2])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def measured_step(run_dir: Path, rl_stage: str) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r["time/step_s"] for r in rows if r.get("stage") == rl_stage and "stage_step" in r]
    return statistics.median(steps[1:])


def predicted_step(exp_path: Path, sets: list[str], profile: str) -> dict[str, float]:
    from deploy.commands.plan import PlanOptions, predict, workload
    from deploy.experiment import load
    from deploy.plan.profiles import load_profile

    exp = load(exp_path, sets)
    opts = PlanOptions(exp_path, 2, 2, None, profile, None, None, PROMPT_LEN, None, 1, False, None)
    return predict(exp, workload(exp, opts), load_profile(profile), per_node=2)


def order(rows: dict[str, Any], key: str) -> list[str]:
    return sorted(rows, key=lambda k: rows[k][key])


def validate(
    name: str, path: Path, placements: dict[str, Any], sets: list[str], work: Path, args: Any
) -> dict[str, Any]:
    rl_stage = "grpo" if "quickstart" in path.name else "ppo"
    rows: dict[str, dict[str, Any]] = {}
    for repeat in range(1 if args.quick else 2):
        for label, block in placements.items():
            place = [f"placement={json.dumps(block)}"]
            run_dir = work / f"{name}-{len(rows)}-{repeat}-{abs(hash(label)) % 10**6}"
            argv = ["run", str(path), "--run-dir", str(run_dir), "--json"]
            for s in [*sets, *place]:
                argv += ["--set", s]
            cli(argv)
            seconds = measured_step(run_dir, rl_stage)
            row = rows.setdefault(label, {"measured_s": seconds})
            row["measured_s"] = min(row["measured_s"], seconds)
            if "predicted" not in row:
                row["predicted"] = {
                    name: predicted_step(path, [*sets, *place], file)
                    for name, file in args.profile_files.items()
                }
            print(f"{name} / {label}: measured {seconds:.3f} s", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"placements": rows, "order_measured": order(rows, "measured_s")}
    for profile in args.profile_files:
        for row in rows.values():
            row[f"{profile}_s"] = row["predicted"][profile]["total"]
            row[f"{profile}_ratio"] = row[f"{profile}_s"] / row["measured_s"]
        report[f"order_{profile}"] = order(rows, f"{profile}_s")
        report[f"ranking_agrees_{profile}"] = report[f"order_{profile}"] == report["order_measured"]
        report[f"best_agrees_{profile}"] = (
            report[f"order_{profile}"][0] == report["order_measured"][0]
        )
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, quickstart only")
    ap.add_argument(
        "--profiles",
        default="vm-2core,calibrate",
        help="comma-separated: profile names or JSON files; calibrate: measured now",
    )
    args = ap.parse_args(argv)
    rl_steps = "4" if args.quick else "8"
    with tempfile.TemporaryDirectory(prefix="plan-validate-") as tmp:
        work = Path(tmp)
        args.profile_files = {}
        report: dict[str, Any] = {"bench": "plan_validate"}
        for profile in args.profiles.split(","):
            if profile == "calibrate":
                out = work / "calibrate.json"
                cli(["plan", "--calibrate", "--out", str(out), "--json"])
                report["calibrated"] = json.loads(out.read_text())
                args.profile_files[profile] = str(out)
            else:
                args.profile_files[profile] = profile
        report["profiles"] = list(args.profile_files)
        qs_sets = ["stages.0.steps=5", "stages.0.optim.warmup_steps=1", f"stages.1.steps={rl_steps}", "trainer.val_data=null",
                   "trainer.export=false", "logging.live=false"]  # fmt: skip
        report["quickstart"] = validate(
            "quickstart", ROOT / "examples/quickstart.yaml", QUICKSTART, qs_sets, work, args
        )
        if not args.quick:
            rm = work / "tiny-rm"
            cli(["model", "init", str(work / "tiny"), "--size", "tiny"])
            cli(["rm", "--model", str(work / "tiny"), "--out", str(rm), "--steps", "5"])
            ppo_sets = ["stages.0.steps=5", "stages.0.optim.warmup_steps=1", "stages.1.steps=6", "trainer.val_data=null",
                        "trainer.export=false", "logging.live=false", f"roles.reward.model={rm}"]  # fmt: skip
            report["ppo"] = validate("ppo", ROOT / "examples/ppo.yaml", PPO, ppo_sets, work, args)
    table = Table(title="predicted vs measured RL step (median after the first)")
    for column in ("experiment", "placement", "measured s"):
        table.add_column(column)
    for profile in args.profile_files:
        table.add_column(f"{profile} s (ratio)")
    for exp in ("quickstart", "ppo"):
        found = report.get(exp, {})
        for label, row in found.get("placements", {}).items():
            cells = [f"{row[f'{p}_s']:.3f} ({row[f'{p}_ratio']:.2f})" for p in args.profile_files]
            table.add_row(exp, label, f"{row['measured_s']:.3f}", *cells)
        if found:
            agree = [
                f"{'yes' if found[f'ranking_agrees_{p}'] else 'no'} (best: "
                f"{'yes' if found[f'best_agrees_{p}'] else 'no'})"
                for p in args.profile_files
            ]
            table.add_row(exp, "order agrees", "", *agree)
    Console(stderr=True).print(table)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
