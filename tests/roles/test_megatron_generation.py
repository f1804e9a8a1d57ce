"""A megatron actor generates through reshard, colocated and into a separate rollout group.

One session: the fsdp actor on one rank, two megatron actors at tp 2 x pp 2 on 4 ranks that
generate at tp 2 (its optimizer state offloaded meanwhile) and at tp 1 (one pipeline stage:
gen_pp 1; 2 and 4 micro-DP replicas), and two rollout groups (1 rank, tp 2) fed from the
tp 2 x pp 2 actor rank to rank:

* every rank's generation weights are bitwise its slice of the actor's HF export (q/k/v and
  gate/up unfused from megatron's layout, other stages' layers gathered, the vocabulary-split
  embedding and head whole at tp 1 and split at tp 2);
* greedy tokens equal the fsdp actor's on the same weights, before and after an SFT step, and
  generating leaves the training weights untouched;
* the rollout groups hold bitwise their slices of the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from controller.clients import ActorClient
from controller.placement import GroupSpec, RoleSpec
from controller.sync import WeightSync
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import GenerationProbedActorClient
from tests.fixtures.sync import ProbedRolloutClient
from tests.reshard.test_sync import expected_digests, settings
from tests.roles.test_rollout import GREEDY, prompts
from transport.batch import TensorBatch

TIMEOUTS = TEST_TIMEOUTS.model_copy(update={"connect_s": 300, "call_s": 300, "group_init_s": 60})
ACTOR = "tests.fixtures.actor:GenerationProbedActor"
GEN_TP = {"g2": 2, "g1": 1}  # megatron actor -> its generation tp
ROWS_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


def megatron_group(name: str, gen_tp: int, config: dict[str, Any]) -> GroupSpec:
    return GroupSpec(
        name=name,
        roles={name: RoleSpec(cls=ACTOR, config=config)},
        nproc=4,
        tp=2,
        pp=2,
        gen_tp=gen_tp,
        gen_pp=1,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("megatron_generation")
    model = init_model(root / "tiny", "tiny", seed=0)
    actor = {"model": str(model), "micro_batch_size": 4, "optim": {"lr": 1e-2}}
    megatron = {**actor, "backend": "megatron"}
    rollout = ("tests.fixtures.sync:ProbedRollout", {"model": str(model)})
    placement = [
        group("one", 1, one=(ACTOR, actor)),
        megatron_group("g2", 2, {**megatron, "offload_optimizer": True}),
        megatron_group("g1", 1, megatron),
        group("r1", 1, rollout_1=rollout),
        group("rt", 2, tp=2, rollout_tp=rollout),
    ]
    found: dict[str, Any] = run(lambda: _session(placement, root))
    return found


async def _session(placement: list[GroupSpec], root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = [(f"{i}+{i}=", f"{2 * i}\n") for i in range(8)]
    sft = TensorBatch.from_dict(
        non_tensors={"prompt": [p for p, _ in rows], "response": [r for _, r in rows]}
    )
    async with local_session(placement, TIMEOUTS) as c:
        names = ("one", *GEN_TP)
        clients = {n: GenerationProbedActorClient(c, n) for n in names}
        for n, client in clients.items():
            out[f"{n}_weights"] = await client.state_dict()
            out[f"{n}_before"] = await client.generate(prompts(), GREEDY)
            out[f"{n}_weights_after"] = await client.state_dict()
            out[f"{n}_export"] = load_file(
                str(Path(await client.export(str(root / n))) / "model.safetensors")
            )
            if n != "one":
                out[f"{n}_gen"] = await client.generation_weights()
        for n, client in clients.items():  # the same SFT step everywhere: new weights
            await client.sft_step(sft)
            out[f"{n}_trained"] = await client.generate(prompts(), GREEDY)
        out["trained_weights"] = await clients["g2"].state_dict()
        rollouts = {n: ProbedRolloutClient(c, n) for n in ("rollout_1", "rollout_tp")}
        sync = WeightSync(ActorClient(c, "g2"), settings())
        for version, (n, rollout) in enumerate(rollouts.items(), start=1):
            await sync.push(rollout, version)
            out[f"{n}_digests"] = await rollout.digests()
            out[f"{n}_served"] = await rollout.generate(prompts(), GREEDY, min_version=version)
    return out


def expected_piece(full: torch.Tensor, name: str, tp: int, index: int) -> torch.Tensor:
    leaf = name.rsplit(".", 2)[-2]
    dim = 0 if leaf in ROWS_SPLIT else 1 if leaf in ("o_proj", "down_proj") else None
    return full if dim is None or tp == 1 else full.chunk(tp, dim)[index]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(GEN_TP))
def test_generation_weights_are_the_export_bitwise(results: dict[str, Any], name: str) -> None:
    export, gen_tp = results[f"{name}_export"], GEN_TP[name]
    # the export is the fsdp actor's weights: nothing was trained yet
    assert all(torch.equal(export[k], v) for k, v in results["one_export"].items())
    for rank, held in enumerate(results[f"{name}_gen"]):
        assert set(held) == set(export), rank
        index = rank % 2 // (2 // gen_tp)  # hybridflow grouping, pp 2 -> 1: tp index j_g
        for key, tensor in held.items():
            assert torch.equal(tensor, expected_piece(export[key], key, gen_tp, index)), (rank, key)


def agree(a: TensorBatch, b: TensorBatch, tol: float) -> None:
    assert torch.equal(a.tensors["input_ids"], b.tensors["input_ids"])
    assert torch.equal(a.tensors["response_mask"], b.tensors["response_mask"])
    diff = (a.tensors["log_probs"] - b.tensors["log_probs"]).abs().max()
    assert float(diff) <= tol, float(diff)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(GEN_TP))
def test_greedy_tokens_equal_the_fsdp_actor(results: dict[str, Any], name: str) -> None:
    agree(results[f"{name}_before"], results["one_before"], 1e-4)
    agree(results[f"{name}_trained"], results["one_trained"], 1e-4)
    before = results["one_before"].tensors["log_probs"]
    assert not torch.equal(results["one_trained"].tensors["log_probs"], before)  # it learned
    assert results[f"{name}_before"].meta["reshard_recv_bytes"] > 0
    offloaded = results[f"{name}_trained"].meta["offloaded_bytes"]
    assert offloaded > 0 if name == "g2" else offloaded == 0  # g2 offloads its moments


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(GEN_TP))
def test_generating_leaves_the_training_weights_untouched(
    results: dict[str, Any], name: str
) -> None:
    before, after = results[f"{name}_weights"], results[f"{name}_weights_after"]
    assert before.keys() == after.keys() == results["one_weights"].keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(before[k], results["one_weights"][k]) for k in before)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rollout_group_takes_the_megatron_weights_bitwise(results: dict[str, Any]) -> None:
    weights = results["trained_weights"]
    for name, (dp, tp) in (("rollout_1", (1, 1)), ("rollout_tp", (1, 2))):
        assert results[f"{name}_digests"] == expected_digests(weights, dp, tp), name
        agree(results[f"{name}_served"], results["g2_trained"], 1e-4)
