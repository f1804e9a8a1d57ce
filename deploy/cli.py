"""The ``hybridflow`` command line.

- ``hybridflow demo`` — the README's main job: a controller drives a 2-rank data-parallel group
  that fits a linear model; prints the result (``--json`` for one JSON line).
- ``hybridflow role NAMES --connect ADDR --nproc N`` — start, by hand, a process group hosting the
  comma-separated roles and join a controller that was started separately.
- ``hybridflow model init|import-gguf|check`` — model folders (``deploy/model_cli.py``).
- ``hybridflow sft`` / ``hybridflow rm`` — supervised training jobs (``deploy/train_cli.py``).
- ``hybridflow run EXPERIMENT.yaml`` / ``hybridflow report RUN_DIR`` — experiments: SFT and RL
  stages, checkpoints, resume, plots (``deploy/run_cli.py``).
- ``hybridflow controller EXPERIMENT.yaml --bind tcp://HOST:PORT`` — the same run with the
  controller alone; each group joins with ``hybridflow role`` (the command is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from deploy.keys_cli import add_keys_command, client_files
from deploy.model_cli import add_model_commands, run_model_command
from deploy.run_cli import add_run_commands, report_command, run_experiment_command
from deploy.slurm_cli import add_slurm_command
from deploy.train_cli import add_train_commands, run_train_command
from transport.device import DeviceKind

console = Console(stderr=True)


def run_async(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` on uvloop (when installed) with SIGINT/SIGTERM cancelling it cleanly."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def guarded() -> Any:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await task

    return runner(guarded())


def cmd_demo(args: argparse.Namespace) -> int:
    from controller.demo import demo_placement, train_linear
    from deploy.session import local_session

    async def main() -> dict[str, Any]:
        start = time.perf_counter()
        placement = demo_placement(nproc=args.nproc, fanout=args.fanout)
        async with local_session(placement) as controller:
            ready = time.perf_counter() - start
            result = await train_linear(controller, steps=args.steps)
        return {
            **result,
            "startup_s": round(ready, 2),
            "wall_s": round(time.perf_counter() - start, 2),
        }

    result = run_async(main)
    if args.json:
        print(json.dumps(result))
    else:
        console.print(
            f"[bold]linear model, {args.nproc} data-parallel ranks, {result['steps']} steps[/]\n"
            f"loss {result['first_loss']:.4f} → {result['final_loss']:.5f}; "
            f"max weight error {result['weight_error']:.4f}; replicas agree: {result['replicas_agree']}\n"
            f"start-up {result['startup_s']} s, total {result['wall_s']} s"
        )
    ok = result["final_loss"] < 0.01 * result["first_loss"] and result["replicas_agree"]
    return 0 if ok else 1


def launched_outside(env: dict[str, str]) -> bool:
    """True when torchrun or srun started this process as one rank of a group."""
    return ("RANK" in env and "WORLD_SIZE" in env) or "SLURM_PROCID" in env


def run_as_rank(args: argparse.Namespace, roles: list[str], name: str) -> int:
    """This process is one rank (torchrun / srun set RANK, WORLD_SIZE or SLURM_PROCID,
    SLURM_NTASKS): fill in what the rank runtime reads and become it; rank 0 coordinates."""
    from roles.runtime import rank

    env = os.environ
    if "MASTER_PORT" not in env and args.master_port is None:
        if "SLURM_JOB_ID" not in env:
            raise SystemExit("hybridflow role: set MASTER_PORT or --master-port for the group")
        # one port per job step, the same on every rank of the step
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        env["MASTER_PORT"] = str(20000 + (int(env["SLURM_JOB_ID"]) * 7 + step) % 20000)
    if args.master_port is not None:
        env["MASTER_PORT"] = str(args.master_port)
    if args.master_addr is not None:
        env["MASTER_ADDR"] = args.master_addr
    env.update(
        HYBRIDFLOW_GROUP=name,
        HYBRIDFLOW_ROLES=",".join(roles),
        HYBRIDFLOW_CONTROLLER=args.connect,
        HYBRIDFLOW_TP=str(args.tp),
        HYBRIDFLOW_PP=str(args.pp),
        HYBRIDFLOW_FANOUT=args.fanout,
        HYBRIDFLOW_DEVICE=args.device,
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    if args.token:
        env["HYBRIDFLOW_TOKEN"] = args.token
    if args.socket_dir:
        env["HYBRIDFLOW_SOCKET_DIR"] = args.socket_dir
    rank.main()
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    from controller.placement import GroupSpec, RoleSpec
    from deploy.local import LocalLauncher, last_error
    from transport.settings import ENV_VAR as TIMEOUTS_ENV
    from transport.settings import Timeouts

    roles = [r for r in args.names.split(",") if r]
    name = args.group or "+".join(roles)
    problem = connect_problem(args.connect)
    if problem is not None:
        console.print(f"[red]hybridflow role: --connect {args.connect}: {problem}[/]")
        return 2
    if args.token == "-":  # from stdin: kept off command lines (a launcher writes it there)
        args.token = sys.stdin.readline().strip()
    if args.wait is not None:  # the ranks read their timeouts from the environment
        waits = Timeouts.from_env().model_copy(update={"connect_s": args.wait})
        os.environ[TIMEOUTS_ENV] = waits.to_env()
    if args.keys is not None:  # the rank runtime reads these (roles/runtime/rank.py)
        secret, server = client_files(args.keys, args.client or name)
        for path in (secret, server):
            if not path.is_file():
                console.print(f"[red]hybridflow role: no key file {path} (hybridflow keys)[/]")
                return 2
        os.environ["HYBRIDFLOW_CURVE_SECRET"] = str(secret.resolve())
        os.environ["HYBRIDFLOW_CURVE_SERVER_KEY"] = str(server.resolve())
    if args.launcher == "env" or (args.launcher == "auto" and launched_outside(dict(os.environ))):
        return run_as_rank(args, roles, name)
    # The role classes come from the controller (WELCOME/build); the spec here sizes the group.
    spec = GroupSpec.model_construct(
        name=name,
        roles={r: RoleSpec(cls="unset:Unset") for r in roles},
        nproc=args.nproc,
        tp=args.tp,
        pp=args.pp,
        device=DeviceKind(args.device),
    )
    token = args.token or os.environ.get("HYBRIDFLOW_TOKEN", "")

    async def main() -> int:
        failed: list[tuple[int, int]] = []
        done = asyncio.Event()

        def on_exit(group: str, rank: int, code: int) -> None:
            if code != 0:
                failed.append((rank, code))
            done.set()

        sock_dir = Path(args.socket_dir or "/tmp")
        launcher = LocalLauncher(
            args.connect,
            token,
            Path(args.run_dir),
            sock_dir,
            Timeouts.from_env(),
            on_exit,
        )
        launcher.start(spec)
        try:
            while launcher.alive() and not failed:
                done.clear()
                await done.wait()
        finally:
            await launcher.stop()
        if failed:
            logs = Path(args.run_dir) / "logs"
            ranks = ", ".join(f"rank {rank} ({code})" for rank, code in failed)
            # rank 0 talks to the controller, so its log holds the reason (e.g. a refusal)
            console.print(f"[red]{name}: {ranks} exited: {last_error(logs / f'{name}-0.log')}[/]")
            console.print(f"logs: {logs}")
        return 1 if failed else 0

    return int(run_async(main))


def connect_problem(address: str) -> str | None:
    """What is wrong with a controller address, found before any rank starts (ZeroMQ would
    otherwise retry a name that never resolves until the connect timeout)."""
    import socket

    from transport.channel import split_tcp

    if address.startswith("ipc://"):
        return None
    try:
        host, port = split_tcp(address)
    except ValueError as exc:
        return f"{exc} (or ipc://PATH on this host)"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a linear model with a 2-rank data-parallel group")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--nproc", type=int, default=2)
    demo.add_argument(
        "--fanout", choices=("socket", "zmq", "rpc"), default="socket", help="rank 0 → ranks"
    )
    demo.add_argument("--json", action="store_true", help="print the result as one JSON line")
    demo.set_defaults(fn=cmd_demo)

    role = sub.add_parser("role", help="start a process group by hand and join a controller")
    role.add_argument("names", help="comma-separated role names this group hosts")
    role.add_argument(
        "--connect", required=True, help="controller address, e.g. ipc:///tmp/x or tcp://HOST:PORT"
    )
    role.add_argument("--nproc", type=int, default=1)
    role.add_argument("--tp", type=int, default=1)
    role.add_argument("--pp", type=int, default=1)
    role.add_argument("--group", help="group name (default: the role names joined with '+')")
    role.add_argument(
        "--token", help="the controller's token ('-': read it from stdin; or HYBRIDFLOW_TOKEN)"
    )
    role.add_argument(
        "--wait", type=float, help="seconds to wait for the controller to answer (default 120)"
    )
    role.add_argument("--fanout", choices=("socket", "zmq", "rpc"), default="socket")
    role.add_argument(
        "--device",
        choices=list(DeviceKind),
        default=DeviceKind.CPU,
        help="where the ranks compute (cuda: the GPU of each rank's LOCAL_RANK, NCCL)",
    )
    role.add_argument("--run-dir", default="runs/role", help="where rank logs go")
    role.add_argument(
        "--launcher",
        choices=("auto", "local", "env"),
        default="auto",
        help="local: start --nproc ranks here; env: this process is one rank started by "
        "torchrun or srun (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS); auto: env when those "
        "are set",
    )
    role.add_argument("--master-addr", help="rank 0's host for the group (env launcher)")
    role.add_argument("--keys", type=Path, help="CURVE keys (hybridflow keys) for a TCP link")
    role.add_argument("--client", help="this group's key name in --keys (default: the group)")
    role.add_argument("--master-port", type=int, help="the group's store port (env launcher)")
    role.add_argument("--socket-dir", help="directory for local ipc sockets (default /tmp)")
    role.set_defaults(fn=cmd_role)

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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        sys.exit(args.fn(args))
    except asyncio.CancelledError:
        console.print("[yellow]interrupted; every process was stopped[/]")
        sys.exit(130)
    except Exception as exc:  # one clear line for the user, details with -v
        if args.verbose:
            console.print_exception()
        console.print(f"[red]error:[/] {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
