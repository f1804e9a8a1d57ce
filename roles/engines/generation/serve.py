"""What the rollout role and the actor share to serve ``generate``: prompts in, samples out.

A generation call carries a batch of prompts — text in a ``prompt`` column (tokenized here as
``<s>`` + text) or token ids in a ``prompt_ids`` column — plus any other per-row columns (answers,
data sources), and sampling settings. A ``seed`` column gives each request its own seed, so it
samples the same on whichever dp rank it lands. It returns one row per sample in the training layout
(``roles/engines/generation/interface.py``), the request's other columns repeated for each of its samples,
the decoded ``response`` text, and the weight version in ``meta``.

A ``continuation`` column (``[sample, offset]`` per row, with ``prompt_ids`` and ``n = 1``) makes
each row continue a sample of an earlier call (partial rollout, ``controller/streaming.py``):
``prompt_ids`` is the original prompt plus the ``offset`` response tokens generated so far,
``sample`` the sample's index among its request's samples, ``seed`` its request's seed as before.
The reply's rows hold only the tokens this call generated (its ``response_mask``, ``log_probs``),
but ``response`` decodes the whole response so far; ``prompt_ids`` is not echoed back.
"""

from __future__ import annotations

from typing import Any, Literal

from roles.engines.generation.interface import (
    GenerationEngine,
    GenerationError,
    Resume,
    samples_to_batch,
)
from roles.engines.generation.native import NativeEngine
from roles.engines.generation.sessions import SessionCache, SessionRequest
from transport.batch import BatchError, TensorBatch
from transport.columns import (
    CONTINUATION,
    PREFIX_REUSED,
    PROMPT,
    PROMPT_IDS,
    REPLICA,
    RESPONSE,
    SEED,
    SESSION,
    WEIGHT_VERSION,
)
from transport.sampling import SamplingConfig

EngineName = Literal["native", "hf", "vllm", "sglang"]


def make_engine(name: EngineName, model: Any, tokenizer: Any) -> GenerationEngine:
    """An engine over ``model``'s own modules. ``vllm`` and ``sglang`` hold their own copy of the
    weights and are built by their owner (``vllm.py``, ``sglang.py`` beside this file)."""
    if name in ("vllm", "sglang"):
        raise ValueError(f"the {name} engine loads its own weights; build it from its module")
    if name == "hf":
        from roles.engines.generation.hf import HFEngine

        return HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    return NativeEngine(model, tokenizer.eos_token_id)


def prompt_ids(batch: TensorBatch, tokenizer: Any) -> list[list[int]]:
    if PROMPT_IDS in batch.non_tensors:
        return [list(map(int, p)) for p in batch.non_tensor(PROMPT_IDS)]
    if PROMPT not in batch.non_tensors:
        raise BatchError(f"a generation batch needs a {PROMPT!r} (text) or {PROMPT_IDS!r} column")
    bos = tokenizer.bos_token_id
    return [[bos, *tokenizer.encode(p, add_special_tokens=False)] for p in batch.non_tensor(PROMPT)]


def serve(
    engine: GenerationEngine,
    tokenizer: Any,
    batch: TensorBatch,
    sampling: SamplingConfig | dict[str, Any] | None,
    version: int,
    cache: SessionCache | None = None,
) -> TensorBatch:
    """``sampling`` as the controller sent it: the struct, or (from a controller that sends
    maps) its fields; None: the defaults. A ``session`` column names each row's trajectory: an
    engine that keeps sessions (native) reuses and keeps their KV in ``cache``. ``meta`` says
    how many prompt positions the call prefilled and how many it took from kept sessions."""
    settings = SamplingConfig.model_validate(sampling if sampling is not None else {})
    seeds = batch.non_tensors.get(SEED)
    resume = continuations(batch)
    prompts = prompt_ids(batch, tokenizer)
    keys = batch.non_tensors.get(SESSION)
    sessions = None
    if keys is not None and cache is not None and isinstance(engine, NativeEngine):
        sessions = SessionRequest(cache, [None if k is None else str(k) for k in keys], version)
    request_seeds = [int(x) for x in seeds] if seeds else None
    if sessions is not None and isinstance(engine, NativeEngine):
        samples = engine.generate(prompts, settings, None, request_seeds, resume, sessions)
    else:
        samples = engine.generate(prompts, settings, request_seeds=request_seeds, resume=resume)
    out = samples_to_batch(samples, tokenizer.pad_token_id)
    requests = [s.request for s in samples]
    echoed = [n for n in batch.non_tensors if n not in out.non_tensors and n != REPLICA]
    for name in echoed if resume is None else [n for n in echoed if n != PROMPT_IDS]:
        out.non_tensors[name] = [batch.non_tensors[name][r] for r in requests]
    out.non_tensors[RESPONSE] = [
        tokenizer.decode(_so_far(s.prompt, s.tokens, resume, s.request), skip_special_tokens=True)
        for s in samples
    ]
    out.meta[WEIGHT_VERSION] = version
    if sessions is not None and cache is not None:
        out.meta.update(cache.take_stats().as_meta())
    reused = engine.last_reused
    if reused is not None and len(reused) == len(samples):
        out.non_tensors[PREFIX_REUSED] = list(reused)
    return out


def continuations(batch: TensorBatch) -> list[Resume] | None:
    """The ``continuation`` column as ``Resume`` entries (None without one)."""
    if CONTINUATION not in batch.non_tensors:
        return None
    if PROMPT_IDS not in batch.non_tensors:
        raise BatchError(
            f"a {CONTINUATION!r} column continues the token ids of a {PROMPT_IDS!r} column"
        )
    found = []
    for i, entry in enumerate(batch.non_tensor(CONTINUATION)):
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise GenerationError(f"continuation row {i} is {entry!r}, not [sample, offset]")
        found.append(Resume(sample=int(entry[0]), offset=int(entry[1])))
    return found


def _so_far(
    prompt: list[int], tokens: list[int], resume: list[Resume] | None, row: int
) -> list[int]:
    """The response so far: a continued sample's earlier tokens (its prompt's tail), then these."""
    if resume is None or resume[row].offset == 0:
        return tokens
    return prompt[len(prompt) - resume[row].offset :] + tokens
