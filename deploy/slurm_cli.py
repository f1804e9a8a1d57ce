"""``hybridflow slurm EXPERIMENT.yaml --nodes N``: a readable sbatch script for the experiment.

One job (not a heterogeneous one: every piece runs the same image and software, and one
allocation keeps the groups' nodes together). Its steps:

1. ``srun`` the controller (1 task) on the first node, bound to ``tcp://FIRST_NODE:PORT``;
2. ``srun`` each process group of the placement (``nproc`` tasks, one rank each: ``hybridflow
   role ... --launcher env`` reads ``SLURM_PROCID``/``SLURM_NTASKS``) on its node(s);
3. wait for the controller; its exit status is the job's.

Groups are spread over the nodes in placement order, each on the nodes after the previous one
(a group of more ranks than a node has CPUs spans several). The controller's token is made in
the script and passed by environment, never written to disk. ``--submit`` runs ``sbatch``,
follows the job's output and exits with its status; ``scancel`` ends every step (slurmd kills
each step's processes).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2


def add_slurm_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("slurm", help="write (and --submit) an sbatch script")
    p.add_argument("experiment", type=Path)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--partition")
    p.add_argument("--time", help="job time limit, e.g. 01:00:00")
    p.add_argument("--run-dir", type=Path, help="default: runs/<name>-<time>")
    p.add_argument("--quick", action="store_true", help="the experiment's quick: overrides")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--port", type=int, help="controller port (default: from the job id)")
    p.add_argument(
        "--keys",
        type=Path,
        help="CURVE keys (hybridflow keys --clients GROUPS); needed for --nodes > 1",
    )
    p.add_argument("--submit", action="store_true", help="sbatch it, follow it, exit with it")
    p.set_defaults(fn=slurm_command)


def slurm_command(args: argparse.Namespace) -> int:
    from deploy.clusters import slurm_cpus_per_node
    from deploy.experiment import ExperimentError, check, load, placement, read_data

    try:
        exp = load(args.experiment, args.set, args.quick)
        read_data(exp)
        check(exp)
        if args.nodes < 1:
            raise ExperimentError(f"--nodes={args.nodes} must be >= 1")
        groups = placement(exp)
        gpus = args.gpus_per_node
        if gpus and (why := overfull(groups, args.nodes, gpus, controller=False)):
            raise ExperimentError(f"one rank per GPU: {why}")
        if args.nodes > 1 and args.keys is None:
            raise ExperimentError(
                f"--nodes={args.nodes}: links between nodes need CURVE keys; make them with "
                f"`hybridflow keys DIR --clients {','.join(groups)}` and pass --keys DIR"
            )
        if args.submit:  # the cluster answers (SLURM's commands, munge) and the job fits
            cpus = slurm_cpus_per_node("--submit", [], args.partition)
            if why := overfull(groups, args.nodes, cpus, controller=True):
                raise ExperimentError(why)
    except (ExperimentError, ValueError) as exc:
        print(f"hybridflow slurm: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = (
        args.run_dir or Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    ).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "job.sbatch"
    script.write_text(render(exp, groups, args, run_dir))
    print(script)
    if not args.submit:
        return 0
    return submit(script, run_dir)


def render(exp: Any, groups: dict[str, Any], args: argparse.Namespace, run_dir: Path) -> str:
    lines = sbatch_header(
        f"hybridflow-{exp.name}",
        args.nodes,
        tasks_per_node(groups, args.nodes, controller=True),
        f"{run_dir}/slurm-%j.out",
        args.partition,
        args.time,
        args.gpus_per_node,
    )
    experiment = shlex.quote(str(Path(args.experiment).resolve()))
    options = " --quick" if args.quick else ""
    options += "".join(f" --set {shlex.quote(s)}" for s in args.set)
    python = shlex.quote(sys.executable)
    keys = f" --keys {shlex.quote(str(Path(args.keys).resolve()))}" if args.keys else ""
    port = str(args.port) if args.port else "$((40000 + SLURM_JOB_ID % 10000))"
    lines += [
        "",
        "# hybridflow: the controller on the first node, each process group on its node(s).",
        "set -euo pipefail",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        # one node: loopback (TCP that leaves a host needs CURVE keys, `hybridflow keys`);
        # more: the first node's address as SLURM knows it (NodeAddr; no DNS needed)
        "head=127.0.0.1"
        if args.nodes == 1
        else 'head=$(scontrol show node "${nodes[0]}" -o | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
        f"port={port}",
        f'export HYBRIDFLOW_TOKEN=$({python} -c "import secrets; print(secrets.token_hex(16))")',
        "export OMP_NUM_THREADS=1",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "",
        "srun --nodes=1 --ntasks=1 --nodelist=${nodes[0]} --exact \\",
        f"  {python} -m deploy.cli controller {experiment}{options} \\",
        f'  --bind "tcp://$head:$port" --run-dir {shlex.quote(str(run_dir))}{keys} &',
        "controller=$!",
        "pids=($controller)",
    ]
    connect = '"tcp://$head:$port"'
    lines += group_steps(groups, args.nodes, connect, run_dir, python, keys, controller=True)
    lines += wait_steps(controller=True)
    return "\n".join(lines)


def wait_steps(controller: bool) -> list[str]:
    """The script's end, watching the steps in ``pids``: the first to fail ends the job with its
    status (SLURM then ends the others), so nobody waits for a group that is gone. A clean exit
    of the ``controller`` step ends the run; the groups leave on its SHUTDOWN."""
    done = '[ "${pids[$i]}" = "$controller" ] && { wait; exit 0; }  # the run is over'
    return [
        "",
        "# the first step to fail fails the job; the controller's end is the run's",
        "set +e",
        "while [ ${#pids[@]} -gt 0 ]; do",
        '  for i in "${!pids[@]}"; do',
        '    kill -0 "${pids[$i]}" 2>/dev/null && continue',
        '    wait "${pids[$i]}"; status=$?',
        '    [ $status -eq 0 ] || { echo "hybridflow: a step failed ($status)" >&2; exit $status; }',
        *([f"    {done}"] if controller else []),
        '    unset "pids[$i]"',
        "  done",
        "  sleep 1",
        "done",
        "",
    ]


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


def group_nodes(groups: dict[str, Any], nodes: int, controller: bool) -> list[int]:
    """The node of each group, in order: round robin, starting after the controller's node
    (node 0) when the job has more than one node."""
    start = 1 if controller and nodes > 1 else 0
    return [(i + start) % nodes for i in range(len(groups))]


def node_ranks(groups: dict[str, Any], nodes: int, controller: bool) -> list[list[str]]:
    """What runs on each node: group names, and "controller" on node 0 when there is one."""
    where: list[list[str]] = [["controller"] if controller and n == 0 else [] for n in range(nodes)]
    for node, name in zip(group_nodes(groups, nodes, controller), groups, strict=True):
        where[node].append(name)
    return where


def tasks_per_node(groups: dict[str, Any], nodes: int, controller: bool) -> int:
    """The job's ``--ntasks-per-node``: its fullest node (the controller is one task)."""
    return max(
        sum(1 if name == "controller" else groups[name].nproc for name in names)
        for names in node_ranks(groups, nodes, controller)
    )


