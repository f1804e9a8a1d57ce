"""``hybridflow role NAMES --connect ADDR``: start a process group by hand and join a controller.

Two ways to run, picked by ``--launcher``:

- ``local``: this process starts ``--nproc`` ranks here (``LocalLauncher``), waits for them and
  exits with 1, naming the ranks and rank 0's last error, when one fails;
- ``env``: torchrun or srun started this process as one rank (``RANK``/``WORLD_SIZE`` or
  ``SLURM_PROCID``/``SLURM_NTASKS``); it fills in what the rank runtime reads and becomes it.
  ``auto`` (the default) picks ``env`` when those variables are set.

The controller's address is checked before any rank starts; the token may come on stdin
(``--token -``) so that it never appears on a command line; ``--keys`` makes the ranks CURVE
clients (``hybridflow keys``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rich.markup import escape

from controller.placement import GroupSpec, RoleSpec
from deploy.keys_cli import client_files
from deploy.local import LocalLauncher, group_rank_env
from deploy.terminal import add_device_option, console, run_async
from roles.runtime.env import RankPlace, RankVar, curve_env, inherited_threads
from transport.channel import split_tcp
from transport.device import DeviceKind
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class RoleOptions:
    """``hybridflow role``'s options, typed (``from_args`` reads the parsed command line)."""

    roles: tuple[str, ...]
    group: str
    connect: str
    nproc: int = 1
    tp: int = 1
    pp: int = 1
    gen_tp: int = 0
    gen_pp: int = 0
    token: str | None = None
    wait: float | None = None
    fanout: Literal["socket", "zmq", "rpc"] = "socket"
    device: DeviceKind = DeviceKind.CPU
    run_dir: Path = Path("runs/role")
    launcher: str = "auto"
    master_addr: str | None = None
    master_port: int | None = None
    keys: Path | None = None
    client: str | None = None
    socket_dir: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RoleOptions:
        roles = tuple(r for r in args.names.split(",") if r)
        return cls(
            roles=roles,
            group=args.group or "+".join(roles),
            connect=args.connect,
            nproc=args.nproc,
            tp=args.tp,
            pp=args.pp,
            gen_tp=args.gen_tp,
            gen_pp=args.gen_pp,
            token=args.token,
            wait=args.wait,
            fanout=args.fanout,
            device=DeviceKind(args.device),
            run_dir=Path(args.run_dir),
            launcher=args.launcher,
            master_addr=args.master_addr,
            master_port=args.master_port,
            keys=args.keys,
            client=args.client,
            socket_dir=args.socket_dir,
        )


def add_role_command(subparsers: argparse._SubParsersAction) -> None:
    role = subparsers.add_parser("role", help="start a process group by hand and join a controller")
    role.add_argument("names", help="comma-separated role names this group hosts")
    role.add_argument(
        "--connect", required=True, help="controller address, e.g. ipc:///tmp/x or tcp://HOST:PORT"
    )
    role.add_argument("--nproc", type=int, default=1)
    role.add_argument("--tp", type=int, default=1)
    role.add_argument("--pp", type=int, default=1)
    role.add_argument(
        "--gen-tp", type=int, default=0, help="tensor-parallel size while generating (0: --tp)"
    )
    role.add_argument(
        "--gen-pp", type=int, default=0, help="pipeline size while generating (0: --pp)"
    )
    role.add_argument("--group", help="group name (default: the role names joined with '+')")
    role.add_argument(
        "--token", help="the controller's token ('-': read it from stdin; or HYBRIDFLOW_TOKEN)"
    )
    role.add_argument(
        "--wait", type=float, help="seconds to wait for the controller to answer (default 120)"
    )
    role.add_argument("--fanout", choices=("socket", "zmq", "rpc"), default="socket")
    add_device_option(
        role, "where the ranks compute (cuda: the GPU of each rank's LOCAL_RANK, NCCL)"
    )
    role.add_argument("--run-dir", default="runs/role", help="where rank logs go")
    _add_launcher_options(role)
    role.set_defaults(fn=role_command)


def _add_launcher_options(role: argparse.ArgumentParser) -> None:
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


def role_command(args: argparse.Namespace) -> int:
    return run_role(RoleOptions.from_args(args))


def run_role(opts: RoleOptions) -> int:
    """Check the address and keys, then be one rank (env) or start the group's ranks here."""
    problem = connect_problem(opts.connect)
    if problem is not None:
        console.print(f"[red]hybridflow role: --connect {escape(f'{opts.connect}: {problem}')}[/]")
        return EXIT_BAD_INPUT
    if opts.token == "-":  # from stdin: kept off command lines (a launcher writes it there)
        opts = replace(opts, token=sys.stdin.readline().strip())
    if opts.wait is not None:  # the ranks read their timeouts from the environment
        waits = Timeouts.from_env().model_copy(update={"connect_s": opts.wait})
        os.environ[TIMEOUTS_ENV] = waits.to_env()
    if opts.keys is not None and not _use_client_keys(opts.keys, opts.client or opts.group):
        return EXIT_BAD_INPUT
    if opts.launcher == "env" or (opts.launcher == "auto" and launched_outside(dict(os.environ))):
        return run_as_rank(opts)
    return run_async(lambda: _launch_here(opts))


