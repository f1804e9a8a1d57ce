"""``hybridflow reshard-plan``: what resharding a model from training to generation costs, on paper.

    hybridflow reshard-plan --model llama2-70b --train 1-8-16 --gen 1-4 [--scheme all] [--json]

``--model`` is a preset (``reshard.shapes.PRESETS``: llama2-7b, llama2-13b, llama3-8b, llama-34b,
llama2-70b) or a model folder / ``config.json`` of a Llama-family model. ``--train P-T-D`` is the
training layout (pipeline stages, tensor shards, data replicas), ``--gen PG-TG`` the generation
one (the micro-DP size d_g = P·T/(PG·TG) follows). For each scheme (``reshard.plan``) it plans the
transfer without moving a byte and prints: bytes received per rank (the most any rank receives),
the paper's formula for it, peak extra memory per rank, the generation shard, the gather groups and
the number of buckets. ``--fsdp`` models training weights sharded over dp as well (the gather then
spans dp; the formula column switches to that case). ``--json`` prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from reshard.layout import GenLayout, LayoutError, Param, gen_groups, parse_layout
from reshard.plan import DEFAULT_BUCKET_BYTES, SCHEMES, Scheme, make_plan, table_bytes
from reshard.shapes import PRESETS, LlamaDims, check_heads, from_hf_config, llama_params
from transport.protocol import Layout

EXIT_BAD_INPUT = 2
#: the rank groups are printed when the world is at most this large
SHOW_GROUPS_UP_TO = 16


@dataclass(frozen=True)
class ReshardPlanOptions:
    """``hybridflow reshard-plan``'s options, typed (``from_args`` reads the command line)."""

    model: str = "llama2-7b"
    train: str = "1-4-2"
    gen: str = "1-2"
    scheme: str = "all"
    fsdp: bool = False
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    dtype_bytes: int | None = None
    json: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReshardPlanOptions:
        return cls(
            model=args.model,
            train=args.train,
            gen=args.gen,
            scheme=args.scheme,
            fsdp=args.fsdp,
            bucket_mb=args.bucket_mb,
            dtype_bytes=args.dtype_bytes,
            json=args.json,
        )


