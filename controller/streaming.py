"""Partial rollout and streaming: a step's samples generated in pieces rather than in one call.

Two ways to cut the generation of a step's batch; each is optional and they combine:

* **partial rollout** (``generate_partial``, ``PartialRollout``): responses grow
  ``chunk_tokens`` new tokens per generation call. Between calls a newer weight version may reach
  the generator; the unfinished responses continue from their prefix (prompt + tokens so far,
  its KV recomputed by the engine's prefill) — on the newest weights (``on_update: switch``), or
  the batch keeps weight pushes waiting until it is done (``finish``).
* **streaming** (``stream``): the prompts are split into sub-batches (a prompt's n samples stay
  together) generated one call after another; each is scored by the reward role (and a cost
  role) as soon as it returns, while the next one generates. The batch is assembled in prompt
  order at the end.

Without a weight update both give the one-call batch: each sample draws from its own random
stream (request seed, sample index, position in the response, ``roles/engines/generation/``),
wherever and in whichever piece it runs. Batches without a ``seed`` column get one (each prompt's
index) for the call and lose it after, so that pieces agree.

What the assembled batch adds to the engines' layout (``roles/engines/generation/interface.py``):

* ``token_versions`` ``[B, T]`` long, aligned with ``input_ids`` like ``log_probs``: the weight
  version that sampled each response token, ``-1`` (``NO_VERSION``) on prompt and padding. Each
  response token's ``log_probs`` entry is its log-prob under those weights.
* ``<role>:scores`` (and ``<role>:reward/<key>``) from ``stream``: what the reward role
  ``<role>`` returned for each row as its sub-batch arrived (``controller/scoring.py``), so an
  algorithm's ``scores`` call need not ask the role again.
* ``meta``: ``weight_version`` (the oldest version any token of the batch was sampled with),
  ``last_weight_version`` (the newest), ``chunks`` (generation calls) and ``stream`` (the
  timeline: per sub-batch, seconds since the start at which generation and scoring began and
  ended). The staleness bound is checked on another number, the ``policy_version`` column the
  rollout pipeline stamps on each row: the version the generator held when the batch was
  launched (``controller/rollouts.py``).

Versions here are policy versions, the pipeline's one unit (``controller/rollouts.py``).

Weights and generation take turns through a ``WeightGate``: a push (``async with gate.push()``)
waits for the generation call in flight (``switch``) or for the whole sub-batch (``finish``),
FIFO, so a chunk never runs half on old weights and the versions in the batch are exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from controller import scoring
from controller.clients import ActorClient, RewardClient, RoleClient, RolloutClient
from transport.batch import TensorBatch
from transport.protocol import Layout
from transport.sampling import SamplingConfig

NO_VERSION = -1  # token_versions outside responses
Generator = ActorClient | RolloutClient
#: ``on_chunk(index, reply)``: awaited after generation call ``index`` returned, before the next.
#: Under ``on_update: finish`` it runs while the batch holds the gate: it may start a push as a
#: task (which then waits for the batch) but must not await one.
OnChunk = Callable[[int, TensorBatch], Awaitable[None]]


class Scored(Protocol):
    """What ``stream`` needs of ``algorithms.Roles``: who generates and who scores."""

    reward: RewardClient
    cost: RewardClient | None

    @property
    def generator(self) -> Generator: ...


class PartialRollout(BaseModel):
    """Generate responses ``chunk_tokens`` at a time, letting weight updates in between."""

    model_config = ConfigDict(extra="forbid")

    chunk_tokens: int = Field(ge=1, description="new tokens per response per generation call")
    on_update: Literal["finish", "switch"] = Field(
        "switch",
        description="a weight update during a batch: 'switch' continues the unfinished "
        "responses on the new weights at the next chunk; 'finish' holds the update until the "
        "batch (a streamed sub-batch) is done, so each response has one version",
    )


class WeightGate:
    """Weight pushes and generation on one generator take turns: a push waits until no
    generation holds the gate, and generation that asks while a push waits or runs waits for it
    (pushes first, then whoever came). Generation holders share the gate with each other: the
    batches of trajectories generated ahead of a step each hold it while their turns are out."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._generating = 0  # holders of generating()
        self._pushes = 0  # pushes waiting or running
        self._pushing = False
        self.push_wait_s = 0.0  # how long pushes waited for generation, in all

    @asynccontextmanager
    async def push(self) -> AsyncIterator[None]:
        """Around a weight push to the generator."""
        start = time.perf_counter()
        async with self._cond:
            self._pushes += 1
            try:
                await self._cond.wait_for(lambda: not self._generating and not self._pushing)
            except BaseException:
                self._pushes -= 1
                self._cond.notify_all()
                raise
            self._pushing = True
        self.push_wait_s += time.perf_counter() - start
        try:
            yield
        finally:
            async with self._cond:
                self._pushing = False
                self._pushes -= 1
                self._cond.notify_all()

    def generating(self) -> AbstractAsyncContextManager[None]:
        """Around generation that a push must not cut (one object may be entered again, after
        each exit: a batch's chunks each hold it)."""
        return _Generating(self)

    async def _enter_generating(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._pushes)
            self._generating += 1

    async def _exit_generating(self) -> None:
        async with self._cond:
            self._generating -= 1
            self._cond.notify_all()


