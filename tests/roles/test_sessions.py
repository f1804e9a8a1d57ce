"""Sessions in the native engine, in one process (fp32): a trajectory's second turn, prefilled
from its kept keys and values, samples what a full re-prefill of the same ids samples; the
positions it ran are only the new ones; a session evicted under the memory bound, computed with
other weights, or whose prompt no longer starts with its ids is prefilled again, never used."""

from __future__ import annotations

import pytest
import torch

from roles.engines.generation.interface import Sample, SamplingConfig
from roles.engines.generation.native import NativeEngine
from roles.engines.generation.sessions import SessionCache, SessionRequest
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer

TEXTS = ["1+2=", "34+56=", "a longer prompt: 12+13=", "0+0="]
OBSERVATION = [7, 8, 9, 10, 11]  # what an env would append after each turn


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[NativeEngine, list[list[int]]]:
    torch.set_num_threads(1)
    path = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    return NativeEngine(model, tokenizer.eos_token_id), [tokenizer.encode(t) for t in TEXTS]


SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3)
SEEDS = [100, 101, 102, 103]


def turns(
    engine: NativeEngine, prompts: list[list[int]], cache: SessionCache | None, count: int = 3
) -> tuple[list[list[Sample]], list[tuple[int, int]]]:
    """``count`` turns of every trajectory: each turn's prompt is the last one, its sampled
    tokens and an observation. With ``cache``, each trajectory is its own session."""
    done, ran = [], []
    for turn in range(count):
        sessions = None if cache is None else SessionRequest(cache, list(range(len(prompts))), 0)
        seeds = [s + 1000 * turn for s in SEEDS]
        out = engine.generate(prompts, SAMPLING, request_seeds=seeds, sessions=sessions)
        done.append(out)
        ran.append(engine.last_prefill)
        prompts = [p + s.tokens + OBSERVATION for p, s in zip(prompts, out, strict=True)]
    return done, ran


def same(a: list[list[Sample]], b: list[list[Sample]]) -> None:
    for turn_a, turn_b in zip(a, b, strict=True):
        assert [s.tokens for s in turn_a] == [s.tokens for s in turn_b]
        for x, y in zip(turn_a, turn_b, strict=True):
            assert torch.allclose(torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-4)


def test_later_turns_prefill_only_their_new_tokens_and_sample_as_a_full_prefill(
    setup: tuple[NativeEngine, list[list[int]]],
) -> None:
    engine, prompts = setup
    full, full_ran = turns(engine, prompts, None)
    cache = SessionCache(max_bytes=1 << 30)
    kept, kept_ran = turns(engine, prompts, cache)
    same(full, kept)
    assert kept_ran[0] == full_ran[0]  # the first turn has nothing kept
    for turn in (1, 2):
        prefilled, reused = kept_ran[turn]
        # only the observation and the last sampled token (never fed back) run again
        assert prefilled == len(prompts) * (len(OBSERVATION) + 1)
        assert prefilled + reused == full_ran[turn][0]
    stats = cache.take_stats()
    assert (stats.hits, stats.misses, stats.evicted) == (8, 4, 0)
    assert len(cache.held) == 4 and cache.nbytes == sum(s.nbytes for s in cache.held.values())
    assert cache.drop(range(4)) == 4 and cache.nbytes == 0


@pytest.mark.parametrize("why", ["evicted", "other weights", "prompt changed"])
def test_a_session_that_cannot_serve_is_prefilled_again(
    setup: tuple[NativeEngine, list[list[int]]], why: str
) -> None:
    engine, prompts = setup
    cache = SessionCache(max_bytes=1 if why == "evicted" else 1 << 30)
    first = engine.generate(
        prompts, SAMPLING, request_seeds=SEEDS, sessions=SessionRequest(cache, [0, 1, 2, 3], 0)
    )
    nxt = [p + s.tokens + OBSERVATION for p, s in zip(prompts, first, strict=True)]
    if why == "prompt changed":  # e.g. the controller rewrote the history
        nxt = [[p[0] + 1, *p[1:]] for p in nxt]
    version = 1 if why == "other weights" else 0
    again = engine.generate(
        nxt, SAMPLING, request_seeds=SEEDS, sessions=SessionRequest(cache, [0, 1, 2, 3], version)
    )
    assert engine.last_prefill == (sum(map(len, nxt)), 0)
    assert [s.tokens for s in again] == [
        s.tokens for s in engine.generate(nxt, SAMPLING, request_seeds=SEEDS)
    ]
    stats = cache.take_stats()
    assert stats.hits == 0
    assert {"evicted": stats.evicted == 8, "other weights": stats.stale == 4}.get(why, True)