def _use_client_keys(keys: Path, client: str) -> bool:
    """Point the ranks at the client's CURVE key files (roles/runtime/env.py reads them);
    False, after saying which file is missing, when one is."""
    secret, server = client_files(keys, client)
    for path in (secret, server):
        if not path.is_file():
            console.print(
                f"[red]hybridflow role: no key file {escape(str(path))} (hybridflow keys)[/]"
            )
            return False
    os.environ.update(curve_env(secret.resolve(), server.resolve()))
    return True


def launched_outside(env: dict[str, str]) -> bool:
    """True when torchrun or srun started this process as one rank of a group."""
    return ("RANK" in env and "WORLD_SIZE" in env) or "SLURM_PROCID" in env


def run_as_rank(opts: RoleOptions) -> int:
    """This process is one rank (torchrun / srun set RANK, WORLD_SIZE or SLURM_PROCID,
    SLURM_NTASKS): write the rest of its ``RankEnv`` and become it; rank 0 coordinates."""
    from roles.runtime import rank  # roles code: loaded only by a process that becomes a rank

    env = os.environ
    if RankVar.MASTER_PORT not in env and opts.master_port is None:
        if "SLURM_JOB_ID" not in env:
            raise SystemExit("hybridflow role: set MASTER_PORT or --master-port for the group")
        # one port per job step, the same on every rank of the step
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        env[RankVar.MASTER_PORT] = str(20000 + (int(env["SLURM_JOB_ID"]) * 7 + step) % 20000)
    if opts.master_port is not None:
        env[RankVar.MASTER_PORT] = str(opts.master_port)
    place = RankPlace.from_env(env)  # as torchrun or srun set it
    if opts.master_addr is not None:
        place = replace(place, master_addr=opts.master_addr)
    started = group_rank_env(
        _group_spec(opts),
        place,
        opts.connect,
        token=opts.token or env.get(RankVar.TOKEN, ""),
        socket_dir=Path(opts.socket_dir or env.get(RankVar.SOCKET_DIR, "/tmp")),
        threads=inherited_threads(env),
    )
    env.update(started.to_env())
    rank.main()
    return 0


def _group_spec(opts: RoleOptions) -> GroupSpec:
    """The group as the launcher sizes it. The role classes come from the controller
    (WELCOME/build), so the spec names none."""
    return GroupSpec.model_construct(
        name=opts.group,
        roles={r: RoleSpec(cls="unset:Unset") for r in opts.roles},
        nproc=opts.nproc,
        tp=opts.tp,
        pp=opts.pp,
        gen_tp=opts.gen_tp,
        gen_pp=opts.gen_pp,
        device=opts.device,
        fanout=opts.fanout,
    )


async def _launch_here(opts: RoleOptions) -> int:
    """Start the group's ranks on this host; wait until they end or one fails."""
    failed: list[tuple[int, int]] = []
    done = asyncio.Event()

    def on_exit(group: str, rank: int, code: int) -> None:
        if code != 0:
            failed.append((rank, code))
        done.set()

    token = opts.token or os.environ.get("HYBRIDFLOW_TOKEN", "")
    sock_dir = Path(opts.socket_dir or "/tmp")
    launcher = LocalLauncher(
        opts.connect, token, opts.run_dir, sock_dir, Timeouts.from_env(), on_exit
    )
    launcher.start(_group_spec(opts))
    try:
        while launcher.alive() and not failed:
            done.clear()
            await done.wait()
    finally:
        await launcher.stop()
    if failed:
        _say_failed(opts.group, launcher, failed)
    return 1 if failed else 0


def _say_failed(name: str, launcher: LocalLauncher, failed: list[tuple[int, int]]) -> None:
    ranks = ", ".join(f"rank {rank} ({code})" for rank, code in failed)
    # rank 0 talks to the controller, so its log holds the reason (e.g. a refusal); only this
    # run's part of the log is read
    console.print(f"[red]{name}: {ranks} exited: {escape(launcher.last_error(name, 0))}[/]")
    console.print(f"logs: {launcher.run_dir / 'logs'}")


def connect_problem(address: str) -> str | None:
    """What is wrong with a controller address, found before any rank starts (ZeroMQ would
    otherwise retry a name that never resolves until the connect timeout)."""
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
