"""Generation engines in one process: native == HF, the shared log-prob definition, sampling.

The model is the tiny Llama after a little SFT on arithmetic, so greedy answers are non-trivial
and end with ``</s>``; prompts have mixed lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.overrides import TorchFunctionMode

from controller.tasks import arithmetic
from roles.engines.generation.hf import HFEngine
from roles.engines.generation.interface import GenerationError, SamplingConfig, samples_to_batch
from roles.engines.generation.native import NativeEngine, filtered_probs
from roles.modeling.logprob import token_log_probs
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[list[int]]]:
    path = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    rows = arithmetic(64, "sft", seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(30):  # enough to make answers end in </s>
        row = rows[step % len(rows)]
        text = tokenizer.encode(row["prompt"] + row["response"])  # [bos, *text]
        ids = torch.tensor([[*text, tokenizer.eos_token_id]])
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    texts = ["1+2=", "34+56=", "7+80=", "99+99=", "0+0=", "a longer prompt: 12+13="]
    prompts = [tokenizer.encode(p) for p in texts]  # the tokenizer adds the BOS
    return model, tokenizer, prompts


def engines(model: Any, tokenizer: Any) -> tuple[NativeEngine, HFEngine]:
    return NativeEngine(model, tokenizer.eos_token_id), HFEngine(
        model, tokenizer.pad_token_id, tokenizer.eos_token_id
    )


def test_greedy_native_equals_hf_token_for_token(setup: Any) -> None:
    model, tokenizer, prompts = setup
    native, hf = engines(model, tokenizer)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    ours, theirs = native.generate(prompts, greedy), hf.generate(prompts, greedy)
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    assert [s.finish for s in ours] == [s.finish for s in theirs]
    assert "stop" in {s.finish for s in ours}
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_generation_log_probs_are_the_training_log_probs(setup: Any, temperature: float) -> None:
    model, tokenizer, prompts = setup
    native, _ = engines(model, tokenizer)
    n = 1 if temperature == 0 else 3
    sampling = SamplingConfig(temperature=temperature, top_p=0.9, n=n, max_new_tokens=10, seed=4)
    batch = samples_to_batch(native.generate(prompts, sampling), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = (
        token_log_probs(logits, batch["input_ids"], temperature or 1.0) * batch["response_mask"]
    )
    torch.testing.assert_close(batch["log_probs"], expected, atol=1e-5, rtol=0)


def test_a_seed_reproduces_samples_whatever_else_is_in_the_batch(setup: Any) -> None:
    model, tokenizer, prompts = setup
    native, _ = engines(model, tokenizer)
    sampling = SamplingConfig(temperature=1.0, n=4, max_new_tokens=10, seed=11)
    first = native.generate(prompts, sampling)
    again = native.generate(prompts, sampling)
    alone = native.generate(prompts[:2], sampling)
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert [s.tokens for s in first[:8]] == [s.tokens for s in alone]
    assert len({tuple(s.tokens) for s in first}) > len(prompts)  # samples of a prompt differ
    other = native.generate(prompts, sampling.model_copy(update={"seed": 12}))
    assert [s.tokens for s in other] != [s.tokens for s in first]


def test_stop_tokens_and_max_new_tokens_are_honoured(setup: Any) -> None:
    model, tokenizer, prompts = setup
    native, hf = engines(model, tokenizer)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    for engine in (native, hf):
        stopped = engine.generate(
            prompts, SamplingConfig(temperature=0, max_new_tokens=9, stop_token_ids=digits)
        )
        assert all(s.finish == "stop" and s.tokens[-1] in digits for s in stopped)
        assert all(not set(s.tokens[:-1]) & set(digits) for s in stopped)
        short = engine.generate(
            prompts, SamplingConfig(temperature=1, max_new_tokens=2, stop_token_ids=[-1])
        )
        assert all(len(s.tokens) == 2 and s.finish == "length" for s in short)


def test_top_k_one_is_greedy_and_filters_by_hand() -> None:
    probs = filtered_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), top_k=2, top_p=1.0)
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    nucleus = filtered_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), top_k=0, top_p=0.8)
    torch.testing.assert_close(nucleus, torch.tensor([[0.5, 0.3, 0.0, 0.0]]))  # 0.5 + 0.3 >= 0.8
    wider = filtered_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), top_k=0, top_p=0.81)
    torch.testing.assert_close(wider, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))


def test_bad_requests_get_clear_errors(setup: Any) -> None:
    model, tokenizer, prompts = setup
    native, hf = engines(model, tokenizer)
    for engine in (native, hf):
        with pytest.raises(GenerationError, match="empty prompt list"):
            engine.generate([], SamplingConfig())
        with pytest.raises(GenerationError, match="prompt 1 is empty"):
            engine.generate([prompts[0], []], SamplingConfig())
        with pytest.raises(GenerationError, match="exceeds the model's context of 512"):
            engine.generate([[5] * 500], SamplingConfig(max_new_tokens=20))
    for bad, field in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"n": 3, "temperature": 0}, "greedy"),
        ({"top_k": -2}, "top_k"),
        ({"beams": 2}, "beams"),
    ]:
        with pytest.raises(ValidationError, match=field):
            SamplingConfig.model_validate(bad)


def test_finished_rows_leave_the_batch(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer, prompts = setup
    native, _ = engines(model, tokenizer)
    widths: list[int] = []
    decode = native._decode

    def spy(caches: Any, lengths: torch.Tensor, tokens: torch.Tensor, span: int) -> torch.Tensor:
        widths.append(len(tokens))
        assert span == int(lengths.max()) + 1  # the host's count matches the device's lengths
        return decode(caches, lengths, tokens, span)

    monkeypatch.setattr(native, "_decode", spy)
    samples = native.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=30))
    assert any(s.finish == "stop" for s in samples)
    assert widths[0] <= len(prompts) and widths[-1] < len(prompts)  # the batch shrank


def test_both_engines_return_n_samples_per_prompt_request_major(setup: Any) -> None:
    model, tokenizer, prompts = setup
    for engine in engines(model, tokenizer):
        samples = engine.generate(prompts, SamplingConfig(temperature=1.0, n=3, max_new_tokens=4))
        assert [s.request for s in samples] == [i for i in range(len(prompts)) for _ in range(3)]
        assert all(s.prompt == prompts[s.request] for s in samples)
        assert all(1 <= len(s.tokens) == len(s.log_probs) <= 4 for s in samples)


def test_request_seeds_make_samples_independent_of_position(setup: Any) -> None:
    model, tokenizer, prompts = setup
    native, _ = engines(model, tokenizer)
    sampling = SamplingConfig(temperature=1.0, n=2, max_new_tokens=8, seed=5)
    whole = native.generate(prompts, sampling, request_seeds=list(range(100, 106)))
    tail = native.generate(prompts[3:], sampling, request_seeds=list(range(103, 106)))
    assert [s.tokens for s in whole[6:]] == [s.tokens for s in tail]
    by_index = native.generate(prompts[3:], sampling)  # seeds from positions 0..2 differ
    assert [s.tokens for s in by_index] != [s.tokens for s in tail]


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host — each one is a device-to-host
    synchronisation on an accelerator (a boolean-mask index sizes its result by the data)."""

    SCALAR = frozenset({"item", "__bool__", "__int__", "__index__", "__float__", "nonzero"})

    def __init__(self) -> None:
        super().__init__()
        self.scalar = self.lists = self.masks = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.SCALAR:
            self.scalar += 1
        elif name == "tolist":
            self.lists += 1
        elif name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.masks += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return func(*args, **(kwargs or {}))


