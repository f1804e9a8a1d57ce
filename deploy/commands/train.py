"""``hybridflow sft`` and ``hybridflow rm``: supervised training jobs on a local role group.

    hybridflow sft --model M --data builtin:arithmetic?n=4000&split=sft --out M-sft
    hybridflow rm  --model M --data builtin:preference?n=4000&split=train --out M-rm

Everything that can be checked is checked before a process starts: the datasets (a bad row is
reported by file and line), the model folder, the engine settings. Then one group of ``--nproc``
ranks (``--tp`` of them per tensor-parallel group) trains; held-out loss (SFT) or pairwise
accuracy (RM) is measured before, every ``--eval-every`` steps and after; the result is exported
as a plain Hugging Face folder to ``--out``; ``metrics.jsonl`` and ``summary.json`` go to
``--run-dir``. The command line becomes one ``TrainOptions`` at the edge (``run_train_command``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from controller.clients import ActorClient, RewardModelClient
from controller.data import PREFERENCE_COLUMNS, SFT_COLUMNS, read_rows
from controller.placement import GroupSpec
from controller.server import Controller
from controller.supervised import Log, LoopConfig, reward_model, sft
from deploy.session import local_session
from deploy.terminal import add_device_option, console, run_async
from roles.runtime.device import DeviceError, check_device
from transport.device import DeviceKind

EXIT_BAD_INPUT = 2

JOBS = {
    "sft": ("roles.actor:Actor", "actor"),
    "rm": ("roles.reward:ModelReward", "reward"),
}
Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class TrainOptions:
    """``hybridflow sft`` / ``hybridflow rm`` options, typed (``from_args`` reads the parsed
    command line); ``full_sequence`` and ``pack`` are SFT's only."""

    job: Literal["sft", "rm"]
    model: str
    data: str
    val: str
    out: Path
    run_dir: Path | None = None
    steps: int = 200
    batch_size: int = 32
    eval_every: int = 50
    lr: float = 1e-3
    warmup: int = 10
    schedule: str = "cosine"
    micro_batch_size: int = 16
    dtype: str = "auto"
    nproc: int = 1
    tp: int = 1
    device: str = DeviceKind.CPU.value
    dp_mode: str = "fsdp"
    seed: int = 0
    json: bool = False
    full_sequence: bool = False
    pack: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        return cls(
            job=args.command,
            model=args.model,
            data=args.data,
            val=args.val,
            out=args.out,
            run_dir=args.run_dir,
            steps=args.steps,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
            lr=args.lr,
            warmup=args.warmup,
            schedule=args.schedule,
            micro_batch_size=args.micro_batch_size,
            dtype=args.dtype,
            nproc=args.nproc,
            tp=args.tp,
            device=args.device,
            dp_mode=args.dp_mode,
            seed=args.seed,
            json=args.json,
            full_sequence=getattr(args, "full_sequence", False),  # sft only
            pack=getattr(args, "pack", False),
        )


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
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per step (default 32)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=50,
        help="steps between held-out evaluations; 0: only before and after (default 50)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    p.add_argument(
        "--schedule",
        choices=("constant", "linear", "cosine"),
        default="cosine",
        help="learning rate after the warm-up (default cosine)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=16,
        help="rows per forward/backward pass; gradients add up to the batch (default 16)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="auto: bf16 where the hardware multiplies bf16 natively, else fp32",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks in the training group")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    add_device_option(p, "where the ranks compute (cuda: one GPU per rank, NCCL between them)")
    p.add_argument(
        "--dp-mode",
        choices=("fsdp", "replicate"),
        default="fsdp",
        help="replicate: whole weights per rank, one gradient all-reduce (faster for small models)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def _prepare(opts: TrainOptions) -> tuple[GroupSpec, Rows, Rows]:
    """Datasets, placement and model checked up front; raises ValueError subclasses."""
    # roles code (transformers) loads only once a training job is being checked
    from roles.engines.training.common import check_tp
    from roles.engines.training.config import EngineConfig
    from roles.modeling.models import check_model_dir

    columns = SFT_COLUMNS if opts.job == "sft" else PREFERENCE_COLUMNS
    train, val = read_rows(opts.data, columns), read_rows(opts.val, columns)
    cls, role = JOBS[opts.job]
    engine = EngineConfig.model_validate(
        {
            "model": str(opts.model),
            "dtype": opts.dtype,
            "micro_batch_size": opts.micro_batch_size,
            "dp_mode": opts.dp_mode,
            "seed": opts.seed,
            "optim": {
                "lr": opts.lr,
                "warmup_steps": min(opts.warmup, opts.steps),
                "schedule": opts.schedule,
                "total_steps": opts.steps,
            },
        }
    )
    model_config, _ = check_model_dir(opts.model)
    check_tp(model_config, opts.tp)
    group = GroupSpec.model_validate(
        {
            "name": opts.job,
            "roles": {role: {"cls": cls, "config": engine.model_dump()}},
            "nproc": opts.nproc,
            "tp": opts.tp,
            "device": opts.device,
        }
    )
    return group, train, val


def run_train_command(args: argparse.Namespace) -> int:
    return run_training(TrainOptions.from_args(args))


def run_training(opts: TrainOptions) -> int:
    """Check, train, export; print the held-out metric before and after (or one JSON line)."""
    try:
        group, train, val = _prepare(opts)
        check_device(group.device, group.name, group.nproc)  # the ranks start on this machine
    except (ValueError, ValidationError, DeviceError) as e:
        print(f"hybridflow {opts.job}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = opts.run_dir or Path("runs") / f"{opts.job}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = _train(opts, group, train, val, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if opts.json:
        print(json.dumps(summary))
    else:
        key = "loss" if opts.job == "sft" else "accuracy"
        before, after = summary["before"][key], summary["after"][key]
        print(f"{opts.job}: held-out {key} {before:.4f} → {after:.4f} in {summary['wall_s']} s")
        print(f"model: {opts.out}  run: {run_dir}")
    return 0


def _train(
    opts: TrainOptions, group: GroupSpec, train: Rows, val: Rows, run_dir: Path
) -> dict[str, Any]:
    """One local group, the job's loop, metrics.jsonl; the summary of the job."""
    loop = LoopConfig(opts.steps, opts.batch_size, opts.eval_every, opts.seed)
    metrics = (run_dir / "metrics.jsonl").open("w")

    def log(record: dict[str, Any]) -> None:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        if any(k.startswith("val/") for k in record) and not opts.json:
            shown = {k: round(v, 4) for k, v in record.items() if k.startswith("val/")}
            console.print(f"step {record['step']}: {shown}")

    async def main() -> dict[str, Any]:
        start = time.perf_counter()
        async with local_session([group], run_dir=run_dir) as controller:
            ready = time.perf_counter() - start
            result = await _job(opts, controller, train, val, loop, log)
        wall = time.perf_counter() - start
        return {**result, "startup_s": round(ready, 2), "wall_s": round(wall, 2)}

    try:
        result = run_async(main)
    finally:
        metrics.close()
    return {"job": opts.job, "model": str(opts.out), **result}


async def _job(
    opts: TrainOptions,
    controller: Controller,
    train: Rows,
    val: Rows,
    loop: LoopConfig,
    log: Log,
) -> dict[str, Any]:
    """The job's loop on its role, then the model exported to ``--out``."""
    name = JOBS[opts.job][1]
    role: ActorClient | RewardModelClient
    if opts.job == "sft":
        role = ActorClient(controller, name)
        result = await sft(role, train, val, loop, log, not opts.full_sequence, opts.pack)
    else:
        role = RewardModelClient(controller, name)
        result = await reward_model(role, train, val, loop, log)
    await role.export(str(Path(opts.out).resolve()))
    return result
