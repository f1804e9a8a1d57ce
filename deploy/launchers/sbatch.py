"""SLURM pieces shared by ``hybridflow slurm`` (``deploy/commands/slurm.py``) and cluster specs
(``clusters.py`` checks a SLURM cluster, ``launchers/slurm.py`` submits its job).

- the batch script's parts: ``sbatch_header``, one ``srun`` step per group (``group_steps``) and
  the end that watches the steps (``wait_steps``);
- where groups go: round robin over the job's nodes (``group_nodes``, ``node_ranks``), how many
  tasks a node needs (``tasks_per_node``) and why a placement does not fit (``overfull``);
- SLURM's client commands: ``run_there`` (here or through ``via``, e.g. ssh), ``slurm_problem``
  (what to fix when one failed) and ``slurm_cpus_per_node`` (asks ``sinfo``).

A group is anything with ``roles``, ``nproc``, ``tp``, ``pp`` (and their generation sizes) and
``device``: an experiment's placement (``GroupConfig``) or a launcher's ``GroupSpec``.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from deploy.experiment import ExperimentError
from transport.device import DeviceKind


class Placed(Protocol):
    """What a SLURM script needs of a process group."""

    @property
    def roles(self) -> Collection[str]: ...

    @property
    def nproc(self) -> int: ...

    @property
    def tp(self) -> int: ...

    @property
    def pp(self) -> int: ...

    @property
    def gen_tp(self) -> int: ...

    @property
    def gen_pp(self) -> int: ...

    @property
    def device(self) -> DeviceKind: ...

    @property
    def nodes(self) -> int: ...


Groups = Mapping[str, Placed]


def sbatch_header(
    name: str,
    nodes: int,
    per_node: int,
    output: str,
    partition: str | None = None,
    time_limit: str | None = None,
    gpus_per_node: int = 0,
    account: str | None = None,
) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",  # each group's step on one node
        f"#SBATCH --output={output}",
    ]
    for option, value in (("partition", partition), ("time", time_limit), ("account", account)):
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    return lines


#: the job's Comment after steps of groups that may come back failed: ``PREFIX gen=137,...``
FAILED_STEPS = "hybridflow-failed:"


def wait_steps(controller: bool, linger_s: int = 0) -> list[str]:
    """The script's end, watching the steps in ``pids``: the first to fail ends the job with its
    status (SLURM then ends the others), so nobody waits for a group that is gone. A clean exit
    of the ``controller`` step ends the run; the groups leave on its SHUTDOWN.

    With ``linger_s`` (a job whose groups may be restarted, ``launchers/slurm.py``), a failed
    step in ``again`` (pid -> group) does not end the job: it is written in the job's Comment
    (``FAILED_STEPS``, where the controller reads it) and the controller starts the group again
    as a new step of this job from outside (``srun --jobid --overlap``). Once the script's own
    steps are over, the allocation is kept while any step of the job runs, and ``linger_s``
    seconds after the last one: a replacement may be on its way. At the end of the run the
    controller ends it sooner with SIGUSR1 (``scancel --batch --signal=USR1``): it completes."""
    done = '[ "${pids[$i]}" = "$controller" ] && { wait; exit 0; }  # the run is over'
    fail = ["    [ $status -eq 0 ] || exit $status"]
    if linger_s:
        fail = [
            "    group=${again[${pids[$i]}]:-}",
            '    if [ $status -ne 0 ] && [ -n "$group" ]; then  # the controller restarts it',
            '      failed="${failed:+$failed,}$group=$status"',
            f'      scontrol update JobId="$SLURM_JOB_ID" Comment="{FAILED_STEPS}$failed"',
            "    elif [ $status -ne 0 ]; then exit $status; fi",
        ]
    lines = [
        "",
        *(
            ["trap 'exit 0' USR1  # the controller's word: no group will come back"]
            if linger_s
            else []
        ),
        "# the first step to fail fails the job"
        + (" (a group in again: it is reported, and comes back)" if linger_s else "")
        + "; the controller's end is the run's",
        "set +e",
        *(['failed=""'] if linger_s else []),
        "while [ ${#pids[@]} -gt 0 ]; do",
        '  for i in "${!pids[@]}"; do',
        '    kill -0 "${pids[$i]}" 2>/dev/null && continue',
        '    wait "${pids[$i]}"; status=$?',
        '    [ $status -eq 0 ] || echo "hybridflow: a step failed ($status)" >&2',
        *fail,
        *([f"    {done}"] if controller else []),
        '    unset "pids[$i]"',
        "  done",
        "  sleep 1",
        "done",
        "",
    ]
    if linger_s:
        lines += [
            "# groups that may be restarted come back as new steps of this job (srun --jobid):",
            f"# the allocation stays while any step runs, and {linger_s} s after the last",
            "idle=0",
            f"while [ $idle -lt {linger_s} ]; do",
            '  steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o %i \\',
            '    | grep -v -e "\\.batch$" -e "\\.extern$")  # the steps of groups, not the script',
            '  if [ -n "$steps" ]; then idle=0; else idle=$((idle + 1)); fi',
            "  sleep 1",
            "done",
            "",
        ]
    return lines


def group_nodes(groups: Groups, nodes: int, controller: bool) -> list[list[int]]:
    """The nodes of each group, in order: round robin, starting after the controller's node
    (node 0) when the job has more than one node; a group over K nodes takes the next K (its
    rank 0 on the first). ``spans_too_many`` first: a group over more nodes than the job has
    would be given one twice."""
    cursor = 1 if controller and nodes > 1 else 0
    found = []
    for group in groups.values():
        found.append([(cursor + i) % nodes for i in range(group.nodes)])
        cursor += group.nodes
    return found


def spans_too_many(groups: Groups, nodes: int) -> str | None:
    """Why a group cannot be laid out on a job of ``nodes`` nodes, or None."""
    for name, group in groups.items():
        if group.nodes > nodes:
            return (
                f"group {name!r} spans {group.nodes} nodes but the job has {nodes}; "
                f"ask for --nodes {group.nodes} or more, or lower placement.{name}.nodes"
            )
    return None


def node_ranks(groups: Groups, nodes: int, controller: bool) -> list[list[str]]:
    """What runs on each node: group names, and "controller" on node 0 when there is one."""
    where: list[list[str]] = [["controller"] if controller and n == 0 else [] for n in range(nodes)]
    for its, name in zip(group_nodes(groups, nodes, controller), groups, strict=True):
        for node in its:
            where[node].append(name)
    return where


def _tasks(groups: Groups, names: list[str]) -> int:
    """The tasks of one node's groups (the controller is one task; a group over K nodes puts
    nproc / K on each)."""
    return sum(
        1 if name == "controller" else groups[name].nproc // groups[name].nodes for name in names
    )


def tasks_per_node(groups: Groups, nodes: int, controller: bool) -> int:
    """The job's ``--ntasks-per-node``: its fullest node (the controller is one task)."""
    return max(_tasks(groups, names) for names in node_ranks(groups, nodes, controller))


