"""``hybridflow run EXPERIMENT.yaml`` and ``hybridflow report RUN_DIR``.

``run`` validates the experiment (exit 2 with the field and the fix when it cannot run), prepares
the run directory — ``config.yaml`` (resolved), ``models/``, ``metrics.jsonl``, ``tensorboard/``,
``checkpoints/``, ``logs/``, ``export/actor`` and ``summary.json`` — starts every role group as
local processes, and runs the trainer with a live view. ``--resume`` continues the newest
checkpoint of ``--run-dir`` with the config saved there; that checkpoint is looked up (and the
metrics file checked) before anything in the run directory is written, so a resume that cannot
start changes nothing. A role that dies ends the run within seconds with its role, rank and cause
(exit 1); Ctrl-C stops every process (exit 130). Either way the command that continues the run is
printed, or, before its first checkpoint, that none exists yet.

``report`` draws PNG plots from a run's ``metrics.jsonl`` (one panel per stage: reward, KL,
response length, validation score, where each step's time went), prints a one-screen summary
with the newest logged answers, and with ``--html`` writes them all on one page
(``deploy/reports/summary.py``).

The command line becomes one ``RunOptions`` at the edge (``run_experiment_command``); what
``_load`` and ``_prepare`` validate becomes one ``Run``; the steps below take those, never the
argparse Namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shlex
import shutil
import sys
import time
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape

from controller.metrics import (
    SAMPLES_FILE,
    JsonlSink,
    MetricsError,
    TensorBoardSink,
    WandbSink,
    read_records,
)
from controller.placement import GroupSpec
from controller.server import Controller
from controller.snapshots import Snapshots
from controller.steps import Roles
from controller.supervisor import Supervisor
from controller.trainer import Sink, Trainer, checkpoints, newest_step
from deploy.clusters import ClusterPlan, check_bind, cluster_plan
from deploy.commands.keys import server_files
from deploy.experiment import (
    RULE_CLASS,
    Experiment,
    ExperimentError,
    check,
    checkpointed_roles,
    load,
    parse,
    prepare_models,
    read_data,
    reference_in_actor,
    role_class,
)
from deploy.groups import build_groups
from deploy.launchers.forkserver import prestart
from deploy.launchers.local import SHM_ROOT, SocketFolder, sweep_socket_folders
from deploy.processes import set_title, started_as_command
from deploy.reports.live import LiveView
from deploy.reports.summary import run_report
from deploy.session import cluster_session, local_session, remote_session
from deploy.terminal import console, run_async
from transport.channel import is_local_address
from transport.security import CurveServer
from transport.settings import Timeouts

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by SIGINT
NO_CHECKPOINT_YET = (
    "a run writes one at each stage end, every trainer.save_every steps (or save_every_s "
    "seconds) and after the step in flight at the first Ctrl-C"
)
Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class RunOptions:
    """``hybridflow run`` and ``hybridflow controller`` options, typed; ``bind``, ``wait`` and
    ``keys`` are the controller command's (``bind`` None: every group starts here)."""

    command: str = "run"
    experiment: Path | None = None
    run_dir: Path | None = None
    resume: bool = False
    quick: bool = False
    overrides: tuple[str, ...] = ()
    stop_after: int | None = None
    json: bool = False
    clusters: Path | None = None
    bind: str | None = None
    wait: float = 120.0
    keys: Path | None = None
    token_file: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        return cls(
            command=args.command,
            experiment=args.experiment,
            run_dir=args.run_dir,
            resume=args.resume,
            quick=args.quick,
            overrides=tuple(args.set),
            stop_after=args.stop_after,
            json=args.json,
            clusters=args.clusters,
            bind=getattr(args, "bind", None),  # the controller command's only
            wait=getattr(args, "wait", 120.0),
            keys=getattr(args, "keys", None),
            token_file=getattr(args, "token_file", None),
        )


@dataclass(frozen=True)
class Run:
    """A run that passed every check: the experiment, where it writes, its datasets, the groups
    to start, (``--clusters``) where each starts and (``--resume``) the global step of the
    checkpoint it continues."""

    exp: Experiment
    run_dir: Path
    data: dict[str, Rows]
    groups: list[GroupSpec]
    plan: ClusterPlan | None = None
    resume_step: int | None = None


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
        "--supervise",
        action="store_true",
        help="run the controller as a child process and restart it with --resume when it dies "
        "(deploy/commands/supervise.py)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="with --supervise: controller restarts allowed within --restart-window",
    )
    run.add_argument(
        "--restart-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with --supervise: the window --max-restarts counts restarts in",
    )
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
    ctl.add_argument(
        "--token-file",
        type=Path,
        help="also write the token the groups need to this file (mode 0600), for scripts: "
        "hybridflow role ... --token-file FILE",
    )
    report = subparsers.add_parser(
        "report", help="plots, a one-screen summary and the logged answers of a run"
    )
    report.add_argument("run_dir", type=Path, help="the run directory (plots go to RUN_DIR/plots)")
    report.add_argument(
        "--html",
        action="store_true",
        help="also write RUN_DIR/report.html: the summary, the plots and the samples on one page",
    )


