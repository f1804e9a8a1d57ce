"""Separate-rollout weight sync, 2 -> 2 ranks on this host: each path against today's baseline.

``sync_seconds(model)`` starts an actor group and a rollout group of two ranks each (one local
session) and times, per path, one sync of the actor's weights into the rollout group:

* ``controller_s`` — the old path: ``actor.state_dict()`` into the controller, then
  ``rollout.load_weights(state)`` (the whole model crosses the controller twice);
* ``shm_s``, ``group_s``, ``zmq_s`` — ``controller/sync.py`` with ``weight_sync.path`` forced to
  each path (rank to rank; the controller passes only commands).

Each path runs once to warm up (segments, the stateless group), then ``repeats`` times; a path's
time is the median, wall-clock on the controller (commands included). Rounds interleave the paths
so drift on a small machine hits all alike. ``*_gbps`` is the model's bytes over that time (each
of the two rollout ranks at tp 1 receives the whole model, so twice that crosses), and
``memcpy_gbps`` one ``copy_`` of the same bytes in this process (the floor for moving them once).

``python -m bench.sync_paths MODEL_DIR [--repeats N]`` prints a table and, last, a JSON line.
``bench.reshard`` calls ``sync_seconds`` for its ``sync_20m`` entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, cast

import torch

from controller.clients import ActorClient, RolloutClient
from controller.placement import GroupSpec
from controller.sync import WeightSync
from deploy.session import local_session
from transport.settings import Timeouts
from transport.weight_sync import WeightSyncSettings

PATHS = ("controller", "shm", "group", "zmq")


def placement(model: str) -> list[GroupSpec]:
    def one(name: str, role: str, cls: str, config: dict[str, Any]) -> GroupSpec:
        spec = {"name": name, "nproc": 2, "roles": {role: {"cls": cls, "config": config}}}
        return GroupSpec.model_validate(spec)

    return [
        one("train", "actor", "roles.actor:Actor", {"model": model, "micro_batch_size": 4}),
        one("gen", "rollout", "roles.rollout:Rollout", {"model": model, "dtype": "fp32"}),
    ]


async def _one(path: str, actor: ActorClient, rollout: RolloutClient, version: int) -> float:
    start = time.perf_counter()
    if path == "controller":
        await rollout.load_weights(await actor.state_dict(), version)
    else:
        settings = WeightSyncSettings.model_validate({"path": path})
        await WeightSync(actor, settings).push(rollout, version)
    return time.perf_counter() - start


async def time_paths(
    model: str, repeats: int = 5, paths: tuple[str, ...] = PATHS
) -> dict[str, Any]:
    """Median seconds per path (``PATH_s``) and GB/s (``PATH_gbps``), with ``model_mb``."""
    timeouts = Timeouts(call_s=300, connect_s=300, group_init_s=120)
    samples: dict[str, list[float]] = {p: [] for p in paths}
    async with local_session(placement(model), timeouts) as c:
        actor, rollout = ActorClient(c, "actor"), RolloutClient(c, "rollout")
        layout = await actor.param_layout()
        shapes = [cast(list[int], v["shape"]) for v in layout.values()]
        nbytes = sum(4 * _numel(shape) for shape in shapes)  # fp32 master weights
        version = 0
        for round_ in range(repeats + 1):
            for path in paths:
                version += 1
                seconds = await _one(path, actor, rollout, version)
                if round_:  # round 0 warms every path up
                    samples[path].append(seconds)
    found: dict[str, Any] = {"model_mb": nbytes / (1 << 20), "memcpy_gbps": memcpy_gbps(nbytes)}
    for path, times in samples.items():
        found[f"{path}_s"] = statistics.median(times)
        found[f"{path}_gbps"] = nbytes / found[f"{path}_s"] / 1e9
    return found


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def sync_seconds(model: str, repeats: int = 5, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    """``time_paths`` from synchronous code (its own event loop)."""
    import uvloop

    found: dict[str, Any] = uvloop.run(time_paths(model, repeats, paths))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a model folder (hybridflow model init DIR --size small)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = sync_seconds(args.model, args.repeats)
    print(f"model {found['model_mb']:.1f} MiB, memcpy {found['memcpy_gbps']:.2f} GB/s")
    print(f"{'path':<12}{'seconds':>10}{'GB/s':>8}{'vs memcpy':>11}{'vs controller':>15}")
    for path in PATHS:
        s, gbps = found[f"{path}_s"], found[f"{path}_gbps"]
        ratio = found["controller_s"] / s
        print(
            f"{path:<12}{s:>10.3f}{gbps:>8.2f}{gbps / found['memcpy_gbps']:>11.2f}{ratio:>14.1f}x"
        )
    print(json.dumps(found))


if __name__ == "__main__":
    main()
