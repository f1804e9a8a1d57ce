"""Continued samples (partial rollout) in one process: the native engine and ``serve``.

A sample continued from its prefix (prompt + tokens so far) with ``Resume(sample, offset)``
must draw the tokens it would have drawn in one call: the engine skips the first ``offset``
uniforms of the sample's own stream. ``serve`` takes the ``continuation`` column.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from roles.engines.generation.interface import (
    GenerationError,
    Resume,
    Sample,
    SamplingConfig,
    resumed_seed,
    sample_seed,
)
from roles.engines.generation.native import NativeEngine
from roles.engines.generation.serve import serve
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer
from transport.batch import BatchError, TensorBatch

TEXTS = ["1+2=", "34+56=", "a longer prompt: 12+13=", "0+0="]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[NativeEngine, Any, list[list[int]]]:
    torch.set_num_threads(1)
    path = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    return (
        NativeEngine(model, tokenizer.eos_token_id),
        tokenizer,
        [tokenizer.encode(t) for t in TEXTS],
    )


def chunked(
    engine: NativeEngine, prompts: list[list[int]], sampling: SamplingConfig, chunk: int
) -> list[Sample]:
    """What the controller does, in one process: ``chunk`` tokens a call, the unfinished
    samples continued from their prefixes."""
    seeds = [100 + i for i in range(len(prompts))]
    first = sampling.model_copy(update={"max_new_tokens": chunk})
    grown = engine.generate(prompts, first, request_seeds=seeds)
    while live := [
        i
        for i, s in enumerate(grown)
        if s.finish == "length" and len(s.tokens) < sampling.max_new_tokens
    ]:
        offset = len(grown[live[0]].tokens)
        budget = min(chunk, sampling.max_new_tokens - offset)
        more = engine.generate(
            [grown[i].prompt + grown[i].tokens for i in live],
            sampling.model_copy(update={"n": 1, "max_new_tokens": budget}),
            request_seeds=[seeds[grown[i].request] for i in live],
            resume=[Resume(i % sampling.n, offset) for i in live],
        )
        for i, extra in zip(live, more, strict=True):
            grown[i].tokens += extra.tokens
            grown[i].log_probs += extra.log_probs
            grown[i].finish = extra.finish
    return grown


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunks_continue_each_samples_own_stream(setup: Any, temperature: float) -> None:
    engine, tokenizer, prompts = setup
    n = 1 if temperature == 0 else 3
    seeds = [100 + i for i in range(len(prompts))]
    sampling = SamplingConfig(temperature=temperature, top_p=0.9, n=n, max_new_tokens=13, seed=4)
    free = engine.generate(prompts, sampling, request_seeds=seeds)
    # two of those tokens also stop, so samples end inside chunks as well as at the budget
    stops = [tokenizer.eos_token_id, free[0].tokens[5], free[-1].tokens[9]]
    sampling = sampling.model_copy(update={"stop_token_ids": stops})
    whole = engine.generate(prompts, sampling, request_seeds=seeds)
    pieces = chunked(engine, prompts, sampling, chunk=4)
    assert [s.tokens for s in pieces] == [s.tokens for s in whole]
    assert [s.finish for s in pieces] == [s.finish for s in whole]
    for a, b in zip(pieces, whole, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0
        )
    lengths = {len(s.tokens) for s in whole}
    assert 13 in lengths and lengths - {4, 8, 12, 13}, lengths  # ended mid-chunk and at the budget


def test_a_resume_skips_exactly_its_offset(setup: Any) -> None:
    engine, _, prompts = setup
    sampling = SamplingConfig(temperature=1.0, n=1, max_new_tokens=6, seed=9)
    own = engine._uniforms(sampling, [7], 0, 2, [Resume(2, 5)])
    stream = torch.rand(11, generator=torch.Generator().manual_seed(sample_seed(9, 7, 2)))
    assert torch.equal(own, stream[5:])
    with pytest.raises(GenerationError, match="n=1"):
        engine.generate(prompts[:1], sampling.model_copy(update={"n": 2}), resume=[Resume(0, 1)])
    with pytest.raises(GenerationError, match="offset 9"):
        engine.generate(prompts[:1], sampling, resume=[Resume(0, 9)])
    assert resumed_seed(9, 7, 2) == sample_seed(9, 7, 2) == resumed_seed(9, 7, 0, Resume(2, 0))
    assert resumed_seed(9, 7, 0, Resume(2, 3)) != resumed_seed(9, 7, 0, Resume(2, 4))


def rows(batch: TensorBatch) -> list[list[int]]:
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]


def test_serve_continues_rows_and_decodes_the_whole_response(setup: Any) -> None:
    engine, tokenizer, _ = setup
    greedy = {"temperature": 0, "max_new_tokens": 10}
    texts = TensorBatch.from_dict(non_tensors={"prompt": TEXTS})
    whole = serve(engine, tokenizer, texts, greedy, 3)
    head = serve(engine, tokenizer, texts, {**greedy, "max_new_tokens": 4}, 3)
    assert head.non_tensors["finish"] == ["length"] * 4  # every row goes on
    rest = TensorBatch.from_dict(
        non_tensors={
            "prompt_ids": rows(head),
            "seed": [0, 1, 2, 3],
            "continuation": [[0, 4]] * 4,
            "answer": ["a", "b", "c", "d"],
        }
    )
    tail = serve(engine, tokenizer, rest, {**greedy, "max_new_tokens": 6}, 4)
    assert rows(tail) == rows(whole)
    assert tail["response_mask"].sum(-1).tolist() == [6] * 4  # this call's tokens only
    assert tail.non_tensors["response"] == whole.non_tensors["response"]
    assert tail.non_tensors["answer"] == ["a", "b", "c", "d"]
    assert "prompt_ids" not in tail.non_tensors and tail.meta["weight_version"] == 4
    lone = TensorBatch.from_dict(non_tensors={"prompt": TEXTS[:1], "continuation": [[0, 1]]})
    with pytest.raises(BatchError, match="prompt_ids"):
        serve(engine, tokenizer, lone, greedy, 0)
    bad = TensorBatch.from_dict(non_tensors={"prompt_ids": [[1, 5, 6]], "continuation": [3]})
    with pytest.raises(GenerationError, match=r"not \[sample, offset\]"):
        serve(engine, tokenizer, bad, greedy, 0)
