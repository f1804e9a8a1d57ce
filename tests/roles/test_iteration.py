"""Iteration-level batching in the native engine, in one process (fp32, the 1.1M model): requests
that join a running decode batch, with their own token limits, sample what one ``generate`` call
per request samples; a short request returns while a long one still decodes; rows leave and the
slots they free are taken by later requests (the batch is compacted); sessions are kept and
reused; a request that samples differently waits for the running rows; a failure reaches the
request's owner."""

from __future__ import annotations

import pytest
import torch

from roles.engines.generation.interface import SamplingConfig
from roles.engines.generation.iteration import DecodeLoop, Job
from roles.engines.generation.native import NativeEngine
from roles.engines.generation.sessions import SessionCache
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer

TEXTS = ["1+2=", "34+56=", "a longer prompt: 12+13=", "0+0=", "99+1=", "7+70=", "abc", "5+5="]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=64, seed=3)
WAIT_S = 60.0  # every take below waits for a result that the loop produces well within this


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[NativeEngine, list[list[int]]]:
    torch.set_num_threads(1)
    path = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    return NativeEngine(model, tokenizer.eos_token_id), [tokenizer.encode(t) for t in TEXTS]


def one_call(engine: NativeEngine, prompt: list[int], seed: int, max_new: int) -> list[int]:
    sampling = SAMPLING.model_copy(update={"max_new_tokens": max_new, "stop_token_ids": [0]})
    (sample,) = engine.generate([prompt], sampling, request_seeds=[seed])
    return sample.tokens


def job(i: int, prompt: list[int], max_new: int, channel: str = "a", **kw: object) -> Job:
    sampling = kw.pop("sampling", SAMPLING.model_copy(update={"stop_token_ids": [0]}))
    return Job(
        id=i,
        channel=channel,
        prompt=prompt,
        max_new=max_new,
        seed=500 + i,
        sampling=sampling,
        version=0,
        **kw,  # type: ignore[arg-type]
    )


def drain(loop: DecodeLoop, channel: str, count: int) -> dict[int, Job]:
    found: dict[int, Job] = {}
    while len(found) < count:
        got = loop.take(channel, WAIT_S)
        assert got, f"no result within {WAIT_S} s"
        found.update({j.id: j for j in got})
    return found


def test_requests_joining_a_running_batch_sample_as_their_own_calls(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    limits = [40, 3, 25, 9, 33, 1, 17, 28]
    loop = DecodeLoop(engine)
    loop.submit([job(i, prompts[i], limits[i]) for i in range(3)])
    first = loop.take("a", WAIT_S)  # the 3-token request returns while the others decode
    assert first and all(j.id != 0 for j in first), [j.id for j in first]
    steps_then = loop.steps
    loop.submit([job(i, prompts[i], limits[i]) for i in range(3, 8)])  # they join mid-batch
    done = {j.id: j for j in first} | drain(loop, "a", 8 - len(first))
    assert sorted(done) == list(range(8))
    for i, found in done.items():
        assert found.tokens == one_call(engine, prompts[i], 500 + i, limits[i]), i
        assert len(found.tokens) == len(found.log_probs) <= limits[i]
        assert found.finish == ("stop" if found.tokens[-1] == 0 else "length")
    assert loop.admissions >= 2 and steps_then < loop.steps
    # one step per token of the longest request, not one call after another
    assert loop.steps <= max(limits) + steps_then
    assert loop.busy == 0
    # the loop thread runs without autograd (grad mode is per thread): the caches its in-place
    # writes fill would otherwise chain every step's graph (memory growing with each step)
    assert any(p.requires_grad for p in engine.model.parameters())
    assert not loop._caches[0][0].requires_grad and loop._logits is not None
    assert not loop._logits.requires_grad
    loop.close()


def test_freed_slots_are_reused_and_the_batch_is_compacted(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    loop = DecodeLoop(engine)
    # eight rows, seven finish early: the long one moves down into a hole, later requests
    # take the freed slots; every sample is still its own call's
    limits = [2, 2, 2, 2, 2, 2, 2, 48]
    loop.submit([job(i, prompts[i], limits[i]) for i in range(8)])
    early = drain(loop, "a", 7)
    assert 7 not in early
    slots_before = len(loop._jobs)
    loop.submit([job(10 + i, prompts[i], 6) for i in range(4)])
    later = drain(loop, "a", 5)
    assert len(loop._jobs) == slots_before  # no growth: the freed slots were taken
    assert loop.compactions >= 1
    for i, found in {**early, **later}.items():
        prompt, limit = prompts[i % 10], limits[i] if i < 8 else 6
        assert found.tokens == one_call(engine, prompt, 500 + i, limit), i
    loop.close()


def test_sessions_are_kept_at_the_end_of_a_turn_and_reused_by_the_next(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    cache = SessionCache(max_bytes=1 << 30)
    loop = DecodeLoop(engine, cache)
    loop.submit([job(i, prompts[i], 10, session=f"s{i}") for i in range(4)])
    turn = drain(loop, "a", 4)
    nxt = [prompts[i] + turn[i].tokens + [7, 8, 9] for i in range(4)]
    loop.submit([job(20 + i, nxt[i], 10, session=f"s{i}") for i in range(4)])
    second = drain(loop, "a", 4)
    for i in range(4):
        # all of the earlier prompt and turn but the last sampled token (never fed back)
        assert second[20 + i].reused == len(prompts[i]) + len(turn[i].tokens) - 1
        assert second[20 + i].tokens == one_call(engine, nxt[i], 520 + i, 10)
    assert set(cache.held) == {f"s{i}" for i in range(4)}
    loop.close()


def test_a_request_sampling_otherwise_waits_and_channels_get_their_own(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    loop = DecodeLoop(engine)
    greedy = SAMPLING.model_copy(update={"temperature": 0.0, "stop_token_ids": [0]})
    loop.submit([job(0, prompts[0], 30), job(1, prompts[1], 30, channel="b", sampling=greedy)])
    a, b = drain(loop, "a", 1), drain(loop, "b", 1)
    assert a[0].tokens == one_call(engine, prompts[0], 500, 30)
    (alone,) = engine.generate([prompts[1]], greedy.model_copy(update={"max_new_tokens": 30}))
    assert b[1].tokens == alone.tokens
    assert loop.take("a", 0.01) == []  # nothing out: returns at once
    loop.close()


def test_a_failed_step_fails_its_requests_owner_and_the_loop_goes_on(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    loop = DecodeLoop(engine)
    bad = job(0, [10**7], 4)  # an id past the vocabulary: the prefill's embedding raises
    loop.submit([bad])
    with pytest.raises(Exception, match="decode loop failed"):
        loop.take("a", WAIT_S)
    loop.submit([job(1, prompts[1], 5)])
    assert drain(loop, "a", 1)[1].tokens == one_call(engine, prompts[1], 501, 5)
    loop.close()


def test_after_a_release_the_loop_starts_a_new_batch_of_any_shape(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    """A weight change releases the caches between batches: the next batch may be smaller and
    ask for more tokens than any before (a run's validation after its training batches)."""
    engine, prompts = setup
    loop = DecodeLoop(engine)
    loop.submit([job(i, prompts[i], 8) for i in range(8)])
    drain(loop, "a", 8)
    with loop.lock:
        assert loop.busy == 0
        loop.release()
    loop.submit([job(30 + i, prompts[i], 40) for i in range(3)])
    found = drain(loop, "a", 3)
    for i in range(3):
        assert found[30 + i].tokens == one_call(engine, prompts[i], 530 + i, 40)
    loop.close()