def run_experiment_command(args: argparse.Namespace) -> int:
    if args.supervise:  # this command again, as a child restarted when it dies
        from deploy.commands.supervise import supervise_command

        return supervise_command(args, sys.argv)
    return run_experiment(RunOptions.from_args(args))


def run_experiment(opts: RunOptions) -> int:
    """Validate (exit 2 naming the field), run (exit 1 naming the cause and how to resume; 130
    on Ctrl-C, saying the same)."""
    try:
        exp, run_dir, plan, resume_step = _load(opts)
        prestart()  # the fork server imports while the models and data are prepared
        data, groups = _prepare(exp, run_dir)
    except (ExperimentError, ValueError, FileNotFoundError) as exc:
        print(f"hybridflow {opts.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before the event loop took SIGINT over
        console.print("[yellow]interrupted before the run started[/]")
        return EXIT_INTERRUPTED
    try:
        summary = _run(Run(exp, run_dir, data, groups, plan, resume_step), opts)
    except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: the session stopped them all
        console.print("[yellow]interrupted; every process was stopped[/]")
        _say_how_to_continue(opts, run_dir)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the run failed: say what, where the checkpoints are
        _say_failed(opts, run_dir, exc)
        return EXIT_FAILED
    if summary.get("interrupted"):  # Ctrl-C once: the step finished and a checkpoint written
        console.print(
            f"[yellow]interrupted after step {summary['stopped_at']}; checkpoint written[/]"
        )
        _say_how_to_continue(opts, run_dir)
        return EXIT_INTERRUPTED
    if opts.json:
        print(json.dumps(summary))
    elif "stopped_at" in summary:
        print(f"stopped after step {summary['stopped_at']}; continue with: {_again(opts, run_dir)}")
    else:
        print(_describe(summary, run_dir))
    return 0


def _say_failed(opts: RunOptions, run_dir: Path, exc: Exception) -> None:
    # the cause is escaped: it quotes paths like gloo's "[/.../pair.cc:553]", markup to rich
    cause = escape(f"{type(exc).__name__}: {exc}")
    console.print(f"[red]hybridflow {opts.command} failed:[/] {cause}", soft_wrap=True)
    if checkpoints(run_dir / "checkpoints"):
        resume = _again(opts, run_dir)
        console.print(f"resume from the last checkpoint: {escape(resume)}", soft_wrap=True)


def _say_how_to_continue(opts: RunOptions, run_dir: Path) -> None:
    """After Ctrl-C: the resume command, or that no checkpoint exists yet and how to start over."""
    step = _resume_step(run_dir)
    if step is not None:
        again = _again(opts, run_dir)
        console.print(f"continue from step {step} with: {escape(again)}", soft_wrap=True)
    else:
        again = _again(opts, run_dir, resume=False)
        console.print(
            f"no checkpoint exists yet ({NO_CHECKPOINT_YET}); start over with: {escape(again)}",
            soft_wrap=True,
        )


def _again(opts: RunOptions, run_dir: Path, resume: bool = True) -> str:
    """The command that continues the run in ``run_dir`` from its last checkpoint (``resume``),
    or starts it over from its saved config; with the options that say where groups run."""
    words = ["hybridflow", opts.command]
    words += ["--resume"] if resume else [str(run_dir / "config.yaml")]
    words += ["--run-dir", str(run_dir)]
    if opts.clusters is not None:
        words += ["--clusters", str(opts.clusters)]
    if opts.bind is not None:
        words += ["--bind", opts.bind]
    if opts.keys is not None:
        words += ["--keys", str(opts.keys)]
    return shlex.join(words)


def _load(opts: RunOptions) -> tuple[Experiment, Path, ClusterPlan | None, int | None]:
    """The experiment (saved config on ``--resume``), its run dir, cluster plan and the step
    it resumes at, with the options checked in the order a user meets them."""
    resume_step = None
    if opts.resume:
        exp, run_dir, resume_step = _resumed(opts)
        _check_bind_option(opts)
    elif opts.experiment is None:
        raise ExperimentError("name an experiment file, e.g. examples/quickstart.yaml")
    else:
        _check_bind_option(opts)
        exp, run_dir = _fresh(opts, opts.experiment)
    plan = cluster_plan(opts.clusters, exp) if opts.clusters is not None else None
    return exp, run_dir, plan, resume_step


def _resumed(opts: RunOptions) -> tuple[Experiment, Path, int]:
    """``--resume``: the config saved in ``--run-dir`` (``--set`` still applies) and the step of
    its newest checkpoint, looked up before anything in the run dir is written."""
    if opts.run_dir is None:
        raise ExperimentError("--resume needs --run-dir (the run to continue)")
    saved = opts.run_dir / "config.yaml"
    if not saved.is_file():
        raise ExperimentError(f"--resume: {saved} does not exist; is this a run directory?")
    step = _resume_point(opts, opts.run_dir)
    exp = parse(yaml.safe_load(saved.read_text()), opts.overrides, False, str(saved))
    return exp, opts.run_dir, step


def _resume_point(opts: RunOptions, run_dir: Path) -> int:
    """The newest checkpoint's step, and metrics and samples files that can be cut back to it."""
    step = _resume_step(run_dir)
    if step is None:
        raise ExperimentError(
            f"--resume: {run_dir} holds no checkpoint yet ({NO_CHECKPOINT_YET}), so there is "
            f"nothing to continue and nothing was changed; start the run over with: "
            f"{_again(opts, run_dir, resume=False)}"
        )
    for records in (run_dir / "metrics.jsonl", run_dir / SAMPLES_FILE):  # both are cut back
        try:
            if records.exists():
                read_records(records)
        except MetricsError as exc:
            raise ExperimentError(
                f"--resume: {exc}, then resume again with: {_again(opts, run_dir)}"
            ) from None
    return step


def _fresh(opts: RunOptions, experiment: Path) -> tuple[Experiment, Path]:
    """A new run of ``experiment``: its run dir must hold no earlier run's checkpoints."""
    exp = load(experiment, opts.overrides, opts.quick)
    run_dir = opts.run_dir or Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if checkpoints(run_dir / "checkpoints"):
        raise ExperimentError(
            f"{run_dir} already holds a run's checkpoints; continue it with --resume, or "
            "give another --run-dir"
        )
    return exp, run_dir


def _check_bind_option(opts: RunOptions) -> None:
    """``--bind`` (controller command): not with ``--clusters``; bindable here; keys off-host."""
    if opts.bind is None:
        return
    if opts.clusters is not None:
        raise ExperimentError("give --bind or --clusters (its controller.bind), not both")
    if opts.bind.startswith("tcp://"):
        check_bind(opts.bind, "--bind")
        if not is_local_address(opts.bind) and not opts.keys:
            raise ExperimentError(
                f"--bind {opts.bind} leaves this host: it needs CURVE keys; make them with "
                "`hybridflow keys DIR --clients GROUPS` and pass --keys DIR"
            )


def _prepare(exp: Experiment, run_dir: Path) -> tuple[dict[str, Rows], list[GroupSpec]]:
    """Check, then write the run dir. The checks that need the models made (build_groups) come
    after they are; when one fails, a run dir this call created is removed again, so a config
    error leaves nothing behind, as the docs promise."""
    data = read_data(exp)  # before anything is written: a bad row costs nothing
    check(exp)  # after the data: stages given in epochs now have their steps
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        prepare_models(exp, run_dir)
        groups = build_groups(exp, run_dir)
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)  # links inside are removed, not followed
        raise
    resolved = exp.model_dump(mode="json", exclude={"quick"})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    return data, groups


