"""Weights between real role groups, rank to rank (``reshard/remote.py``, ``controller/sync.py``).

One session: an actor on 2 dp ranks (with a colocated reference), an actor at tp = 2, rollout
groups of 2 dp ranks, tp = 2 and 1 rank, and a 1-rank critic group. Before every sync the actor
gets new weights (a seeded perturbation), so each check proves that sync moved them; each
rollout rank's pieces are compared bitwise (by digest) with the slice of the actor's weights its
layout gives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from controller.clients import ActorClient, CriticClient, ReferenceClient
from controller.sync import WeightSync, WeightSyncError
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.sync import ProbedRolloutClient, digest
from transport.batch import TensorBatch
from transport.errors import RemoteError
from transport.weight_sync import WeightSyncSettings

GREEDY = {"temperature": 0, "max_new_tokens": 4}
ROWS_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # tp splits dim 0
COLS_SPLIT = ("o_proj", "down_proj")  # tp splits dim 1
Weights = dict[str, torch.Tensor]


def perturbed(base: Weights, seed: int) -> Weights:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


def expected_digests(full: Weights, dp: int, tp: int) -> list[dict[str, str]]:
    """What each rank of a (dp, tp) rollout group must hold: its tp slice of every weight."""
    found = []
    for rank in range(dp * tp):
        j, mine = rank % tp, {}
        for name, t in full.items():
            dim = 0 if name.rsplit(".", 2)[-2] in ROWS_SPLIT else None
            dim = 1 if name.rsplit(".", 2)[-2] in COLS_SPLIT else dim
            mine[name] = digest(t if dim is None or tp == 1 else t.chunk(tp, dim)[j])
        found.append(mine)
    return found


def settings(path: str = "auto") -> WeightSyncSettings:
    return WeightSyncSettings(path=path, bucket_mb=0.25, stall_s=20)  # ~17 buckets per pair


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sync")
    model = str(init_model(root / "tiny", "tiny", seed=0))
    engine = {"model": model, "micro_batch_size": 4, "optim": {"lr": 1e-2}}
    frozen = {"model": model, "micro_batch_size": 4}
    rollout = ("tests.fixtures.sync:ProbedRollout", {"model": model})
    placement = [
        group(
            "a", 2, actor=("roles.actor:Actor", engine), reference=("roles.actor:Reference", frozen)
        ),
        group("t", 2, tp=2, actor_tp=("roles.actor:Actor", engine)),
        group("r", 2, rollout=rollout),
        group("rt", 2, tp=2, rollout_tp=rollout),
        group("r1", 1, rollout_1=rollout),
        group("c", 1, critic=("roles.critic:Critic", engine)),
    ]
    found: dict[str, Any] = run(lambda: _session(placement, root))
    return found


async def _session(placement: list[Any], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"digests": {}, "expected": {}, "traffic": {}}
    async with local_session(placement, TEST_TIMEOUTS) as c:
        actor, actor_tp = ActorClient(c, "actor"), ActorClient(c, "actor_tp")
        rollouts = {n: ProbedRolloutClient(c, n) for n in ("rollout", "rollout_tp", "rollout_1")}
        base = await actor.state_dict()

        async def push(source: ActorClient, sink: str, key: str, path: str, seed: int) -> None:
            weights = perturbed(base, seed)
            await source.load_state(weights)
            before = c.traffic.sent + c.traffic.received
            await WeightSync(source, settings(path)).push(rollouts[sink], seed)
            out["traffic"][key] = c.traffic.sent + c.traffic.received - before
            out["digests"][key] = await rollouts[sink].digests()
            layout = {"rollout": (2, 1), "rollout_tp": (1, 2), "rollout_1": (1, 1)}[sink]
            out["expected"][key] = expected_digests(weights, *layout)

        for seed, path in enumerate(("shm", "group", "zmq"), start=1):
            await push(actor, "rollout", path, path, seed)
        await push(actor_tp, "rollout_1", "tp2->tp1", "auto", 4)
        await push(actor, "rollout_tp", "tp1->tp2", "auto", 5)
        await push(actor_tp, "rollout_tp", "tp2->tp2", "group", 6)
        out["paths"] = await _paths(actor, rollouts["rollout"])
        out.update(await _versions(rollouts["rollout"]))
        out.update(await _init_from_actor(actor, ReferenceClient(c, "reference"), c, root, base))
    return out


async def _paths(actor: ActorClient, rollout: ProbedRolloutClient) -> dict[str, Any]:
    """Rank 0's path to each rollout rank under auto (one host: shared memory)."""
    got = await WeightSync(actor, settings()).push(rollout, 7)
    return dict(got["sent"]["paths"])