def overfull(groups: Groups, nodes: int, per_node: int, controller: bool) -> str | None:
    """Why the groups (and the controller, 1 task on node 0) do not fit ``nodes`` nodes of
    ``per_node`` tasks each, or None."""
    if why := spans_too_many(groups, nodes):
        return why
    for n, names in enumerate(node_ranks(groups, nodes, controller)):
        ranks = _tasks(groups, names)
        if ranks > per_node:
            return (
                f"node {n} of the job would run {ranks} tasks ({', '.join(names)}) but a node "
                f"holds {per_node}; use more nodes or fewer ranks (placement nproc)"
            )
    return None


def group_steps(
    groups: Groups,
    nodes: int,
    connect: str,
    run_dir: str | Path,
    python: str,
    keys: str,
    controller: bool,
    again: Collection[str] = (),
) -> list[str]:
    """One background srun step per group, on the nodes ``group_nodes`` gives it; each rank is
    one ``hybridflow role --launcher env`` process (``SLURM_PROCID``). A group on one node meets
    on loopback; a group over several at its step's first node (``STEP_FIRST_NODE``). The
    steps of the groups in ``again`` (they may be restarted) are listed in the script's
    ``again`` too, by pid (``wait_steps``)."""
    lines: list[str] = []
    for its, (name, group) in zip(
        group_nodes(groups, nodes, controller), groups.items(), strict=True
    ):
        hosts = [f"${{nodes[{node}]}}" for node in its]
        step = group_step(name, group, hosts, connect, run_dir, python, keys)
        roles = ",".join(group.roles)
        spread = f" over {group.nodes} nodes" if group.nodes > 1 else ""
        lines += [
            "",
            f"# group {name}: {roles}, {group.nproc} rank(s){spread}, tp={group.tp}, pp={group.pp}",
            *step[:-1],
            step[-1] + " &",
            "pids+=($!)" + (f"; again[$!]={name}" if name in again else ""),
        ]
    return lines