class _Generating(AbstractAsyncContextManager[None]):
    def __init__(self, gate: WeightGate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        await self.gate._enter_generating()

    async def __aexit__(self, *exc: object) -> None:
        await self.gate._exit_generating()


class VersionError(RuntimeError):
    """The generator's weights changed where the settings forbid it (a push that bypassed the
    ``WeightGate`` under ``on_update: finish``)."""


# -- partial rollout ----------------------------------------------------------------------------


@dataclass
class _Response:
    """One sample as it grows, chunk by chunk."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    text: str = ""

    def grow(self, reply: TensorBatch, row: int, version: int) -> None:
        ids, mask = reply.tensors["input_ids"][row], reply.tensors["response_mask"][row]
        where = mask.nonzero().flatten()
        start, end = int(where[0]), int(where[-1]) + 1
        self.tokens += ids[start:end].tolist()
        self.log_probs += reply.tensors["log_probs"][row, start:end].tolist()
        self.versions += [version] * (end - start)
        self.finish = str(reply.non_tensors["finish"][row])
        self.text = str(reply.non_tensors["response"][row])

    def done(self, limit: int) -> bool:
        return self.finish == "stop" or len(self.tokens) >= limit


async def generate_partial(
    generator: Generator,
    prompts: TensorBatch,
    sampling: SamplingConfig,
    partial: PartialRollout,
    *,
    min_version: int = 0,
    gate: WeightGate | None = None,
    on_chunk: OnChunk | None = None,
) -> TensorBatch:
    """``sampling.n`` samples per prompt, ``partial.chunk_tokens`` new tokens per call, laid
    out as one call lays them out, plus ``token_versions``. A rollout group refuses to generate
    on weights older than ``min_version`` (later chunks: than the last chunk's)."""
    limit, n = sampling.max_new_tokens, sampling.n
    prompts, added_seed = with_seeds(prompts)
    seeds = [int(s) for s in prompts.non_tensors["seed"]]
    gate = gate or WeightGate()
    finish = partial.on_update == "finish"
    # finish: the gate is held for the whole batch; switch: for each call, so a push gets in
    # between chunks
    whole, each = (
        (gate.generating(), nullcontext()) if finish else (nullcontext(), gate.generating())
    )
    async with whole:
        padded = fill_replicas(prompts, replicas(generator))
        async with each:
            reply = await generator.generate(padded, _budget(sampling, partial, 0), min_version)
        first = reply[: len(prompts) * n]
        version = int(first.meta["weight_version"])
        responses = [_Response(_prompt_of(first, r)) for r in range(len(first))]
        for r, response in enumerate(responses):
            response.grow(first, r, version)
        chunks = 1
        while pending := [r for r, x in enumerate(responses) if not x.done(limit)]:
            if on_chunk is not None:
                await on_chunk(chunks - 1, reply)
            offset = len(responses[pending[0]].tokens)  # alike: each ran every chunk in full
            batch = TensorBatch.from_dict(
                non_tensors={
                    "prompt_ids": [responses[r].prompt + responses[r].tokens for r in pending],
                    "seed": [seeds[r // n] for r in pending],
                    "continuation": [[r % n, offset] for r in pending],
                }
            )
            padded = fill_replicas(batch, replicas(generator))
            budget = _budget(sampling, partial, offset).model_copy(update={"n": 1})
            async with each:
                reply = await generator.generate(padded, budget, max(min_version, version))
            now = int(reply.meta["weight_version"])
            if finish and now != version:
                raise VersionError(
                    f"{generator.role}'s weights moved from version {version} to {now} inside a "
                    "batch under partial_rollout.on_update: finish; push weights through the "
                    "WeightGate (controller/streaming.py)"
                )
            version, chunks = now, chunks + 1
            for i, r in enumerate(pending):
                responses[r].grow(reply, i, version)
    out = assemble(first, responses)
    out.meta["chunks"] = chunks
    return without(out, "seed") if added_seed else out


def _budget(sampling: SamplingConfig, partial: PartialRollout, offset: int) -> SamplingConfig:
    remaining = sampling.max_new_tokens - offset
    return sampling.model_copy(update={"max_new_tokens": min(partial.chunk_tokens, remaining)})


def _prompt_of(reply: TensorBatch, row: int) -> list[int]:
    start = int(reply.tensors["response_mask"][row].nonzero()[0])
    prompt: list[int] = reply.tensors["input_ids"][row, :start].tolist()
    return prompt


@dataclass(frozen=True)
class TokenRow:
    """One generated row before padding: ``prefix`` (the prompt: never trained on), then ``ids``
    with, per id, whether the model sampled it (``mask``), its log-prob and the policy version
    that sampled it (``NO_VERSION`` where it did not)."""

    prefix: list[int]
    ids: list[int]
    mask: list[int]
    log_probs: list[float]
    versions: list[int]


def token_rows(rows: Sequence[TokenRow], pad: int) -> dict[str, torch.Tensor]:
    """The engines' training layout (``samples_to_batch``'s), right-padded, plus
    ``token_versions``: ``input_ids``, ``attention_mask``, ``response_mask``, ``log_probs``."""
    width = max(len(r.prefix) + len(r.ids) for r in rows)
    count = len(rows)
    ids = torch.full((count, width), pad, dtype=torch.long)
    attention = torch.zeros((count, width), dtype=torch.long)
    response = torch.zeros((count, width), dtype=torch.long)
    log_probs = torch.zeros((count, width), dtype=torch.float32)
    versions = torch.full((count, width), NO_VERSION, dtype=torch.long)
    for i, r in enumerate(rows):
        s, e = len(r.prefix), len(r.prefix) + len(r.ids)
        ids[i, :e] = torch.tensor(r.prefix + r.ids, dtype=torch.long)
        attention[i, :e] = 1
        response[i, s:e] = torch.tensor(r.mask, dtype=torch.long)
        log_probs[i, s:e] = torch.tensor(r.log_probs, dtype=torch.float32)
        versions[i, s:e] = torch.tensor(r.versions, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": response,
        "log_probs": log_probs,
        "token_versions": versions,
    }


def assemble(first: TensorBatch, responses: Sequence[_Response]) -> TensorBatch:
    """The grown samples in the engines' layout (``samples_to_batch``'s), with ``first``'s
    per-row columns (the request's, echoed) and the final ``finish`` and ``response``."""
    pad = int(first.meta.get("pad_values", {}).get("input_ids", 0))
    rows = [
        TokenRow(x.prompt, x.tokens, [1] * len(x.tokens), x.log_probs, x.versions)
        for x in responses
    ]
    non_tensors = dict(first.non_tensors)
    non_tensors["finish"] = [x.finish for x in responses]
    non_tensors["response"] = [x.text for x in responses]
    used = [v for x in responses for v in x.versions]
    meta = {**first.meta, "weight_version": min(used), "last_weight_version": max(used)}
    tensors = token_rows(rows, pad)
    return TensorBatch(tensors, {k: list(v) for k, v in non_tensors.items()}, meta)


# -- streaming ----------------------------------------------------------------------------------


async def stream(
    roles: Scored,
    prompts: TensorBatch,
    sampling: SamplingConfig,
    *,
    sub_batches: int = 1,
    partial: PartialRollout | None = None,
    min_version: int = 0,
    gate: WeightGate | None = None,
) -> TensorBatch:
    """A step's samples from ``roles.generator`` in ``sub_batches`` calls (each in chunks with
    ``partial``), each scored by ``roles.reward`` (and ``roles.cost``) while the next generates;
    ``<role>:scores`` columns hold the scores. With one sub-batch and no partial rollout this is
    one generation call, and nothing is scored."""
    generator = roles.generator
    if sub_batches <= 1 and partial is None:
        async with gate.generating() if gate else nullcontext():
            return await generator.generate(prompts, sampling, min_version)
    prompts, added_seed = with_seeds(prompts)
    n = sampling.n
    scorers = [role for role in (roles.reward, roles.cost) if role is not None]
    start = time.perf_counter()
    parts = prompts.chunk(min(sub_batches, len(prompts)))
    timeline: list[dict[str, list[float]]] = []
    results: list[TensorBatch] = []
    pending: list[asyncio.Task[list[TensorBatch]]] = []
    try:
        done = 0  # prompts generated so far
        for part in parts:
            began = time.perf_counter() - start
            got = await _piece(generator, part, sampling, partial, min_version, gate)
            got.non_tensors["request"] = [done + r // n for r in range(len(got))]
            done += len(part)
            results.append(without(got, "seed") if added_seed else got)
            timeline.append({"generate": [began, time.perf_counter() - start]})
            pending.append(asyncio.create_task(_score(scorers, results[-1], timeline[-1], start)))
        scored = await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
    batch = concat_padded(results)
    for role, columns in zip(scorers, zip(*scored, strict=True), strict=True):
        scoring.stash(batch, role.role, concat_columns(list(columns)))
        names = {k for part in columns for k in part.non_tensors}
        notes = {
            k: [x for p in columns for x in p.non_tensors.get(k, [None] * len(p))] for k in names
        }
        scoring.keep_notes(batch, role.role, TensorBatch.from_dict(non_tensors=notes))
    batch.meta["stream"] = timeline
    return batch


async def _piece(
    generator: Generator,
    prompts: TensorBatch,
    sampling: SamplingConfig,
    partial: PartialRollout | None,
    min_version: int,
    gate: WeightGate | None,
) -> TensorBatch:
    """One sub-batch, in chunks (``partial``) or in one call, with ``token_versions``."""
    if partial is not None:
        return await generate_partial(
            generator, prompts, sampling, partial, min_version=min_version, gate=gate
        )
    padded = fill_replicas(prompts, replicas(generator))
    async with gate.generating() if gate else nullcontext():
        reply = await generator.generate(padded, sampling, min_version)
    reply = reply[: len(prompts) * sampling.n]
    version = int(reply.meta["weight_version"])
    mask = reply.tensors["response_mask"].bool()
    versions = torch.full(mask.shape, NO_VERSION, dtype=torch.long).masked_fill(mask, version)
    reply.tensors["token_versions"] = versions
    reply.meta.update(last_weight_version=version, chunks=1)
    return reply


async def _score(
    scorers: list[RewardClient], batch: TensorBatch, into: dict[str, list[float]], start: float
) -> list[TensorBatch]:
    began = time.perf_counter() - start
    found = list(await asyncio.gather(*(scoring.ask(role, batch) for role in scorers)))
    into["score"] = [began, time.perf_counter() - start]
    return found


# -- batch plumbing -----------------------------------------------------------------------------


def replicas(client: RoleClient) -> int:
    """How many shards a generation call to ``client``'s group is split into: its dp size, or
    its generation replicas when it generates at another layout (placement ``gen_tp``)."""
    spec = client.controller.group_of(client.role).spec
    layout = Layout.for_world(spec.nproc, spec.tp, spec.pp, spec.gen_tp, spec.gen_pp)
    return layout.world_size // (layout.generation_tp * layout.generation_pp)


def fill_replicas(batch: TensorBatch, count: int) -> TensorBatch:
    """``batch`` with rows repeated (cycling from the start) up to ``count`` rows, so that every
    shard of a call over ``count`` replicas gets one; callers drop the extra rows' samples."""
    if len(batch) >= count:
        return batch
    return batch.index(torch.arange(count) % len(batch))


def with_seeds(prompts: TensorBatch) -> tuple[TensorBatch, bool]:
    """``prompts`` with a ``seed`` column (each prompt's index, when it has none): the seed its
    samples are drawn with in every piece. Also says whether the column was added."""
    if "seed" in prompts.non_tensors:
        return prompts, False
    seeded = TensorBatch(dict(prompts.tensors), dict(prompts.non_tensors), dict(prompts.meta))
    seeded.non_tensors["seed"] = list(range(len(prompts)))
    return seeded, True


def without(batch: TensorBatch, column: str) -> TensorBatch:
    kept = {k: v for k, v in batch.non_tensors.items() if k != column}
    return TensorBatch(dict(batch.tensors), kept, dict(batch.meta))


def concat_padded(batches: Sequence[TensorBatch]) -> TensorBatch:
    """Row-wise concat of generated batches of different widths: ``[B, T]`` columns right-padded
    to the widest (``input_ids`` with ``meta["pad_values"]``, ``token_versions`` with -1, the
    rest with 0); ``meta`` from the first, versions spanning all."""
    pads = {"token_versions": NO_VERSION, **batches[0].meta.get("pad_values", {})}
    width = max(b.tensors["input_ids"].shape[1] for b in batches)
    padded = []
    for b in batches:
        tensors = {}
        for name, t in b.tensors.items():
            extra = width - t.shape[1] if t.dim() >= 2 else 0
            fill = t.new_full((t.shape[0], extra, *t.shape[2:]), pads.get(name, 0))
            tensors[name] = torch.cat([t, fill], dim=1) if extra else t
        padded.append(TensorBatch(tensors, b.non_tensors, b.meta))
    out = TensorBatch.concat(padded)
    out.meta["weight_version"] = min(int(b.meta["weight_version"]) for b in batches)
    out.meta["last_weight_version"] = max(int(b.meta["last_weight_version"]) for b in batches)
    out.meta["chunks"] = sum(int(b.meta.get("chunks", 1)) for b in batches)
    return out


def concat_columns(parts: list[TensorBatch]) -> dict[str, torch.Tensor]:
    """Scores of the sub-batches as one column each; a ``reward/<key>`` a piece lacks is NaN
    there (as the reward role fills a key a row lacks)."""
    keys = sorted({k for p in parts for k in p.tensors})
    return {
        k: torch.cat([p.tensors.get(k, torch.full((len(p),), float("nan"))) for p in parts])
        for k in keys
    }