def test_native_decoding_reads_the_device_only_where_the_host_looks(setup: Any) -> None:
    """Between the host's looks (every ``check_every`` steps) the decode loop keeps tokens,
    log-probs and finished rows on the device; the results are read once, at the end."""
    model, tokenizer, prompts = setup
    sampling = SamplingConfig(temperature=1.0, n=4, max_new_tokens=24, seed=5)
    results = {}
    for check_every in (1, 8, 24):
        engine = NativeEngine(model, tokenizer.eos_token_id, check_every=check_every)
        with HostReads() as reads:
            samples = engine.generate(prompts, sampling)
        results[check_every] = [(s.tokens, s.log_probs, s.finish) for s in samples]
        looks = (sampling.max_new_tokens - 1) // check_every  # the last step needs no look
        compactions = reads.masks // (2 * len(model.model.layers) + 3)  # k, v per layer; 3 more
        assert reads.masks == compactions * (2 * len(model.model.layers) + 3)
        assert reads.scalar == looks + compactions  # a count per look, a longest row per compact
        assert reads.lists == 4  # tokens, log-probs, lengths, stopped: once per call
    assert "stop" in {finish for *_, finish in results[1]}
    # when the host looks changes only when finished rows leave the batch, not what is sampled
    # (log-probs to float rounding: a product's summation order depends on the batch's size)
    for other in (results[8], results[24]):
        assert [(t, f) for t, _, f in other] == [(t, f) for t, _, f in results[1]]
        for (_, ours, _), (_, theirs, _) in zip(other, results[1], strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=0)
    # one look per step, the default on the host, and compaction then happens
    with HostReads() as reads:
        NativeEngine(model, tokenizer.eos_token_id).generate(prompts, sampling)
    assert reads.scalar >= sampling.max_new_tokens - 1 and reads.masks > 0


def test_check_every_must_be_positive(setup: Any) -> None:
    model, tokenizer, _ = setup
    with pytest.raises(GenerationError, match="check_every"):
        NativeEngine(model, tokenizer.eos_token_id, check_every=0)
