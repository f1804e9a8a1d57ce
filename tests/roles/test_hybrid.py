"""The actor's 3D-HybridEngine through real role groups: a group that trains at tp 4 (or dp 2 x
tp 2) and generates at tp 2 (or 1) by resharding answers as the one-rank actor does, splits the
batch over its d * d_g generation replicas, and leaves its training weights untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from controller.clients import ActorClient
from controller.placement import GroupSpec, RoleSpec
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_rollout import GREEDY, prompts
from transport.batch import TensorBatch


def hybrid_group(name: str, role: str, tp: int, gen_tp: int, config: dict[str, Any]) -> GroupSpec:
    return GroupSpec(
        name=name,
        roles={role: RoleSpec(cls="roles.actor:Actor", config=config)},
        nproc=4,
        tp=tp,
        gen_tp=gen_tp,
    )


def four_kv_heads(folder: Path) -> Path:
    """The tiny Llama with 4 key/value heads (tp 4 splits them), weights re-drawn, same
    tokenizer."""
    config = AutoConfig.from_pretrained(folder)
    config.num_key_value_heads = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).float().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = four_kv_heads(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))
    actor = {"model": str(model), "micro_batch_size": 4, "optim": {"lr": 1e-2}}
    replicate = {**actor, "dp_mode": "replicate"}
    placement = [
        group("one", 1, actor=("roles.actor:Actor", actor)),
        # 1-4-1 -> 1-2-2, optimizer state offloaded while generating
        hybrid_group("t4g2", "tp4_gen2", 4, 2, {**actor, "offload_optimizer": True}),
        hybrid_group("t2g1", "dp2_tp2_gen1", 2, 1, replicate),  # 1-2-2 -> 1-1-4
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            names = ("actor", "tp4_gen2", "dp2_tp2_gen1")
            clients = {n: ActorClient(c, n) for n in names}
            for n, client in clients.items():
                out[f"{n}_weights"] = await client.state_dict()
                out[f"{n}_before"] = await client.generate(prompts(), GREEDY)
                out[f"{n}_weights_after"] = await client.state_dict()
            rows = [(f"{i}+{i}=", f"{2 * i}\n") for i in range(8)]
            batch = TensorBatch.from_dict(
                non_tensors={"prompt": [p for p, _ in rows], "response": [r for _, r in rows]}
            )
            for n, client in clients.items():  # the same SFT steps everywhere: new weights
                await client.sft_step(batch)
                out[f"{n}_trained"] = await client.generate(prompts(), GREEDY)
                await client.sft_step(batch)  # after an offload: the moments came back
                out[f"{n}_twice"] = await client.generate(prompts(), GREEDY)
        return out

    found: dict[str, Any] = run(main)
    return found


def agree(a: TensorBatch, b: TensorBatch, tol: float) -> None:
    assert torch.equal(a.tensors["input_ids"], b.tensors["input_ids"])
    assert torch.equal(a.tensors["response_mask"], b.tensors["response_mask"])
    diff = (a.tensors["log_probs"] - b.tensors["log_probs"]).abs().max()
    assert float(diff) <= tol, float(diff)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resharded_generation_answers_as_one_rank_does(results: dict[str, Any]) -> None:
    one = results["actor_before"]
    agree(results["tp4_gen2_before"], one, 1e-4)  # t_g = 2: sums in another order
    agree(results["dp2_tp2_gen1_before"], one, 1e-5)  # t_g = 1: the whole model on each rank
    assert results["tp4_gen2_before"].meta["reshard_recv_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_weights_are_untouched_by_generation(results: dict[str, Any]) -> None:
    for name in ("tp4_gen2", "dp2_tp2_gen1"):
        before, after = results[f"{name}_weights"], results[f"{name}_weights_after"]
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), name
        assert all(torch.equal(before[k], results["actor_weights"][k]) for k in before), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_generate_reshards_the_newest_weights(results: dict[str, Any]) -> None:
    one = results["actor_trained"]
    assert not torch.equal(one.tensors["log_probs"], results["actor_before"].tensors["log_probs"])
    agree(results["tp4_gen2_trained"], one, 1e-4)
    agree(results["dp2_tp2_gen1_trained"], one, 1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offloaded_optimizer_state_comes_back_for_the_next_step(results: dict[str, Any]) -> None:
    assert results["tp4_gen2_before"].meta["offloaded_bytes"] == 0  # no step yet: no moments
    assert results["tp4_gen2_trained"].meta["offloaded_bytes"] > 0
    assert results["actor_trained"].meta["offloaded_bytes"] == 0  # not asked for
    agree(results["tp4_gen2_twice"], results["actor_twice"], 1e-4)
