"""Session affinity with several rollout replicas: a rollout group of 2 dp ranks, each keeping
the KV of the trajectories it served; every turn of a trajectory goes to the replica that keeps
its session (its ``replica``), so later turns prefill only what is new, and the trajectories are
those of full re-prefills. The same with iteration-level serving (each replica's decode loop
admits turns as they come): the same trajectories again. Also the split itself: rows to the
replica they name, in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from controller.agent import AgentConfig, AgentRollout, Turn, by_replica, run_trajectories
from controller.clients import EnvClient, RolloutClient
from deploy.session import local_session
from roles.modeling.models import init_model
from roles.runtime.endpoint import split
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.controller.test_agent import SAMPLING, prompts
from transport.batch import BatchError, TensorBatch

TEXTS = ["1+2=", "34+56=", "a longer prompt", "7+8=", "99+1="]


def test_rows_go_to_the_replica_they_name_in_order() -> None:
    batch = TensorBatch.from_dict(non_tensors={"x": list("abcde"), "replica": [0, 0, 0, 1, 1]})
    shards = split(batch, 2)
    assert [s.non_tensors["x"] for s in shards] == [["a", "b", "c"], ["d", "e"]]
    assert [s.non_tensors["x"] for s in split(batch.select([], ["x"]), 2)] == [
        ["a", "b", "c"],
        ["d", "e"],
    ]
    for wrong in ([1, 0, 0, 1, 1], [0, 0, 0, 0, 0]):  # unsorted; a replica without a row
        batch.non_tensors["replica"] = wrong
        with pytest.raises(BatchError, match="sorted and name each of the 2 replicas"):
            split(batch, 2)


def test_turns_are_grouped_by_replica_with_a_filler_where_one_has_none() -> None:
    turns = [Turn(k, [1], 0, 4, None) for k in (4, 7, 9, 2)]  # type: ignore[arg-type]
    placed = by_replica(turns, 2)
    assert [(None if t is None else t.key, r) for t, r in placed] == [
        (4, 0), (2, 0), (7, 1), (9, 1)
    ]  # fmt: skip
    placed = by_replica(turns[:1], 3)
    assert [(None if t is None else t.key, r) for t, r in placed] == [(None, 0), (4, 1), (None, 2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    rollout = {"model": str(model), "dtype": "fp32"}
    counter = {"environment": "tests.fixtures.envs:Counter", "tokenizer": str(model)}
    placement = [
        group("g", 2, rollout=("roles.rollout:Rollout", rollout)),
        group("e", 1, env=("roles.env:EnvRole", counter)),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            generator, env = RolloutClient(c, "rollout"), EnvClient(c, "env")
            spec = await env.spec()
            runs = (("kept", True, "continuous"), ("plain", False, "continuous"))
            runs += (("iteration", True, "iteration"), ("iteration_plain", False, "iteration"))
            for name, sessions, serving in runs:
                cfg = AgentConfig(
                    max_turns=4, max_total_tokens=96, sessions=sessions, serving=serving
                )
                setup = AgentRollout(generator, env, cfg, spec, first_session=100 * len(out))
                out[name] = await run_trajectories(setup, prompts(TEXTS), SAMPLING, 0)
            out["held"] = await generator.drop_sessions([f"t{200 + i}" for i in range(10)])
            # new weights between batches (each decode loop lets its caches go), then a batch
            # of another shape on them
            state = {k: v * 1.5 for k, v in load_file(model / "model.safetensors").items()}
            await generator.load_weights(state, 1)
            cfg = AgentConfig(max_turns=2, max_total_tokens=96, serving="iteration")
            setup = AgentRollout(generator, env, cfg, spec, first_session=900)
            out["pushed"] = await run_trajectories(setup, prompts(TEXTS[:3]), SAMPLING, 1)
        return out

    return run(main)


def test_each_trajectory_keeps_its_replica_and_samples_as_full_prefills(
    results: dict[str, Any],
) -> None:
    kept, plain = results["kept"], results["plain"]
    for name in ("input_ids", "response_mask"):
        assert torch.equal(kept.tensors[name], plain.tensors[name])
    torch.testing.assert_close(
        kept.tensors["log_probs"], plain.tensors["log_probs"], atol=1e-5, rtol=0
    )
    assert kept.non_tensors["turns"] == [3] * len(kept)
    # every turn but the first found its session on the replica it went to: all that is
    # prefilled again is the observation and the last sampled token
    reuse = kept.meta["agent"]["agent/prefix_reuse"]
    assert reuse > 0.6, reuse
    assert plain.meta["agent"]["agent/prefix_reuse"] == 0.0


def test_iteration_level_serving_gives_the_same_trajectories_on_both_replicas(
    results: dict[str, Any],
) -> None:
    plain = results["plain"]
    for name in ("iteration", "iteration_plain"):
        found = results[name]
        for column in ("input_ids", "response_mask"):
            assert torch.equal(found.tensors[column], plain.tensors[column]), (name, column)
        torch.testing.assert_close(
            found.tensors["log_probs"], plain.tensors["log_probs"], atol=1e-5, rtol=0
        )
        assert found.non_tensors["turns"] == [3] * len(found)
        assert found.meta["pad_values"] == plain.meta["pad_values"]
    assert results["iteration"].meta["agent"]["agent/prefix_reuse"] > 0.6
    assert results["iteration_plain"].meta["agent"]["agent/prefix_reuse"] == 0.0
    assert results["held"] == 0  # the batch's sessions were dropped at its end


def test_iteration_level_serving_goes_on_after_a_weight_push(results: dict[str, Any]) -> None:
    pushed = results["pushed"]
    mask = pushed.tensors["response_mask"].bool()
    assert len(pushed) == 3 * SAMPLING.n and mask.sum() > 0
    assert (pushed.tensors["token_versions"][mask] == 1).all()
    assert pushed.non_tensors["turns"] == [2] * len(pushed)
    assert pushed.non_tensors["finish"] == ["turns"] * len(pushed)
