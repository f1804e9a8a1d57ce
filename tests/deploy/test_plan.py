"""``hybridflow plan``: the enumeration, the cost model's pieces by hand, the search against brute
force, memory safety over random cases, and a planned placement that runs."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.plan.cost import (
    ModelShape,
    Strategy,
    Workload,
    all_reduce_s,
    group_cost,
    state_bytes,
    step_cost,
)
from deploy.plan.profiles import PROFILES, load_profile
from deploy.plan.search import PlanError, Planner, allocations, set_partitions
from reshard.shapes import PRESETS, LlamaDims

ROOT = Path(__file__).resolve().parents[2]
BELL = [1, 1, 2, 5, 15, 52]


@pytest.mark.parametrize("n", range(6))
def test_set_partitions_are_the_bell_numbers(n: int) -> None:
    items = [f"m{i}" for i in range(n)]
    found = list(set_partitions(items))
    assert len(found) == BELL[n]
    canonical = {frozenset(frozenset(g) for g in p) for p in found}
    assert len(canonical) == BELL[n]  # no partition twice
    assert all(sorted(x for g in p for x in g) == sorted(items) for p in found)


def test_four_models_have_fifteen_placements() -> None:
    found = list(set_partitions(["actor", "critic", "reference", "reward"]))
    assert len(found) == 15
    assert sum(len(p) == 1 for p in found) == 1 and sum(len(p) == 4 for p in found) == 1


@pytest.mark.parametrize("total, groups", [(8, 1), (8, 2), (16, 3), (128, 4)])
def test_allocations_are_the_compositions(total: int, groups: int) -> None:
    found = list(allocations(total, [1] * groups))
    assert len(found) == math.comb(total - 1, groups - 1)
    assert all(sum(a) == total and min(a) >= 1 for a in found)


def test_allocations_respect_each_groups_minimum() -> None:
    found = list(allocations(6, [2, 3]))
    assert found == [(2, 4), (3, 3)]
    assert list(allocations(4, [3, 2])) == []


TINY = ModelShape(LlamaDims(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=4, vocab=100))


def test_parameter_and_flop_counts_by_hand() -> None:
    # per layer: q, k, v, o 4 x 64 x 64 = 16384, MLP 3 x 64 x 128 = 24576; two layers 81920;
    # embeddings and head 2 x 100 x 64 = 12800
    assert TINY.block_params == 81920 and TINY.params == 94720
    # 10 tokens of a 10-token sequence: blocks 2 x 81920 x 10 = 1638400, attention 2 x 2 x 2 x
    # 64 x 10 x 10 / 2 = 25600, head 2 x 64 x 100 x 10 = 128000
    assert TINY.forward_flops(10, 10) == 1638400 + 25600 + 128000
    # k and v, 2 layers, 64 wide, 2 bytes
    assert TINY.kv_bytes_per_token() == 2 * 2 * 64 * 2


def test_ring_all_reduce_and_state_bytes_by_hand() -> None:
    profile = replace(PROFILES["a100"], collective_latency_s=0.001)
    # 4 ranks move 2 x 3/4 of 8 GB at 100 GB/s = 0.12 s, plus the call's latency
    assert all_reduce_s(8e9, 4, 100e9, profile) == pytest.approx(0.121)
    assert all_reduce_s(8e9, 1, 100e9, profile) == 0.0
    s = Strategy(p=2, t=2, d=4, gen_t=1)
    assert state_bytes(TINY, True, s) == pytest.approx((4 + 12 / 4) * 94720 / 4)
    assert state_bytes(TINY, False, s) == pytest.approx(2 * 94720 / 4)


def small_workload(models: dict[str, ModelShape]) -> Workload:
    return Workload(models=models, rows=64, prompt_len=32, response_len=32, micro_batch=4)


def test_two_models_on_four_devices_pick_the_brute_force_best() -> None:
    """Every placement of an actor and a reference on 4 devices, costed directly, against the
    search's pick."""
    wl = small_workload({"actor": TINY, "reference": TINY})
    profile = PROFILES["vm-2core"]
    planner = Planner(wl, 4, 4, profile)
    candidates = []
    for groups, sizes in [
        ((("actor", "reference"),), (4,)),
        ((("actor",), ("reference",)), (1, 3)),
        ((("actor",), ("reference",)), (2, 2)),
        ((("actor",), ("reference",)), (3, 1)),
    ]:
        costs = []
        for g, n in zip(groups, sizes, strict=True):
            fitting = [
                c
                for s in planner.strategies(g, n)
                if (c := group_cost(list(g), wl, s, 4, profile)).fits
            ]
            costs.append(min(fitting, key=lambda c: c.total))
        candidates.append((step_cost(costs)["total"], groups, sizes))
    best = min(candidates, key=lambda c: c[0])
    plan = planner.plans(top=4)[0]
    assert plan.total == pytest.approx(best[0])
    assert plan.groups == best[1]
    assert tuple(c.strategy.p * c.strategy.t * c.strategy.d for c in plan.costs) == best[2]
    # the reference alone idles through generation and training: colocation wins here
    assert plan.groups == (("actor", "reference"),)


