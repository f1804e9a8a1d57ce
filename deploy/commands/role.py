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

What it says (stderr, one line each): where the rank logs are as it starts the ranks; when the
group has joined, what it runs (roles, ranks, layout, device); and how it ended, with its exit
status and the reason (the controller shut the group down, refused it or was lost, a rank
died). Rank 0 reports the last two (``roles/runtime/status.py``): here through an abstract Unix
datagram socket (no file), under torchrun or srun on rank 0's own stderr.

Rank logs go to ``--run-dir``/logs/``<group>-<rank>.log``. Give the controller's run directory
there to keep them beside the controller's (``hybridflow run`` puts its groups' logs in
``RUN_DIR/logs`` too); the run directory must be readable at the same path on every host anyway,
for checkpoints. Without it they go to ``runs/role/logs`` under the current directory; the path
is printed either way.

What it made it removes: rank 0's fan-out socket file (``{socket_dir}/{group}-{pid}.fan``, gone
once every rank connected; removed here too when rank 0 died before), on a clean exit, a
refusal, and when the controller is killed.
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
from deploy.commands.keys import client_files
from deploy.launchers.local import LocalLauncher, group_rank_env
from deploy.launchers.sbatch import STEP_FIRST_NODE, step_first_node_addr
from deploy.terminal import add_device_option, console, run_async
from roles.runtime.coordinator import fanout_path
from roles.runtime.env import (
    RankPlace,
    RankVar,
    curve_env,
    inherited_threads,
    thread_count,
)
from roles.runtime.status import ENDED, JOINED, STATUS_ENV, TO_STDERR, StatusInbox, describe
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
    threads: int | None = None  # None: OMP_NUM_THREADS of the environment, else 1
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
            threads=args.threads,
            tp=args.tp,
            pp=args.pp,
            gen_tp=args.gen_tp,
            gen_pp=args.gen_pp,
            token=args.token if args.token_file is None else f"@{args.token_file}",
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
    role.add_argument("--nproc", type=int, default=1, help="ranks of this group on this host")
    role.add_argument(
        "--threads",
        type=int,
        help="intra-op threads of each rank (placement threads; default: OMP_NUM_THREADS, else 1)",
    )
    role.add_argument("--tp", type=int, default=1, help="tensor-parallel size (placement tp)")
    role.add_argument("--pp", type=int, default=1, help="pipeline stages (placement pp)")
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
        "--token-file",
        type=Path,
        help="read the token from this file (hybridflow controller --token-file writes it)",
    )
    role.add_argument(
        "--wait", type=float, help="seconds to wait for the controller to answer (default 120)"
    )
    role.add_argument(
        "--fanout",
        choices=("socket", "zmq", "rpc"),
        default="socket",
        help="how rank 0 hands each call to the other ranks (placement fanout; default socket)",
    )
    add_device_option(
        role, "where the ranks compute (cuda: the GPU of each rank's LOCAL_RANK, NCCL)"
    )
    role.add_argument(
        "--run-dir",
        default="runs/role",
        help="rank logs go to RUN_DIR/logs; give the controller's run directory to keep them "
        "beside its own (default: runs/role)",
    )
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
    role.add_argument(
        "--master-addr",
        help=f"rank 0's host for the group (env launcher); {STEP_FIRST_NODE}: the first node of "
        "this SLURM step, as scontrol knows its address (a group over several nodes)",
    )
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
    elif opts.token is not None and opts.token.startswith("@"):  # --token-file
        try:
            opts = replace(opts, token=Path(opts.token[1:]).read_text().strip())
        except OSError as exc:
            console.print(f"[red]hybridflow role: --token-file {escape(str(exc))}[/]")
            return EXIT_BAD_INPUT
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
    env.setdefault(STATUS_ENV, TO_STDERR)  # rank 0 says when it joined and how it ended
    if RankVar.MASTER_PORT not in env and opts.master_port is None:
        if "SLURM_JOB_ID" not in env:
            raise SystemExit("hybridflow role: set MASTER_PORT or --master-port for the group")
        # one port per job step, the same on every rank of the step
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        env[RankVar.MASTER_PORT] = str(20000 + (int(env["SLURM_JOB_ID"]) * 7 + step) % 20000)
    if opts.master_port is not None:
        env[RankVar.MASTER_PORT] = str(opts.master_port)
    place = RankPlace.from_env(env)  # as torchrun or srun set it
    if opts.master_addr == STEP_FIRST_NODE:  # rank 0 runs on the step's first node
        place = replace(place, master_addr=step_first_node_addr(env))
    elif opts.master_addr is not None:
        place = replace(place, master_addr=opts.master_addr)
    started = group_rank_env(
        _group_spec(opts),
        place,
        opts.connect,
        token=opts.token or env.get(RankVar.TOKEN, ""),
        socket_dir=Path(opts.socket_dir or env.get(RankVar.SOCKET_DIR, "/tmp")),
        threads=str(opts.threads) if opts.threads else inherited_threads(env),
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
        threads=opts.threads or thread_count(inherited_threads(dict(os.environ))),
        tp=opts.tp,
        pp=opts.pp,
        gen_tp=opts.gen_tp,
        gen_pp=opts.gen_pp,
        device=opts.device,
        fanout=opts.fanout,
    )