def add_reshard_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "reshard-plan", help="plan a training → generation weight reshard (bytes, memory, groups)"
    )
    p.add_argument("--model", default="llama2-7b", help=f"{', '.join(PRESETS)} or a model PATH")
    p.add_argument("--train", default="1-4-2", help="training layout P-T-D (default 1-4-2)")
    p.add_argument("--gen", default="1-2", help="generation layout PG-TG (default 1-2)")
    p.add_argument(
        "--scheme",
        choices=(*SCHEMES, "all"),
        default="all",
        help="which weight-transfer scheme to plan (default all, side by side)",
    )
    p.add_argument("--fsdp", action="store_true", help="training weights also sharded over dp")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help=f"MiB sent per bucket (default {DEFAULT_BUCKET_BYTES >> 20})",
    )
    p.add_argument("--dtype-bytes", type=int, default=None, help="bytes per weight (default 2)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(fn=reshard_plan_command)


def reshard_plan_command(args: argparse.Namespace) -> int:
    return run_reshard_plan(ReshardPlanOptions.from_args(args))


def run_reshard_plan(opts: ReshardPlanOptions) -> int:
    """Plan every asked scheme and print the result; 2 on bad input (the reason on stderr)."""
    try:
        result = plan_report(opts)
    except LayoutError as e:
        print(f"hybridflow reshard-plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if opts.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


def load_dims(model: str, dtype_bytes: int | None) -> LlamaDims:
    """A preset's dimensions or a model folder's / config.json's."""
    if model in PRESETS:
        dims = PRESETS[model]
        if dtype_bytes is None:
            return dims
        return LlamaDims(**{**dims.__dict__, "itemsize": dtype_bytes})
    if not Path(model).exists():
        raise LayoutError(
            f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a model folder "
            "or config.json"
        )
    return from_hf_config(model, itemsize=dtype_bytes)


def parse_layouts(train: str, gen: str) -> tuple[Layout, GenLayout]:
    """``P-T-D`` and ``PG-TG`` (a third part, d_g, is accepted when it is the implied one)."""
    tr, ge = parse_layout(train), parse_layout(gen)
    if len(tr) != 3:
        raise LayoutError(f"--train {train!r}: expected P-T-D, e.g. 1-8-16")
    if len(ge) not in (2, 3):
        raise LayoutError(f"--gen {gen!r}: expected PG-TG, e.g. 1-4")
    layout, gen_layout = Layout(dp=tr[2], tp=tr[1], pp=tr[0]), GenLayout(tp=ge[1], pp=ge[0])
    d_g = gen_layout.micro_dp(layout)  # raises when PG-TG does not divide P-T
    if len(ge) == 3 and ge[2] != d_g:
        raise LayoutError(f"--gen {gen!r}: d_g must be P·T/(PG·TG) = {d_g} for --train {train}")
    return layout, gen_layout


def formula_bytes(scheme: Scheme, train: Layout, gen: GenLayout, model: int, fsdp: bool) -> float:
    """The per-rank volume by formula: the paper's table, or with FSDP the gather over every
    rank holding M/(t·p·d) (HybridFlow: M/(t_g·p_g) - M/(t·p·d))."""
    if not fsdp:
        return table_bytes(scheme, train, gen, model)
    n = train.world_size
    if scheme == "hybridflow":
        return model / (gen.tp * gen.pp) - model / n
    return (n - 1) / n * model


def plan_report(opts: ReshardPlanOptions) -> dict[str, Any]:
    """Plan each scheme; the whole answer as one JSON-ready dict."""
    train, gen = parse_layouts(opts.train, opts.gen)
    dims = load_dims(opts.model, opts.dtype_bytes)
    for tp in (train.tp, gen.tp):
        check_heads(dims, tp)
    params = llama_params(dims, train.pp)
    schemes = SCHEMES if opts.scheme == "all" else tuple(s for s in SCHEMES if s == opts.scheme)
    if not schemes:
        raise LayoutError(f"scheme {opts.scheme!r}: pick one of {', '.join(SCHEMES)} or all")
    bucket = max(1, int(opts.bucket_mb * 2**20))
    model = sum(p.nbytes for p in params)
    rows = [scheme_row(params, train, gen, s, opts.fsdp, bucket) for s in schemes]
    return {
        "model": opts.model,
        "model_bytes": model,
        "params": len(params),
        "train": opts.train,
        "gen": f"{gen.pp}-{gen.tp}-{gen.micro_dp(train)}",
        "world": train.world_size,
        "fsdp": opts.fsdp,
        "bucket_bytes": bucket,
        "gen_tp_groups": gen_groups(train, gen, "hybridflow")["tp"],
        "plans": rows,
    }


def scheme_row(
    params: list[Param], train: Layout, gen: GenLayout, scheme: Scheme, fsdp: bool, bucket: int
) -> dict[str, Any]:
    start = time.perf_counter()
    plan = make_plan(params, train, gen, scheme, fsdp=fsdp, bucket_bytes=bucket)
    summary = plan.summary()
    model = sum(p.nbytes for p in params)
    groups = [g.members for g in plan.groups]
    return {
        "scheme": scheme,
        "recv_bytes_max": summary["recv_bytes_max"],
        "formula_bytes": formula_bytes(scheme, train, gen, model, fsdp),
        "send_bytes_max": summary["send_bytes_max"],
        "peak_extra_bytes_max": summary["peak_extra_bytes_max"],
        "gen_bytes_max": summary["gen_bytes_max"],
        "group_count": len(groups),
        "group_size": max(len(g) for g in groups),
        "groups": groups,
        "buckets_max": summary["buckets_max"],
        "plan_s": round(time.perf_counter() - start, 3),
    }


def unit_of(n: float) -> tuple[str, int]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return unit, size
    return "B", 1


def human(n: float) -> str:
    unit, size = unit_of(n)
    return f"{n / size:.2f} {unit}"


def print_report(result: dict[str, Any]) -> None:
    """One table, a row per scheme, sizes in one unit (the model's)."""
    title = (
        f"{result['model']} ({human(result['model_bytes'])}): train {result['train']} → "
        f"gen {result['gen']} on {result['world']} ranks"
        + (" — FSDP: training weights sharded over dp too" if result["fsdp"] else "")
    )
    unit, size = unit_of(result["model_bytes"])
    table = Table(title=title, caption=f"sizes in {unit}", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("scheme", no_wrap=True)
    for column in ("recv/rank", "formula", "peak extra", "gen shard"):
        table.add_column(column, justify="right", no_wrap=True)
    for column in ("groups", "buckets"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in result["plans"]:
        sizes = ("recv_bytes_max", "formula_bytes", "peak_extra_bytes_max", "gen_bytes_max")
        table.add_row(
            row["scheme"],
            *(f"{row[k] / size:.2f}" for k in sizes),
            f"{row['group_count']}x{row['group_size']}",
            str(row["buckets_max"]),
        )
    out = Console()
    out.print(table)
    if result["world"] <= SHOW_GROUPS_UP_TO:
        out.print(f"generation TP groups (hybridflow grouping): {result['gen_tp_groups']}")
        for row in result["plans"]:
            out.print(f"{row['scheme']} gather groups: {row['groups']}")
    out.print(f"bucket {human(result['bucket_bytes'])}; per rank: the largest over the ranks")
