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
each step's processes). The script's parts and the placement arithmetic are in
``deploy/launchers/sbatch.py``, shared with cluster specs (``deploy/clusters.py``).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.experiment import (
    Experiment,
    ExperimentError,
    GroupConfig,
    check,
    load,
    placement,
    read_data,
)
from deploy.launchers.sbatch import (
    group_steps,
    overfull,
    sbatch_header,
    slurm_cpus_per_node,
    slurm_node_room,
    slurm_problem,
    spans_too_many,
    tasks_per_node,
    wait_steps,
)

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class SlurmOptions:
    """``hybridflow slurm``'s options, typed (``from_args`` reads the parsed command line)."""

    experiment: Path
    nodes: int = 1
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    run_dir: Path | None = None
    quick: bool = False
    overrides: tuple[str, ...] = ()
    port: int | None = None
    keys: Path | None = None
    submit: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SlurmOptions:
        return cls(
            experiment=args.experiment,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            time=args.time,
            run_dir=args.run_dir,
            quick=args.quick,
            overrides=tuple(args.set),
            port=args.port,
            keys=args.keys,
            submit=args.submit,
        )


def add_slurm_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("slurm", help="write (and --submit) an sbatch script")
    p.add_argument("experiment", type=Path, help="experiment YAML file")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs to ask for on each node (default 0)"
    )
    p.add_argument("--partition", help="SLURM partition (default: the cluster's default)")
    p.add_argument("--time", help="job time limit, e.g. 01:00:00")
    p.add_argument("--run-dir", type=Path, help="default: runs/<name>-<time>")
    p.add_argument("--quick", action="store_true", help="the experiment's quick: overrides")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field"
    )
    p.add_argument("--port", type=int, help="controller port (default: from the job id)")
    p.add_argument(
        "--keys",
        type=Path,
        help="CURVE keys (hybridflow keys --clients GROUPS); needed for --nodes > 1",
    )
    p.add_argument("--submit", action="store_true", help="sbatch it, follow it, exit with it")
    p.set_defaults(fn=slurm_command)


def slurm_command(args: argparse.Namespace) -> int:
    return write_sbatch(SlurmOptions.from_args(args))


def write_sbatch(opts: SlurmOptions) -> int:
    """Check the experiment and the job's shape, write ``RUN_DIR/job.sbatch``, ``--submit`` it."""
    try:
        exp, groups = _checked(opts)
    except (ExperimentError, ValueError) as exc:
        print(f"hybridflow slurm: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = (
        opts.run_dir or Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    ).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "job.sbatch"
    script.write_text(render(exp, groups, opts, run_dir))
    print(script)
    if not opts.submit:
        return 0
    return submit(script, run_dir)


def _checked(opts: SlurmOptions) -> tuple[Experiment, dict[str, GroupConfig]]:
    """The experiment and its groups, once everything that can fail before sbatch has passed."""
    exp = load(opts.experiment, opts.overrides, opts.quick)
    read_data(exp)
    check(exp)
    if opts.nodes < 1:
        raise ExperimentError(f"--nodes={opts.nodes} must be >= 1")
    groups = placement(exp)
    if why := spans_too_many(groups, opts.nodes):
        raise ExperimentError(why)
    gpus = opts.gpus_per_node
    if gpus and (why := overfull(groups, opts.nodes, gpus, controller=False)):
        raise ExperimentError(f"one rank per GPU: {why}")
    if opts.nodes > 1 and opts.keys is None:
        raise ExperimentError(
            f"--nodes={opts.nodes}: links between nodes need CURVE keys; make them with "
            f"`hybridflow keys DIR --clients {','.join(groups)}` and pass --keys DIR"
        )
    if opts.submit:  # the cluster answers (SLURM's commands, munge) and the job fits
        cpus = slurm_cpus_per_node("--submit", [], opts.partition)
        nodes, most = slurm_node_room("--submit", [], opts.partition)
        where = f"partition {opts.partition!r}" if opts.partition else "the default partition"
        if opts.nodes > nodes:
            raise ExperimentError(
                f"--nodes={opts.nodes}: {where} has {nodes} node(s); the job would never start"
            )
        if most is not None and opts.nodes > most:
            raise ExperimentError(
                f"--nodes={opts.nodes}: {where} holds jobs of at most {most} node(s); the job "
                "would never start"
            )
        if why := overfull(groups, opts.nodes, cpus, controller=True):
            raise ExperimentError(why)
    return exp, groups


