"""Iteration-level batching: requests join and leave the native engine's running decode batch at
every decode step, and each returns as soon as it finishes.

A call-level engine (``NativeEngine.generate``) serves a batch of prompts from prefill to its
slowest row; a request that arrives meanwhile waits for the whole call. ``DecodeLoop`` instead
runs one decode batch for as long as there is work, in a thread beside the role's call handling:

* between two decode steps it **admits** every waiting request: their prompts are prefilled in
  one packed pass (after a kept session's prefix, ``sessions.py``) and their keys and values
  written into free **slots** of the loop's caches; the rows already decoding are not touched;
* each step samples one token for every live row and **retires** the rows that finished (a stop
  token or their own ``max_new``): the result is published at once, the session kept, the slot
  freed for the next admission;
* the caches are one tensor per layer, ``[slots, kv heads, width, head dim]``; slots and width
  grow by doubling when a request needs more (a copy, rare), and when a quarter of the slots
  below the highest live one are free, the highest live rows move down into the holes (only the
  moved rows are copied), so a step computes at most a third more rows than are live.

Samples are those of ``NativeEngine.generate`` for the same request: each row draws its uniforms
from the stream ``generate`` would give it (``sample_seed(seed, request seed, 0)``), so its tokens
do not depend on which rows shared its steps (their log-probs do, to float rounding). Rows only
share a step when they sample alike (temperature, top-k, top-p, greedy) and with the same weight
version; a request that differs waits until the running rows have finished.

Threads: the role's main thread calls ``submit`` / ``take``; the loop thread runs the model. The
engine is shared with the role's other calls (``generate``, a weight load), which hold ``lock``
while they use it: the loop takes it for each step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from roles.engines.generation.interface import GenerationError, SamplingConfig, sample_seed
from roles.engines.generation.native import NativeEngine, decode_attention
from roles.engines.generation.sessions import Session, SessionCache, SessionRequest

#: compact the slots once this share of those below the highest live row is free
HOLE_FRACTION = 0.25


@dataclass
class Job:
    """One request in the loop: ``prompt`` then up to ``max_new`` sampled tokens."""

    id: int
    channel: Hashable  # whose ``take`` returns it
    prompt: list[int]
    max_new: int
    seed: int  # the request's seed: its uniforms are generate's for that request
    sampling: SamplingConfig
    version: int
    session: Hashable | None = None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str = ""
    reused: int = 0  # prompt positions taken from its kept session

    @property
    def kind(self) -> tuple[object, ...]:
        """What rows sharing a step must agree on."""
        s = self.sampling
        return (s.temperature, s.top_k, s.top_p, s.greedy, self.version)


class TurnLoop:
    """The role's side of a loop that serves turns as they come, whatever the engine: requests
    are ``submit``-ted, run in a thread of the loop's own, and ``take``-n per channel once done.
    A subclass says what runs (``_live``, ``_running``, ``_admissible``, ``_iterate``, ``_empty``)
    and what fits (``_context``). ``THREADED``: the steps run in a thread of the loop's own; else
    in the caller's, inside ``take``."""

    THREADED = True

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the engine: the loop's steps vs. the role's other calls
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._done: dict[Hashable, list[Job]] = {}
        self._failed: dict[Hashable, BaseException] = {}
        self._out: dict[Hashable, int] = {}  # per channel: jobs submitted, not yet taken
        self._thread: threading.Thread | None = None
        self._closing = False
        self._empty()
        self.steps = 0  # decode steps run (for tests and metrics)
        self.admissions = 0  # prefills that joined a running batch
        # intra-op threads are per thread: the loop's own would start at OpenMP's default (every
        # core), not the rank's setting (placement threads), and crowd the other ranks
        self._threads = torch.get_num_threads()

    # -- the role's side ---------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Requests submitted and not yet finished (running or waiting)."""
        with self._cond:
            return len(self._pending) + self._running()

    def submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.max_new < 1:
                raise GenerationError(f"request {job.id}: max_new must be >= 1, got {job.max_new}")
            if job.sampling.n != 1:
                raise GenerationError(f"request {job.id}: one sample per request (n = 1)")
            if len(job.prompt) + job.max_new > self._context() or not job.prompt:
                raise GenerationError(
                    f"request {job.id}: a prompt of {len(job.prompt)} tokens with max_new "
                    f"{job.max_new} does not fit the model's context of {self._context()}"
                )
        with self._cond:
            for job in jobs:
                self._out[job.channel] = self._out.get(job.channel, 0) + 1
            self._pending.extend(jobs)
            if self._thread is None and self.THREADED:
                self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def take(self, channel: Hashable, wait_s: float) -> list[Job]:
        """``channel``'s finished requests, waiting up to ``wait_s`` for the first while any of
        its requests are out; raises what made the loop fail them."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (
                not self._done.get(channel)
                and channel not in self._failed
                and self._out.get(channel, 0) > 0
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            failed = self._failed.pop(channel, None)
            if failed is not None:
                self._out.pop(channel, None)
                self._done.pop(channel, None)
                raise GenerationError(f"the decode loop failed: {failed}") from failed
            found = self._done.pop(channel, [])
            left_out = self._out.get(channel, 0) - len(found)
            if left_out > 0:
                self._out[channel] = left_out
            else:
                self._out.pop(channel, None)
            return found

    def release(self) -> None:
        """Let the loop's state go (the next request builds it again); only when nothing runs
        (a weight change: a caller holding ``lock`` and finding ``busy`` 0)."""
        self._empty()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            with self._cond:
                while not self._closing and not self._pending and not self._live():
                    self._cond.wait()
                if self._closing:
                    return
            self._step()

    def _step(self) -> None:
        """Admit what may join, run one step, publish the requests that finished."""
        with self._cond:
            admitted = self._admissible()
        try:
            # grad mode is per thread, and on in a new one: without this every step would
            # record an autograd graph that the caches' in-place writes chain together
            with self.lock, torch.no_grad():
                finished = self._iterate(admitted)
        except BaseException as exc:  # every request in the batch fails with the loop
            self._fail([*admitted, *self._running_jobs()], exc)
            return
        if finished:
            with self._cond:
                for job in finished:
                    self._done.setdefault(job.channel, []).append(job)
                self._cond.notify_all()

    def _fail(self, jobs: list[Job], exc: BaseException) -> None:
        self._empty()
        with self._cond:
            for job in jobs:
                self._failed[job.channel] = exc
            self._cond.notify_all()

    # -- what a subclass says ------------------------------------------------------------------

    def _context(self) -> int:
        raise NotImplementedError

    def _empty(self) -> None:
        """No running batch (the loop thread's state, or the lock holder's while it runs none)."""
        raise NotImplementedError

    def _running_jobs(self) -> list[Job]:
        raise NotImplementedError

    def _running(self) -> int:
        return len(self._running_jobs())

    def _live(self) -> bool:
        return self._running() > 0

    def _admissible(self) -> list[Job]:
        """The waiting requests that may join now (called holding ``_cond``): all of them."""
        taken = list(self._pending)
        self._pending.clear()
        return taken

    def _iterate(self, admitted: list[Job]) -> list[Job]:
        """Admit ``admitted``, run one step; the requests that finished."""
        raise NotImplementedError


class DecodeLoop(TurnLoop):
    """The running decode batch of one ``NativeEngine`` (see the module's docstring)."""

    def __init__(self, engine: NativeEngine, cache: SessionCache | None = None) -> None:
        self.engine = engine
        self.cache = cache
        super().__init__()
        self.compactions = 0

    def _context(self) -> int:
        return self.engine.context

    def _empty(self) -> None:
        self._jobs: list[Job | None] = []  # per slot
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._steps = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)  # each slot's last sampled token
        self._uniforms = torch.zeros((0, 0))
        self._logits: torch.Tensor | None = None
        self._fused_version: int | None = None

    def _running_jobs(self) -> list[Job]:
        return [j for j in self._jobs if j is not None]

    def _live(self) -> bool:
        return any(j is not None for j in self._jobs)

    def _admissible(self) -> list[Job]:
        """The waiting requests that may join now: those sampling like the running rows (all
        alike, as the first waiting one, when none runs)."""
        running = next((j.kind for j in self._jobs if j is not None), None)
        kind = (
            running if running is not None else (self._pending[0].kind if self._pending else None)
        )
        taken = [j for j in self._pending if j.kind == kind]
        if taken:
            self._pending = deque(j for j in self._pending if j.kind != kind)
        return taken

    def _iterate(self, admitted: list[Job]) -> list[Job]:
        """One iteration: a token for every live row (the rows that finish leave), then one
        forward pass over the others' last tokens and the admitted requests' prompts (what
        their kept sessions do not hold), packed together. Returns the rows that finished."""
        finished = self._choose()
        continuing = [s for s, j in enumerate(self._jobs) if j is not None]
        if continuing:
            self._compact()
            continuing = [s for s, j in enumerate(self._jobs) if j is not None]
        top = continuing[-1] + 1 if continuing else 0  # the decode part: slots [0, top)
        new = self._place(admitted) if admitted else []
        if continuing or new:
            self._forward(top, continuing, new)
            if continuing:
                moved = torch.tensor(continuing, device=self.engine.device)
                self._lengths[moved] += 1
                self._steps[moved] += 1
            for slot, job, _ in new:
                self._lengths[slot] = len(job.prompt)
        return finished

    def _choose(self) -> list[Job]:
        """Sample every live row's next token; free the slots of the rows that finished."""
        live = [s for s, j in enumerate(self._jobs) if j is not None]
        if not live:
            return []
        engine = self.engine
        assert self._logits is not None
        rows = torch.tensor(live, device=engine.device)
        sampling = self._jobs[live[0]].sampling  # type: ignore[union-attr]
        tokens, log_probs = engine._choose(
            self._logits[rows], rows, self._steps[rows], self._uniforms, sampling, None
        )
        finished = []
        for slot, token, log_prob in zip(live, tokens.tolist(), log_probs.tolist(), strict=True):
            job = self._jobs[slot]
            assert job is not None
            job.tokens.append(token)
            job.log_probs.append(log_prob)
            if token in (job.sampling.stop_token_ids or [engine.eos]):
                job.finish = "stop"
            elif len(job.tokens) >= job.max_new:
                job.finish = "length"
            else:
                continue
            finished.append(job)
            self._keep(slot, job)
            self._jobs[slot] = None
        self._last[rows] = tokens
        self.steps += 1
        return finished

    def _place(self, jobs: list[Job]) -> list[tuple[int, Job, int]]:
        """Slots for the admitted requests, their kept sessions' keys and values copied in;
        per request: (slot, job, prompt positions its session holds)."""
        engine = self.engine
        version = jobs[0].version
        if self._fused_version != version:  # no row runs: rows sharing a step share a version
            engine._fuse()
            self._fused_version = version
        past: list[tuple[Session, int] | None] = [None] * len(jobs)
        keys = [j.session for j in jobs]
        if self.cache is not None and any(k is not None for k in keys):
            prompts = [j.prompt for j in jobs]
            found = engine._take_sessions(prompts, SessionRequest(self.cache, keys, version))
            past = list(found) if found is not None else past
        widest = max(len(j.prompt) + j.max_new for j in jobs)
        slots = self._slots(len(jobs), widest, max(j.max_new for j in jobs))
        placed = []
        for slot, job, kept in zip(slots, jobs, past, strict=True):
            reused = 0
            if kept is not None:
                session, reused = kept
                for layer, (k, v) in enumerate(self._caches):
                    k[slot, :, :reused] = session.keys[layer][:, :reused]
                    v[slot, :, :reused] = session.values[layer][:, :reused]
            job.reused = reused
            self._jobs[slot] = job
            self._steps[slot] = 0
            self._uniforms[slot] = 0.0
            self._uniforms[slot, : job.max_new] = self._stream(job)
            placed.append((slot, job, reused))
        self.admissions += 1
        return placed

    def _stream(self, job: Job) -> torch.Tensor:
        """The uniforms ``NativeEngine.generate`` draws for this request's one sample."""
        seed = sample_seed(job.sampling.seed, job.seed, 0)
        return torch.rand(job.max_new, generator=torch.Generator().manual_seed(seed))

    def _slots(self, count: int, width: int, draws: int) -> list[int]:
        """``count`` free slots (the lowest), the caches grown to hold them and ``width``
        positions, the uniforms to ``draws`` per row."""
        free = [s for s, j in enumerate(self._jobs) if j is None][:count]
        need = len(self._jobs) + count - len(free)
        rows = len(self._jobs)
        held = self._caches[0][0].shape[2] if self._caches else 0
        if need > rows or width > held or not self._caches:
            rows = max(need, 2 * rows) if need > rows else rows
            wide = min(self.engine.context, max(width, 2 * held)) if width > held else held
            self._grow(rows, wide)
        if draws > self._uniforms.shape[1] or rows > self._uniforms.shape[0]:
            grown = torch.zeros((rows, max(draws, self._uniforms.shape[1])))
            grown[: self._uniforms.shape[0], : self._uniforms.shape[1]] = self._uniforms
            self._uniforms = grown.to(self.engine.device)
        return [s for s, j in enumerate(self._jobs) if j is None][:count]

    def _grow(self, rows: int, width: int) -> None:
        engine = self.engine
        weight = engine.base.embed_tokens.weight
        fused = engine.fused[0]
        heads = fused.split[1] // engine.head_dim if fused.qkv is not None else _kv_heads(engine)
        old_rows = len(self._jobs)
        grown = []
        for layer in range(len(engine.base.layers)):
            shape = (rows, heads, width, engine.head_dim)
            new_k, new_v = weight.new_zeros(shape), weight.new_zeros(shape)
            if self._caches:
                held_k, held_v = self._caches[layer]
                new_k[:old_rows, :, : held_k.shape[2]] = held_k
                new_v[:old_rows, :, : held_v.shape[2]] = held_v
            grown.append((new_k, new_v))
        self._caches = grown
        device = engine.device
        self._lengths = _extend(self._lengths, rows, device)
        self._steps = _extend(self._steps, rows, device)
        self._last = _extend(self._last, rows, device)
        logits = torch.zeros((rows, engine.model.lm_head.weight.shape[0]), device=device)
        if self._logits is not None:
            logits[: self._logits.shape[0]] = self._logits
        self._logits = logits
        self._jobs += [None] * (rows - old_rows)

    def _forward(self, top: int, continuing: list[int], new: list[tuple[int, Job, int]]) -> None:
        """One pass of the model over ``top`` decode tokens (slot s's last token at its length
        for the continuing slots; a dummy elsewhere, whose result is never read) followed by
        the admitted prompts' tails, packed: the projections and MLPs run once for all of them.
        Attention runs per part: the decode rows in one operation over their slots (a view of
        the caches), each prompt's tail over its own slot (the kept prefix and itself).
        Writes the next-token logits of every row it ran for."""
        engine = self.engine
        device = engine.device
        width = self._caches[0][0].shape[2]
        tails = [job.prompt[reused:] for _, job, reused in new]
        go_on = torch.zeros(top, dtype=torch.bool, device=device)
        go_on[torch.tensor(continuing, dtype=torch.long, device=device)] = True
        lengths = torch.where(go_on, self._lengths[:top], 0)
        # a dummy's key and value go to the slot's last position: a position a row writes
        # (its own decode) before it ever reads it
        write_at = torch.where(go_on, lengths, width - 1)
        # each tail token: its slot and its position (after the session's kept prefix)
        owner = [slot for (slot, _, _), tail in zip(new, tails, strict=True) for _ in tail]
        at = [r + i for (_, _, r), tail in zip(new, tails, strict=True) for i in range(len(tail))]
        tail_ids = torch.tensor([t for tail in tails for t in tail], dtype=torch.long)
        tail_slots = torch.tensor(owner, dtype=torch.long, device=device)
        tail_at = torch.tensor(at, dtype=torch.long, device=device)
        ids = torch.cat([torch.where(go_on, self._last[:top], 0), tail_ids.to(device)])
        x = engine.base.embed_tokens(ids)[None]
        engine._rotary(x, width)
        positions = torch.cat([lengths, tail_at])
        cos, sin = engine.cos[positions][None], engine.sin[positions][None]
        batch = torch.arange(top, device=device)
        span = int(lengths.max()) + 1 if top else 0
        hidden = (torch.arange(span, device=device)[None, :] > lengths[:, None])[:, None, None, :]
        starts = [sum(len(t) for t in tails[:i]) for i in range(len(tails))]
        for index, (k_cache, v_cache) in enumerate(self._caches):
            q, k, v = engine._attention_block(index, x, cos, sin)
            k_cache[batch, :, write_at] = k[0, :, :top].transpose(0, 1)
            v_cache[batch, :, write_at] = v[0, :, :top].transpose(0, 1)
            k_cache[tail_slots, :, tail_at] = k[0, :, top:].transpose(0, 1)
            v_cache[tail_slots, :, tail_at] = v[0, :, top:].transpose(0, 1)
            parts = []
            if top:
                q_rows = q[0, :, :top].transpose(0, 1)[:, :, None]
                kept = (k_cache[:top, :, :span], v_cache[:top, :, :span])
                parts.append(decode_attention(q_rows, *kept, hidden)[:, :, 0].transpose(0, 1))
            for (slot, _, r), tail, a in zip(new, tails, starts, strict=True):
                b = a + len(tail)
                parts.append(
                    _prompt_attention(
                        q[:, :, top + a : top + b],
                        k_cache[slot : slot + 1, :, : r + len(tail)],
                        v_cache[slot : slot + 1, :, : r + len(tail)],
                        r,
                    )[0]
                )
            x = engine._finish_layer(index, x, torch.cat(parts, dim=1)[None])
        lasts = [top + sum(len(t) for t in tails[: i + 1]) - 1 for i in range(len(tails))]
        picks = torch.tensor(continuing + lasts, dtype=torch.long, device=device)
        where = torch.tensor(continuing + [slot for slot, _, _ in new], device=device)
        assert self._logits is not None
        self._logits[where] = engine._logits(x[0, picks])

    def _keep(self, slot: int, job: Job) -> None:
        """Keep a finished row as its session: the prompt and the sampled tokens fed back."""
        if self.cache is None or job.session is None:
            return
        held = len(job.prompt) + len(job.tokens) - 1
        self.cache.put(
            job.session,
            Session(
                [*job.prompt, *job.tokens[:-1]],
                [k[slot, :, :held].clone() for k, _ in self._caches],
                [v[slot, :, :held].clone() for _, v in self._caches],
                job.version,
            ),
        )

    def _compact(self) -> None:
        """Move the highest live rows into the free slots below them once those holes are
        ``HOLE_FRACTION`` of the slots a step computes."""
        live = [s for s, j in enumerate(self._jobs) if j is not None]
        top = live[-1] + 1
        if top - len(live) < max(1, int(top * HOLE_FRACTION)):
            return
        self.compactions += 1
        holes = [s for s in range(len(live)) if self._jobs[s] is None]
        movers = [s for s in live if s >= len(live)]
        src = torch.tensor(movers, device=self.engine.device)
        dst = torch.tensor(holes, device=self.engine.device)
        for k, v in self._caches:
            k[dst] = k[src]
            v[dst] = v[src]
        for t in (self._lengths, self._steps, self._last, self._uniforms):
            t[dst] = t[src]
        assert self._logits is not None
        self._logits[dst] = self._logits[src]
        for s, d in zip(movers, holes, strict=True):
            self._jobs[d], self._jobs[s] = self._jobs[s], None


def _prompt_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: int
) -> torch.Tensor:
    """Causal attention of a prompt's new tokens (query j at position ``kept + j``) over its
    slot's keys and values: the kept prefix and the new tokens."""
    if kept == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    count = q.shape[2]
    seen = (
        torch.arange(kept + count, device=q.device)[None, :]
        <= (kept + torch.arange(count, device=q.device))[:, None]
    )
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, enable_gqa=True)


def _kv_heads(engine: NativeEngine) -> int:
    config = engine.model.config
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def _extend(t: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    grown = torch.zeros(rows, dtype=t.dtype, device=device)
    grown[: len(t)] = t
    return grown