def test_planned_layouts_always_fit_memory() -> None:
    rng = random.Random(0)
    for _ in range(40):
        heads = rng.choice([4, 8, 16])
        dims = LlamaDims(
            hidden=heads * 64 * rng.choice([1, 2]),
            intermediate=rng.choice([1024, 4096, 11008]),
            layers=rng.choice([4, 8, 16, 32]),
            heads=heads,
            kv_heads=rng.choice([h for h in (1, 2, 4, heads) if heads % h == 0]),
            vocab=32000,
        )
        roles = rng.sample(["actor", "critic", "reference", "reward"], rng.randint(1, 4))
        if "actor" not in roles:
            roles.append("actor")
        wl = Workload(
            models={r: ModelShape(dims) for r in roles},
            rows=rng.choice([64, 256, 1024]),
            prompt_len=rng.choice([128, 1024]),
            response_len=rng.choice([128, 1024]),
            micro_batch=rng.choice([1, 4]),
        )
        profile = replace(PROFILES["a100"], mem_bytes=rng.choice([8e9, 24e9, 80e9]))
        devices = rng.choice([1, 2, 4, 8, 16])
        try:
            plans = Planner(wl, devices, 8, profile, allow_pp=rng.random() < 0.5).plans(top=3)
        except PlanError:
            continue
        for plan in plans:
            for group, cost in zip(plan.groups, plan.costs, strict=True):
                s = cost.strategy
                resident = sum(
                    state_bytes(wl.models[r], r in ("actor", "critic"), s) for r in group
                )
                assert resident <= cost.memory <= profile.mem_bytes
                assert s.p * s.t * s.d >= 1 and s.t <= 8 and s.t % s.gen_t == 0


def test_paper_scale_plan_is_quick_and_colocates_at_16_gpus() -> None:
    wl = Workload(
        models={
            r: ModelShape(PRESETS["llama2-7b"]) for r in ("actor", "critic", "reference", "reward")
        },
        rows=1024,
        prompt_len=1024,
        response_len=1024,
    )
    plan = Planner(wl, 16, 8, PROFILES["a100"], allow_pp=True).plans(top=1)[0]
    assert plan.groups == (("actor", "critic", "reference", "reward"),)


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_too_few_devices_is_a_clear_error() -> None:
    done = cli("plan", "examples/ppo.yaml", "--gpus", "8", "--model-size", "llama2-70b")
    assert done.returncode == 2
    assert "--gpus" in done.stderr and "llama" not in done.stdout


def test_a_profile_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(PROFILES["h100"].to_json())
    assert load_profile(str(path)) == PROFILES["h100"]
    with pytest.raises(ValueError, match="--device-profile"):
        load_profile(str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_the_written_placement_runs_as_is(tmp_path: Path) -> None:
    planned = tmp_path / "planned.yaml"
    done = cli(
        "plan", "examples/quickstart.yaml", "--gpus", "2", "--gpus-per-node", "2",
        "--device-profile", "vm-2core", "--prompt-len", "16", "--json", "--write", str(planned),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    block = result["placement"]
    assert sum(g["nproc"] for g in block.values()) == 2
    assert sorted(r for g in block.values() for r in g["roles"]) == ["actor", "reward"]
    short = ("--set", "stages.0.steps=6", "--set", "stages.1.steps=1")  # that it runs, not learns
    run = cli(
        "run", str(planned), "--quick", "--run-dir", str(tmp_path / "run"), "--json", *short,
        timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["name"] == "quickstart" and summary["steps"] > 0
