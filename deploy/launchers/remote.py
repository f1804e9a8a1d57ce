"""The ``remote`` launcher: each group as one ``hybridflow role`` process on a host reached
through the cluster's ``via`` command (ssh). The token goes over stdin (never on a command line);
the process is in its own session, dies with this one (``PR_SET_PDEATHSIG``), and its exit is
seen at once through a pidfd."""

from __future__ import annotations

import asyncio
import shlex
import signal
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from controller.placement import GroupSpec
from deploy.clusters import RemoteCluster
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
from reshard.peers import CLUSTER_ENV
from roles.runtime.env import RankVar
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts


class RemoteLauncher:
    """Groups on a host reached through ``via``: one ``hybridflow role`` process each."""

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
        self.procs: dict[str, Popen] = {}  # each group's current process
        self.retired: list[Popen] = []  # processes a restart replaced (and has not seen end)
        self.stopping = False
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def command_line(self, group: GroupSpec, address: str) -> str:
        python = self.cluster.python or sys.executable
        workdir = self.cluster.workdir or str(Path.cwd())
        there = dir_there(self.cluster, self.run_dir, self.name)
        env = [f"{TIMEOUTS_ENV}={self.timeouts.to_env()}", f"{RankVar.THREADS}=1"]
        env.append(f"{CLUSTER_ENV}={self.name}")  # weight syncs pick paths by it (reshard/peers.py)
        cli = [python, "-m", "deploy.cli", *role_argv(group, address, there, self.keys)]
        argv = ["env", *env, *cli, "--token", "-"]
        return f"cd {shlex.quote(workdir)} && exec {shlex.join(argv)}"

    def start(self, groups: Sequence[GroupSpec]) -> None:
        for group in groups:
            self._start(group)

    def _start(self, group: GroupSpec) -> None:
        log_path = self.run_dir / "logs" / f"{self.name}-{group.name}.log"
        argv = [*self.cluster.via, self.command_line(group, self.address)]
        on_exit = partial(self._exited, group.name)
        self.procs[group.name] = spawn(argv, self.token, log_path, on_exit)

    def where(self) -> list[Where]:
        via = " ".join(self.cluster.via) or "here"
        return [Where(g, None, via, proc.pid) for g, proc in self.procs.items()]

    def _exited(self, group: str, proc: Popen, log: Log) -> None:
        code = proc.returncode
        if self.stopping or code == 0 or self.procs.get(group) is not proc:
            return  # the shutdown, a clean exit, or an incarnation a restart replaced
        via = " ".join(self.cluster.via)
        cause = f"on cluster {self.name!r} ({via}) exited with {code}: {last_error(*log)}"
        self.on_dead(group, 0, f"{cause} (log: {log[0]})")

    async def restart(self, spec: GroupSpec) -> None:
        """End what is left of the group's process (its whole session), wait until it is gone,
        then start the group again. The old
        process's exit is not reported: the controller already forgot that incarnation
        (``Controller.reset``). Over ssh the session here is the ssh client: a ``hybridflow
        role`` still running there leaves on its own once its ranks lose the controller."""
        old = self.procs.pop(spec.name, None)  # from here on its exit is no death (``_exited``)
        if old is not None:
            self.retired.append(old)  # should it not die, stop() tries again
            what = f"the process of group {spec.name!r} on cluster {self.name!r}"
            await end_session(old, self.timeouts.shutdown_s + 5.0, what)
            self.retired.remove(old)
        self._start(spec)

    async def stop(self) -> None:
        """The groups leave on the controller's SHUTDOWN; what is still running after the
        grace period is ended (its whole session)."""
        self.stopping = True
        procs = [*self.procs.values(), *self.retired]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.shutdown_s + 5.0
        while any(p.poll() is None for p in procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None:
                    kill_session(proc, sig)
            await asyncio.sleep(0.5)
