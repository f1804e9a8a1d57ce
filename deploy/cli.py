"""The ``hybridflow`` command line.

- ``hybridflow demo`` — the mesh's own linear-regression demo: a controller drives a 2-rank
  data-parallel group that fits a linear model; prints the result (``--json`` for one JSON
  line). Not the main job, which is ``make demo`` (``hybridflow run examples/quickstart.yaml``).
- ``hybridflow role NAMES --connect ADDR --nproc N`` — start, by hand, a process group hosting the
  comma-separated roles and join a controller that was started separately (``deploy/commands/role.py``).
- ``hybridflow model init|import-gguf|check`` — model folders (``deploy/commands/model.py``).
- ``hybridflow sft`` / ``hybridflow rm`` — supervised training jobs (``deploy/commands/train.py``).
- ``hybridflow run EXPERIMENT.yaml`` / ``hybridflow report RUN_DIR`` — experiments: SFT and RL
  stages, checkpoints, resume, plots (``deploy/commands/run.py``).
- ``hybridflow controller EXPERIMENT.yaml --bind tcp://HOST:PORT`` — the same run with the
  controller alone; each group joins with ``hybridflow role`` (the command is printed).
- ``hybridflow slurm`` / ``hybridflow keys`` — sbatch scripts (``deploy/commands/slurm.py``) and CURVE
  keys (``deploy/commands/keys.py``).
- ``hybridflow serve --base-model DIR`` — the Tinker REST API, for the ``tinker`` SDK's clients
  (``deploy/commands/serve.py``, ``deploy/tinker/``).
- ``hybridflow reshard-plan --model llama2-70b --train 1-8-16 --gen 1-4`` — bytes, memory and
  groups of a training → generation weight reshard, planned on paper (``deploy/commands/reshard.py``).

Each command module adds its parser, with a help line for every option (plain text: ``--help``
prints it as written), and turns the parsed arguments into one typed options object
(``RunOptions``, ``TrainOptions``, ...) at its edge; nothing past that sees an argparse Namespace.
The console and ``run_async`` every command shares live in ``deploy/terminal.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from rich.logging import RichHandler
from rich.markup import escape

from controller.demo import demo_placement, train_linear
from deploy.commands.keys import add_keys_command
from deploy.commands.model import add_model_commands, run_model_command
from deploy.commands.plan import add_plan_command
from deploy.commands.reshard import add_reshard_command
from deploy.commands.role import add_role_command
from deploy.commands.run import add_run_commands, report_command, run_experiment_command
from deploy.commands.serve import add_serve_command
from deploy.commands.slurm import add_slurm_command
from deploy.commands.train import add_train_commands, run_train_command
from deploy.commands.trajectories import add_trajectories_command
from deploy.processes import add_status_command
from deploy.session import local_session
from deploy.terminal import console, run_async

__all__ = ["build_parser", "console", "main", "run_async"]


@dataclass(frozen=True)
class DemoOptions:
    """``hybridflow demo``'s options, typed (``from_args`` reads the parsed command line)."""

    steps: int = 60
    nproc: int = 2
    fanout: str = "socket"
    json: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        return cls(steps=args.steps, nproc=args.nproc, fanout=args.fanout, json=args.json)


def demo_command(args: argparse.Namespace) -> int:
    return run_demo(DemoOptions.from_args(args))


def run_demo(opts: DemoOptions) -> int:
    """Fit the linear model; 0 when the loss fell a hundredfold and the replicas agree."""

    async def main() -> dict[str, Any]:
        start = time.perf_counter()
        placement = demo_placement(nproc=opts.nproc, fanout=opts.fanout)
        async with local_session(placement) as controller:
            ready = time.perf_counter() - start
            result = await train_linear(controller, steps=opts.steps)
        return {
            **result,
            "startup_s": round(ready, 2),
            "wall_s": round(time.perf_counter() - start, 2),
        }

    result = run_async(main)
    if opts.json:
        print(json.dumps(result))
    else:
        console.print(
            f"[bold]linear model, {opts.nproc} data-parallel ranks, {result['steps']} steps[/]\n"
            f"loss {result['first_loss']:.4f} → {result['final_loss']:.5f}; "
            f"max weight error {result['weight_error']:.4f}; replicas agree: {result['replicas_agree']}\n"
            f"start-up {result['startup_s']} s, total {result['wall_s']} s"
        )
    ok = result["final_loss"] < 0.01 * result["first_loss"] and result["replicas_agree"]
    return 0 if ok else 1


def _add_demo_command(sub: argparse._SubParsersAction) -> None:
    what = (
        "the mesh's linear-regression demo: a controller drives a data-parallel group that fits "
        "a linear model (not the main job, which is: hybridflow run examples/quickstart.yaml)"
    )
    demo = sub.add_parser("demo", help=what, description=what)
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument("--nproc", type=int, default=2, help="ranks in the group (default 2)")
    demo.add_argument(
        "--fanout",
        choices=("socket", "zmq", "rpc"),
        default="socket",
        help="how rank 0 passes each call to the other ranks (default socket)",
    )
    demo.add_argument("--json", action="store_true", help="print the result as one JSON line")
    demo.set_defaults(fn=demo_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="hybridflow: RL fine-tuning of language models. Start with "
        "hybridflow run examples/quickstart.yaml; each command's --help lists its options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_command(sub)
    add_role_command(sub)
    add_model_commands(sub)
    sub.choices["model"].set_defaults(fn=run_model_command)
    add_train_commands(sub)
    for job in ("sft", "rm"):
        sub.choices[job].set_defaults(fn=run_train_command)
    add_run_commands(sub)
    sub.choices["run"].set_defaults(fn=run_experiment_command)
    sub.choices["controller"].set_defaults(fn=run_experiment_command)
    sub.choices["report"].set_defaults(fn=report_command)
    add_slurm_command(sub)
    add_keys_command(sub)
    add_reshard_command(sub)
    add_plan_command(sub)
    add_trajectories_command(sub)
    add_status_command(sub)
    add_serve_command(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(message)s",
        # not a terminal: one plain line per record, never wrapped (grep, SLURM logs, CI)
        handlers=[
            logging.StreamHandler(sys.stderr)
            if not sys.stderr.isatty()
            else RichHandler(console=console, show_path=False)
        ],
    )
    try:
        sys.exit(args.fn(args))
    except asyncio.CancelledError:
        console.print("[yellow]interrupted; every process was stopped[/]")
        sys.exit(130)
    except Exception as exc:  # one clear line for the user, details with -v
        if args.verbose:
            console.print_exception()
        # escaped: messages quote paths like gloo's "[/.../pair.cc:553]", which rich would
        # read as a closing tag and fail on, hiding the error itself
        console.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
