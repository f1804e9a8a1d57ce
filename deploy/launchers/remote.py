"""The ``remote`` launcher: groups on hosts reached through a command (``via``: ssh).

A cluster of one host (``via``) runs each group there as one ``hybridflow role`` process, which
starts the group's ranks. A cluster of several (``hosts``) puts each group on the next host in
turn, as a SLURM job lays groups on its nodes (``sbatch.group_nodes``); a group over K hosts
(``nodes: K``) has its ranks laid out host by host (nproc / K on each, tensor-parallel peers on
one) and runs each rank as its own ``hybridflow role --launcher env`` through its host's
``via``, as torchrun would: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and the address and a
port free on rank 0's host (asked of that host just before the start), where the group meets.

Every process started here gets the token over stdin (never on a command line), is in a session
of its own, dies with this one (``PR_SET_PDEATHSIG``), and its exit is seen at once through a
pidfd; over ssh that is the ssh client, and what runs there leaves once its group loses the
controller."""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from controller.placement import GroupSpec
from deploy.clusters import RemoteCluster, RemoteHost
from deploy.launchers.base import (
    DeathCallback,
    Log,
    Popen,
    Where,
    dir_there,
    end_session,
    kill_session,
    last_error,
    role_argv,
    spawn,
)
from deploy.launchers.sbatch import group_nodes
from reshard.peers import CLUSTER_ENV
from roles.runtime.env import RankVar
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts

#: prints a TCP port free on the host it runs on (the group's store binds it just after)
_FREE_PORT = (
    "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1]); s.close()"
)


@dataclass(frozen=True)
class _Started:
    """A process this launcher started for a group: a whole group, or one rank of it."""

    rank: int | None  # None: a ``hybridflow role`` that starts every rank of the group
    host: str  # the host's address, or the ``via`` that reaches it
    popen: Popen