def _run(run: Run, opts: RunOptions) -> dict[str, Any]:
    """Start the groups, train with the live view and the metric sinks, write summary.json."""
    exp, run_dir = run.exp, run.run_dir
    live = LiveView(exp, console, enabled=exp.logging.live and not opts.json, run_dir=run_dir)
    # on --resume the step was found before anything was written (None would empty the file)
    assert run.resume_step is not None or not opts.resume
    sinks: list[Sink] = [*_sinks(exp, run_dir, run.resume_step)]
    sinks.append(live)
    if started_as_command():  # a program that runs this in-process keeps its own title
        set_title(f"hybridflow controller {run_dir}", "hf-controller")
    stop = GracefulStop()
    try:
        summary = run_async(lambda: _train(run, opts, sinks, live, stop), stop.request)
    finally:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
    summary["run_dir"] = str(run_dir)
    summary["run_dir_mb"] = round(folder_bytes(run_dir) / 2**20, 1)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(run_dir / "summary.json")
    return summary


def folder_bytes(folder: Path) -> int:
    """What ``folder`` holds on disk, links not followed (a linked model folder is not the
    run's)."""
    total = 0
    for entry in os.scandir(folder):
        if entry.is_symlink():
            continue
        if entry.is_dir():
            total += folder_bytes(Path(entry.path))
        else:
            total += entry.stat(follow_symlinks=False).st_size
    return total


