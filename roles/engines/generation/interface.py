"""The generation-engine interface and its one output contract (the sampling settings it takes,
``SamplingConfig``, come from the controller with the call: ``transport/sampling.py``).

An engine turns prompts (token ids) into samples. Whatever the engine, a sample reports:

* the prompt and response token ids,
* the log-probability of each response token under the temperature-scaled, *unfiltered*
  distribution (``roles/modeling/logprob.py``'s definition — top-k/top-p change what is sampled, not what
  is reported; greedy decoding reports temperature-1 log-probs),
* why it ended: ``stop`` (a stop token, which is kept as the last response token) or ``length``.

A sample can also be *continued* (partial rollout, ``controller/streaming.py``): its prompt is the
original prompt plus the response so far, and a ``Resume`` says which of its request's samples it
is and how many response tokens it already has, so the engine draws the random numbers that sample
would have drawn next had it run in one call (the native engine; engines that cannot skip ahead in
a seeded stream use ``resumed_seed``: reproducible, not the one-call tokens).

``samples_to_batch`` lays samples out as the training engines read them: each row is prompt then
response, right-padded, with ``attention_mask``, ``response_mask`` and ``log_probs`` aligned with
``input_ids`` — so ``compute_log_prob`` on the same batch must give the same numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from transport.batch import TensorBatch
from transport.columns import (
    ATTENTION_MASK,
    FINISH,
    INPUT_IDS,
    LOG_PROBS,
    PAD_VALUES,
    REQUEST,
    RESPONSE_MASK,
)
from transport.sampling import SamplingConfig

__all__ = [  # SamplingConfig is the controller's too: it lives in transport/sampling.py
    "GenerationEngine",
    "GenerationError",
    "LogitsProcessor",
    "Resume",
    "Sample",
    "SamplingConfig",
    "ServingEngine",
    "check_prompts",
    "check_resume",
    "resumed_seed",
    "sample_seed",
    "samples_to_batch",
]

#: ``processor(samples, step, logits) -> logits``: ``samples`` are the sample indices of the rows
#: of ``logits`` ``[rows, V]``, ``step`` the index of the token being chosen. It shapes what is
#: sampled (e.g. forced lengths in benchmarks), never the reported log-probs.
LogitsProcessor = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass
class Sample:
    request: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str = ""


@dataclass(frozen=True)
class Resume:
    """A sample continued from an earlier call: its index among its request's samples and the
    number of response tokens it already has (the tail of its prompt)."""

    sample: int
    offset: int


class GenerationError(ValueError):
    """Prompts or settings an engine cannot serve, with what to change."""


class GenerationEngine(ABC):
    #: per sample of the last ``generate``: its prompt's positions the engine did not compute
    #: again (a kept session's, a prefix cache's); None: the engine keeps nothing between calls
    last_reused: list[int] | None = None

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
        request_seeds: Sequence[int] | None = None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Sample]:
        """``len(prompts) * sampling.n`` samples, request-major (prompt i's samples together).
        ``request_seeds`` (one per prompt) replace the prompt's index in the seed of its
        samples, so a request samples the same wherever it lands (which dp rank, which batch).
        ``resume`` (one per prompt, with ``n = 1``): each prompt continues a sample."""


class ServingEngine(GenerationEngine):
    """An engine that holds its own copy of the weights (vLLM, SGLang) rather than running a
    model module of ours: weights come in by name, and its memory can be let go between
    generation phases."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight in place: Hugging Face names, whole tensors."""

    @abstractmethod
    def release(self, weights: bool = False) -> int:
        """Free the KV cache (and the weights) until the next call; returns the bytes freed."""

    @abstractmethod
    def close(self) -> None:
        """Shut the engine down."""


def check_prompts(
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    context: int,
    resume: Sequence[Resume] | None = None,
) -> None:
    if not prompts:
        raise GenerationError("no prompts to generate from (an empty prompt list)")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) + sampling.max_new_tokens > context:
            raise GenerationError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} it exceeds the model's context of {context}; "
                "shorten the prompt or lower max_new_tokens"
            )
    if resume is not None:
        check_resume(prompts, sampling, resume)


def check_resume(
    prompts: Sequence[Sequence[int]], sampling: SamplingConfig, resume: Sequence[Resume]
) -> None:
    if len(resume) != len(prompts):
        raise GenerationError(f"{len(resume)} resume entries for {len(prompts)} prompts")
    if sampling.n != 1:
        raise GenerationError(f"a continued sample is one sample: use n=1 (got n={sampling.n})")
    for i, (prompt, where) in enumerate(zip(prompts, resume, strict=True)):
        if where.sample < 0 or not 0 <= where.offset < len(prompt):
            raise GenerationError(
                f"prompt {i}: resume at sample {where.sample}, offset {where.offset} does not fit "
                f"a prompt of {len(prompt)} tokens (0 <= offset < prompt length, sample >= 0)"
            )


def sample_seed(seed: int, request: int, index: int) -> int:
    """One generator seed per (request, sample): reproducible whatever the batch holds."""
    return (seed * 1_000_003 + request) * 1_009 + index


def resumed_seed(seed: int, request: int, index: int, resume: Resume | None = None) -> int:
    """The seed of a sample for engines that seed each sample once (vLLM, SGLang): a continued
    sample's is its own ``sample_seed`` moved by its offset (a fresh, reproducible stream)."""
    if resume is None:
        return sample_seed(seed, request, index)
    base = sample_seed(seed, request, resume.sample)
    return base if resume.offset == 0 else (base * 1_000_033 + resume.offset) % 2**63


def samples_to_batch(samples: Sequence[Sample], pad_id: int) -> TensorBatch:
    width = max(len(s.prompt) + len(s.tokens) for s in samples)
    rows = len(samples)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    response = torch.zeros((rows, width), dtype=torch.long)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt), len(s.tokens)
        ids[i, : p + r] = torch.tensor(s.prompt + s.tokens, dtype=torch.long)
        attention[i, : p + r] = 1
        response[i, p : p + r] = 1
        log_probs[i, p : p + r] = torch.tensor(s.log_probs, dtype=torch.float32)
    return TensorBatch.from_dict(
        {INPUT_IDS: ids, ATTENTION_MASK: attention, RESPONSE_MASK: response, LOG_PROBS: log_probs},
        {FINISH: [s.finish for s in samples], REQUEST: [s.request for s in samples]},
        {PAD_VALUES: {INPUT_IDS: pad_id}},
    )
