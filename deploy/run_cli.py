"""``hybridflow run EXPERIMENT.yaml`` and ``hybridflow report RUN_DIR``.

``run`` validates the experiment (exit 2 with the field and the fix when it cannot run), prepares
the run directory — ``config.yaml`` (resolved), ``models/``, ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/``, ``logs/``, ``export/actor`` and ``summary.json`` — starts every role group as
local processes, and runs the trainer with a live view. ``--resume`` continues the newest
checkpoint of ``--run-dir`` with the config saved there. A role that dies ends the run within
seconds with its role, rank and cause (exit 1); the last checkpoint resumes.

``report`` draws PNG plots from a run's ``metrics.jsonl``: reward, KL, response length,
validation score and where each step's time went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def add_run_commands(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="run an experiment (SFT and RL stages)")
    run.add_argument("experiment", nargs="?", type=Path, help="experiment YAML file")
    run.add_argument("--run-dir", type=Path, help="default: runs/<name>-<time>")
    run.add_argument("--resume", action="store_true", help="continue the run dir's checkpoint")
    run.add_argument("--quick", action="store_true", help="apply the file's quick: overrides")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field"
    )
    run.add_argument(
        "--stop-after",
        type=int,
        metavar="STEP",
        help="checkpoint and stop after this global step (continue with --resume)",
    )
    run.add_argument("--json", action="store_true", help="print summary.json as one line")
    run.add_argument(
        "--clusters",
        type=Path,
        metavar="SPEC",
        help="cluster spec YAML: which cluster runs each group (docs/deploy.md)",
    )
    ctl = subparsers.add_parser(
        "controller",
        help="run an experiment's controller alone; its groups join with `hybridflow role`",
        parents=[run],
        add_help=False,
        conflict_handler="resolve",
    )
    ctl.add_argument(
        "--bind", required=True, help="address the groups connect to, e.g. tcp://0.0.0.0:5555"
    )
    ctl.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for every group to join"
    )
    ctl.add_argument(
        "--keys", type=Path, help="CURVE keys (hybridflow keys): needed on an address off this host"
    )
    report = subparsers.add_parser("report", help="PNG plots of a run's metrics")
    report.add_argument("run_dir", type=Path)


def run_experiment_command(args: argparse.Namespace) -> int:
    from deploy.experiment import ExperimentError

    try:
        exp, run_dir = _load(args)
        data, groups = _prepare(exp, run_dir)
    except (ExperimentError, ValueError, FileNotFoundError) as exc:
        print(f"hybridflow run: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        summary = _run(exp, run_dir, data, groups, args)
    except Exception as exc:  # the run failed: say what, where the checkpoints are
        from controller.trainer import checkpoints
        from deploy.cli import console

        failed = f"[red]hybridflow {args.command} failed:[/] {type(exc).__name__}: {exc}"
        console.print(failed, soft_wrap=True)
        if checkpoints(run_dir / "checkpoints"):
            resume = f"hybridflow {args.command} --resume --run-dir {run_dir}"
            if args.clusters is not None:
                resume += f" --clusters {args.clusters}"
            console.print(f"resume from the last checkpoint: {resume}", soft_wrap=True)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(summary))
    elif "stopped_at" in summary:
        print(
            f"stopped after step {summary['stopped_at']}; continue with: "
            f"hybridflow run --resume --run-dir {run_dir}"
        )
    else:
        print(_describe(summary, run_dir))
    return 0


def _load(args: argparse.Namespace) -> tuple[Any, Path]:
    from deploy.experiment import ExperimentError, load, parse

    if args.resume:
        if args.run_dir is None:
            raise ExperimentError("--resume needs --run-dir (the run to continue)")
        saved = args.run_dir / "config.yaml"
        if not saved.is_file():
            raise ExperimentError(f"--resume: {saved} does not exist; is this a run directory?")
        exp = parse(yaml.safe_load(saved.read_text()), args.set, False, str(saved))
        run_dir = args.run_dir
    elif args.experiment is None:
        raise ExperimentError("name an experiment file, e.g. examples/quickstart.yaml")
    if getattr(args, "bind", None) is not None:
        from transport.channel import is_local_address

        if args.clusters is not None:
            raise ExperimentError("give --bind or --clusters (its controller.bind), not both")
        if args.bind.startswith("tcp://"):
            check_bind(args.bind, "--bind")
            if not is_local_address(args.bind) and not args.keys:
                raise ExperimentError(
                    f"--bind {args.bind} leaves this host: it needs CURVE keys; make them with "
                    "`hybridflow keys DIR --clients GROUPS` and pass --keys DIR"
                )
    if not args.resume:
        exp = load(args.experiment, args.set, args.quick)
        run_dir = args.run_dir or Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        from controller.trainer import checkpoints

        if checkpoints(run_dir / "checkpoints"):
            raise ExperimentError(
                f"{run_dir} already holds a run's checkpoints; continue it with --resume, or "
                "give another --run-dir"
            )
    if args.clusters is not None:
        from deploy.clusters import check_spec, load_spec

        spec = load_spec(args.clusters)
        check_bind(spec.controller.bind, "cluster spec controller.bind")
        args.cluster_plan = (spec, check_spec(spec, exp))
    return exp, run_dir


def check_bind(address: str, setting: str) -> None:
    """Fail before anything starts when ``tcp://HOST:PORT`` cannot be bound here: a port in
    use, a host that is not this machine's, a name that does not resolve."""
    import errno
    import socket

    from deploy.experiment import ExperimentError
    from transport.channel import split_tcp

    try:
        host, port = split_tcp(address)
        family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except ValueError as exc:
        raise ExperimentError(f"{setting}: {exc}") from None
    except socket.gaierror as exc:
        raise ExperimentError(f"{setting} {address}: cannot resolve {host!r} ({exc})") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(where)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"port {port} is in use (another controller?); pick another, or :0 for any"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = f"{host} is not an address of this host"
            else:
                why = str(exc)
            raise ExperimentError(f"{setting} {address}: {why}") from None


