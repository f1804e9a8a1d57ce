"""The ``hf`` generation engine: transformers' ``generate``, the reference the native engine is
measured and checked against.

Prompts are left-padded into one batch; the log-probs come from the raw logits ``generate``
returns (``output_logits``), temperature-scaled — the same definition as everywhere else. One
seed per call: ``generate`` draws all rows from the global generator, so per-request seeds (which
the native engine honours) are not available here, and a continued sample (``Resume``) is just
its prompt continued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor as HFLogitsProcessor
from transformers import LogitsProcessorList

from roles.engines.generation.interface import (
    GenerationEngine,
    LogitsProcessor,
    Resume,
    Sample,
    SamplingConfig,
    check_prompts,
)
from transport.device import HOST


class _Adapter(HFLogitsProcessor):
    """Our ``processor(samples, step, logits)`` as a transformers logits processor."""

    def __init__(self, processor: LogitsProcessor, prompt_width: int) -> None:
        self.processor, self.prompt_width = processor, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
        step = input_ids.shape[1] - self.prompt_width
        return self.processor(torch.arange(len(scores), device=scores.device), step, scores)


class HFEngine(GenerationEngine):
    def __init__(self, model: Any, pad_token_id: int, eos_token_id: int) -> None:
        self.model, self.pad, self.eos = model, pad_token_id, eos_token_id
        self.context = int(model.config.max_position_embeddings)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
        request_seeds: Sequence[int] | None = None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Sample]:
        check_prompts(prompts, sampling, self.context, resume)
        del request_seeds  # generate draws every row from one global generator
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
        stops = sampling.stop_token_ids or [self.eos]
        torch.manual_seed(sampling.seed)
        kwargs: dict[str, Any] = {"do_sample": False}
        if not sampling.greedy:
            kwargs = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k or None,
                "top_p": sampling.top_p,
            }
        device = self.model.device  # where the weights are; the results come back to the host
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=sampling.n,
            eos_token_id=stops,
            pad_token_id=self.pad,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([_Adapter(processor, width)])
            if processor
            else None,
            **kwargs,
        )
        temperature = sampling.temperature or 1.0
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [rows, steps, V]
        generated = out.sequences[:, width:]
        log_probs = torch.log_softmax(logits, -1).gather(-1, generated[..., None]).squeeze(-1)
        generated, log_probs = generated.to(HOST), log_probs.to(HOST)
        return [
            self._sample(i // sampling.n, prompts[i // sampling.n], row, lp, stops)
            for i, (row, lp) in enumerate(zip(generated, log_probs, strict=True))
        ]

    @staticmethod
    def _sample(
        request: int, prompt: Sequence[int], row: torch.Tensor, lp: torch.Tensor, stops: list[int]
    ) -> Sample:
        tokens = row.tolist()
        for end, token in enumerate(tokens):
            if token in stops:
                return Sample(
                    request, list(prompt), tokens[: end + 1], lp[: end + 1].tolist(), "stop"
                )
        return Sample(request, list(prompt), tokens, lp.tolist(), "length")
