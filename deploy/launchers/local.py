"""Local launcher: every rank of every group as its own OS process on this machine.

A rank runs ``roles.runtime.rank.main`` with torchrun-style variables: forked by this process's
fork server (``forkserver.py``: CPU ranks, imports done once) or started as ``python -m
roles.runtime`` (GPU ranks, or forking off). Each asks the kernel for SIGKILL when its parent
dies (``PR_SET_PDEATHSIG``, ``roles.runtime.rank.die_with_parent``; the server, in turn, ends
with the launcher), so even ``kill -9`` of the launcher leaves no orphans; each gets its own
session so a terminal's Ctrl-C reaches only the launcher, which then shuts the ranks down in
order. An exit is seen within milliseconds (a pidfd per child in the event loop, or the fork
server's word on its connection), with its code or signal; the rest of that group is then
killed (its process group is broken anyway).

Rank logs are appended to across runs (an earlier run's log is kept for reading); each start
writes a marker line and remembers where this run's part begins, and ``last_error`` reads from
there, so a failure is explained by this run's lines, never by an earlier run's.

A session's ipc sockets live in a ``SocketFolder`` under the temp dir (ipc names are limited to
about 100 bytes, so not under a run dir of any length). Its owner holds an ``flock`` on the
folder's ``owner.lock`` for its lifetime; the kernel drops it when the owner dies, even by
``kill -9``, so ``sweep_socket_folders`` at the next session's start removes exactly the orphans
— no pid is trusted (pids are reused, and a /tmp shared between pid namespaces sees other pids).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from controller.placement import GroupSpec
from deploy.launchers.base import Where, begin_log, client_env, last_error
from deploy.launchers.forkserver import (
    Forked,
    ForkLink,
    ForkServer,
    StaleServer,
    fork_ranks_enabled,
)
from deploy.processes import write_processes
from roles.runtime.device import check_device
from roles.runtime.env import RankEnv, RankPlace
from transport.channel import spare_port
from transport.device import DeviceKind
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts
from transport.shm import sweep_dead

log = logging.getLogger("hybridflow.launcher")

ExitCallback = Callable[[str, int, int, str], None]  # group, rank, returncode, its last error


@dataclass
class RankProcess:
    group: str
    rank: int
    popen: subprocess.Popen[bytes] | Forked
    pidfd: int  # -1: none (a forked rank's end comes from its fork server)
    log_path: Path
    log_start: int = 0  # where this run's lines begin in the (appended) log
    retired: bool = False  # an earlier incarnation of a restarted group: its exit is no death
    roles: tuple[str, ...] = ()


SOCKET_PREFIX = "hf-"
OWNER_LOCK = "owner.lock"


SHM_ROOT = "/dev/shm"  # in-memory snapshots: memory-backed files that outlive a rank


class SocketFolder:
    """A private folder for a session's ipc sockets, held by this process until ``remove``."""

    def __init__(self, root: Path | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=SOCKET_PREFIX, dir=root))
        making = self.path / f".{OWNER_LOCK}.new"
        self._fd = os.open(making, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        # locked before it has the name sweepers look for: never seen unlocked while alive
        making.rename(self.path / OWNER_LOCK)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep_socket_folders(root: Path | None = None) -> list[Path]:
    """Remove this user's socket folders whose owner is gone (its lock is free); returns them.
    Folders of live sessions, of other users and without an owner lock are left alone."""
    removed = []
    for folder in sorted(Path(root or tempfile.gettempdir()).glob(f"{SOCKET_PREFIX}*")):
        if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
            continue
        try:
            fd = os.open(folder / OWNER_LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock: not ours to judge (being made, or from an older version)
        try:
            if _lock_is_free(fd):  # its owner is gone; we hold the lock while removing
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d socket folder(s) of dead sessions: %s", len(removed), removed)
    return removed


def _lock_is_free(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def group_rank_env(
    spec: GroupSpec,
    place: RankPlace,
    controller: str,
    token: str,
    socket_dir: Path,
    threads: str,
    parent_pid: int | None = None,
) -> RankEnv:
    """The environment of the rank at ``place`` in ``spec``'s group (this launcher's ranks and
    a rank torchrun or srun started, ``deploy/commands/role.py``)."""
    return RankEnv(
        place=place,
        group=spec.name,
        roles=tuple(spec.roles),
        controller=controller,
        token=token,
        tp=spec.tp,
        pp=spec.pp,
        gen_tp=spec.gen_tp,
        gen_pp=spec.gen_pp,
        fanout=spec.fanout,
        device=spec.device,
        socket_dir=socket_dir,
        threads=threads,
        parent_pid=parent_pid,
    )


class LocalLauncher:
    """Every rank of the groups as a child process of this one (``Launcher``)."""

    def __init__(
        self,
        controller_address: str,
        token: str,
        run_dir: Path,
        socket_dir: Path,
        timeouts: Timeouts,
        on_exit: ExitCallback,
        keys: Path | None = None,
    ) -> None:
        self.controller_address = controller_address
        self.keys = keys  # CURVE key folder: each group's ranks get its client files
        self.token = token
        self.run_dir = run_dir
        self.socket_dir = socket_dir
        self.timeouts = timeouts
        self.on_exit = on_exit
        self.procs: list[RankProcess] = []
        self.envs: dict[str, dict[str, str] | None] = {}  # each group's extra environment
        self.stopping = False
        self.fork = fork_ranks_enabled()  # ranks forked from the fork server (forkserver.py)
        self.links: list[ForkLink] = []  # to the servers that forked this launcher's ranks
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def rank_env(
        self,
        spec: GroupSpec,
        rank: int,
        port: int,
        extra: dict[str, str] | None = None,
        parent_pid: int | None = None,
    ) -> dict[str, str]:
        """This launcher's environment, ``extra`` (CURVE key files) and the rank's
        (``RankEnv``: its place, its group's settings) for rank ``rank`` of ``spec``;
        ``parent_pid``: the process it dies with (default this one; the fork server's)."""
        env = {**os.environ, **(extra or {})}
        place = RankPlace(rank, spec.nproc, local_rank=rank, master_port=port)
        started = group_rank_env(
            spec,
            place,
            self.controller_address,
            self.token,
            self.socket_dir,
            threads=str(spec.threads),
            parent_pid=parent_pid or os.getpid(),
        )
        env.update(started.to_env())
        env[TIMEOUTS_ENV] = self.timeouts.to_env()
        return env

    def start(self, groups: Sequence[GroupSpec]) -> None:
        for spec in groups:
            self.start_group(spec, client_env(self.keys, spec.name))

    def start_group(self, spec: GroupSpec, env: dict[str, str] | None = None) -> None:
        """Start the group's ranks; ``env`` adds to their environment (CURVE key files)."""
        if spec.nodes > 1:
            raise ValueError(
                f"group {spec.name!r} spans {spec.nodes} nodes, and this launcher starts every "
                "rank here; run it where nodes are: hybridflow slurm --nodes, or --clusters with "
                "a slurm, ray or remote (hosts:) cluster (docs/deploy.md), or set "
                f"placement.{spec.name}.nodes: 1"
            )
        check_device(spec.device, spec.name, spec.nproc)  # ranks run here: fail now, not in each
        self.envs[spec.name] = env
        loop = asyncio.get_running_loop()
        port = spare_port()
        for rank in range(spec.nproc):
            log_path = self.run_dir / "logs" / f"{spec.name}-{rank}.log"
            start = begin_log(log_path)
            title = f"hybridflow {spec.name}:{rank} ({','.join(spec.roles)})"
            roles = tuple(spec.roles)
            forked = self._forked(spec, rank, port, env, title, log_path)
            if forked is not None:
                proc = RankProcess(spec.name, rank, forked, -1, log_path, start, roles=roles)
                self.procs.append(proc)
                continue
            with open(log_path, "ab") as out:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "roles.runtime", title],  # ps: which rank this is
                    env=self.rank_env(spec, rank, port, env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            pidfd = os.pidfd_open(popen.pid)
            proc = RankProcess(spec.name, rank, popen, pidfd, log_path, start, roles=roles)
            self.procs.append(proc)
            loop.add_reader(proc.pidfd, self._exited, proc)
        self._write_processes()

    def _forked(
        self,
        spec: GroupSpec,
        rank: int,
        port: int,
        env: dict[str, str] | None,
        title: str,
        log_path: Path,
    ) -> Forked | None:
        """The rank forked by this process's fork server, or None: to be started as its own
        interpreter (a GPU rank, forking off, or the server failed: said once, then off)."""
        if not self.fork or spec.device != DeviceKind.CPU:
            return None
        for _ in range(2):  # a stale server is replaced once (a second is said, then off)
            try:
                if not self.links or self.links[-1].server is not ForkServer.shared():
                    self.links.append(ForkLink(ForkServer.shared(), self._forked_exited))
                link = self.links[-1]
                ranks_env = self.rank_env(spec, rank, port, env, parent_pid=link.server.pid)
                child = link.spawn(title, ranks_env, log_path, self.timeouts.group_init_s)
                link.watch()
                return child
            except StaleServer as stale:
                log.info("a fresh fork server: %s", stale)
                stale.server.retire()
            except (OSError, RuntimeError) as exc:
                log.warning("ranks start as their own interpreters from now on: %s", exc)
                break
        else:
            log.warning(
                "ranks start as their own interpreters from now on: the environment "
                "changed between two starts"
            )
        self.fork = False
        return None

    def _write_processes(self) -> None:
        """``RUN_DIR/processes.json`` with the ranks started so far (``deploy/processes.py``)."""
        host = socket.gethostname()
        ranks = [
            {
                "group": p.group,
                "rank": p.rank,
                "roles": list(p.roles),
                "pid": p.popen.pid,
                "host": host,
                "log": str(p.log_path),
            }
            for p in self.procs
            if not p.retired
        ]
        write_processes(self.run_dir, ranks)

    async def restart(self, spec: GroupSpec) -> None:
        """End what is left of the group's ranks (SIGKILL), wait until every one is gone, then
        start the group again with the environment it was first started with. The old ranks'
        exits are not reported: the controller already forgot them (``Controller.reset``)."""
        old = [p for p in self.procs if p.group == spec.name and not p.retired]
        for proc in old:
            proc.retired = True
            if proc.popen.poll() is None:
                proc.popen.kill()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.shutdown_s + 5.0
        while any(p.popen.poll() is None for p in old):  # exit statuses are observable here
            if loop.time() > deadline:
                left = [p.popen.pid for p in old if p.popen.poll() is None]
                raise RuntimeError(f"ranks {left} of group {spec.name!r} would not die")
            await asyncio.sleep(0.02)
        sweep_dead()
        self.procs = [p for p in self.procs if not (p.retired and p.pidfd < 0)]
        self.start_group(spec, self.envs.get(spec.name))

    def _exited(self, proc: RankProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.pidfd)
        os.close(proc.pidfd)
        proc.pidfd = -1
        self._ended(proc, proc.popen.wait())

    def _forked_exited(self, child: Forked) -> None:
        for proc in self.procs:
            if proc.popen is child:
                self._ended(proc, child.wait())
                return

    def _ended(self, proc: RankProcess, code: int) -> None:
        sweep_dead()  # shared memory a killed rank can no longer remove itself
        if self.stopping or proc.retired:
            return
        said = ""
        if code != 0:
            said = last_error(proc.log_path, proc.log_start)
            log.error(
                "%s rank %d ended (code %d): %s; log: %s",
                proc.group,
                proc.rank,
                code,
                said,
                proc.log_path,
            )
        self.on_exit(proc.group, proc.rank, code, said)
        if code == 0:
            return  # a clean exit (the group was told to stop); its peers follow on their own
        for other in self.procs:
            if other.group == proc.group and not other.retired and other.popen.poll() is None:
                other.popen.kill()

    def last_error(self, group: str, rank: int) -> str:
        """This run's last error line in a rank's log (``last_error``)."""
        for proc in reversed(self.procs):  # the newest incarnation's
            if (proc.group, proc.rank) == (group, rank):
                return last_error(proc.log_path, proc.log_start)
        return f"no rank {rank} of {group!r} was started"

    def where(self) -> list[Where]:
        host = socket.gethostname()
        live = [p for p in self.procs if not p.retired]
        return [Where(p.group, p.rank, host, p.popen.pid) for p in live]

    def alive(self) -> list[RankProcess]:
        return [p for p in self.procs if p.popen.poll() is None]

    async def stop(self) -> None:
        """Give ranks ``timeouts.shutdown_s`` to leave after SHUTDOWN, then TERM, then KILL."""
        self.stopping = True
        for sig, wait_s in (
            (None, self.timeouts.shutdown_s),
            (signal.SIGTERM, 2.0),
            (signal.SIGKILL, 5.0),
        ):
            if sig is not None:
                for proc in self.alive():
                    proc.popen.send_signal(sig)
            deadline = asyncio.get_running_loop().time() + wait_s
            while self.alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            if proc.pidfd >= 0 and proc.popen.poll() is not None:
                loop.remove_reader(proc.pidfd)
                os.close(proc.pidfd)
                proc.pidfd = -1
        for link in self.links:
            link.close()
        left = self.alive()
        if left:
            raise RuntimeError(
                f"ranks would not die: {[(p.group, p.rank, p.popen.pid) for p in left]}"
            )
