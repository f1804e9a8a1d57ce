"""Partial rollout and streaming (``controller/streaming.py``) through real role groups.

One session: an actor and a frozen reference of the same tiny model on one rank, a rollout group
of two dp ranks, a rule reward on one rank. Without a weight update, chunked and streamed
generation must give the one-call batch; a response whose generation spans an update must carry
per-token versions that change once, with log-probs from the weights of each segment.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest
import torch

from controller.clients import ActorClient, ReferenceClient, RewardClient, RolloutClient
from controller.scoring import scores, stashed
from controller.steps import Roles
from controller.streaming import (
    NO_VERSION,
    PartialRollout,
    VersionError,
    WeightGate,
    concat_padded,
    fill_replicas,
    generate_partial,
    stream,
)
from deploy.session import local_session
from roles.modeling.models import init_model, load_tokenizer
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch
from transport.protocol import PEAK_MEMORY
from transport.sampling import SamplingConfig

TEXTS = ["1+2=", "34+56=", "7+80=", "a longer prompt, 99+1=", "0+0=", "5+5="]
TOKENS = ["input_ids", "attention_mask", "response_mask"]
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9, n=2, seed=3, max_new_tokens=12)
GREEDY = SamplingConfig(temperature=0.0, n=1, max_new_tokens=12)


def prompts() -> TensorBatch:
    """As the trainer sends them: a seed and a uid per request, plus data columns."""
    count = len(TEXTS)
    return TensorBatch.from_dict(
        non_tensors={
            "prompt": TEXTS,
            "bonus": list(range(count)),
            "uid": list(range(count)),
            "seed": [1000 + 7 * i for i in range(count)],
        }
    )


async def train_once(actor: ActorClient, seed: int) -> None:
    batch = token_batch(6, seed=seed)
    old = (await actor.compute_log_prob(batch))["log_probs"]
    await actor.update_policy(batch.union(TensorBatch.from_dict({"old_log_probs": old})))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    engine = {"model": str(model), "micro_batch_size": 4}
    reward = {"function": "tests.fixtures.roles:length_reward"}
    placement = [
        group(
            "a",
            1,
            actor=("roles.actor:Actor", {**engine, "optim": {"lr": 1e-2}}),
            reference=("roles.actor:Reference", engine),
        ),
        group("r", 2, rollout=("roles.rollout:Rollout", {"model": str(model)})),
        group("w", 1, reward=("roles.reward:RuleReward", reward)),
    ]
    eos = load_tokenizer(model).eos_token_id

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            actor, reference = ActorClient(c, "actor"), ReferenceClient(c, "reference")
            rollout = RolloutClient(c, "rollout")
            roles = Roles(actor=actor, reward=RewardClient(c, "reward"), rollout=rollout)
            free = await rollout.generate(prompts(), SAMPLING)
            # two tokens the samples draw also stop, so some end inside a chunk
            ids, mask = free["input_ids"], free["response_mask"].bool()
            long = [r for r in range(len(free)) if int(mask[r].sum()) >= 10]
            stops = [
                eos,
                int(ids[long[0]][mask[long[0]]][5]),
                int(ids[long[-1]][mask[long[-1]]][9]),
            ]
            sampling = SAMPLING.model_copy(update={"stop_token_ids": stops})
            out["sampling"] = sampling
            chunks = PartialRollout(chunk_tokens=4)
            for name, settings in (("seeded", sampling), ("greedy", GREEDY)):
                out[f"one_{name}"] = await rollout.generate(prompts(), settings)
                out[f"chunked_{name}"] = await generate_partial(
                    rollout, prompts(), settings, chunks
                )
            out["actor_one"] = await actor.generate(prompts(), sampling=sampling)
            out["actor_chunked"] = await generate_partial(actor, prompts(), sampling, chunks)
            out["one_scores"] = await scores(roles.reward, out["one_seeded"])
            out["streamed"] = await stream(roles, prompts(), sampling, sub_batches=3)
            out["streamed_partial"] = await stream(
                roles, prompts(), sampling, sub_batches=2, partial=PartialRollout(chunk_tokens=5)
            )
            out["plain"] = await stream(roles, prompts(), sampling)

            # switch: after the first chunk the actor trains once; its weights (version 1)
            # reach the rollout group before the second chunk
            gate = WeightGate()

            async def update(index: int, reply: TensorBatch) -> None:
                if index == 0:
                    await train_once(actor, seed=2)
                    state = await actor.state_dict()
                    async with gate.push():
                        await rollout.load_weights(state, 1)

            spanned = await generate_partial(
                rollout, prompts(), sampling, chunks, gate=gate, on_chunk=update
            )
            out["spanned"] = spanned
            out["v0"] = (await reference.compute_log_prob(spanned.select(TOKENS, [])))["log_probs"]
            out["v1"] = (await actor.compute_log_prob(spanned.select(TOKENS, [])))["log_probs"]

            # finish: a push of version 2 asked for after the first chunk waits for the batch
            await train_once(actor, seed=5)
            state = await actor.state_dict()
            events: dict[str, float] = {}
            pushes: list[asyncio.Task[None]] = []

            async def push() -> None:
                async with gate.push():
                    events["push_start"] = time.perf_counter()
                    await rollout.load_weights(state, 2)

            async def ask_for_push(index: int, reply: TensorBatch) -> None:
                if index == 0:
                    pushes.append(asyncio.create_task(push()))

            finish = PartialRollout(chunk_tokens=4, on_update="finish")
            out["held"] = await generate_partial(
                rollout, prompts(), sampling, finish, gate=gate, on_chunk=ask_for_push
            )
            events["generated"] = time.perf_counter()
            await pushes[0]
            out["events"] = events
            out["after_finish"] = await rollout.weight_version()

            async def bypass(index: int, reply: TensorBatch) -> None:
                await rollout.load_weights(state, 3)  # not through the gate

            with pytest.raises(VersionError, match="from version 2 to 3"):
                await generate_partial(rollout, prompts(), sampling, finish, on_chunk=bypass)
        return out

    found: dict[str, Any] = run(main)
    return found


def assert_same_samples(got: TensorBatch, want: TensorBatch) -> None:
    for name in TOKENS:
        assert torch.equal(got[name], want[name]), name
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)
    for name in ("finish", "response", "uid", "bonus", "seed"):
        assert got.non_tensors[name] == want.non_tensors[name], name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["seeded", "greedy"])
def test_chunked_generation_without_an_update_is_the_one_call_batch(
    results: dict[str, Any], name: str
) -> None:
    one, chunked = results[f"one_{name}"], results[f"chunked_{name}"]
    assert_same_samples(chunked, one)
    mask = one["response_mask"].bool()
    assert torch.equal(chunked["token_versions"], torch.where(mask, 0, NO_VERSION))
    assert chunked.meta["weight_version"] == chunked.meta["last_weight_version"] == 0
    assert chunked.meta["chunks"] == 3  # 12 tokens, 4 a call
    if name == "seeded":  # some samples stopped inside a chunk, some ran to the budget
        lengths = set(mask.sum(-1).tolist())
        assert 12 in lengths and lengths - {4, 8, 12}, lengths


def test_the_colocated_actor_generates_in_chunks_too(results: dict[str, Any]) -> None:
    assert_same_samples(results["actor_chunked"], results["actor_one"])
    assert_same_samples(results["actor_one"], results["one_seeded"])  # same weights, same seeds


def test_streamed_batch_is_the_one_call_batch_with_its_scores(results: dict[str, Any]) -> None:
    one = results["one_seeded"]
    score, extras = results["one_scores"]
    for key in ("streamed", "streamed_partial"):
        streamed = results[key]
        assert_same_samples(streamed, one)
        assert torch.equal(streamed["reward:scores"], score)
        found = stashed(streamed, "reward")
        assert found is not None and torch.equal(found["scores"], score)
        assert float(found["reward/bonus"].mean()) == extras["reward/bonus"]
        assert streamed.non_tensors["request"] == [i // 2 for i in range(12)]
    assert results["streamed"].meta["chunks"] == 3  # one call per sub-batch
    assert results["streamed_partial"].meta["chunks"] == 6  # two sub-batches of 3 chunks
    plain = results["plain"]  # one sub-batch, no chunks: the one call, nothing added
    assert plain.meta[PEAK_MEMORY] > 0 and one.meta[PEAK_MEMORY] > 0
    # what the rank held differs from call to call; the rest is the same
    plain, one = (
        TensorBatch(b.tensors, b.non_tensors, b.meta | {PEAK_MEMORY: 0}) for b in (plain, one)
    )
    assert plain.equals(one) and "token_versions" not in plain.tensors
    assert stashed(results["plain"], "reward") is None


def test_scoring_of_a_sub_batch_overlaps_generating_the_next(results: dict[str, Any]) -> None:
    timeline = results["streamed"].meta["stream"]
    assert len(timeline) == 3
    for this, following in itertools.pairwise(timeline):
        assert this["score"][0] >= this["generate"][1]  # scored once generated ...
        assert this["score"][0] < following["generate"][1]  # ... while the next generates
        assert this["score"][1] > following["generate"][0]


def test_a_response_spanning_an_update_switches_version_once(results: dict[str, Any]) -> None:
    spanned = results["spanned"]
    mask = spanned["response_mask"].bool()
    versions = spanned["token_versions"]
    assert torch.equal(versions[~mask], torch.full_like(versions[~mask], NO_VERSION))
    spanning = 0
    for row in range(len(spanned)):
        tagged = versions[row][mask[row]].tolist()
        assert tagged == [0] * min(4, len(tagged)) + [1] * (len(tagged) - 4), (row, tagged)
        spanning += len(tagged) > 4
    assert spanning >= 4
    assert (spanned.meta["weight_version"], spanned.meta["last_weight_version"]) == (0, 1)
    logp = spanned["log_probs"]
    old, new = versions == 0, versions == 1
    torch.testing.assert_close(logp[old], results["v0"][old], atol=1e-5, rtol=0)
    torch.testing.assert_close(logp[new], results["v1"][new], atol=1e-5, rtol=0)
    assert float((logp[new] - results["v0"][new]).abs().max()) > 1e-3  # the weights moved


def test_finish_holds_a_push_until_the_batch_is_done(results: dict[str, Any]) -> None:
    held = results["held"]
    mask = held["response_mask"].bool()
    assert set(held["token_versions"][mask].tolist()) == {1}
    assert held.meta["chunks"] == 3
    assert results["events"]["push_start"] >= results["events"]["generated"]
    assert results["after_finish"] == 2


# -- the batch plumbing, without processes ------------------------------------------------------


def test_fill_replicas_cycles_rows_up_to_the_shard_count() -> None:
    batch = TensorBatch.from_dict(non_tensors={"x": ["a", "b", "c"]})
    assert fill_replicas(batch, 2) is batch
    assert fill_replicas(batch, 5).non_tensors["x"] == ["a", "b", "c", "a", "b"]


def test_concat_padded_pads_each_column_with_its_value() -> None:
    def piece(width: int, version: int) -> TensorBatch:
        return TensorBatch.from_dict(
            {
                "input_ids": torch.full((1, width), 7),
                "token_versions": torch.full((1, width), version),
                "log_probs": torch.full((1, width), -1.0),
                "scores": torch.tensor([float(width)]),
            },
            {"finish": ["stop"]},
            {"pad_values": {"input_ids": 2}, "weight_version": version, "last_weight_version": 4},
        )

    out = concat_padded([piece(2, 3), piece(4, 1)])
    assert out["input_ids"].tolist() == [[7, 7, 2, 2], [7, 7, 7, 7]]
    assert out["token_versions"].tolist() == [[3, 3, -1, -1], [1, 1, 1, 1]]
    assert out["log_probs"].tolist() == [[-1.0, -1.0, 0.0, 0.0], [-1.0] * 4]
    assert out["scores"].tolist() == [2.0, 4.0]
    assert (out.meta["weight_version"], out.meta["last_weight_version"], out.meta["chunks"]) == (
        1,
        4,
        2,
    )
