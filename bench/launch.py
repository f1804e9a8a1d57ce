"""Starting a run's groups through each launcher, and what a call costs once they run.

The quickstart's groups (its actor and reward on one group of 2 ranks) are started through a
cluster spec three times, one launcher each: ``local`` (child processes here), ``slurm`` (a job
on the one-node cluster of ``.ci/slurm-up``) and ``ray`` (a two-node Ray cluster on this
machine, ``ray.cluster_utils.Cluster``, started here; its start is not counted). The controller
listens on TCP in all three, so the calls take the same path. A launcher whose cluster is
missing is skipped and said so.

    python -m bench.launch [--calls 1000]

Reported per launcher: ``start_s`` (from entering ``hf.mesh`` until every group has joined and
built its roles; after one uncounted local start, which warms this process's fork server) and ``call_ms`` (median of ``--calls`` round trips of a small call to the
actor's group, ``precision``). The peer is the local launcher: a launcher only starts processes,
so once they run its calls must cost what the local launcher's cost (``call_ratio_<kind>``,
within noise). Last line, JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

import hybridflow as hf

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart.yaml"


def spec(kind: dict[str, Any]) -> dict[str, Any]:
    return {
        "controller": {"bind": "tcp://127.0.0.1:0", "wait": 120},
        "clusters": {"there": kind},
        "groups": {"main": "there"},
    }


async def measure(clusters: Path, run_dir: Path, calls: int) -> dict[str, float]:
    start = time.perf_counter()
    async with hf.mesh(EXAMPLE, run_dir=run_dir, clusters=clusters) as m:
        started = time.perf_counter() - start
        await m.actor.precision()  # warm
        took = []
        for _ in range(calls):
            t = time.perf_counter()
            await m.actor.precision()
            took.append(time.perf_counter() - t)
    return {"start_s": round(started, 2), "call_ms": round(1000 * statistics.median(took), 3)}


@contextmanager
def ray_cluster() -> Iterator[str | None]:
    """The suite's two-node Ray cluster (``tests/deploy/launchers/test_ray.py``); None without
    ray."""
    from tests.deploy.launchers.test_ray import ray_installed, two_ray_nodes

    if not ray_installed():
        yield None
        return
    with two_ray_nodes() as address:
        yield address


def slurm_up() -> bool:
    from tests.deploy.test_slurm import cluster_up

    return cluster_up(wait=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    found: dict[str, Any] = {"bench": "launch", "calls": args.calls}
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    kinds: list[tuple[str, dict[str, Any]]] = [("local", {"kind": "local"})]
    if slurm_up():
        kinds.append(("slurm", {"kind": "slurm"}))
    else:
        found["skipped_slurm"] = "no SLURM cluster here (.ci/slurm-up starts one)"
    with ray_cluster() as address:
        if address is not None:
            kinds.append(("ray", {"kind": "ray", "address": address}))
        else:
            found["skipped_ray"] = "ray is not installed (pip install -e '.[ray]')"
        warm = work / "warm.yaml"  # once, uncounted: this process's fork server and imports
        warm.write_text(yaml.safe_dump(spec({"kind": "local"})))
        asyncio.run(measure(warm, work / "warm", 1))
        for name, kind in kinds:
            path = work / f"{name}.yaml"
            path.write_text(yaml.safe_dump(spec(kind)))
            row = asyncio.run(measure(path, work / name, args.calls))
            print(f"{name:>6}: groups up in {row['start_s']:.2f} s, a call {row['call_ms']:.3f} ms")
            found[f"start_s_{name}"] = row["start_s"]
            found[f"call_ms_{name}"] = row["call_ms"]
    for name, _ in kinds[1:]:
        found[f"call_ratio_{name}"] = round(found[f"call_ms_{name}"] / found["call_ms_local"], 3)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