def render(
    exp: Experiment, groups: dict[str, GroupConfig], opts: SlurmOptions, run_dir: Path
) -> str:
    lines = sbatch_header(
        f"hybridflow-{exp.name}",
        opts.nodes,
        tasks_per_node(groups, opts.nodes, controller=True),
        f"{run_dir}/slurm-%j.out",
        opts.partition,
        opts.time,
        opts.gpus_per_node,
    )
    python = shlex.quote(sys.executable)
    keys = f" --keys {shlex.quote(str(Path(opts.keys).resolve()))}" if opts.keys else ""
    lines += _controller_step(opts, run_dir, python, keys)
    connect = '"tcp://$head:$port"'
    lines += group_steps(groups, opts.nodes, connect, run_dir, python, keys, controller=True)
    lines += wait_steps(controller=True)
    return "\n".join(lines)


def _controller_step(opts: SlurmOptions, run_dir: Path, python: str, keys: str) -> list[str]:
    """The script's set-up (nodes, the head's address, port, token) and the controller's step."""
    experiment = shlex.quote(str(Path(opts.experiment).resolve()))
    options = " --quick" if opts.quick else ""
    options += "".join(f" --set {shlex.quote(s)}" for s in opts.overrides)
    # a port free on the first node now (the script runs there); one made of the job id could
    # be another job's on a shared node
    free = f"$({python} -c \"import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])\")"
    port = str(opts.port) if opts.port else free
    return [
        "",
        "# hybridflow: the controller on the first node, each process group on its node(s).",
        "set -euo pipefail",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        # one node: loopback (TCP that leaves a host needs CURVE keys, `hybridflow keys`);
        # more: the first node's address as SLURM knows it (NodeAddr; no DNS needed)
        "head=127.0.0.1"
        if opts.nodes == 1
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


def submit(script: Path, run_dir: Path) -> int:
    """sbatch, follow the output, exit with the job's status (1 when it did not complete).
    While the job waits, its pending reason is printed each time it changes; Ctrl-C or SIGTERM
    cancels the job (``scancel``) and exits 130 / 143."""
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(f"hybridflow slurm: {slurm_problem('sbatch', done.stderr)}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    print(f"submitted job {job}; output: {run_dir}/slurm-{job}.out", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        state = _follow(job, run_dir / f"slurm-{job}.out")
    except _Stopped as stop:
        subprocess.run(["scancel", job], capture_output=True, check=False)
        print(f"\njob {job}: cancelled ({stop.name})", file=sys.stderr)
        return 128 + stop.signal
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"job {job}: {state}")
    return 0 if state == "COMPLETED" else 1


class _Stopped(Exception):
    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.signal = sig
        self.name = signal.Signals(sig).name


def _interrupted(sig: int, _frame: object) -> None:
    raise _Stopped(sig)


def _follow(job: str, output: Path) -> str:
    """Print the job's output as it grows and its pending reasons; its final state."""
    shown, said = 0, ""
    try:
        while True:
            fields = job_fields(job)
            state = fields.get("JobState", "")
            if state == "PENDING" and (reason := fields.get("Reason", "")) != said:
                print(f"job {job}: pending ({reason})", flush=True)
                said = reason
            if output.exists():
                text = output.read_text(errors="replace")
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
                return state
            time.sleep(1.0)
    except KeyboardInterrupt:
        raise _Stopped(signal.SIGINT) from None


def job_fields(job: str) -> dict[str, str]:
    """The job's fields from scontrol (JobState, Reason, ...; no accounting database needed)."""
    done = subprocess.run(
        ["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, check=False
    )
    return dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)


def job_state(job: str) -> str:
    """The job's state from scontrol ("" once SLURM has forgotten it)."""
    return job_fields(job).get("JobState", "")
