"""The rollout role and the actor's colocated generation, through real role groups.

One session: an actor on 1 rank, an actor under FSDP on 2 ranks, a rollout group on 1 rank and one
at tp = 2. A rollout group that received the actor's new weights must generate exactly what the
actor generates; tp = 2 must agree with tp = 1; generation log-probs must equal the actor's
``compute_log_prob`` on the same tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from controller.clients import ActorClient, RolloutClient
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch
from transport.errors import RemoteError

PROMPTS = ["1+2=", "34+56=", "7+80=", "a longer prompt, 99+1=", "0+0=", "5+5="]
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def prompts(texts: list[str] = PROMPTS) -> TensorBatch:
    return TensorBatch.from_dict(non_tensors={"prompt": texts, "answer": list(range(len(texts)))})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    actor = {"model": str(model), "micro_batch_size": 4, "optim": {"lr": 1e-2}}
    rollout = {"model": str(model)}
    placement = [
        group("a1", 1, actor=("roles.actor:Actor", actor)),
        group("a2", 2, actor_fsdp=("roles.actor:Actor", actor)),
        group("r1", 1, rollout=("roles.rollout:Rollout", rollout)),
        group("r2", 2, tp=2, rollout_tp=("roles.rollout:Rollout", rollout)),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            actor, fsdp = ActorClient(c, "actor"), ActorClient(c, "actor_fsdp")
            r1, r2 = RolloutClient(c, "rollout"), RolloutClient(c, "rollout_tp")
            for name, role in (("actor", actor), ("fsdp", fsdp), ("r1", r1), ("r2", r2)):
                out[f"{name}_before"] = await role.generate(prompts(), GREEDY)
            seeded = prompts()
            seeded.non_tensors["seed"] = [7 * i for i in range(len(PROMPTS))]
            for name, role in (("actor", actor), ("fsdp", fsdp)):  # 1 rank vs 2 dp ranks
                out[f"{name}_seeded"] = await role.generate(seeded, {"n": 2, "seed": 3})
            for name, role in (("r1", r1), ("r2", r2)):
                out[f"{name}_logits"] = (await role.prompt_logits(prompts()))["logits"]
            sampled = await actor.generate(prompts(), {"n": 2, "max_new_tokens": 8})
            out["sampled"] = sampled
            out["scored"] = await actor.compute_log_prob(sampled)
            batch = token_batch(6, seed=2)
            old = (await actor.compute_log_prob(batch))["log_probs"]
            await actor.update_policy(batch.union(TensorBatch.from_dict({"old_log_probs": old})))
            out["actor_after"] = await actor.generate(prompts(), GREEDY)
            state = await actor.state_dict()
            out["versions"] = [await r.load_weights(state, 1) for r in (r1, r2)]
            out["r1_after"] = await r1.generate(prompts(), GREEDY)
            out["r2_after"] = await r2.generate(prompts(), GREEDY)
            out["errors"] = {}
            for key, bad in (
                ("empty", (prompts([]), GREEDY)),
                ("sampling", (prompts(), {"top_p": 2})),
            ):
                with pytest.raises(RemoteError) as err:
                    await r1.generate(*bad)
                out["errors"][key] = str(err.value)
            out["still_serving"] = await r1.generate(prompts(), GREEDY)
        return out

    found: dict[str, Any] = run(main)
    return found


def same_tokens(a: TensorBatch, b: TensorBatch) -> bool:
    return torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
        a["response_mask"], b["response_mask"]
    )


@pytest.mark.timeout(300)
def test_every_generator_agrees_on_the_initial_weights(results: dict[str, Any]) -> None:
    ref = results["actor_before"]
    for name in ("fsdp", "r1", "r2"):
        other = results[f"{name}_before"]
        assert same_tokens(other, ref), name
        torch.testing.assert_close(other["log_probs"], ref["log_probs"], atol=1e-4, rtol=0)
    assert ref.non_tensors["answer"] == list(range(len(PROMPTS)))  # request columns ride along
    assert ref.meta["weight_version"] == 0
    assert results["fsdp_before"].meta["gather_s"] > 0 and ref.meta["gather_s"] < 0.01


def test_seeded_requests_sample_alike_on_one_rank_and_on_two_dp_ranks(
    results: dict[str, Any],
) -> None:
    assert same_tokens(results["fsdp_seeded"], results["actor_seeded"])
    assert not same_tokens(results["actor_seeded"], results["actor_before"])  # really sampled


def test_tp2_logits_and_log_probs_within_1e_4_of_tp1(results: dict[str, Any]) -> None:
    assert results["r1_logits"].shape == (len(PROMPTS), 320)
    torch.testing.assert_close(results["r2_logits"], results["r1_logits"], atol=1e-4, rtol=0)
    torch.testing.assert_close(
        results["r2_before"]["log_probs"], results["r1_before"]["log_probs"], atol=1e-4, rtol=0
    )


def test_generation_log_probs_equal_compute_log_prob(results: dict[str, Any]) -> None:
    sampled, scored = results["sampled"], results["scored"]
    assert len(sampled) == 2 * len(PROMPTS)
    expected = scored["log_probs"] * sampled["response_mask"]
    torch.testing.assert_close(sampled["log_probs"], expected, atol=1e-5, rtol=0)


def test_rollout_with_the_actors_new_weights_generates_what_the_actor_does(
    results: dict[str, Any],
) -> None:
    assert results["versions"] == [1, 1]
    assert not same_tokens(results["actor_after"], results["actor_before"])  # weights moved
    for name in ("r1_after", "r2_after"):
        assert same_tokens(results[name], results["actor_after"]), name
        assert results[name].meta["weight_version"] == 1
        torch.testing.assert_close(
            results[name]["log_probs"], results["actor_after"]["log_probs"], atol=1e-4, rtol=0
        )


def test_bad_requests_fail_clearly_and_the_group_keeps_serving(results: dict[str, Any]) -> None:
    assert "no prompts to generate from" in results["errors"]["empty"]
    assert "top_p" in results["errors"]["sampling"]
    assert same_tokens(results["still_serving"], results["r1_after"])
