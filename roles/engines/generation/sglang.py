"""The ``sglang`` generation engine: SGLang's offline ``Engine`` for a rollout rank.

**Never run.** Written against SGLang 0.5.23's offline-engine API (``sglang.Engine``:
``generate(input_ids=..., sampling_params=[...], return_logprob=True)``,
``update_weights_from_tensor(named_tensors, flush_cache=True)``,
``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``, ``shutdown()``; the
sampler code of that release was read for what it reports). No CPU build of SGLang installs on
this project's machines: the 0.5.23 wheel on the package index requires CUDA 13 packages
(flashinfer, cuda-python, nvidia-cutlass-dsl, ...) and torch 2.14.1, and the lent GPU machine
reaches no package index. Nothing in the test suite runs it; treat it as a starting point that
follows the same contract as ``vllm.py``.

How it maps onto hybridflow, and how that differs from the vLLM engine:

* **one engine per rank, tp = 1** — SGLang's ``Engine`` starts its own scheduler process(es) and
  process group on the GPUs from ``base_gpu_id``; it does not join our group as vLLM's external
  launcher does. Each rank of a rollout group is one replica on its own GPU; a group at tp > 1 is
  refused.
* **the output contract** — each sample is its own request with ``n = 1`` and the seed
  ``sample_seed(seed, request, j)`` (``sampling_seed``, honoured under
  ``enable_deterministic_inference``); our stop tokens exactly (``ignore_eos`` plus
  ``stop_token_ids``) and kept (``no_stop_trim``). SGLang 0.5.23 reports ``log(softmax(logits /
  T))`` before top-k/top-p filtering, and ``log_softmax(logits)`` when greedy: the contract's
  definition (unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which reports temperature 1).
  hybridflow's ``LogitsProcessor`` is not supported (SGLang takes serialized processor classes).
* **weights and memory** — ``update_weights_from_tensor`` with Hugging Face names and whole
  tensors; ``release_memory_occupation`` frees the KV cache (and weights) between phases when the
  engine was started with ``enable_memory_saver`` (it is).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from roles.engines.generation.interface import (
    GenerationError,
    LogitsProcessor,
    Resume,
    Sample,
    SamplingConfig,
    ServingEngine,
    check_prompts,
    resumed_seed,
)

EXTRA = "pip install 'sglang==0.5.23' (a CUDA machine)"
API_VERSION = "0.5.23"


def import_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise GenerationError(
            f"engine 'sglang' needs SGLang, which is not installed here ({exc}); {EXTRA}. This "
            f"adapter was written against SGLang {API_VERSION} and has never run"
        ) from exc
    return sglang


class SGLangEngine(ServingEngine):
    """One SGLang engine (tp 1) on the GPU ``gpu``."""

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        eos_token_id: int,
        context: int,
        gpu: int = 0,
        seed: int = 0,
        memory_fraction: float = 0.5,
    ) -> None:
        sglang = import_sglang()
        self.eos, self.context = eos_token_id, context
        self.engine = sglang.Engine(
            model_path=str(model_dir),
            tp_size=1,
            base_gpu_id=gpu,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
            context_length=context,
            mem_fraction_static=memory_fraction,
            skip_tokenizer_init=True,
            enable_memory_saver=True,
            enable_deterministic_inference=True,
            random_seed=seed,
            log_level="error",
        )
        self._released: list[str] = []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
        request_seeds: Sequence[int] | None = None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Sample]:
        check_prompts(prompts, sampling, self.context, resume)
        if processor is not None:
            raise GenerationError("engine 'sglang' takes no hybridflow logits processor")
        self._resume()
        stops = list(sampling.stop_token_ids or [self.eos])
        samples, ids, params = [], [], []
        for i, prompt in enumerate(prompts):
            seed_of = request_seeds[i] if request_seeds else i
            for j in range(sampling.n):
                samples.append(Sample(request=i, prompt=list(prompt)))
                ids.append(list(prompt))
                seed = resumed_seed(sampling.seed, seed_of, j, resume[i] if resume else None)
                params.append(self._params(sampling, stops, seed))
        outputs = self.engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        for sample, out in zip(samples, outputs, strict=True):
            _fill(sample, out)
        return samples

    @staticmethod
    def _params(sampling: SamplingConfig, stops: list[int], seed: int) -> dict[str, Any]:
        return {
            "n": 1,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "max_new_tokens": sampling.max_new_tokens,
            "stop_token_ids": stops,
            "ignore_eos": True,  # ours are the only stop tokens
            "no_stop_trim": True,  # the stop token stays the last response token
            "skip_special_tokens": False,
            "sampling_seed": seed % 2**63,
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._resume()
        self.engine.update_weights_from_tensor(named_tensors=list(weights), flush_cache=True)

    def release(self, weights: bool = False) -> int:
        if self._released:
            return 0
        tags = ["kv_cache", *(["weights"] if weights else [])]
        self.engine.release_memory_occupation(tags=tags)
        self._released = tags
        return 0  # SGLang does not say how much it freed

    def _resume(self) -> None:
        if self._released:
            self.engine.resume_memory_occupation(tags=self._released)
            self._released = []

    def close(self) -> None:
        self.engine.shutdown()


def _fill(sample: Sample, out: dict[str, Any]) -> None:
    meta = out["meta_info"]
    finish = meta["finish_reason"]["type"]
    if finish not in ("stop", "length"):
        raise GenerationError(f"SGLang ended a sample with {meta['finish_reason']!r}")
    sample.tokens = [int(t) for t in out["output_ids"]]
    sample.log_probs = [float(lp) for lp, _token, _text in meta["output_token_logprobs"]]
    sample.finish = finish
    if len(sample.log_probs) != len(sample.tokens):
        raise GenerationError(
            f"SGLang returned {len(sample.tokens)} tokens but {len(sample.log_probs)} log-probs"
        )