def group_step(
    name: str,
    group: Placed,
    hosts: list[str],
    connect: str,
    run_dir: str | Path,
    python: str,
    keys: str,
    options: str = "",
) -> list[str]:
    """The srun command (continued lines) that runs one group on ``hosts`` (one a node of the
    group) as a job step named after the group (``squeue -s`` finds it by that name); ranks fill
    the nodes in order (``--distribution=block``), so tensor-parallel peers share one. A group
    on one node meets on loopback, one over several at the step's first node, which each rank
    asks SLURM for (``STEP_FIRST_NODE``). ``options`` come first (``--jobid=J --overlap``: a
    step started from outside the job)."""
    roles = ",".join(group.roles)
    k = len(hosts)
    where = f"--nodes={k} --ntasks={group.nproc} --ntasks-per-node={group.nproc // k} "
    where += f"--distribution=block --nodelist={','.join(hosts)}"
    master = "127.0.0.1" if k == 1 else STEP_FIRST_NODE
    return [
        f"srun {options}--job-name={name} {where} --exact \\",
        f"  {python} -m deploy.cli role {roles} --connect {connect} \\",
        f"  --group {name} --tp {group.tp} --pp {group.pp} --gen-tp {group.gen_tp} "
        f"--gen-pp {group.gen_pp} --device {group.device} "
        "--launcher env "
        f"--master-addr {master} "
        f"--run-dir {shlex.quote(str(run_dir))}" + (f"{keys} --client {name}" if keys else ""),
    ]


#: ``hybridflow role --master-addr`` for a group over several nodes: its ranks meet at the step's
#: first node, where SLURM puts task 0 (tasks fill the step's nodes in SLURM's node order, which
#: need not be the order of ``--nodelist``)
STEP_FIRST_NODE = "@step"


def step_first_node_addr(env: Mapping[str, str], patience_s: float = 60.0) -> str:
    """The address of the first node of this SLURM step as SLURM knows it (``NodeAddr``: the
    hostname on most clusters, an address where names do not resolve). Every rank of a step
    asks at once; a slurmctld slow to answer is asked again for ``patience_s`` seconds (a name
    taken in its place would not resolve where names do not)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise SystemExit(f"hybridflow role: --master-addr {STEP_FIRST_NODE} outside a SLURM step")
    deadline = time.monotonic() + patience_s
    hosts = _asked(["scontrol", "show", "hostnames", nodelist], deadline)
    first = hosts.stdout.split()[0]
    node = _asked(["scontrol", "show", "node", first, "-o"], deadline)
    fields = dict(f.split("=", 1) for f in node.stdout.split() if "=" in f)
    return fields.get("NodeAddr") or first


def _asked(argv: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    """``argv`` (a SLURM client command) until it answers with output, or SystemExit naming
    what failed once ``deadline`` (monotonic) has passed."""
    who = f"hybridflow role: {' '.join(argv[:3])}"
    done = asked_again([], argv, deadline, who, lambda d: d.returncode != 0 or not d.stdout.split())
    if done.returncode != 0 or not done.stdout.split():
        raise SystemExit(slurm_problem(who, done.stderr))
    return done


def asked_again(
    via: list[str],
    argv: list[str],
    deadline: float,
    who: str,
    again: Callable[[subprocess.CompletedProcess[str]], bool],
) -> subprocess.CompletedProcess[str]:
    """``argv``'s answer once ``again`` (it) is false or ``deadline`` (monotonic) has passed,
    asking again every half second and saying so on stderr (``who``: what asks)."""
    while True:
        done = run_there(via, argv, timeout=30)
        if not again(done) or time.monotonic() > deadline:
            return done
        said = (done.stderr + done.stdout).strip()[-200:]
        print(f"{who}: {argv[0]} failed, asking again: {said}", file=sys.stderr, flush=True)
        time.sleep(0.5)


def run_there(via: list[str], argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on the host ``via`` reaches (here when empty)."""
    command = [*via, shlex.join(argv)] if via else argv
    return subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)