def _prepare(exp: Any, run_dir: Path) -> tuple[dict[str, Any], list[Any]]:
    from deploy.experiment import build_groups, check, prepare_models, read_data

    data = read_data(exp)  # before anything is written: a bad row costs nothing
    check(exp)  # after the data: stages given in epochs now have their steps
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_models(exp, run_dir)
    groups = build_groups(exp, run_dir)
    resolved = exp.model_dump(mode="json", exclude={"quick"})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    return data, groups


def _run(
    exp: Any, run_dir: Path, data: dict[str, Any], groups: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    from controller.algorithms import Roles
    from controller.metrics import JsonlSink, TensorBoardSink, WandbSink
    from controller.trainer import Trainer, checkpoints
    from deploy.cli import console, run_async
    from deploy.experiment import checkpointed_roles
    from deploy.live import LiveView
    from deploy.session import cluster_session, local_session, remote_session
    from transport.settings import Timeouts

    resume_step = None
    if args.resume:
        found = checkpoints(run_dir / "checkpoints")
        if found:
            saved = json.loads((found[-1] / "controller.json").read_text())
            resume_step = int(saved["global_step"])
    sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if exp.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if exp.logging.wandb:
        sinks.append(WandbSink(run_dir, exp.logging.project, exp.model_dump(mode="json")))
    live = LiveView(exp, console, enabled=exp.logging.live and not args.json)
    sinks.append(live)

    def session() -> Any:
        if args.clusters is not None:
            spec, where = args.cluster_plan
            say = lambda g, command: _announce_one(g, command)  # noqa: E731
            return cluster_session(groups, spec, where, run_dir, Timeouts.from_env(), say)
        if getattr(args, "bind", None) is None:
            return local_session(groups, run_dir=run_dir)
        timeouts = Timeouts.from_env().model_copy(update={"connect_s": args.wait})
        token = os.environ.get("HYBRIDFLOW_TOKEN") or None  # set by a launcher (SLURM script)
        curve = None
        if args.keys is not None:
            from deploy.keys_cli import server_files
            from transport.security import CurveServer

            curve = CurveServer(*server_files(args.keys))
        announce = lambda a, t: _announce(groups, a, t, args.keys)  # noqa: E731
        return remote_session(groups, args.bind, timeouts, announce, token, curve)

    async def main() -> dict[str, Any]:
        start = time.perf_counter()
        async with session() as controller:
            ready = time.perf_counter() - start
            roles = Roles.placed(controller)
            trainer = Trainer(
                exp.trainer,
                exp.stages,
                roles,
                roles.engines(),
                data,
                run_dir,
                checkpointed_roles(exp),
                sinks,
                args.stop_after,
            )
            with live:
                result = await trainer.run(resume=args.resume)
        wall = time.perf_counter() - start
        return {"name": exp.name, **result, "startup_s": round(ready, 2), "wall_s": round(wall, 2)}

    try:
        summary: dict[str, Any] = run_async(main)
    finally:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
    summary["run_dir"] = str(run_dir)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(run_dir / "summary.json")
    return summary


def _announce(groups: list[Any], address: str, token: str, keys: Path | None = None) -> None:
    """How to start each group (stderr, so --json output stays one line)."""
    from deploy.cli import console

    console.print(f"controller listening on {address}; start each group with:")
    for g in groups:
        console.print(
            f"  HYBRIDFLOW_TOKEN={token} hybridflow role {','.join(g.roles)} --connect {address} "
            f"--group {g.name} --nproc {g.nproc} --tp {g.tp} --device {g.device}"
            + (f" --keys {keys} --client {g.name}" if keys else ""),
            soft_wrap=True,
        )


def _announce_one(group: Any, command: str) -> None:
    from deploy.cli import console

    console.print(f"start group {group.name} by hand with:\n  {command}", soft_wrap=True)


def _describe(summary: dict[str, Any], run_dir: Path) -> str:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    return (
        f"{summary['name']}: validation score init {fmt(summary['val_acc_init'])}, "
        f"before RL {fmt(summary['val_acc_before'])}, after {fmt(summary['val_acc_after'])} "
        f"in {summary['wall_s']} s ({summary['steps']} steps)\nrun: {run_dir}"
    )


def report_command(args: argparse.Namespace) -> int:
    from deploy.report import write_report

    try:
        written = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hybridflow report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in written:
        print(path)
    return 0
