"""The ``vllm`` generation engine (``roles/engines/generation/vllm.py``) on real ranks.

vLLM's parallel state is global to a process, so each check group runs in spawned gloo ranks
(``tests/fixtures/ranks.py``), one engine per rank, as in a role group:

* one rank: greedy tokens equal the native and HF engines' token for token (fp32, the tiny model
  after a little SFT so answers end in ``</s>``); log-probs follow the contract (temperature-
  scaled, unfiltered) and are compared with the trainer's definition; seeds, stop tokens, ``n``,
  a logits processor; new weights in place; memory released between phases;
* two ranks at tp = 2 (vLLM's external launcher inside our group): the same tokens;
* role groups: a rollout group at tp 1 and one at tp 2, synced rank to rank from the actor
  through ``reshard/``, generate what the actor's weights generate.

Needs the ``[vllm]`` extra; under HYBRIDFLOW_REQUIRE_SYSTEM_TESTS=1 (CI) a missing vllm fails
(the last test, the error that names the extra, runs either way).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.clients import ActorClient, RolloutClient
from controller.sync import WeightSync
from controller.tasks import arithmetic
from deploy.session import local_session
from roles.modeling.models import load_causal_lm, load_tokenizer
from tests.conftest import TEST_TIMEOUTS, group, require_system, run
from tests.fixtures.ranks import run_ranks
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch
from transport.weight_sync import WeightSyncSettings

pytestmark = [pytest.mark.slow]

TEXTS = ["1+2=", "34+56=", "7+80=", "99+99=", "0+0=", "a longer prompt: 12+13="]
#: vLLM's log-probs against the trainer's (``compute_log_prob``) on the same tokens, fp32: both
#: compute log_softmax(logits / T) of the same fp32 model, through different kernels
LOGPROB_BOUND_MAX = 1e-4
LOGPROB_BOUND_MEAN = 1e-5
#: the same in bf16 (vLLM's bf16 weights against the trainer's bf16 autocast): measured on the
#: tiny and 20M models, max 0.015-0.040 and mean 0.003-0.005 per token
BF16_BOUND_MAX = 0.1
BF16_BOUND_MEAN = 0.01
#: vLLM's start-up (import, model, KV cache) inside a role's build call, on a loaded 2-core box
VLLM_TIMEOUTS = TEST_TIMEOUTS.model_copy(
    update={"call_s": 240, "connect_s": 180, "group_init_s": 90}
)


@pytest.fixture(scope="module")
def needs_vllm() -> None:
    require_system(
        "vLLM (the [vllm] extra)",
        importlib.util.find_spec("vllm") is not None,
        "pip install -e '.[vllm]'",
    )


@pytest.fixture(scope="module")
def model_dir(needs_vllm: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama after 30 SFT steps on arithmetic (answers end in ``</s>``)."""
    from roles.modeling.models import init_model

    path = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    rows = arithmetic(64, "sft", seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(30):
        row = rows[step % len(rows)]
        text = tokenizer.encode(row["prompt"] + row["response"])  # [bos, *text]
        ids = torch.tensor([[*text, tokenizer.eos_token_id]])
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    model.save_pretrained(path)
    return path


def perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (n, p.detach() + 0.02 * torch.randn(p.shape, generator=gen))
        for n, p in model.named_parameters()
    ]


# -- one rank ------------------------------------------------------------------------------------


def _tokens(samples: list[Any]) -> list[list[int]]:
    return [s.tokens for s in samples]


def _gap(model: Any, tokenizer: Any, samples: list[Any], temperature: float) -> list[float]:
    """|vLLM log-prob - the trainer's| per response token (roles/modeling/logprob.py)."""
    from roles.engines.generation.interface import samples_to_batch
    from roles.modeling.logprob import token_log_probs

    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    trainer = token_log_probs(logits.logits, batch["input_ids"], temperature)
    mask = batch["response_mask"].bool()
    return (batch["log_probs"] - trainer)[mask].abs().tolist()