async def _versions(rollout: ProbedRolloutClient) -> dict[str, Any]:
    prompts = TensorBatch.from_dict(non_tensors={"prompt": ["1+2=", "3+4="]})
    found: dict[str, Any] = {"served": await rollout.generate(prompts, GREEDY, min_version=7)}
    with pytest.raises(RemoteError) as err:
        await rollout.generate(prompts, GREEDY, min_version=8)
    found["stale"] = str(err.value)
    found["version"] = await rollout.weight_version()
    return found


async def _init_from_actor(
    actor: ActorClient, reference: ReferenceClient, c: Any, root: Path, base: Weights
) -> dict[str, Any]:
    """The reference (colocated with the actor) and the critic (its own group) take the actor's
    weights; their exports show what they hold."""
    weights = perturbed(base, 8)
    await actor.load_state(weights)
    sync = WeightSync(actor, settings())
    await sync.push(reference, 8)
    await sync.push(CriticClient(c, "critic"), 8, strict=False)
    found: dict[str, Any] = {"init_weights": weights}
    for name, client in (("reference", reference), ("critic", CriticClient(c, "critic"))):
        path = await client.export(str(root / name))
        found[f"{name}_export"] = load_file(str(Path(path) / "model.safetensors"))
    with pytest.raises(WeightSyncError) as err:  # strict: every name on both sides
        await sync.push(CriticClient(c, "critic"), 9)
    found["strict_error"] = str(err.value)
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["shm", "group", "zmq", "tp2->tp1", "tp1->tp2", "tp2->tp2"])
def test_every_rollout_rank_holds_its_slice_of_the_new_weights_bitwise(
    results: dict[str, Any], key: str
) -> None:
    assert results["digests"][key] == results["expected"][key]


def test_the_controller_carries_only_commands(results: dict[str, Any]) -> None:
    # 4.3 MB of weights per sync; the commands are a few kilobytes
    assert all(n < 64 << 10 for n in results["traffic"].values()), results["traffic"]


def test_auto_takes_shared_memory_on_one_host(results: dict[str, Any]) -> None:
    # the FSDP-sharded actor's rank 0 sends its shards to both rollout ranks
    assert results["paths"] == {"0": "shm", "1": "shm"}


def test_a_rollout_refuses_to_generate_on_older_weights(results: dict[str, Any]) -> None:
    assert results["version"] == 7
    assert results["served"].meta["weight_version"] == 7
    assert "StaleWeightsError" in results["stale"]
    assert "holds weight version 7, older than the version 8 asked for" in results["stale"]


def test_reference_and_critic_start_from_the_actor(results: dict[str, Any]) -> None:
    weights = results["init_weights"]
    reference, critic = results["reference_export"], results["critic_export"]
    assert reference.keys() == weights.keys()
    assert all(torch.equal(reference[k], weights[k]) for k in weights)
    backbone = [k for k in weights if k.startswith("model.")]
    assert backbone and all(torch.equal(critic[k], weights[k]) for k in backbone)
    assert "score.weight" in critic and "lm_head.weight" not in critic


def test_a_strict_sync_between_different_models_says_which_names_differ(
    results: dict[str, Any],
) -> None:
    assert "cannot take actor's weights strictly" in results["strict_error"]
    assert "lm_head.weight" in results["strict_error"]
