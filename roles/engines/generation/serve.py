"""What the rollout role and the actor share to serve ``generate``: prompts in, samples out.

A generation call carries a batch of prompts — text in a ``prompt`` column (tokenized here as
``<s>`` + text) or token ids in a ``prompt_ids`` column — plus any other per-row columns (answers,
data sources), and sampling settings. A ``seed`` column gives each request its own seed, so it
samples the same on whichever dp rank it lands. It returns one row per sample in the training layout
(``roles/engines/generation/interface.py``), the request's other columns repeated for each of its samples,
the decoded ``response`` text, and the weight version in ``meta``.
"""

from __future__ import annotations

from typing import Any, Literal

from roles.engines.generation.interface import GenerationEngine, SamplingConfig, samples_to_batch
from transport.batch import BatchError, TensorBatch

EngineName = Literal["native", "hf", "vllm", "sglang"]


def make_engine(name: EngineName, model: Any, tokenizer: Any) -> GenerationEngine:
    """An engine over ``model``'s own modules. ``vllm`` and ``sglang`` hold their own copy of the
    weights and are built by their owner (``vllm.py``, ``sglang.py`` beside this file)."""
    if name in ("vllm", "sglang"):
        raise ValueError(f"the {name} engine loads its own weights; build it from its module")
    if name == "hf":
        from roles.engines.generation.hf import HFEngine

        return HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    from roles.engines.generation.native import NativeEngine

    return NativeEngine(model, tokenizer.eos_token_id)


def prompt_ids(batch: TensorBatch, tokenizer: Any) -> list[list[int]]:
    if "prompt_ids" in batch.non_tensors:
        return [list(map(int, p)) for p in batch.non_tensor("prompt_ids")]
    if "prompt" not in batch.non_tensors:
        raise BatchError("a generation batch needs a 'prompt' (text) or 'prompt_ids' column")
    bos = tokenizer.bos_token_id
    return [
        [bos, *tokenizer.encode(p, add_special_tokens=False)] for p in batch.non_tensor("prompt")
    ]


def serve(
    engine: GenerationEngine,
    tokenizer: Any,
    batch: TensorBatch,
    sampling: dict[str, Any] | SamplingConfig,
    version: int,
) -> TensorBatch:
    settings = SamplingConfig.model_validate(sampling)
    seeds = batch.non_tensors.get("seed")
    samples = engine.generate(
        prompt_ids(batch, tokenizer),
        settings,
        request_seeds=[int(x) for x in seeds] if seeds else None,
    )
    out = samples_to_batch(samples, tokenizer.pad_token_id)
    requests = [s.request for s in samples]
    for name, column in batch.non_tensors.items():
        if name not in out.non_tensors:
            out.non_tensors[name] = [column[r] for r in requests]
    out.non_tensors["response"] = [
        tokenizer.decode(s.tokens, skip_special_tokens=True) for s in samples
    ]
    out.meta["weight_version"] = version
    return out