def _one_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    """Everything a single vLLM engine is checked for, against native and HF in the same rank."""
    from roles.engines.generation.hf import HFEngine
    from roles.engines.generation.interface import SamplingConfig
    from roles.engines.generation.native import NativeEngine
    from roles.engines.generation.vllm import VLLMEngine

    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    eos = tokenizer.eos_token_id
    native, hf = NativeEngine(model, eos), HFEngine(model, tokenizer.pad_token_id, eos)
    vllm = VLLMEngine(path, eos_token_id=eos, context=512)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    ours = vllm.generate(prompts, greedy)
    out: dict[str, Any] = {
        "greedy": {
            "vllm": _tokens(ours),
            "native": _tokens(native.generate(prompts, greedy)),
            "hf": _tokens(hf.generate(prompts, greedy)),
            "finish": [s.finish for s in ours],
            "native_finish": [s.finish for s in native.generate(prompts, greedy)],
            "gap": _gap(model, tokenizer, ours, 1.0),
        }
    }
    out["sampled"] = _sampled(vllm, model, tokenizer, prompts)
    out["turn_loop"] = _turn_loop(vllm, prompts)
    out.update(_shaped(vllm, native, tokenizer, prompts))
    out.update(_reloaded(vllm, native, model, prompts, greedy, out["greedy"]["vllm"]))
    return out


def _sampled(vllm: Any, model: Any, tokenizer: Any, prompts: Any) -> dict[str, Any]:
    """Seeded sampling at two temperatures: per-request seeds, a tail re-run, another seed."""
    from roles.engines.generation.interface import SamplingConfig

    sampled = {}
    for temperature in (0.7, 1.3):
        sampling = SamplingConfig(
            temperature=temperature, top_p=0.9, top_k=40, n=3, max_new_tokens=10, seed=4
        )
        first = vllm.generate(prompts, sampling, request_seeds=list(range(100, 106)))
        tail = vllm.generate(prompts[3:], sampling, request_seeds=list(range(103, 106)))
        other = vllm.generate(prompts, sampling.model_copy(update={"seed": 5}))
        sampled[str(temperature)] = {
            "requests": [s.request for s in first],
            "tokens": _tokens(first),
            "tail": _tokens(tail),
            "other_seed": _tokens(other),
            "lengths_ok": all(len(s.tokens) == len(s.log_probs) for s in first),
            "gap": _gap(model, tokenizer, first, temperature),
        }
    return sampled


def _turn_loop(vllm: Any, prompts: Any) -> dict[str, Any]:
    """Iteration-level serving on vLLM: turns submitted while others run, taken per channel,
    against one generate call with the same request seeds; generate refused meanwhile."""
    from roles.engines.generation.interface import GenerationError, SamplingConfig
    from roles.engines.generation.iteration import Job
    from roles.engines.generation.vllm import VLLMTurnLoop

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=4)
    call = vllm.generate(prompts, sampling, request_seeds=list(range(200, 206)))
    loop = VLLMTurnLoop(vllm)
    jobs = [
        Job(i, "ab"[i % 2], list(p), 10, 200 + i, sampling, version=0)
        for i, p in enumerate(prompts)
    ]
    loop.submit(jobs[:3])
    refused = ""
    try:
        vllm.generate(prompts[:1], sampling)
    except GenerationError as exc:
        refused = str(exc)
    loop.submit(jobs[3:])  # joining the running batch
    done: dict[str, list[Any]] = {"a": [], "b": []}
    for _ in range(400):
        for channel in done:
            done[channel] += loop.take(channel, 0.5)
        if sum(map(len, done.values())) == len(jobs):
            break
    steps, admissions, busy = loop.steps, loop.admissions, loop.busy
    loop.close()
    by_id = {j.id: j for found in done.values() for j in found}
    return {
        "channels": {c: sorted(j.id for j in found) for c, found in done.items()},
        "tokens": [by_id[i].tokens if i in by_id else None for i in range(len(jobs))],
        "call_tokens": _tokens(call),
        "log_prob_gap": max(
            abs(a - b)
            for i, sample in enumerate(call)
            if i in by_id
            for a, b in zip(by_id[i].log_probs, sample.log_probs, strict=True)
        ),
        "refused": refused,
        "steps": steps,
        "admissions": admissions,
        "busy_after": busy,
        "turns_out_after": vllm.turns_out,
    }