def slurm_problem(who: str, stderr: str) -> str:
    """What to fix when a SLURM client command failed."""
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    if "munge" in stderr.lower():
        return (
            f"{who}: SLURM cannot authenticate ({text}): munged is not running or "
            "not installed on this host; start it (e.g. `service munge start`)"
        )
    if "unable to contact" in stderr.lower() or "connection refused" in stderr.lower():
        return f"{who}: slurmctld does not answer ({text}); is the cluster up?"
    return f"{who}: {text}"


BUSY = "timed out"  # what SLURM's clients say when slurmctld is up but slow to answer


def _busy(done: subprocess.CompletedProcess[str]) -> bool:
    return done.returncode != 0 and BUSY in (done.stderr + done.stdout).lower()


def slurm_cpus_per_node(
    who: str, via: list[str], partition: str | None, patience_s: float = 60.0
) -> int:
    """The smallest CPU count of the partition's nodes; a clear error (starting with ``who``)
    when SLURM's commands are missing or munge/slurmctld do not answer. A slurmctld that is up
    but busy (its answer timed out) is asked again for ``patience_s``, saying so on stderr."""
    if not via and shutil.which("sinfo") is None:
        raise ExperimentError(
            f"{who}: SLURM's commands (sinfo, sbatch) are not on PATH; install the "
            "SLURM client (Debian: slurm-client) or set via: to reach a login node"
        )
    said = _sinfo(who, via, "%c", partition, patience_s)
    counts = [int(c.rstrip("+")) for c in said.split() if c.rstrip("+").isdigit()]
    if not counts:
        where = f"partition {partition!r}" if partition else "the default partition"
        raise ExperimentError(f"{who}: sinfo lists no nodes in {where}")
    return min(counts)


def slurm_node_room(
    who: str, via: list[str], partition: str | None, patience_s: float = 60.0
) -> tuple[int, int | None]:
    """(the partition's node count, the most nodes one job may have there or None for no
    limit), from sinfo: a job asking more nodes would only ever sit pending."""
    nodes, limit = 0, None
    for line in _sinfo(who, via, "%D|%s", partition, patience_s).split():
        count, _, size = line.partition("|")
        nodes += int(count) if count.isdigit() else 0
        most = size.rpartition("-")[2]
        if most.isdigit():
            limit = int(most) if limit is None else max(limit, int(most))
    return nodes, limit


def _sinfo(who: str, via: list[str], fields: str, partition: str | None, patience_s: float) -> str:
    """``sinfo -h -o FIELDS`` of the partition, asked again while slurmctld is busy; a clear
    error (starting with ``who``) when it does not answer."""
    argv = ["sinfo", "-h", "-o", fields] + (["-p", partition] if partition else [])
    try:
        done = asked_again(via, argv, time.monotonic() + patience_s, who, _busy)
    except subprocess.TimeoutExpired:
        raise ExperimentError(f"{who}: sinfo did not answer within 30 s") from None
    if done.returncode != 0:
        raise ExperimentError(slurm_problem(who, done.stderr + done.stdout))
    return done.stdout
