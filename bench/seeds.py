"""Seed spread of an experiment: run it once per seed and print how far the results scatter.

    python -m bench.seeds examples/quickstart.yaml --seeds 8            (8 full runs, sequential)
    python -m bench.seeds examples/quickstart.yaml --seeds 3 --quick    (the CI-sized form)

Seed ``s`` runs ``hybridflow run EXP --json --set models.base.seed=S --set trainer.seed=S`` (plus
any ``--set`` given here) as its own process, one after another: each run uses every core, so
running seeds side by side would only slow each one and distort its wall time. Varying the model's
initial weights and the trainer's seed (data order, sampling) stands in for what differs from one
machine to the next — last-bit float differences between CPU kernels, which a long run amplifies
into a different trajectory. A result worth reporting holds over the spread, not for one seed.

Printed: one row per seed (held-out greedy accuracy at random init, just before RL and after RL,
the RL gain after - before, wall time, the actor's dtype), then min / median / max of each column.
``--require-gain G`` and ``--require-after A`` make the exit status 1 when a seed falls short,
naming the seeds. The last line is a JSON object: ``experiment``, ``quick``, ``seeds`` (the rows),
``spread`` (column → min, median, max) and ``failed`` (seeds short of a requirement).

A script here rather than ``hybridflow run --seeds``: it composes runs exactly as a user types
them, so it measures the command itself, and ``run`` keeps one run per invocation (one run
directory, one summary, one exit status).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = ("init", "before", "after", "gain", "wall_s")
out, err = Console(), Console(stderr=True)


class SeedRunError(RuntimeError):
    """One seed's run did not finish; carries its exit status and the end of its output."""


@dataclass(frozen=True)
class SeedResult:
    seed: int
    init: float
    before: float
    after: float
    gain: float
    wall_s: float
    dtype: str
    #: multi-turn runs: the share of held-out answers that called a tool, before and after RL
    calls_before: float | None = None
    calls_after: float | None = None


def seed_overrides(seed: int) -> list[str]:
    """The ``--set`` pairs that make run ``seed`` differ: initial weights and trainer seed."""
    return ["--set", f"models.base.seed={seed}", "--set", f"trainer.seed={seed}"]


def run_argv(experiment: Path, seed: int, run_dir: Path, quick: bool, sets: list[str]) -> list[str]:
    extra = [x for pair in sets for x in ("--set", pair)]
    flags = ["--quick"] if quick else []
    return [
        *(sys.executable, "-m", "deploy.cli", "run", str(experiment), "--json"),
        *flags,
        *seed_overrides(seed),
        *extra,
        *("--run-dir", str(run_dir)),
    ]


def run_seed(argv: list[str], seed: int, timeout: float) -> SeedResult:
    """Run one seed to completion and read its summary (the last line ``--json`` prints)."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise SeedRunError(f"seed {seed}: `{' '.join(argv)}` exited {done.returncode}:\n{tail}")
    lines = done.stdout.strip().splitlines()
    summary: dict[str, Any] = json.loads(lines[-1])
    return from_summary(seed, summary, wall)


def from_summary(seed: int, summary: dict[str, Any], wall: float) -> SeedResult:
    """One row from a run's summary.json; wall time is the whole command's, start-up included."""
    keys = ("val_acc_init", "val_acc_before", "val_acc_after")
    missing = [k for k in keys if summary.get(k) is None]
    if missing:
        raise SeedRunError(
            f"seed {seed}: summary has no {', '.join(missing)}; the experiment needs "
            "trainer.val_data and an RL stage after an SFT stage"
        )
    init, before, after = (float(summary[k]) for k in keys)
    dtype = str(summary.get("precision", {}).get("actor", {}).get("dtype", "?"))
    calls = [summary.get(k) for k in ("val_tool_calls_before", "val_tool_calls_after")]
    return SeedResult(
        seed,
        init,
        before,
        after,
        after - before,
        round(wall, 1),
        dtype,
        *(None if c is None else float(c) for c in calls),
    )


def spread(rows: list[SeedResult]) -> dict[str, dict[str, float]]:
    """Column → min, median, max over the seeds."""
    found = {}
    calls = ("calls_before", "calls_after") if rows and rows[0].calls_after is not None else ()
    for column in (*COLUMNS, *calls):
        values = [float(getattr(r, column)) for r in rows]
        found[column] = {
            "min": min(values),
            "median": statistics.median(values),
            "max": max(values),
        }
    return found


def shortfalls(rows: list[SeedResult], gain: float | None, after: float | None) -> list[int]:
    """Seeds whose RL gain or after-RL accuracy is below what was required."""
    return [
        r.seed
        for r in rows
        if (gain is not None and r.gain < gain) or (after is not None and r.after < after)
    ]


def table(title: str, rows: list[SeedResult], found: dict[str, dict[str, float]]) -> Table:
    shown = Table(title=title)
    calls = ("calls_before", "calls_after") if rows and rows[0].calls_after is not None else ()
    for name in ("seed", *COLUMNS, *calls, "dtype"):
        shown.add_column(name, justify="right")
    for r in rows:
        values = [_fmt(c, getattr(r, c)) for c in (*COLUMNS, *calls)]
        shown.add_row(str(r.seed), *values, r.dtype)
    for stat in ("min", "median", "max"):
        values = [_fmt(c, found[c][stat]) for c in (*COLUMNS, *calls)]
        shown.add_row(stat, *values, "", style="bold")
    return shown


def _fmt(column: str, value: float) -> str:
    if column == "wall_s":
        return f"{value:.1f}"
    return f"{value:+.3f}" if column == "gain" else f"{value:.3f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", type=Path, help="experiment YAML file")
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 (default 8)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="apply the file's quick: overrides")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="run dirs go here (default runs/seeds-<time>)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--require-gain", type=float, metavar="G", help="exit 1 if a gain < G")
    parser.add_argument("--require-after", type=float, metavar="A", help="exit 1 if after < A")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: run at least one seed")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or Path("runs") / f"seeds-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    for seed in range(args.first, args.first + args.seeds):
        argv_seed = run_argv(args.experiment, seed, out_dir / f"seed-{seed}", args.quick, args.set)
        try:
            rows.append(run_seed(argv_seed, seed, args.timeout))
        except (SeedRunError, subprocess.TimeoutExpired) as exc:
            err.print(f"[red]{exc}[/]", soft_wrap=True)
            return 1
        err.print(f"seed {seed}: {rows[-1]}", soft_wrap=True)
    found = spread(rows)
    failed = shortfalls(rows, args.require_gain, args.require_after)
    sized = " --quick" if args.quick else ""
    out.print(table(f"{args.experiment}{sized}, {len(rows)} seeds", rows, found))
    if failed:
        err.print(f"[red]seeds short of the requirement: {failed}[/]")
    result = {
        "experiment": str(args.experiment),
        "quick": args.quick,
        "seeds": [asdict(r) for r in rows],
        "spread": found,
        "failed": failed,
    }
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