def _shaped(vllm: Any, native: Any, tokenizer: Any, prompts: Any) -> dict[str, Any]:
    """Stop tokens, a short budget, and hybridflow's logits processor (vLLM against native)."""
    from bench.generate import ForcedLengths
    from roles.engines.generation.interface import SamplingConfig

    out: dict[str, Any] = {}
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    stopped = vllm.generate(
        prompts, SamplingConfig(temperature=0, max_new_tokens=9, stop_token_ids=digits)
    )
    out["stopped"] = {"tokens": _tokens(stopped), "finish": [s.finish for s in stopped]}
    out["digits"] = digits
    short = vllm.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=2))
    out["short"] = [[len(s.tokens), s.finish] for s in short]
    # sample i ends after exactly lengths[i] tokens, lengths drawn in [4, 16]
    lengths = torch.randint(4, 17, (64,), generator=torch.Generator().manual_seed(3))
    forced = ForcedLengths(tokenizer.eos_token_id, lengths.tolist())
    shaped = SamplingConfig(temperature=0, max_new_tokens=16)
    with_processor = vllm.generate(prompts, shaped, forced)
    native_processor = native.generate(prompts, shaped, forced)
    out["processor"] = {
        "lengths": [len(s.tokens) for s in with_processor],
        "forced": forced.lengths[: len(prompts)].tolist(),
        "same_tokens": _tokens(with_processor) == _tokens(native_processor),
        "log_prob_gap": max(
            abs(a - b)
            for x, y in zip(with_processor, native_processor, strict=True)
            for a, b in zip(x.log_probs, y.log_probs, strict=True)
        ),
    }
    return out


def _reloaded(
    vllm: Any, native: Any, model: Any, prompts: Any, greedy: Any, before: list[list[int]]
) -> dict[str, Any]:
    """New weights in place (``before``: the greedy tokens under the old ones), then release and
    resume (clean, and with a poisoned cache)."""
    import psutil

    new = perturbed(model, seed=9)
    vllm.load_weights(new)
    with torch.no_grad():
        for (_, tensor), (_, param) in zip(new, model.named_parameters(), strict=True):
            param.copy_(tensor)
    out: dict[str, Any] = {
        "reloaded": {
            "vllm": _tokens(vllm.generate(prompts, greedy)),
            "native": _tokens(native.generate(prompts, greedy)),
            "before": before,
        }
    }
    rss = psutil.Process().memory_info().rss
    freed = vllm.release(weights=True)
    out["release"] = {
        "freed": freed,
        "rss_drop": rss - psutil.Process().memory_info().rss,
        "weights": sum(t.numel() * t.element_size() for _, t in new),
    }
    vllm.load_weights(new)
    out["after_release"] = _tokens(vllm.generate(prompts, greedy))
    out.update(_poisoned_release(vllm, new, prompts, greedy))
    return out


def _poisoned_release(vllm: Any, new: Any, prompts: Any, greedy: Any) -> dict[str, Any]:
    """A released KV cache whose memory comes back holding NaN (what a training step can leave
    in memory the process frees; here the allocator's fresh pages are zero, so the storage is
    given back and filled before ``resume`` runs): is it zero after, and what does greedy
    decoding give?"""
    from roles.engines.generation.interface import GenerationError
    from roles.engines.generation.vllm import _bytes_of, _kv_tensors

    vllm.release(weights=True)
    for tensor, size, cache in vllm._released:
        if cache:  # all bytes 0xff: NaN in float32 and bfloat16, in every layer's cache
            storage = tensor.untyped_storage()
            storage.resize_(size)
            _bytes_of(storage).fill_(255)
    vllm.load_weights(new)
    caches = vllm.llm.collective_rpc(_kv_tensors)[0]
    # the layers' caches are views into one storage; each is checked (not only the first)
    zeroed = len(caches) > 1 and all(bool((c == 0).all()) for c in caches)
    try:
        poisoned = vllm.generate(prompts, greedy)
    except GenerationError as e:  # NaN log-probs are refused: the other checks still run
        return {"cache_zeroed": zeroed, "after_poisoned_release": str(e)}
    return {"cache_zeroed": zeroed, "after_poisoned_release": [s.tokens for s in poisoned]}