def _resume_step(run_dir: Path) -> int | None:
    """The global step of the newest checkpoint (None: there is none)."""
    return newest_step(run_dir / "checkpoints")


def _sinks(exp: Experiment, run_dir: Path, resume_step: int | None) -> list[Sink]:
    """Where the records go: metrics.jsonl always, TensorBoard and W&B as logging says."""
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if exp.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if exp.logging.wandb:
        sinks.append(WandbSink(run_dir, exp.logging.project, exp.model_dump(mode="json")))
    return sinks


def score_name(exp: Experiment) -> str:
    """What the validation score of ``exp`` is, as the summary names it (``val_<name>_after``):
    a rule's reward is an accuracy, a reward model's or a judge's a score."""
    if "reward" not in exp.roles:
        return "acc"
    cls = role_class("reward", exp.roles["reward"])
    return {RULE_CLASS: "acc", "roles.judge:JudgeReward": "judge_score"}.get(cls, "rm_score")


class GracefulStop:
    """The first Ctrl-C: the trainer finishes its step, writes a checkpoint and stops (a second
    Ctrl-C cancels at once: ``run_async``)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def request(self) -> bool:
        if self.trainer is None:  # still starting: nothing to finish
            return False
        self.trainer.request_stop()
        console.print(
            f"[yellow]Ctrl-C: finishing step {self.trainer.global_step + 1}, then a checkpoint "
            "and stop; Ctrl-C again stops at once (losing the work since the last checkpoint)[/]"
        )
        return True


async def _train(
    run: Run, opts: RunOptions, sinks: list[Sink], live: LiveView, stop: GracefulStop
) -> dict[str, Any]:
    start = time.perf_counter()
    async with _session(run, opts) as controller, AsyncExitStack() as stack:
        ready = time.perf_counter() - start
        roles = Roles.placed(controller, reference_in_actor(run.exp))
        found = controller.supervisor  # the sessions give every controller one
        supervisor = found if isinstance(found, Supervisor) else None
        resume = opts.resume
        snapshots = _snapshots(run.exp, supervisor, stack)
        with live:
            while True:  # once, or once more after each rollback
                trainer = Trainer(
                    run.exp.trainer,
                    run.exp.stages,
                    roles,
                    roles.engines(),
                    run.data,
                    run.run_dir,
                    checkpointed_roles(run.exp),
                    sinks,
                    opts.stop_after,
                    snapshots,
                    score_name(run.exp),
                )
                stop.trainer = trainer
                if supervisor is not None:
                    supervisor.on_event = functools.partial(_record_event, sinks, trainer)
                try:
                    result = await trainer.run(resume=resume)
                    break
                except Exception:
                    again = await _roll_back(
                        supervisor, run.run_dir, sinks, trainer.global_step, snapshots
                    )
                    if again is None:
                        raise
                    resume = again
        if supervisor is not None:
            result["supervision"] = supervisor.summary()
        # what crossed the controller's sockets (calls, batches, results; never weights, which
        # go rank to rank): a summary can show that no weight went through it
        traffic = controller.traffic
        result["controller_bytes"] = {
            "sent": traffic.sent,
            "received": traffic.received,
            "tensors": traffic.tensors,  # of both: tensor payloads (batches, results)
        }
    wall = time.perf_counter() - start
    return {"name": run.exp.name, **result, "startup_s": round(ready, 2), "wall_s": round(wall, 2)}


async def _roll_back(
    supervisor: Supervisor | None,
    run_dir: Path,
    sinks: list[Sink],
    step: int,
    snapshots: Snapshots | None = None,
) -> bool | None:
    """After the trainer failed: when a stateful group died and its restart policy allows,
    restart every stateful group, cut the records back to the last checkpoint and say whether
    to resume from it (True) or start over (False: there is none yet); None: re-raise."""
    if supervisor is None:
        return None
    fault = await supervisor.stateful_fault()
    if fault is None:
        return None
    saved = _resume_step(run_dir)
    if snapshots is not None and snapshots.latest is not None:
        saved = max(saved or 0, snapshots.latest.step)
    await supervisor.rollback(fault, step - (saved or 0))
    for sink in sinks:
        rewind = getattr(sink, "rewind", None)
        if rewind is not None:
            rewind(saved)
    return saved is not None


def _snapshots(
    exp: Experiment, supervisor: Supervisor | None, stack: AsyncExitStack
) -> Snapshots | None:
    """In-memory snapshots of the trained roles (``trainer.snapshot_every``; unset: every step
    when a stateful group may be restarted and every trained role runs on fsdp), in a folder
    under /dev/shm removed when the run ends (or, after a kill, by the next run's sweep)."""
    every = exp.trainer.snapshot_every
    if every is None:
        restartable = supervisor is not None and supervisor.restarts_stateful()
        every = 1 if restartable and not _megatron_roles(exp) else 0
    if not every:
        return None
    root = Path(SHM_ROOT)
    sweep_socket_folders(root)
    folder = SocketFolder(root)
    stack.callback(folder.remove)
    return Snapshots(folder.path, every)


def _megatron_roles(exp: Experiment) -> list[str]:
    return [
        r for r in checkpointed_roles(exp) if exp.roles[r].settings().get("backend") == "megatron"
    ]


def _record_event(sinks: list[Sink], trainer: Trainer, event: dict[str, Any]) -> None:
    """A supervision event as a record on every sink, at the trainer's step (a trainer that is
    still restoring a checkpoint: the step it restores)."""
    record = {"step": trainer.global_step or trainer.saved_step_on_disk(), **event}
    for sink in sinks:
        sink(record)


def _session(run: Run, opts: RunOptions) -> AbstractAsyncContextManager[Controller]:
    """Every group here (``run``), started on its cluster (``--clusters``), or joining by hand
    (``controller --bind``)."""
    if run.plan is not None:
        spec, where = run.plan.spec, run.plan.where
        timeouts = Timeouts.from_env()
        return cluster_session(run.groups, spec, where, run.run_dir, timeouts, _announce_one)
    if opts.bind is None:
        return local_session(run.groups, run_dir=run.run_dir)
    timeouts = Timeouts.from_env().model_copy(update={"connect_s": opts.wait})
    token = os.environ.get("HYBRIDFLOW_TOKEN") or None  # set by a launcher (SLURM script)
    curve = CurveServer(*server_files(opts.keys)) if opts.keys is not None else None
    announce = functools.partial(
        _announce, run.groups, run.run_dir, keys=opts.keys, token_file=opts.token_file
    )
    return remote_session(run.groups, opts.bind, timeouts, announce, token, curve)


def _announce(
    groups: list[GroupSpec],
    run_dir: Path,
    address: str,
    token: str,
    keys: Path | None = None,
    token_file: Path | None = None,
) -> None:
    """How to start each group (stderr, so --json output stays one line); each writes its rank
    logs under the run folder (``--run-dir``), which a group on another host must share. With
    ``token_file`` the token is also written there (0600, whole or not at all)."""
    if token_file is not None:
        part = token_file.with_name(f".{token_file.name}.part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{token}\n")
        part.replace(token_file)
        console.print(f"the groups' token is in {token_file}")
    console.print(f"controller listening on {address}; start each group with:")
    for g in groups:
        console.print(
            f"  HYBRIDFLOW_TOKEN={token} hybridflow role {','.join(g.roles)} --connect {address} "
            f"--group {g.name} --nproc {g.nproc} --tp {g.tp} --pp {g.pp} --device {g.device} "
            f"--run-dir {run_dir}"
            + (f" --gen-tp {g.gen_tp}" if g.gen_tp else "")
            + (f" --gen-pp {g.gen_pp}" if g.gen_pp else "")
            + (f" --keys {keys} --client {g.name}" if keys else ""),
            soft_wrap=True,
        )


def _announce_one(group: GroupSpec, command: str) -> None:
    console.print(f"start group {group.name} by hand with:\n  {command}", soft_wrap=True)


def _describe(summary: dict[str, Any], run_dir: Path) -> str:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    name = summary.get("val_score_is", "acc")
    what = {"acc": "score", "rm_score": "reward-model score", "judge_score": "judge's score"}[name]
    actor = summary.get("precision", {}).get("actor")
    dtype = f", actor in {actor['dtype']} ({actor['reason']})" if actor else ""
    return (
        f"{summary['name']}: validation {what} init {fmt(summary[f'val_{name}_init'])}, "
        f"before RL {fmt(summary[f'val_{name}_before'])}, after "
        f"{fmt(summary[f'val_{name}_after'])} "
        f"in {summary['wall_s']} s ({summary['steps']} steps{dtype})\n"
        f"run: {run_dir} ({summary.get('run_dir_mb', 0):g} MB)"
    )


def report_command(args: argparse.Namespace) -> int:
    return run_report(args.run_dir, html=args.html)
