"""The controller never holds weights: during a sync of a 70 MB model between two 2-rank groups the
bytes through the controller's sockets (shared-memory payloads included) stay under 1 MB; the
old path (``state_dict`` + ``load_weights``) moves the model through it twice."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from controller.clients import ActorClient
from controller.sync import WeightSync, tensor_bytes
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.sync import ProbedRolloutClient
from tests.reshard.test_sync import expected_digests, perturbed
from transport.weight_sync import WeightSyncSettings

MB = 1 << 20


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = str(init_model(tmp_path_factory.mktemp("bytes") / "small", "small", seed=0))
    placement = [
        group("a", 2, actor=("roles.actor:Actor", {"model": model, "micro_batch_size": 4})),
        group("r", 2, rollout=("tests.fixtures.sync:ProbedRollout", {"model": model})),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            actor, rollout = ActorClient(c, "actor"), ProbedRolloutClient(c, "rollout")
            weights = perturbed(await actor.state_dict(), 1)
            await actor.load_state(weights)
            out["model_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
            before, tensors = c.traffic.sent + c.traffic.received, c.traffic.tensors
            pushed = await WeightSync(actor, WeightSyncSettings()).push(rollout, 1)
            out["sync_bytes"] = c.traffic.sent + c.traffic.received - before
            out["sync_tensor_bytes"] = c.traffic.tensors - tensors
            out["pushed"] = pushed
            # another call's weights through the controller while a sync runs: the actor
            # answers its state_dict between the sync's calls to it, so the sockets carry the
            # model meanwhile; the sync's own count stays at its own calls
            tensors = c.traffic.tensors
            beside, _state = await asyncio.gather(
                WeightSync(actor, WeightSyncSettings()).push(rollout, 1), actor.state_dict()
            )
            out["beside"] = beside
            out["beside_tensor_bytes"] = c.traffic.tensors - tensors
            out["digests"] = await rollout.digests()
            out["expected"] = expected_digests(weights, 2, 1)
            before, tensors = c.traffic.sent + c.traffic.received, c.traffic.tensors
            await rollout.load_weights(await actor.state_dict(), 2)
            out["old_path_bytes"] = c.traffic.sent + c.traffic.received - before
            out["old_path_tensor_bytes"] = c.traffic.tensors - tensors
        return out

    found: dict[str, Any] = run(main)
    return found


@pytest.mark.timeout(300)
def test_a_sync_of_a_70_mb_model_moves_under_1_mb_through_the_controller(
    measured: dict[str, Any],
) -> None:
    print(
        f"model {measured['model_bytes'] / MB:.1f} MiB; through the controller: sync "
        f"{measured['sync_bytes']} B, old path {measured['old_path_bytes'] / MB:.1f} MiB"
    )
    assert measured["model_bytes"] >= 50 * MB
    assert measured["sync_bytes"] < 1 * MB, measured["sync_bytes"]
    # of those, no tensor payload at all; the sync reports both as it measured them
    assert measured["sync_tensor_bytes"] == 0
    assert measured["pushed"]["controller_bytes"] == measured["sync_bytes"]
    assert measured["pushed"]["controller_weight_bytes"] == 0
    assert measured["digests"] == measured["expected"]


def test_a_sync_counts_its_own_calls_not_the_weights_another_call_moves_meanwhile(
    measured: dict[str, Any],
) -> None:
    assert measured["beside_tensor_bytes"] >= measured["model_bytes"]  # the sockets carried it
    assert measured["beside"]["controller_bytes"] >= measured["model_bytes"]  # and said so
    assert measured["beside"]["controller_weight_bytes"] == 0  # none of it was the sync's


def test_tensor_bytes_looks_into_what_a_call_carries() -> None:
    """Hand-made: 4 float32 + 3 int64 + a numpy array of 2 float64 = 16 + 24 + 16 bytes."""
    carried = WeightsSentLike(
        {"a": torch.zeros(4), "b": [torch.zeros(3, dtype=torch.int64), "name"]},
        (np.zeros(2), 7),
    )
    assert tensor_bytes(carried) == 56
    assert tensor_bytes({"names": ["w"], "shapes": [(4, 4)]}) == 0


@dataclass(frozen=True)
class WeightsSentLike:
    tensors: dict[str, Any]
    rest: tuple[Any, ...]


def test_the_counters_see_weights_that_do_pass_through_the_controller(
    measured: dict[str, Any],
) -> None:
    assert measured["old_path_bytes"] >= 2 * measured["model_bytes"]  # in from the actor, out
    # the tensor counter sees them as tensors: all but the headers (names, shapes, dtypes)
    tensors = measured["old_path_tensor_bytes"]
    assert 2 * measured["model_bytes"] <= tensors <= measured["old_path_bytes"]