def _tied_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    """A model whose head is its embedding (as SmolLM2's): new weights, then a release and the
    same weights again; vLLM's greedy tokens against the native engine's on the new model."""
    from roles.engines.generation.interface import SamplingConfig
    from roles.engines.generation.native import NativeEngine
    from roles.engines.generation.vllm import VLLMEngine

    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    native = NativeEngine(model, tokenizer.eos_token_id)
    vllm = VLLMEngine(path, eos_token_id=tokenizer.eos_token_id, context=512)
    before = [s.tokens for s in vllm.generate(prompts, greedy)]
    new = perturbed(model, seed=11)  # the embedding (so the head) changes too
    with torch.no_grad():
        for (_, tensor), (_, param) in zip(new, model.named_parameters(), strict=True):
            param.copy_(tensor)
    vllm.load_weights(new)
    reloaded = [s.tokens for s in vllm.generate(prompts, greedy)]
    vllm.release(weights=True)
    vllm.load_weights(new)
    return {
        "before": before,
        "reloaded": reloaded,
        "after_release": [s.tokens for s in vllm.generate(prompts, greedy)],
        "native": [s.tokens for s in native.generate(prompts, greedy)],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


@pytest.mark.timeout(300)
def test_a_head_tied_to_the_embedding_takes_new_weights_and_survives_a_release(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's reload re-packs the linear layers whose weights it loads; a tied head is not one of
    them, so after a release it had no packed copy and the next generate failed (the colocated
    actor releases after every generate). The engine re-packs every layer the reload left out."""
    tied = tmp_path / "tied"
    model, tokenizer = load_causal_lm(model_dir), load_tokenizer(model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tied)
    tokenizer.save_pretrained(tied)
    found = run_ranks(_tied_rank, 1, tmp_path / "ranks", str(tied))[0]
    assert found["tied"]
    assert found["reloaded"] == found["native"] != found["before"]
    assert found["after_release"] == found["native"]


@pytest.fixture(scope="module")
def one(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    found: dict[str, Any] = run_ranks(_one_rank, 1, tmp_path_factory.mktemp("one"), str(model_dir))[
        0
    ]
    return found


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_native_and_hf(one: dict[str, Any]) -> None:
    greedy = one["greedy"]
    assert greedy["vllm"] == greedy["native"] == greedy["hf"]
    assert greedy["finish"] == greedy["native_finish"]
    assert "stop" in greedy["finish"]  # answers end in </s>, kept as the last token


def test_log_probs_follow_the_contract_within_the_stated_bound(one: dict[str, Any]) -> None:
    """Temperature-scaled and unfiltered (top-k/top-p change what is sampled only), against the
    trainer's computation on the same tokens; the measured gaps are printed (pytest -s)."""
    for name, gaps in [("greedy", one["greedy"]["gap"])] + [
        (f"T={t}", s["gap"]) for t, s in one["sampled"].items()
    ]:
        worst, mean = max(gaps), sum(gaps) / len(gaps)
        print(f"vLLM - compute_log_prob, {name}: max {worst:.2e}, mean {mean:.2e} per token")
        assert worst < LOGPROB_BOUND_MAX and mean < LOGPROB_BOUND_MEAN, name


def test_per_sample_seeds_reproduce_whatever_the_batch(one: dict[str, Any]) -> None:
    for sampled in one["sampled"].values():
        assert sampled["requests"] == [i for i in range(len(TEXTS)) for _ in range(3)]
        assert sampled["tokens"][9:] == sampled["tail"]  # requests 3..5 alone, same seeds
        assert sampled["tokens"] != sampled["other_seed"]
        assert len({tuple(t) for t in sampled["tokens"]}) > len(TEXTS)
        assert sampled["lengths_ok"]


def test_turns_joining_vllm_s_running_batch_sample_as_one_call_does(one: dict[str, Any]) -> None:
    """Iteration-level serving on vLLM (``VLLMTurnLoop``): each turn a request of vLLM's own
    scheduler, admitted between its steps; the same tokens as one generate call with the same
    request seeds, each channel gets its own, and a generate call is refused while turns are out
    (vLLM would step them, and take their outputs)."""
    loop = one["turn_loop"]
    assert loop["channels"] == {"a": [0, 2, 4], "b": [1, 3, 5]}
    assert loop["tokens"] == loop["call_tokens"]
    assert loop["log_prob_gap"] < LOGPROB_BOUND_MAX
    assert "turns out in its turn loop" in loop["refused"]
    # a scheduler step gives each running turn one token (its prefill step the first)
    assert loop["admissions"] == 6 and loop["steps"] >= max(map(len, loop["tokens"]))
    assert loop["busy_after"] == 0 and loop["turns_out_after"] == 0


def test_stop_tokens_and_max_new_tokens_are_honoured(one: dict[str, Any]) -> None:
    digits = set(one["digits"])
    stopped = one["stopped"]
    assert all(f == "stop" for f in stopped["finish"])
    assert all(t[-1] in digits and not set(t[:-1]) & digits for t in stopped["tokens"])
    full = one["greedy"]["vllm"]  # the same prompts without the cap
    assert one["short"] == [[min(len(t), 2), "length" if len(t) > 2 else "stop"] for t in full]
    assert any(finish == "length" for _, finish in one["short"])


def test_a_logits_processor_shapes_tokens_not_log_probs(one: dict[str, Any]) -> None:
    processor = one["processor"]
    assert processor["lengths"] == processor["forced"]
    assert processor["same_tokens"]
    assert processor["log_prob_gap"] < 1e-4  # unshaped log-probs, as the native engine reports


def test_new_weights_in_place_generate_what_the_new_model_does(one: dict[str, Any]) -> None:
    reloaded = one["reloaded"]
    assert reloaded["vllm"] == reloaded["native"]
    assert reloaded["vllm"] != reloaded["before"]
    assert one["after_release"] == reloaded["vllm"]


def test_a_released_cache_comes_back_zeroed(one: dict[str, Any]) -> None:
    """The colocated actor releases vLLM's KV cache after every generate. Its storage came back
    holding what the process last freed there, where vLLM allocates it zeroed. Every layer's
    cache is a view into one storage: filled with NaN bytes before a release, all of it is zero
    after, and greedy tokens are what they were (zeroing the first layer's view alone left NaN
    in the others, and the greedy samples' log-probs came out NaN)."""
    assert one["after_poisoned_release"] == one["after_release"]  # not a NaN error
    assert one["cache_zeroed"]


def test_a_sample_with_non_finite_log_probs_is_an_error_not_training_data(
    needs_vllm: None,
) -> None:
    """NaN logits sample noise; such a sample is refused with its request named, never handed
    on to a loss that would turn NaN."""
    from types import SimpleNamespace

    from roles.engines.generation.interface import GenerationError, Sample
    from roles.engines.generation.vllm import VLLMEngine

    done = SimpleNamespace(finish_reason="length", token_ids=[5, 0, 0])
    sample = Sample(request=7, prompt=[1, 2])
    VLLMEngine._fill(sample, done, [-0.5, -1.0, -2.0])
    assert sample.log_probs == [-0.5, -1.0, -2.0]
    with pytest.raises(GenerationError, match=r"not finite at 2 of 3 steps .* request 7"):
        VLLMEngine._fill(Sample(request=7, prompt=[1, 2]), done, [-0.5, math.nan, math.nan])


def test_release_frees_the_kv_cache_and_weights(one: dict[str, Any]) -> None:
    released = one["release"]
    print(
        f"released {released['freed'] / 2**20:.0f} MiB, resident set -"
        f"{released['rss_drop'] / 2**20:.0f} MiB"
    )
    assert released["freed"] >= 256 * 2**20  # the KV cache (and unpacked parameters)
    assert released["rss_drop"] > 0.9 * released["freed"]  # given back to the system


def _bf16_gap(rank: int, world: int, path: str) -> list[float]:
    from roles.engines.generation.interface import SamplingConfig, samples_to_batch
    from roles.engines.generation.vllm import VLLMEngine
    from roles.modeling.logprob import token_log_probs

    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    vllm = VLLMEngine(path, dtype=torch.bfloat16, eos_token_id=tokenizer.eos_token_id, context=512)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    samples = vllm.generate(prompts, SamplingConfig(n=4, max_new_tokens=16, seed=2))
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the actor computes
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    trainer = token_log_probs(logits.logits, batch["input_ids"])
    gaps: list[float] = (batch["log_probs"] - trainer)[batch["response_mask"].bool()].abs().tolist()
    return gaps


@pytest.mark.timeout(300)
def test_bf16_log_prob_gap_to_the_trainer_within_the_stated_bound(
    model_dir: Path, tmp_path: Path
) -> None:
    gaps = run_ranks(_bf16_gap, 1, tmp_path, str(model_dir))[0]
    worst, mean = max(gaps), sum(gaps) / len(gaps)
    print(f"vLLM bf16 - compute_log_prob bf16: max {worst:.2e}, mean {mean:.2e} per token")
    assert worst < BF16_BOUND_MAX and mean < BF16_BOUND_MEAN
    assert worst > LOGPROB_BOUND_MAX  # bf16 really differs: the check above is not vacuous


# -- tp = 2 --------------------------------------------------------------------------------------


def _tp2(rank: int, world: int, path: str) -> dict[str, Any]:
    from roles.engines.generation.interface import SamplingConfig
    from roles.engines.generation.vllm import VLLMEngine

    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    vllm = VLLMEngine(path, tp=2, eos_token_id=tokenizer.eos_token_id, context=512)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    before = [s.tokens for s in vllm.generate(prompts, greedy)]
    vllm.load_weights(perturbed(model, seed=9))
    return {"before": before, "after": [s.tokens for s in vllm.generate(prompts, greedy)]}


@pytest.mark.timeout(300)
def test_tp2_inside_our_group_gives_the_tp1_tokens(
    one: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    ranks = run_ranks(_tp2, 2, tmp_path, str(model_dir))
    for found in ranks:
        assert found["before"] == one["greedy"]["native"]
        assert found["after"] == one["reloaded"]["native"]


# -- role groups ---------------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_new_tokens": 12}


def prompts() -> TensorBatch:
    return TensorBatch.from_dict(non_tensors={"prompt": TEXTS})


@pytest.mark.timeout(400)
def test_rollout_groups_synced_through_reshard_generate_what_the_actor_does(
    model_dir: Path,
) -> None:
    actor = {"model": str(model_dir), "micro_batch_size": 4, "optim": {"lr": 1e-2}}
    rollout = {"model": str(model_dir), "engine": "vllm", "kv_cache_mb": 64}
    placement = [
        group("a", 1, actor=("roles.actor:Actor", actor)),
        group("r1", 1, rollout=("roles.rollout:Rollout", rollout)),
        group("r2", 2, tp=2, rollout_tp=("roles.rollout:Rollout", rollout)),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, VLLM_TIMEOUTS) as c:
            actor = ActorClient(c, "actor")
            r1, r2 = RolloutClient(c, "rollout"), RolloutClient(c, "rollout_tp")
            out["before"] = [await x.generate(prompts(), GREEDY) for x in (actor, r1, r2)]
            batch = token_batch(6, seed=2)
            old = (await actor.compute_log_prob(batch))["log_probs"]
            await actor.update_policy(batch.union(TensorBatch.from_dict({"old_log_probs": old})))
            sync = WeightSync(actor, WeightSyncSettings(bucket_mb=0.25, stall_s=30))
            out["synced"] = [await sync.push(r, 1) for r in (r1, r2)]
            out["after"] = [await x.generate(prompts(), GREEDY) for x in (actor, r1, r2)]
            sampled = await r1.generate(prompts(), {"n": 2, "max_new_tokens": 8, "seed": 3})
            out["sampled"] = sampled
            out["scored"] = await actor.compute_log_prob(sampled)
        return out

    found = run(main)
    for name in ("before", "after"):
        actor_out, *rollouts = found[name]
        for got in rollouts:
            assert torch.equal(got["input_ids"], actor_out["input_ids"]), name
            assert torch.equal(got["response_mask"], actor_out["response_mask"]), name
    assert not torch.equal(found["after"][0]["input_ids"], found["before"][0]["input_ids"])
    assert [b.meta["weight_version"] for b in found["after"][1:]] == [1, 1]
    mask = found["sampled"]["response_mask"].bool()
    gaps = (found["sampled"]["log_probs"] - found["scored"]["log_probs"])[mask].abs()
    print(f"rollout vLLM - actor compute_log_prob: max {gaps.max():.2e}, mean {gaps.mean():.2e}")
    assert gaps.max() < LOGPROB_BOUND_MAX and gaps.mean() < LOGPROB_BOUND_MEAN


def test_a_judge_served_by_vllm_scores_as_the_native_one(model_dir: Path) -> None:
    """The same judge (the briefly SFT'd tiny model, which answers with runs of 1s) on two engines in two
    groups: greedy verdicts, so equal scores and equal malformed counts."""
    from controller.clients import RewardClient

    judge = {
        "model": str(model_dir),
        "template": "{prompt}",
        "verdict": {"kind": "number", "low": 0, "high": 100000},
        "max_new_tokens": 4,
    }
    placement = [
        group("n", 1, native=("roles.judge:JudgeReward", judge)),
        group("v", 1, served=("roles.judge:JudgeReward", {**judge, "engine": "vllm"})),
    ]
    rows = TensorBatch.from_dict(non_tensors={"prompt": TEXTS, "response": [""] * len(TEXTS)})

    async def main() -> list[TensorBatch]:
        async with local_session(placement, VLLM_TIMEOUTS) as c:
            return [
                await RewardClient(c, name).compute_reward(rows) for name in ("native", "served")
            ]

    native, served = run(main)
    assert torch.equal(native["scores"], served["scores"])
    assert torch.equal(native["reward/judge_malformed"], served["reward/judge_malformed"])
    print("judge verdicts:", native["scores"].tolist(), native["reward/judge_malformed"].tolist())
    assert native["reward/judge_malformed"].sum() < len(TEXTS)  # it answers with numbers


def test_the_engine_names_the_extra_when_vllm_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from roles.engines.generation.interface import GenerationError
    from roles.engines.generation.vllm import import_vllm

    real = builtins.__import__

    def no_vllm(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(GenerationError, match=r"pip install -e '\.\[vllm\]'"):
        import_vllm()


# -- whole runs ----------------------------------------------------------------------------------

ROLLOUT_GROUP = [
    "roles.rollout={model: base, engine: vllm, kv_cache_mb: 64}",
    "placement.gen={roles: [rollout], nproc: 1}",
    "placement.main.nproc=1",
    # truncated importance sampling with vLLM's log-probs as the behaviour policy
    "stages.1.algorithm.loss={dual_clip: null, agg: token-mean, tis_cap: 2.0}",
]
COLOCATED = ["roles.actor.generator=vllm"]
RUNS = {
    "rollout": ROLLOUT_GROUP,
    "actor": COLOCATED,
    # the actor trains at tp 2; vLLM generates at tp 2 on the same two ranks
    "actor-tp2": [*COLOCATED, "placement.main.tp=2"],
    # LoRA adapters: vLLM runs none here, it loads the merged weights before each generation;
    # the KL's reference is the actor's adapters as SFT left them
    "actor-lora": [
        *COLOCATED,
        "roles.actor.lora={rank: 8, alpha: 16}",
        "stages.1.algorithm.kl={coef: 0.01, mode: loss}",
    ],
}
# actor-lora covers the colocated path too; the multi-turn game's run covers a vLLM rollout
# group taking the actor's weights every step (staleness 0, the fp32 log-prob bound)
EXTENDED_RUNS = ("actor-tp2", "actor", "rollout")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "where",
    [pytest.param(w, marks=[pytest.mark.extended] if w in EXTENDED_RUNS else []) for w in RUNS],
)
def test_grpo_quick_run_generates_with_vllm(needs_vllm: None, where: str, tmp_path: Path) -> None:
    """The quickstart's quick run (SFT, then GRPO) with vLLM as a rollout group of its own, or
    colocated in the actor (at tp 1 and tp 2, and with LoRA adapters merged into the weights
    vLLM loads); in fp32 its log-probs are the trainer's within the bound, so it generated from
    the actor's current weights at every step."""
    from tests.deploy.test_run import job, quick_argv, records

    assert job(quick_argv("quickstart.yaml", tmp_path, RUNS[where])) == 0
    rl = [r for r in records(tmp_path) if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 6
    if where == "rollout":
        assert [r["train/staleness"] for r in rl] == [0] * 6
        assert [r["train/weight_version"] for r in rl] == [41, 42, 43, 44, 45, 46]  # after SFT
        # fp32: pi_old / pi_rollout is 1 up to the engines' rounding, never near the cap
        assert all(abs(r["train/actor/tis_weight"] - 1) < 1e-4 for r in rl)
        assert all(r["train/actor/tis_capped_frac"] == 0 for r in rl)
    if where == "actor-lora":  # the reference starts at the SFT model, not the base one
        assert rl[0]["train/kl"] == 0.0
    gaps = [r["train/rollout/logprob_gap_max"] for r in rl]
    print(f"GRPO with vLLM ({where}): per-step max |log-prob gap| {max(gaps):.2e}")
    assert max(gaps) < LOGPROB_BOUND_MAX
    assert all(r["train/rollout/logprob_gap_mean"] < LOGPROB_BOUND_MEAN for r in rl)


MULTI_TURN = [
    "trainer.val_data=null",  # what is under test is the RL stage's turns, not validation
    "roles.rollout={model: base, engine: vllm, kv_cache_mb: 64, kv_block_tokens: 32}",
    "placement.gen={roles: [rollout], nproc: 1}",
    "placement.main.nproc=1",
    "roles.rollout.dtype=fp32",
    "roles.actor.dtype=fp32",
    # iteration-level: each turn a request of vLLM's scheduler as soon as it is asked for
    # (continuous serving is the controller's, the same on every engine: tested on native)
    "trainer.agent.serving=iteration",
]


@pytest.mark.timeout(600)
def test_multi_turn_games_run_on_vllm_token_in_token_out_with_its_prefix_cache(
    needs_vllm: None, tmp_path: Path
) -> None:
    """The number-guessing game's quick run (SFT, then GRPO over multi-turn games: the env
    answers every guess) with a vLLM rollout group serving turns at iteration level (each joins
    vLLM's running batch): every turn goes in as the trajectory's token ids and
    comes out as ids, its later turns are served from vLLM's prefix cache (the step's
    ``agent/prefix_reuse``), and in fp32 the log-probs vLLM reports are the trainer's, so no
    token was re-tokenised and every turn was sampled from the actor's current weights."""
    from tests.deploy.test_run import job, quick_argv, records

    assert job(quick_argv("guess_number.yaml", tmp_path, MULTI_TURN)) == 0
    rl = [r for r in records(tmp_path) if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rl) == 2
    assert [r["train/staleness"] for r in rl] == [0] * 2
    assert all(r["agent/turns"] > 1 for r in rl)  # games of several moves
    reuse = [r["agent/prefix_reuse"] for r in rl]
    print(f"multi-turn on vLLM: prefix-cache share of the turns' prompt positions {reuse}")
    assert all(x > 0.2 for x in reuse)
    assert max(r["train/rollout/logprob_gap_max"] for r in rl) < LOGPROB_BOUND_MAX
    # the example's own story (tests/deploy/test_guess_number_example.py, on the native engine,
    # is in the extended tier): games end on the right guess or after 5, an environment is no
    # tool, and the trajectory viewer shows the game's observations after the guesses
    assert all(r["agent/turns"] <= 5 and r["agent/tool_calls"] == 0 for r in rl)
    from tests.deploy.test_guess_number_example import shows_the_games

    shows_the_games(tmp_path)


# extended: a composition of what the default tier checks apart (a resume is bitwise on the
# native engine, tests/deploy/test_run.py; vLLM's per-sample seeds reproduce whatever the batch,
# above); three runs with vLLM cost 40 s
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_resume_with_vllm_reproduces_the_straight_run(needs_vllm: None, tmp_path: Path) -> None:
    """Stopped after step 3 (mid-GRPO) and resumed, with vLLM colocated in the actor: the same
    metrics and bitwise the same exported weights as the straight run (per-sample seeds, and
    vLLM leaves the process's random streams alone)."""
    from safetensors.torch import load_file

    from tests.deploy.test_run import RESUME, job, quick_argv, records, without_timing

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert job(quick_argv("quickstart.yaml", straight, [*RESUME, *COLOCATED])) == 0
    stop = ("--stop-after", "3")
    assert job(quick_argv("quickstart.yaml", split, [*RESUME, *COLOCATED], *stop)) == 0
    assert job(["run", "--resume", "--run-dir", str(split)]) == 0
    a = load_file(straight / "export" / "actor" / "model.safetensors")
    b = load_file(split / "export" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert without_timing(records(straight)) == without_timing(records(split))
