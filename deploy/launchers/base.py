"""What every launcher is, and what they share.

A launcher starts the groups placed on one cluster and answers for them until the run ends
(``Launcher``): it starts a group's ranks, says where each runs, restarts a group the
supervisor relaunches (``controller/supervisor.py``), and at the end waits for the groups to
leave on the controller's SHUTDOWN and ends what is left. It reports a death as soon as it sees
one, with the rank's last error line, so the controller can name role, rank and cause.

One file per launcher: ``local.py`` (ranks as child processes here), ``remote.py`` (one
``hybridflow role`` per group through ``via``, ssh), ``slurm.py`` (one batch job per cluster;
its script from ``sbatch.py``, shared with ``hybridflow slurm``), ``manual.py`` (the command to
start each group, printed).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controller.placement import GroupSpec
from deploy.clusters import RemoteCluster, SlurmCluster
from deploy.commands.keys import client_files
from roles.runtime.env import curve_env

DeathCallback = Callable[[str, int | None, str], None]  # group, rank, cause
Popen = subprocess.Popen[bytes]
Log = tuple[Path, int]  # a log file and where this run's lines begin in it
ExitCallback = Callable[[Popen, Log], None]


@dataclass(frozen=True)
class Where:
    """Where one rank (or, when the launcher cannot tell ranks apart, a group) runs."""

    group: str
    rank: int | None  # None: the whole group (one process or job there starts its ranks)
    host: str  # the host, the ``via`` that reaches it, or the job that holds it
    pid: int | None = None  # the process here that is (or leads) it


class Launcher(Protocol):
    """Starts the groups placed on one cluster and answers for them until the run ends."""

    stopping: bool  # set when the run ends: exits from then on are the shutdown, not deaths

    def start(self, groups: Sequence[GroupSpec]) -> None:
        """Start every rank of ``groups``; they dial the controller and register."""

    async def restart(self, spec: GroupSpec) -> None:
        """End what is left of the group, wait until it is gone, start it again."""

    async def stop(self) -> None:
        """After the controller told the groups to stop: wait for them, end what is left."""

    def where(self) -> list[Where]:
        """Where each rank started so far runs (``hybridflow status``, ``processes.json``)."""


def role_argv(group: GroupSpec, address: str, run_dir: str | None, keys: str | None) -> list[str]:
    """The arguments of ``hybridflow`` that start one group and join the controller."""
    argv = ["role", ",".join(group.roles), "--connect", address, "--group", group.name]
    argv += ["--nproc", str(group.nproc), "--tp", str(group.tp), "--pp", str(group.pp)]
    argv += ["--threads", str(group.threads)] if group.threads > 1 else []
    argv += ["--gen-tp", str(group.gen_tp)] if group.gen_tp else []
    argv += ["--gen-pp", str(group.gen_pp)] if group.gen_pp else []
    argv += ["--fanout", group.fanout, "--device", group.device]
    if run_dir is not None:
        argv += ["--run-dir", run_dir]
    if keys is not None:
        argv += ["--keys", keys, "--client", group.name]
    return argv


def dir_there(cluster: RemoteCluster | SlurmCluster, run_dir: Path, name: str) -> str:
    """Where a cluster's groups write (logs, SLURM output): ``runs/RUN/CLUSTER`` under its
    ``workdir`` when it has its own, else ``RUN_DIR/CLUSTER`` (the same filesystem)."""
    if cluster.workdir is not None:
        return f"runs/{run_dir.name}/{name}"
    return str(run_dir / name)


def may_restart(group: GroupSpec) -> bool:
    """Whether the group's restart policy allows any restart (a rollback restarts it too)."""
    return group.restart is not None and group.restart.max > 0


def client_env(keys: Path | None, group: str) -> dict[str, str]:
    """What a rank process reads to be a CURVE client (``roles/runtime/env.py``)."""
    if keys is None:
        return {}
    return curve_env(*client_files(keys, group))


def begin_log(path: Path) -> int:
    """Mark the start of a run in an appended log; returns the offset after the marker."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(path, "ab") as out:
        out.write(f"--- hybridflow: started {stamp} by pid {os.getpid()} ---\n".encode())
        return out.tell()


def last_error(log_path: Path, start: int = 0) -> str:
    """The last line of a log from byte ``start`` on (this run's part) that names an error (the
    reason a group was refused); else its last line."""
    try:
        with open(log_path, "rb") as log:
            log.seek(start)
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return "no log"
    lines = [line for line in lines if not _START_LINE.search(line)]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.split("]: ", 1)[-1].strip()
    return lines[-1] if lines else "it printed nothing in this run"


# the line a rank prints first (roles/runtime/rank.py): which process it is, not why it ended
_START_LINE = re.compile(r": pid \d+, launched by pid \d+$")


_LIBC = ctypes.CDLL(None)  # loaded here: the child between fork and exec only makes a call


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], token: str, log_path: Path, on_exit: ExitCallback) -> Popen:
    """Run ``argv`` in a session of its own that dies with this process, its output appended
    to ``log_path``, ``token`` on its stdin (never on a command line); ``on_exit(proc, log)``
    runs in the event loop as soon as it ends (a pidfd)."""
    start = begin_log(log_path)  # errors are read from here: this run's lines only
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    assert proc.stdin is not None
    proc.stdin.write(f"{token}\n".encode())
    proc.stdin.close()
    pidfd = os.pidfd_open(proc.pid)
    loop = asyncio.get_running_loop()

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        proc.wait()
        on_exit(proc, (log_path, start))

    loop.add_reader(pidfd, exited)
    return proc


async def end_session(proc: Popen, limit_s: float, what: str) -> None:
    """SIGKILL the session ``proc`` leads (it and what it started here) and wait until every
    process of it is gone; RuntimeError naming ``what`` after ``limit_s`` seconds."""
    kill_session(proc, signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while proc.poll() is None or session_alive(proc.pid):
        if loop.time() > deadline:
            raise RuntimeError(f"{what} (pid {proc.pid}) would not die")
        await asyncio.sleep(0.02)


def kill_session(proc: Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # ``start_new_session``: its process group is its session
    except ProcessLookupError:
        pass  # every process of it is gone


def session_alive(sid: int) -> bool:
    """Whether a process of session ``sid`` still runs here (``/proc``; a zombie is gone)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()  # from field 3 (state) on
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[3]) == sid:  # field 6: the session
            return True
    return False
