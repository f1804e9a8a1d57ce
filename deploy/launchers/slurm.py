"""The ``slurm`` launcher: the groups placed on one SLURM cluster as one batch job, its script
(``sbatch.py``) on sbatch's stdin. ``scontrol`` is polled so a job that ends (or fails) before
the run does is reported as the death of its groups; a job still there when the run is over gets
``scancel``. A group the supervisor restarts comes back as a new step of its job (``srun --jobid
--overlap``) while the job's allocation runs, else in a job of its own. A replaced incarnation's
end is no death."""

from __future__ import annotations

import asyncio
import math
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from controller.placement import GroupSpec
from deploy.clusters import SlurmCluster
from deploy.launchers.base import (
    DeathCallback,
    Log,
    Popen,
    Where,
    dir_there,
    end_session,
    kill_session,
    last_error,
    may_restart,
    spawn,
)
from deploy.launchers.sbatch import (
    FAILED_STEPS,
    group_nodes,
    group_step,
    group_steps,
    run_there,
    sbatch_header,
    slurm_problem,
    tasks_per_node,
    wait_steps,
)
from reshard.peers import CLUSTER_ENV
from roles.runtime.env import RankVar
from transport.settings import ENV_VAR as TIMEOUTS_ENV
from transport.settings import Timeouts

LINGER_S = 60  # what a job keeps its allocation for a replacement step, besides the back-off
#: the state of a job slurmctld no longer knows (its record purged after MinJobAge)
GONE = "GONE"
#: the states a job does not leave (SLURM's job_state_string, the base states past running)
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    GONE,
}


