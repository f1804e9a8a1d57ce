"""Starting a run's groups on the clusters of a cluster spec (``deploy/clusters.py``).

- ``local``: ``LocalLauncher`` ranks, here, connecting to the controller's TCP address.
- ``remote``: one ``hybridflow role`` per group, run through the cluster's ``via`` command (ssh).
  The token goes over stdin (never on a command line); the process is in its own session, dies
  with this one (``PR_SET_PDEATHSIG``), and its exit is seen at once through a pidfd.
- ``slurm``: one batch job per cluster, its script on sbatch's stdin; ``scontrol`` is polled so a
  job that ends (or fails) before the run does is reported as the death of its groups; a job
  still there when the run is over gets ``scancel``.
- ``manual``: the command to start each group is printed.

Each launcher reports a group's death as ``on_dead(group, rank, cause)`` and has ``stop()``:
after the controller told the groups to stop, wait for them, then end what is left.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from controller.placement import GroupSpec
from deploy.clusters import RemoteCluster, SlurmCluster
from deploy.keys_cli import client_files
from deploy.local import begin_log, last_error
from deploy.slurm import (
    group_steps,
    run_there,
    sbatch_header,
    slurm_problem,
    tasks_per_node,
    wait_steps,
)
from reshard.peers import CLUSTER_ENV
from roles.runtime.env import RankVar, curve_env
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts

DeathCallback = Callable[[str, int | None, str], None]  # group, rank, cause
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def role_argv(group: GroupSpec, address: str, run_dir: str | None, keys: str | None) -> list[str]:
    """The arguments of ``hybridflow`` that start one group and join the controller."""
    argv = ["role", ",".join(group.roles), "--connect", address, "--group", group.name]
    argv += ["--nproc", str(group.nproc), "--tp", str(group.tp), "--pp", str(group.pp)]
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


_LIBC = ctypes.CDLL(None)  # loaded here: the child between fork and exec only makes a call


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class RemoteGroups:
    """Groups on a host reached through ``via``: one ``hybridflow role`` process each."""

    def __init__(
        self,
        name: str,
        cluster: RemoteCluster,
        run_dir: Path,
        keys: Path | None,
        timeouts: Timeouts,
        on_dead: DeathCallback,
    ) -> None:
        self.name, self.cluster, self.run_dir = name, cluster, run_dir
        self.keys = cluster.keys or (str(keys) if keys is not None else None)
        self.timeouts, self.on_dead = timeouts, on_dead
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
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

    def start(self, group: GroupSpec, address: str, token: str) -> None:
        log_path = self.run_dir / "logs" / f"{self.name}-{group.name}.log"
        start = begin_log(log_path)  # errors are read from here: this run's lines only
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [*self.cluster.via, self.command_line(group, address)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        assert proc.stdin is not None
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.close()
        self.procs[group.name] = proc
        pidfd = os.pidfd_open(proc.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, self._exited, group.name, proc, pidfd, (log_path, start))

    def _exited(
        self, group: str, proc: subprocess.Popen[bytes], pidfd: int, log: tuple[Path, int]
    ) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        code = proc.wait()
        if self.stopping or code == 0:
            return
        via = " ".join(self.cluster.via)
        cause = f"on cluster {self.name!r} ({via}) exited with {code}: {last_error(*log)}"
        self.on_dead(group, 0, f"{cause} (log: {log[0]})")

    async def stop(self) -> None:
        """The groups leave on the controller's SHUTDOWN; what is still running after the
        grace period is ended (its whole session)."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.shutdown_s + 5.0
        while any(p.poll() is None for p in self.procs.values()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self.procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
            await asyncio.sleep(0.5)


class SlurmJob:
    """The groups placed on one SLURM cluster, as one batch job."""

    def __init__(
        self,
        name: str,
        cluster: SlurmCluster,
        groups: list[GroupSpec],
        run_dir: Path,
        keys: Path | None,
        timeouts: Timeouts,
        on_dead: DeathCallback,
    ) -> None:
        self.name, self.cluster, self.groups, self.run_dir = name, cluster, groups, run_dir
        self.keys = cluster.keys or (str(keys) if keys is not None else None)
        self.timeouts, self.on_dead = timeouts, on_dead
        self.job: str | None = None
        self.state, self.reason = "", ""
        self.stopping = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def there(self) -> str:
        return dir_there(self.cluster, self.run_dir, self.name)

    @property
    def output(self) -> str:
        """The job's output file (``%j``: the job id), relative to ``workdir`` if it has one."""
        return f"{self.there}/slurm-%j.out"

    def script(self, address: str, token: str) -> str:
        c = self.cluster
        specs = {g.name: g for g in self.groups}
        lines = sbatch_header(
            f"hybridflow-{self.name}",
            c.nodes,
            tasks_per_node(specs, c.nodes, controller=False),
            self.output,
            c.partition,
            c.time,
            c.gpus_per_node,
            c.account,
        )
        python = shlex.quote(c.python or sys.executable)
        keys = f" --keys {shlex.quote(self.keys)}" if self.keys else ""
        if c.workdir is not None:
            lines.append(f"#SBATCH --chdir={c.workdir}")
        lines += [
            "",
            f"# hybridflow: the groups of cluster {self.name!r}; the controller is at {address}",
            "set -euo pipefail",
            'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
            f"export {RankVar.TOKEN}={token}",
            f"export {TIMEOUTS_ENV}={shlex.quote(self.timeouts.to_env())}",
            f"export {RankVar.THREADS}=1",
            f"export {CLUSTER_ENV}={shlex.quote(self.name)}",
            f"cd {shlex.quote(c.workdir or str(Path.cwd()))}",
            "pids=()",
        ]
        lines += group_steps(specs, c.nodes, address, self.there, python, keys, controller=False)
        lines += wait_steps(controller=False)
        return "\n".join(lines)

    def submit(self, address: str, token: str) -> None:
        """sbatch with the script on stdin (the token is in no file of ours)."""
        argv = ["sbatch", "--parsable"]
        if self.cluster.via:  # the output folder must exist there before the job starts
            command = [
                *self.cluster.via,
                f"cd {shlex.quote(self.cluster.workdir or '.')} && mkdir -p "
                f"{shlex.quote(self.there)} && {shlex.join(argv)}",
            ]
        else:
            (Path(self.cluster.workdir or ".") / self.there).mkdir(parents=True, exist_ok=True)
            command = argv
        done = subprocess.run(
            command,
            input=self.script(address, token),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(slurm_problem(f"cluster {self.name!r}: sbatch", done.stderr))
        self.job = done.stdout.strip().split(";")[0]
        self._watch = asyncio.ensure_future(self._follow())

    def query(self) -> None:
        assert self.job is not None
        done = run_there(self.cluster.via, ["scontrol", "show", "job", self.job, "-o"], timeout=30)
        fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
        self.state = fields.get("JobState", self.state)
        self.reason = fields.get("Reason", "")

    async def _follow(self) -> None:
        while True:
            await asyncio.to_thread(self.query)
            if self.state in ENDED:
                break
            await asyncio.sleep(2.0)
        if not self.stopping:
            out = Path(self.cluster.workdir or ".") / self.output.replace("%j", str(self.job))
            said = f": {last_error(out)}" if not self.cluster.via and out.is_file() else ""
            cause = f"SLURM job {self.job} on cluster {self.name!r} ended {self.state}{said}"
            cause += f" (output: {out})"
            for group in self.groups:
                self.on_dead(group.name, None, cause)

    def hint(self) -> str:
        if self.job is None:
            return f"cluster {self.name!r}: not submitted"
        reason = f", reason {self.reason}" if self.reason and self.reason != "None" else ""
        return f"cluster {self.name!r}: SLURM job {self.job} is {self.state or 'unknown'}{reason}"

    async def stop(self) -> None:
        """Let the job end on its own (its groups were told to stop); scancel what is left."""
        self.stopping = True
        if self.job is None:
            return
        deadline = asyncio.get_running_loop().time() + self.timeouts.shutdown_s + 10.0
        while self._watch is not None and not self._watch.done():
            if asyncio.get_running_loop().time() > deadline:
                self._watch.cancel()
                await asyncio.to_thread(run_there, self.cluster.via, ["scancel", self.job])
                break
            await asyncio.sleep(0.2)


def client_env(keys: Path | None, group: str) -> dict[str, str]:
    """What a rank process reads to be a CURVE client (``roles/runtime/env.py``)."""
    if keys is None:
        return {}
    return curve_env(*client_files(keys, group))
