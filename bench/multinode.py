"""A group over two nodes against the same group on one, on a real two-node SLURM cluster.

The cluster is the suite's (``tests/deploy/test_slurm_nodes.py``): its own slurmctld and two
slurmd, each node a network namespace of this machine with its own address and hostname, joined
by a veth pair whose byte counters say what crossed between the nodes. Needs root, slurm-wlm,
munge running (``.ci/slurm-up``) and iproute2.

``hybridflow plan examples/quickstart.yaml --gpus 4 --gpus-per-node 2 --write`` writes the
quickstart's group over two nodes; ``hybridflow slurm --nodes 2 --submit`` runs the file as
written, and again with ``nodes: 1`` (the same four ranks on the second node). The peer is that
one-node run: the same work, whose ranks meet on loopback.

    python -m bench.multinode [--sft-steps 20] [--rl-steps 4]

Last line, JSON: ``multinode_equal`` (the exported weights, bit for bit), ``step_s_one_node``
and ``step_s_two_nodes`` (median SFT step, seconds), ``cross_node_bytes_per_step`` (the veth's
bytes over the run's steps) beside ``gradient_bytes`` (the fp32 gradient one all-reduce sums:
a ring over n ranks moves 2(n-1)/n of it through each rank), ``job_s`` of each run, and
``node_loss_recovered`` / ``node_loss_recover_s``: a third run (the controller on the first node
through a cluster spec, the group in a job over both) whose second node's ranks are all killed
after step 3 completes with each step once, the group back in the same job; and from a fourth,
with a rollout group of its own on the second node, each weight sync rank to rank over the
link: ``sync_bytes`` (what the rollout rank received) beside ``sync_bytes_planned`` (the
model's bytes, what the reshard plan sends a tp-1 rank), ``controller_bytes_per_sync`` (its
commands) and ``controller_weight_bytes`` (tensor payloads through the controller over every
sync: 0). Nothing here is a GPU or two machines: the link is a veth, with no bandwidth of its
own to speak of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

from tests.deploy.test_multicluster import WITH_ROLLOUT
from tests.deploy.test_netns import veth_bytes_of
from tests.deploy.test_slurm_nodes import (
    daemons_available,
    lose_a_node,
    node_address,
    on_cpu,
    slurm_nodes,
)

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "deploy.cli"]


def submit(
    node1: list[str], env: dict[str, str], run_dir: Path, exp: Path, sets: list[str]
) -> float:
    """Run the experiment as a job on both nodes; the seconds ``hybridflow slurm`` took."""
    argv = ["slurm", str(exp), "--quick", "--nodes", "2", "--keys", str(run_dir.parent / "keys")]
    argv += ["--run-dir", str(run_dir), "--submit"]
    for override in sets:
        argv += ["--set", override]
    start = time.perf_counter()
    done = subprocess.run([*node1, *CLI, *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def sync_over_the_link(node1: list[str], env: dict[str, str], node2: str, work: Path) -> Path:
    """The quickstart with a rollout group of its own on the second node (a ``remote`` cluster
    reached by ``nsenter``), the actor's group on the first beside the controller: each RL
    step's weights go from the actor's rank 0 to the rollout rank over a CURVE link between the
    nodes. Returns the run directory."""
    run_dir = work / "sync"
    subprocess.run([*CLI, "keys", str(work / "keys"), "--clients", "main,gen"], check=True)
    there = ["nsenter", f"--net=/run/netns/{node2}", "env", "HYBRIDFLOW_HOST_ID=hfnode2"]
    spec = {
        "controller": {"bind": f"tcp://{node_address(1)}:0", "wait": 120},
        "keys": str(work / "keys"),
        "clusters": {
            "home": {"kind": "local"},
            "far": {"kind": "remote", "via": [*there, "sh", "-c"]},
        },
        "groups": {"main": "home", "gen": "far"},
    }
    (work / "sync.yaml").write_text(yaml.safe_dump(spec))
    argv = ["run", str(ROOT / "examples" / "quickstart.yaml"), "--quick", "--json"]
    argv += ["--clusters", str(work / "sync.yaml"), "--run-dir", str(run_dir)]
    for override in [
        *WITH_ROLLOUT,
        "stages.0.steps=6",
        "stages.0.optim.warmup_steps=1",
        "stages.1.steps=4",
    ]:
        argv += ["--set", override]
    here = [*node1, "env", "HYBRIDFLOW_HOST_ID=hfnode1"]
    done = subprocess.run([*here, *CLI, *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the sync run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return run_dir


def sft_step_s(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_s"] for r in rows if r.get("stage") == "sft" and "time/step_s" in r]
    return statistics.median(steps[1:] or steps)  # the first step carries the warm-up


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.multinode", description=__doc__)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--rl-steps", type=int, default=4)
    args = parser.parse_args(argv)
    if not daemons_available():
        raise SystemExit("needs root, slurm-wlm and munge running (.ci/slurm-up) and iproute2")
    work = Path(tempfile.mkdtemp(prefix="hf-multinode-"))
    planned = work / "planned.yaml"
    plan = ["plan", str(on_cpu(work)), "--gpus", "4"]  # the nodes here have CPUs only
    subprocess.run([*CLI, *plan, "--gpus-per-node", "2", "--write", str(planned)], check=True)
    ((name, group),) = yaml.safe_load(planned.read_text())["placement"].items()
    subprocess.run([*CLI, "keys", str(work / "keys"), "--clients", name], check=True)
    sets = [f"stages.0.steps={args.sft_steps}", f"stages.1.steps={args.rl_steps}"]
    sets.append("trainer.val_every=1000")
    with slurm_nodes() as (node1, env, node2):
        before = veth_bytes_of(node2, f"v{node2}")
        spread_s = submit(node1, env, work / "spread", planned, sets)
        crossed = veth_bytes_of(node2, f"v{node2}") - before
        one_s = submit(node1, env, work / "one", planned, [*sets, f"placement.{name}.nodes=1"])
        (work / "lost").mkdir()
        code, _, killed, lost_dir = lose_a_node(node1, env, node2, work / "lost")
        synced = sync_over_the_link(node1, env, node2, work)
    rows = [json.loads(x) for x in (synced / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in rows if r.get("train/sync/bytes")]
    model = load_file(synced / "export" / "actor" / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    events = [json.loads(x) for x in (lost_dir / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    steps = [e["step"] for e in events if "stage_step" in e]
    weights = [
        load_file(work / r / "export" / "actor" / "model.safetensors") for r in ("spread", "one")
    ]
    equal = weights[0].keys() == weights[1].keys() and all(
        weights[0][k].equal(weights[1][k]) for k in weights[0]
    )
    params = sum(t.numel() for t in weights[0].values())
    result = {
        "bench": "multinode",
        "placement": {name: group},
        "multinode_equal": equal,
        "step_s_one_node": round(sft_step_s(work / "one"), 4),
        "step_s_two_nodes": round(sft_step_s(work / "spread"), 4),
        "cross_node_bytes_per_step": round(crossed / (args.sft_steps + args.rl_steps)),
        "gradient_bytes": params * 4,
        "job_s_one_node": round(one_s, 1),
        "job_s_two_nodes": round(spread_s, 1),
        # the second node's ranks killed at once after step 3 (a cluster spec's SLURM job)
        "node_loss_recovered": code == 0 and len(killed) == 2 and steps == list(range(1, 9)),
        "node_loss_recover_s": rollbacks[0]["recover_s"] if rollbacks else None,
        # a rollout group on the second node: the weights of each sync rank to rank
        "syncs": len(syncs),
        "sync_bytes": syncs[0]["train/sync/bytes"] if syncs else None,
        "sync_bytes_planned": model_bytes,  # a tp-1 rollout rank receives every parameter
        "controller_bytes_per_sync": max(r["train/sync/controller_bytes"] for r in syncs),
        "controller_weight_bytes": sum(r["train/sync/controller_weight_bytes"] for r in syncs),
        "run_dirs": str(work),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