class RemoteLauncher:
    """Groups on hosts reached through ``via`` (``Launcher``)."""

    def __init__(
        self,
        name: str,
        cluster: RemoteCluster,
        run_dir: Path,
        keys: Path | None,
        timeouts: Timeouts,
        on_dead: DeathCallback,
        address: str,
        token: str,
    ) -> None:
        self.name, self.cluster, self.run_dir = name, cluster, run_dir
        self.address, self.token = address, token  # what the groups join
        self.keys = cluster.keys or (str(keys) if keys is not None else None)
        self.timeouts, self.on_dead = timeouts, on_dead
        self.procs: dict[str, list[_Started]] = {}  # each group's current processes
        self.hosts_of: dict[str, list[int]] = {}  # each group's hosts (cluster.hosts indices)
        self.retired: list[Popen] = []  # processes a restart replaced (and has not seen end)
        self.stopping = False
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def _env(self) -> list[str]:
        env = [f"{TIMEOUTS_ENV}={self.timeouts.to_env()}"]
        return [
            *env,
            f"{CLUSTER_ENV}={self.name}",
        ]  # weight syncs pick paths by it (reshard/peers.py)

    def _line(self, env: list[str], cli: list[str]) -> str:
        python = self.cluster.python or sys.executable
        workdir = self.cluster.workdir or str(Path.cwd())
        argv = ["env", *env, python, "-m", "deploy.cli", *cli, "--token", "-"]
        return f"cd {shlex.quote(workdir)} && exec {shlex.join(argv)}"

    def _role(self, group: GroupSpec, address: str) -> list[str]:
        there = dir_there(self.cluster, self.run_dir, self.name)
        return role_argv(group, address, there, self.keys)

    def command_line(self, group: GroupSpec, address: str) -> str:
        """The shell line that runs the whole group as one ``hybridflow role`` on a host."""
        return self._line([*self._env(), f"{RankVar.THREADS}=1"], self._role(group, address))

    def rank_line(self, group: GroupSpec, rank: int, master: str, port: int) -> str:
        """The shell line that runs rank ``rank`` of a group over several hosts, torchrun's
        way: the group meets at ``master:port`` (rank 0's host)."""
        share = group.nproc // group.nodes
        place = [f"RANK={rank}", f"WORLD_SIZE={group.nproc}", f"LOCAL_RANK={rank % share}"]
        cli = [*self._role(group, self.address), "--launcher", "env"]
        cli += ["--master-addr", master, "--master-port", str(port)]
        return self._line([*self._env(), f"{RankVar.THREADS}={group.threads}", *place], cli)

    def start(self, groups: Sequence[GroupSpec]) -> None:
        if self.cluster.hosts:  # round robin over the hosts, a group over K on K in a row
            placed = {g.name: g for g in groups}
            layout = group_nodes(placed, len(self.cluster.hosts), controller=False)
            self.hosts_of.update(zip(placed, layout, strict=True))
        for group in groups:
            self._start(group, self._master_port(group))

    def _master_port(self, group: GroupSpec) -> int:
        """A port free on the group's first host, when its ranks are started one by one."""
        if group.nodes == 1 or not self.cluster.hosts:
            return 0  # its ranks are started by one ``hybridflow role``, which picks one
        host = self.cluster.hosts[self.hosts_of[group.name][0]]
        python = shlex.quote(self.cluster.python or sys.executable)
        argv = [*host.via, f"{python} -c {shlex.quote(_FREE_PORT)}"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeouts.connect_s
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"cluster {self.name!r}: host {host.address} did not answer within "
                f"{self.timeouts.connect_s:.0f} s (timeouts.connect_s): {shlex.join(argv)}"
            ) from None
        if done.returncode != 0 or not done.stdout.strip().isdigit():
            raise RuntimeError(
                f"cluster {self.name!r}: asking host {host.address} for a free port failed "
                f"({done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}"
            )
        return int(done.stdout.strip())

    def _start(self, group: GroupSpec, port: int) -> None:
        if not self.cluster.hosts:
            via = " ".join(self.cluster.via)
            line = self.command_line(group, self.address)
            self.procs[group.name] = [self._spawn(group.name, None, via, self.cluster.via, line)]
            return
        hosts = [self.cluster.hosts[i] for i in self.hosts_of[group.name]]
        if group.nodes == 1:  # the group on one host: one ``hybridflow role`` starts its ranks
            line = self.command_line(group, self.address)
            started = [self._spawn(group.name, None, hosts[0].address, hosts[0].via, line)]
        else:
            share = group.nproc // group.nodes
            started = []
            for rank in range(group.nproc):
                host: RemoteHost = hosts[rank // share]
                line = self.rank_line(group, rank, hosts[0].address, port)
                started.append(self._spawn(group.name, rank, host.address, host.via, line))
        self.procs[group.name] = started

    def _spawn(
        self, group: str, rank: int | None, host: str, via: list[str], line: str
    ) -> _Started:
        part = "" if rank is None else f"-{rank}"
        log_path = self.run_dir / "logs" / f"{self.name}-{group}{part}.log"
        on_exit = partial(self._exited, group, rank, host)
        return _Started(rank, host, spawn([*via, line], self.token, log_path, on_exit))

    def where(self) -> list[Where]:
        return [
            Where(group, p.rank, p.host or "here", p.popen.pid)
            for group, started in self.procs.items()
            for p in started
        ]

    def _exited(self, group: str, rank: int | None, host: str, proc: Popen, log: Log) -> None:
        code = proc.returncode
        current = [p.popen for p in self.procs.get(group, [])]
        if self.stopping or code == 0 or proc not in current:
            return  # the shutdown, a clean exit, or an incarnation a restart replaced
        which = "" if rank is None else f"rank {rank} "
        cause = f"{which}on cluster {self.name!r} ({host}) exited with {code}: {last_error(*log)}"
        self.on_dead(group, 0 if rank is None else rank, f"{cause} (log: {log[0]})")

    async def restart(self, spec: GroupSpec) -> None:
        """End what is left of the group's processes (each one's whole session), wait until
        they are gone, then start the group again (on the same hosts, a new port). The old
        processes' exits are not reported: the controller already forgot that incarnation
        (``Controller.reset``). Over ssh the session here is the ssh client: a rank still
        running there leaves on its own once it loses the controller."""
        old = [p.popen for p in self.procs.pop(spec.name, [])]  # their exits: no deaths now
        self.retired += old  # should one not die, stop() tries again
        what = f"a process of group {spec.name!r} on cluster {self.name!r}"
        limit_s = self.timeouts.shutdown_s + 5.0
        await asyncio.gather(*(end_session(p, limit_s, what) for p in old))
        self.retired = [p for p in self.retired if p not in old]
        port = await asyncio.to_thread(self._master_port, spec)
        self._start(spec, port)

    async def stop(self) -> None:
        """The groups leave on the controller's SHUTDOWN; what is still running after the
        grace period is ended (its whole session)."""
        self.stopping = True
        procs = [p.popen for started in self.procs.values() for p in started] + self.retired
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.shutdown_s + 5.0
        while any(p.poll() is None for p in procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None:
                    kill_session(proc, sig)
            await asyncio.sleep(0.5)