async def _launch_here(opts: RoleOptions) -> int:
    """Start the group's ranks on this host; say what happens to them; wait until they end or
    one fails. Exit status 0 when every rank exited 0, else 1."""
    failed: list[tuple[int, int]] = []
    done = asyncio.Event()

    def on_exit(group: str, rank: int, code: int, said: str) -> None:
        if code != 0:
            failed.append((rank, code))
        done.set()

    token = opts.token or os.environ.get("HYBRIDFLOW_TOKEN", "")
    sock_dir = Path(opts.socket_dir or "/tmp")
    launcher = LocalLauncher(
        opts.connect, token, opts.run_dir, sock_dir, Timeouts.from_env(), on_exit
    )
    inbox = StatusInbox(opts.group)
    ended: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.add_reader(inbox.fileno(), _on_status, inbox, ended)
    try:
        _say(
            f"hybridflow role: starting group {opts.group} (roles {','.join(opts.roles)}), "
            f"{opts.nproc} rank{'s' if opts.nproc != 1 else ''} here, joining {opts.connect}; "
            f"rank logs: {(opts.run_dir / 'logs').resolve()}/{opts.group}-<rank>.log"
        )
        launcher.start_group(_group_spec(opts), env={STATUS_ENV: inbox.target})
        while launcher.alive() and not failed:
            done.clear()
            await done.wait()
    finally:
        await launcher.stop()
        _on_status(inbox, ended)  # the last words of rank 0, sent just before it exited
        loop.remove_reader(inbox.fileno())
        inbox.close()
        for proc in launcher.procs[:1]:  # rank 0 removes it unless killed while ranks joined
            fanout_path(sock_dir, opts.group, proc.popen.pid).unlink(missing_ok=True)
    code = 1 if failed else 0
    _say_ended(opts.group, launcher, failed, ended[-1] if ended else None, code)
    return code


def _say(line: str) -> None:
    console.print(escape(line), soft_wrap=True)


def _on_status(inbox: StatusInbox, ended: list[dict[str, object]]) -> None:
    """Print that the group joined; keep how it ended for the last line."""
    for event in inbox.read():
        if event.get("event") == JOINED:
            _say(describe(event))
        elif event.get("event") == ENDED:
            ended.append(event)


def _say_ended(
    name: str,
    launcher: LocalLauncher,
    failed: list[tuple[int, int]],
    ended: dict[str, object] | None,
    code: int,
) -> None:
    """How the group ended: the reason rank 0 reported, this command's exit status and, when a
    rank failed, which ones and where the logs are."""
    reason = None if ended is None else str(ended.get("reason"))
    if failed:
        _say_failed(name, launcher, failed, reason)
    else:
        _say(f"group {name} ended: {reason or 'every rank exited 0'} (exit {code})")


def _say_failed(
    name: str, launcher: LocalLauncher, failed: list[tuple[int, int]], reason: str | None = None
) -> None:
    """The failed ranks (exit code, or minus the signal) and why: rank 0 talks to the
    controller, so the reason is the one it reported, else the last error in its log (this
    run's part only)."""
    ranks = ", ".join(f"rank {rank} ({code})" for rank, code in sorted(failed))
    why = reason if reason is not None else launcher.last_error(name, 0)
    line = f"group {name} ended: {ranks} exited: {why} (exit 1)"
    console.print(f"[red]{escape(line)}[/]", soft_wrap=True)
    _say(f"rank logs: {(launcher.run_dir / 'logs').resolve()}")


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
