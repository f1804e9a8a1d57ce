"""``hybridflow sft`` and ``hybridflow rm``: supervised training jobs on a local role group.

    hybridflow sft --model M --data builtin:arithmetic?n=4000&split=sft --out M-sft
    hybridflow rm  --model M --data builtin:preference?n=4000&split=train --out M-rm

Everything that can be checked is checked before a process starts: the datasets (a bad row is
reported by file and line), the model folder, the engine settings. Then one group of ``--nproc``
ranks (``--tp`` of them per tensor-parallel group) trains; held-out loss (SFT) or pairwise
accuracy (RM) is measured before, every ``--eval-every`` steps and after; the result is exported
as a plain Hugging Face folder to ``--out``; ``metrics.jsonl`` and ``summary.json`` go to
``--run-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2

JOBS = {
    "sft": ("roles.actor:Actor", "actor"),
    "rm": ("roles.reward:ModelReward", "reward"),
}


def add_train_commands(subparsers: argparse._SubParsersAction) -> None:
    sft = subparsers.add_parser("sft", help="supervised fine-tuning of a causal LM")
    _common(sft, "builtin:arithmetic?n=4000&split=sft", "builtin:arithmetic?n=256&split=test")
    sft.add_argument(
        "--full-sequence",
        action="store_true",
        help="train on prompt tokens too (default: only the response)",
    )
    sft.add_argument("--pack", action="store_true", help="pack rows into context-long rows")
    rm = subparsers.add_parser("rm", help="train a reward model on preference pairs")
    _common(rm, "builtin:preference?n=4000&split=train", "builtin:preference?n=512&split=test")


def _common(p: argparse.ArgumentParser, data: str, val: str) -> None:
    p.add_argument("--model", required=True, help="model folder to start from")
    p.add_argument("--data", default=data, help=f"JSONL, Parquet or builtin:... (default {data})")
    p.add_argument("--val", default=val, help=f"held-out rows (default {val})")
    p.add_argument("--out", required=True, type=Path, help="where the trained model is exported")
    p.add_argument("--run-dir", type=Path, help="metrics and logs (default runs/<job>-<time>)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    p.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="cosine")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--nproc", type=int, default=1, help="ranks in the training group")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--dp-mode",
        choices=("fsdp", "replicate"),
        default="fsdp",
        help="replicate: whole weights per rank, one gradient all-reduce (faster for small models)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def _prepare(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """Datasets, placement and model checked up front; raises ValueError subclasses."""
    from controller.data import PREFERENCE_COLUMNS, SFT_COLUMNS, read_rows
    from controller.placement import GroupSpec
    from roles.engines.training.config import EngineConfig
    from roles.engines.training.fsdp import check_tp
    from roles.modeling.models import check_model_dir

    columns = SFT_COLUMNS if args.command == "sft" else PREFERENCE_COLUMNS
    train, val = read_rows(args.data, columns), read_rows(args.val, columns)
    cls, role = JOBS[args.command]
    engine = EngineConfig.model_validate(
        {
            "model": str(args.model),
            "dtype": args.dtype,
            "micro_batch_size": args.micro_batch_size,
            "dp_mode": args.dp_mode,
            "seed": args.seed,
            "optim": {
                "lr": args.lr,
                "warmup_steps": min(args.warmup, args.steps),
                "schedule": args.schedule,
                "total_steps": args.steps,
            },
        }
    )
    model_config, _ = check_model_dir(args.model)
    check_tp(model_config, args.tp)
    group = GroupSpec.model_validate(
        {
            "name": args.command,
            "roles": {role: {"cls": cls, "config": engine.model_dump()}},
            "nproc": args.nproc,
            "tp": args.tp,
        }
    )
    return group, train, val


def run_train_command(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        group, train, val = _prepare(args)
    except (ValueError, ValidationError) as e:
        print(f"hybridflow {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = args.run_dir or Path("runs") / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = _train(args, group, train, val, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary))
    else:
        key = "loss" if args.command == "sft" else "accuracy"
        before, after = summary["before"][key], summary["after"][key]
        print(f"{args.command}: held-out {key} {before:.4f} → {after:.4f} in {summary['wall_s']} s")
        print(f"model: {args.out}  run: {run_dir}")
    return 0


def _train(
    args: argparse.Namespace,
    group: Any,
    train: list[dict[str, Any]],
    val: list[dict[str, Any]],
    run_dir: Path,
) -> dict[str, Any]:
    from controller.clients import ActorClient, RewardModelClient
    from controller.supervised import LoopConfig, reward_model, sft
    from deploy.cli import console, run_async
    from deploy.session import local_session

    loop = LoopConfig(args.steps, args.batch_size, args.eval_every, args.seed)
    metrics = (run_dir / "metrics.jsonl").open("w")

    def log(record: dict[str, Any]) -> None:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        if any(k.startswith("val/") for k in record) and not args.json:
            shown = {k: round(v, 4) for k, v in record.items() if k.startswith("val/")}
            console.print(f"step {record['step']}: {shown}")

    async def main() -> dict[str, Any]:
        start = time.perf_counter()
        async with local_session([group], run_dir=run_dir) as controller:
            ready = time.perf_counter() - start
            name = JOBS[args.command][1]
            role: ActorClient | RewardModelClient
            if args.command == "sft":
                role = ActorClient(controller, name)
                result = await sft(role, train, val, loop, log, not args.full_sequence, args.pack)
            else:
                role = RewardModelClient(controller, name)
                result = await reward_model(role, train, val, loop, log)
            await role.export(str(Path(args.out).resolve()))
        wall = time.perf_counter() - start
        return {**result, "startup_s": round(ready, 2), "wall_s": round(wall, 2)}

    try:
        result: dict[str, Any] = run_async(main)
    finally:
        metrics.close()
    return {"job": args.command, "model": str(args.out), **result}