def overfull(groups: dict[str, Any], nodes: int, per_node: int, controller: bool) -> str | None:
    """Why the groups (and the controller, 1 task on node 0) do not fit ``nodes`` nodes of
    ``per_node`` tasks each, or None."""
    for n, names in enumerate(node_ranks(groups, nodes, controller)):
        ranks = sum(1 if name == "controller" else groups[name].nproc for name in names)
        if ranks > per_node:
            return (
                f"node {n} of the job would run {ranks} tasks ({', '.join(names)}) but a node "
                f"holds {per_node}; use more nodes or fewer ranks (placement nproc)"
            )
    return None


def group_steps(
    groups: dict[str, Any],
    nodes: int,
    connect: str,
    run_dir: str | Path,
    python: str,
    keys: str,
    controller: bool,
) -> list[str]:
    """One background srun step per group, on the node ``group_nodes`` gives it; each rank is
    one ``hybridflow role --launcher env`` process (``SLURM_PROCID``). A group stays on one node,
    so its ranks meet on loopback."""
    lines: list[str] = []
    for node, (name, group) in zip(
        group_nodes(groups, nodes, controller), groups.items(), strict=True
    ):
        roles = ",".join(group.roles)
        where = f"${{nodes[{node}]}}"
        lines += [
            "",
            f"# group {name}: {roles}, {group.nproc} rank(s), tp={group.tp}",
            f"srun --nodes=1 --ntasks={group.nproc} --nodelist={where} --exact \\",
            f"  {python} -m deploy.cli role {roles} --connect {connect} \\",
            f"  --group {name} --tp {group.tp} --device {group.device} --launcher env "
            "--master-addr 127.0.0.1 "
            f"--run-dir {shlex.quote(str(run_dir))}"
            + (f"{keys} --client {name}" if keys else "")
            + " &",
            "pids+=($!)",
        ]
    return lines


def submit(script: Path, run_dir: Path) -> int:
    """sbatch, follow the output, exit with the job's status (1 when it did not complete)."""
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        from deploy.clusters import slurm_problem

        print(f"hybridflow slurm: {slurm_problem('sbatch', done.stderr)}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    print(f"submitted job {job}; output: {run_dir}/slurm-{job}.out", flush=True)
    output = run_dir / f"slurm-{job}.out"
    shown = 0
    while True:
        state = job_state(job)
        if output.exists():
            text = output.read_text(errors="replace")
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
            break
        time.sleep(1.0)
    print(f"job {job}: {state}")
    return 0 if state == "COMPLETED" else 1


def job_state(job: str) -> str:
    """The job's state from scontrol (no accounting database needed)."""
    done = subprocess.run(
        ["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, check=False
    )
    for field in done.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return ""
