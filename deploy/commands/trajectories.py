"""``hybridflow trajectories RUN_DIR``: a few multi-turn trajectories of a run, with what the model
sampled told apart from what the tools or the environment answered.

The trainer logs some trajectories of every ``trainer.log_samples.every``-th step (and of each
validation) to ``samples.jsonl`` with their pieces (``segments``: sampled text and observations,
``controller/agent.py``). Sampled text is printed as it is, observations between ``⟦`` and ``⟧``
(in colour on a terminal); each trajectory ends with its reward, turns, tool calls and why it
ended, and with what an LLM judge said of it when one scored it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from controller.metrics import SAMPLES_FILE
from deploy.terminal import console

OPEN, CLOSE = "⟦", "⟧"


def add_trajectories_command(sub: argparse._SubParsersAction) -> None:
    what = "print a run's logged multi-turn trajectories, sampled text and observations marked"
    cmd = sub.add_parser("trajectories", help=what, description=what)
    cmd.add_argument("run_dir", type=Path, help="the run folder (holds samples.jsonl)")
    cmd.add_argument("--step", type=int, help="the global step (default: the last logged)")
    cmd.add_argument("--count", type=int, default=4, help="trajectories to print (default 4)")
    cmd.add_argument(
        "--kind",
        choices=("rollout", "validation"),
        default="rollout",
        help="training rollouts or validation answers (default rollout)",
    )
    cmd.set_defaults(fn=trajectories_command)


def read_trajectories(
    run_dir: Path, kind: str, step: int | None
) -> tuple[int, list[dict[str, Any]]]:
    """(step, its logged trajectories of ``kind``); ValueError naming what is missing."""
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no samples logged (is {run_dir} a run folder?)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number}: not a JSON line") from None
        if row.get("kind") == kind and "segments" in row:
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no {kind} trajectories (was trainer.agent set for this run?)")
    steps = sorted({int(r["step"]) for r in rows})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"--step {step}: trajectories were logged at steps {steps}")
    return chosen, [r for r in rows if int(r["step"]) == chosen]


def render(row: dict[str, Any], colour: bool) -> str:
    """One trajectory as text: prompt, then its pieces, observations marked."""
    out = [escape(str(row["prompt"])) if colour else str(row["prompt"])]
    for kind, text in row["segments"]:
        text = escape(text) if colour else text
        if kind == "sampled":
            out.append(f"[bold]{text}[/]" if colour else text)
        else:
            out.append(f"[cyan]{OPEN}{text}{CLOSE}[/]" if colour else f"{OPEN}{text}{CLOSE}")
    return "".join(out)


def trajectories_command(args: argparse.Namespace) -> int:
    try:
        step, rows = read_trajectories(args.run_dir, args.kind, args.step)
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    out = Console(soft_wrap=True)  # stdout, one line per piece of text: grep works on it
    colour = out.is_terminal
    out.print(f"step {step}: {len(rows)} {args.kind} trajectories logged", markup=False)
    for row in rows[: args.count]:
        facts = ", ".join(
            f"{k} {row[k]}" for k in ("reward", "turns", "tool_calls", "finish") if k in row
        )
        out.print(f"--- {facts}", markup=False, highlight=False)
        out.print(render(row, colour), markup=colour, highlight=False)
        if "verdict" in row:  # an LLM judge scored it: what it said
            out.print(f"judge: {row['verdict']!r}", markup=False, highlight=False)
    return 0