class SlurmLauncher:
    """The groups placed on one SLURM cluster, as one batch job.

    A group that may be restarted comes back (``restart``) as a new step of the job it ran in,
    started from here (``srun --jobid=JOB --overlap``, through ``via`` when set) while that job's
    allocation runs, else in a new job of its own. The script of a job with such groups does not
    end on their steps' failures and keeps its allocation a while after its last step
    (``wait_steps``): ``stop`` ends it once no step of it runs."""

    def __init__(
        self,
        name: str,
        cluster: SlurmCluster,
        run_dir: Path,
        keys: Path | None,
        timeouts: Timeouts,
        on_dead: DeathCallback,
        address: str,
        token: str,
    ) -> None:
        self.name, self.cluster, self.run_dir = name, cluster, run_dir
        self.groups: list[GroupSpec] = []  # every group of the cluster, given to ``start``
        self.keys = cluster.keys or (str(keys) if keys is not None else None)
        self.timeouts, self.on_dead = timeouts, on_dead
        self.job: str | None = None  # the job submitted first, holding every group
        self.state, self.reason = "", ""  # that job's
        self.joins = (address, token)  # what the groups join
        self.job_of: dict[str, str] = {}  # group -> the job it runs in now
        self.node_of: dict[str, list[int]] = {}  # group -> its nodes' indices in that job
        self.lingering: set[str] = set()  # jobs that keep their allocation for a restart
        self.steps: dict[str, Popen] = {}  # group -> the srun of a step started from here
        self.retired: list[Popen] = []  # such sruns a restart replaced
        self.restarting: set[str] = set()  # groups between the death and their new step or job
        self.reported: set[tuple[str, str]] = set()  # (job, group): failed steps seen
        self.stopping = False
        self._watch: dict[str, asyncio.Task[None]] = {}  # job -> what follows its state
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def there(self) -> str:
        return dir_there(self.cluster, self.run_dir, self.name)

    @property
    def output(self) -> str:
        """The job's output file (``%j``: the job id), relative to ``workdir`` if it has one."""
        return f"{self.there}/slurm-%j.out"

    def script(self, groups: list[GroupSpec] | None = None) -> str:
        """The batch script of every group of the cluster, or of ``groups`` alone on the nodes
        it spans (a group restarted after its job ended)."""
        c = self.cluster
        address, token = self.joins
        specs = {g.name: g for g in (groups or self.groups)}
        nodes = c.nodes if groups is None else max(g.nodes for g in groups)
        lines = sbatch_header(
            f"hybridflow-{self.name}",
            nodes,
            tasks_per_node(specs, nodes, controller=False),
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
            *self._exports(),
            f"cd {shlex.quote(c.workdir or str(Path.cwd()))}",
            "pids=() again=()  # again: pid -> group, for the steps of groups that may come back",
        ]
        again = [n for n, g in specs.items() if may_restart(g)]
        there = self.there
        lines += group_steps(specs, nodes, address, there, python, keys, False, again)
        lines += wait_steps(controller=False, linger_s=linger_s(list(specs.values())))
        return "\n".join(lines)

    def _exports(self) -> list[str]:
        """What the steps' environment holds besides the token."""
        return [
            f"export {TIMEOUTS_ENV}={shlex.quote(self.timeouts.to_env())}",
            f"export {RankVar.THREADS}=1",
            f"export {CLUSTER_ENV}={shlex.quote(self.name)}",
        ]

    def start(self, groups: Sequence[GroupSpec]) -> None:
        """Submit the job of every group and follow its state."""
        self.groups = list(groups)
        self.job = self._submit(None)
        self._hold(self.job, self.groups)
        nodes = group_nodes({g.name: g for g in self.groups}, self.cluster.nodes, False)
        self.node_of = {g.name: n for g, n in zip(self.groups, nodes, strict=True)}

    def _hold(self, job: str, groups: list[GroupSpec]) -> None:
        """``job`` runs ``groups`` from now on: follow its state (in the event loop)."""
        self.job_of.update({g.name: job for g in groups})
        if linger_s(groups):
            self.lingering.add(job)
        self._watch[job] = asyncio.ensure_future(self._follow(job))

    def _submit(self, groups: list[GroupSpec] | None) -> str:
        """sbatch with the script on stdin (the token is in no file of ours); the job id."""
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
            input=self.script(groups),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(slurm_problem(f"cluster {self.name!r}: sbatch", done.stderr))
        return done.stdout.strip().split(";")[0]

    def fields(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Reason, NodeList, ...); JobState GONE once
        slurmctld has forgotten the job, none when it did not answer."""
        done = run_there(self.cluster.via, ["scontrol", "show", "job", job, "-o"], timeout=30)
        if done.returncode != 0 and "invalid job id" in done.stderr.lower():
            return {"JobState": GONE}  # ended long enough ago to be forgotten
        return dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)

    async def _follow(self, job: str) -> None:
        """Poll the job's state until it ends; report the death of the groups it runs when it
        ends, and of one whose step failed (the script writes it in the job's Comment)."""
        state = ""
        while state not in ENDED:
            fields = await asyncio.to_thread(self.fields, job)
            state = fields.get("JobState", state)
            if job == self.job:
                self.state, self.reason = state, fields.get("Reason", "")
            if state not in ENDED:
                self._failed_steps(job, fields.get("Comment", ""))
                await asyncio.sleep(2.0)
        if self.stopping:
            return
        cause = f"SLURM job {job} on cluster {self.name!r} ended {state}{self._said(job)}"
        for group in self.groups:  # a group being restarted: its restart sees the job's end
            if self.job_of.get(group.name) == job and group.name not in self.restarting:
                self.on_dead(group.name, None, cause)

    def _failed_steps(self, job: str, comment: str) -> None:
        """Report the groups whose step the job's script saw fail (``wait_steps``), once each,
        unless the group runs elsewhere by now (a restart under way, a step started from here
        or another job)."""
        if self.stopping or not comment.startswith(FAILED_STEPS):
            return
        for entry in comment.removeprefix(FAILED_STEPS).split(","):
            group, _, status = entry.partition("=")
            if (job, group) in self.reported or self.job_of.get(group) != job:
                continue
            self.reported.add((job, group))
            if group in self.restarting or group in self.steps:
                continue
            cause = f"SLURM job {job} on cluster {self.name!r}: the step of group {group!r} "
            self.on_dead(group, None, f"{cause}ended FAILED (exit {status}){self._said(job)}")

    def _said(self, job: str) -> str:
        """The job's last error line (when its output is readable here) and where it is."""
        out = Path(self.cluster.workdir or ".") / self.output.replace("%j", job)
        said = f": {last_error(out)}" if not self.cluster.via and out.is_file() else ""
        return f"{said} (output: {out})"

    def where(self) -> list[Where]:
        return [
            Where(g, None, f"SLURM job {job} on cluster {self.name!r}")
            for g, job in self.job_of.items()
        ]

    def hint(self) -> str:
        if self.job is None:
            return f"cluster {self.name!r}: not submitted"
        reason = f", reason {self.reason}" if self.reason and self.reason != "None" else ""
        return f"cluster {self.name!r}: SLURM job {self.job} is {self.state or 'unknown'}{reason}"

    # -- restarts -----------------------------------------------------------------------------

    async def restart(self, spec: GroupSpec) -> None:
        """End what is left of the group (its steps: ``scancel JOB.STEP``; the srun of a step
        started from here: its session) and wait until it is gone, then start it again: as a
        new step of its job while the job's allocation runs, else as a new job of its own. The
        old step's end is not reported as a death, nor, meanwhile, the end of its job."""
        name = spec.name
        self.restarting.add(name)
        try:
            job = self.job_of[name]
            await self._end_steps(name, job)
            fields = await asyncio.to_thread(self.fields, job)
            if fields.get("JobState") == "RUNNING":
                hosts = await asyncio.to_thread(self._hosts, fields.get("NodeList", ""))
                self._start_step(spec, job, [hosts[n] for n in self.node_of[name]])
            else:  # the allocation is gone: a job of its own
                self.node_of[name] = list(range(spec.nodes))
                self._hold(await asyncio.to_thread(self._submit, [spec]), [spec])
        finally:
            self.restarting.discard(name)

    async def _end_steps(self, name: str, job: str) -> None:
        """Cancel the group's steps in ``job`` and wait until they and their srun are gone."""
        old = self.steps.pop(name, None)  # from here on its exit is no death (``_step_exited``)
        limit_s = self.timeouts.shutdown_s + 30.0
        steps = await asyncio.to_thread(self._step_ids, job, name)
        if steps:
            await asyncio.to_thread(run_there, self.cluster.via, ["scancel", *steps], timeout=30)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while await asyncio.to_thread(self._step_ids, job, name):
            if loop.time() > deadline:
                raise RuntimeError(
                    f"steps {steps} of group {name!r} (cluster {self.name!r}) would not end"
                )
            await asyncio.sleep(0.2)
        if old is not None:
            self.retired.append(old)  # should it not die, stop() tries again
            await end_session(old, limit_s, f"the srun of group {name!r} (job {job})")
            self.retired.remove(old)

    def _step_ids(self, job: str, name: str) -> list[str]:
        """The running steps (``JOB.STEP``) of ``job`` that run group ``name``."""
        argv = ["squeue", "-h", "-s", "-j", job, "-o", "%i %j"]
        done = run_there(self.cluster.via, argv, timeout=30)
        rows = [line.split() for line in done.stdout.splitlines()]
        return [row[0] for row in rows if len(row) == 2 and row[1] == name]

    def _hosts(self, nodelist: str) -> list[str]:
        done = run_there(self.cluster.via, ["scontrol", "show", "hostnames", nodelist], timeout=30)
        if done.returncode != 0 or not done.stdout.split():
            raise RuntimeError(slurm_problem(f"cluster {self.name!r}: scontrol", done.stderr))
        return done.stdout.split()

    def step_command(self, spec: GroupSpec, job: str, hosts: list[str]) -> str:
        """The shell line that runs the group as a new step of ``job`` on ``hosts``, from
        outside the job; it reads the token from stdin into the step's environment."""
        c = self.cluster
        python = shlex.quote(c.python or sys.executable)
        keys = f" --keys {shlex.quote(self.keys)}" if self.keys else ""
        address = self.joins[0]
        options = f"--jobid={job} --overlap "
        srun = group_step(spec.name, spec, hosts, address, self.there, python, keys, options)
        return "\n".join(
            [
                f"cd {shlex.quote(c.workdir or str(Path.cwd()))}",
                f"read -r {RankVar.TOKEN} && export {RankVar.TOKEN}",
                *self._exports(),
                "exec " + "\n".join(srun) + " </dev/null",
            ]
        )

    def _start_step(self, spec: GroupSpec, job: str, hosts: list[str]) -> None:
        line = self.step_command(spec, job, hosts)
        argv = [*self.cluster.via, line] if self.cluster.via else ["sh", "-c", line]
        log_path = self.run_dir / "logs" / f"{self.name}-{spec.name}.log"
        on_exit = partial(self._step_exited, spec.name, job)
        self.steps[spec.name] = spawn(argv, self.joins[1], log_path, on_exit)

    def _step_exited(self, group: str, job: str, proc: Popen, log: Log) -> None:
        code = proc.returncode
        if self.stopping or code == 0 or self.steps.get(group) is not proc:
            return  # the shutdown, a clean exit, or a step a restart replaced
        cause = f"SLURM job {job} on cluster {self.name!r}: the step of group {group!r} "
        cause += f"(srun --jobid, started here) ended FAILED (exit {code}): {last_error(*log)}"
        self.on_dead(group, None, f"{cause} (log: {log[0]})")

    # -- the end ------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Let the jobs end on their own (their groups were told to stop); one that keeps its
        allocation for a restart is told to end once no step of it runs; at the deadline,
        scancel what is left."""
        self.stopping = True
        if self.job is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.shutdown_s + 10.0
        sruns = [*self.steps.values(), *self.retired]
        while True:
            left = [job for job, watch in self._watch.items() if not watch.done()]
            if not left and all(p.poll() is not None for p in sruns):
                return
            if loop.time() > deadline:
                break
            idle = [j for j in left if j in self.lingering and not await self._runs_steps(j)]
            if idle:  # held for a restart that will not come: its script ends at once
                argv = ["scancel", "--batch", "--signal=USR1", *idle]
                await asyncio.to_thread(run_there, self.cluster.via, argv, timeout=30)
            await asyncio.sleep(0.5 if self.lingering else 0.2)
        for job in left:
            self._watch[job].cancel()
        if left:
            await asyncio.to_thread(run_there, self.cluster.via, ["scancel", *left])
        for proc in sruns:
            kill_session(proc, signal.SIGKILL)

    async def _runs_steps(self, job: str) -> bool:
        """Whether a step of a group runs in ``job`` (the batch script's own is no group's);
        True when squeue does not answer (the job is then left to end on its own)."""
        argv = ["squeue", "-h", "-s", "-j", job, "-o", "%i"]
        done = await asyncio.to_thread(run_there, self.cluster.via, argv, timeout=30)
        steps = done.stdout.split()
        return done.returncode != 0 or any(not s.endswith((".batch", ".extern")) for s in steps)


def linger_s(groups: list[GroupSpec]) -> int:
    """How long a job of ``groups`` keeps its allocation after its last step, for a group's
    replacement step: its longest back-off and a minute; 0 when none may be restarted."""
    backoffs = [max(g.restart.backoff_s) for g in groups if g.restart and may_restart(g)]
    return math.ceil(max(backoffs)) + LINGER_S if backoffs else 0
