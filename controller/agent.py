"""Multi-turn rollouts: trajectories in which the model calls tools or acts in an environment.

The rollout is a controller program, one coroutine per trajectory (``Trajectories.run``):

1. the env group opens a session for the trajectory and gives its first context: the prompt's
   tokens as the generator tokenizes them, then an environment's first observation;
2. generate a turn on the generator (the colocated actor or a rollout group) until a stop: the
   model's end of sequence, the last token of the tool-call close tag, or the turn's token limit;
3. the turn's text goes to the env group (``roles/env.py``), which parses the call, runs the
   tool under its limits and returns the observation as token ids; they are appended;
4. repeat until the model answers without a call (tools), the environment says done, or a limit
   (``max_turns``, ``max_total_tokens``) is reached.

**Token in, token out.** A trajectory is the exact ids the engine sampled plus the observation ids
the env returned, in order; nothing is ever re-tokenised. Its training row is those ids with
``response_mask`` 1 on the sampled tokens only, their ``log_probs`` from the engine and each
token's ``token_versions``; observation and prompt tokens have mask 0, so advantages, the loss and
the KL term touch only what the model chose.

**Continuous serving.** The trajectories do not take turns in lock step. A ``TurnServer`` sends the
generator, whenever it is free, every turn waiting at that moment as one batch; a trajectory whose
tool is slow only holds itself back. Tool actions go to the env group as they come
(``submit``) and come back as they finish (``collect``), so one slow tool never holds back another.
``serving: lockstep`` is the naive baseline on the same code: each generation call waits until
every live trajectory has asked for its next turn.

**Determinism.** Each turn is sampled with its own seed, from the step's seed, the trajectory's
index and the turn's index, and the native engine draws each sample's random numbers from its own
stream: a trajectory's tokens do not depend on which other turns shared its call. Its log-probs
do, in their last bits, so continuous serving gives the tokens of lock step unless a draw falls
within rounding of a boundary; lock step, whose calls hold the same rows in the same order
whatever the timing, reproduces a run bitwise.

What reaches the reward role: ``response`` is the text of the final turn (the answer),
``transcript`` all text after the prompt (``segments``: the same as ``[kind, text]`` pieces,
kind ``sampled`` or ``observation``, after a ``start`` piece for an environment's first
observation), ``env_reward`` the sum of the environment's rewards,
``turns``, ``tool_calls`` and ``seconds`` (its wall time) per trajectory, and the data row's
columns.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import Counter
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from controller.clients import EnvClient
from controller.streaming import (
    NO_VERSION,
    Generator,
    TokenRow,
    WeightGate,
    fill_replicas,
    replicas,
    token_rows,
)
from transport.agent import (
    AgentAsk,
    AgentEnd,
    AgentReply,
    EnvAction,
    EnvOpen,
    EnvResult,
    EnvSpec,
)
from transport.batch import TensorBatch
from transport.columns import PREFIX_REUSED, REPLICA, SESSION
from transport.sampling import SamplingConfig
from transport.turns import TurnRequest

#: text columns of a prompt batch that trajectories do not echo
NOT_ECHOED = ("prompt_ids",)
#: the text columns a trajectory adds to its row (besides ``response``, ``finish``, ``request``)
TRAJECTORY_COLUMNS = ("transcript", "segments", "env_reward", "turns", "tool_calls", "seconds")
#: [B] a trajectory's budget of sampled tokens: max_total_tokens less its prompt and observation
#: tokens (the limit DAPO's overlong shaping measures a multi-turn row against)
SAMPLE_BUDGET = "sample_budget"

log = logging.getLogger("hybridflow.agent")


class AgentConfig(BaseModel):
    """Multi-turn rollouts with an ``env`` role (tools or an environment)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(4, ge=1, description="generation turns per trajectory")
    max_total_tokens: int = Field(
        256, ge=2, description="a trajectory's tokens in all: prompt, turns, observations"
    )
    serving: Literal["iteration", "continuous", "lockstep"] = Field(
        "continuous",
        description="iteration: each turn joins the generator's running decode batch as soon as "
        "it is asked for and returns as soon as it is done (a rollout group, native or vllm "
        "engine, tp 1); continuous: the generator serves whatever turns are waiting whenever a "
        "call is not in flight; lockstep: each call waits for every live trajectory (the naive "
        "baseline)",
    )
    sessions: bool = Field(
        True,
        description="name each trajectory as its turns' session: the generator (native engine) "
        "keeps its KV between turns and prefills only what is new (the observation); off: every "
        "turn prefills the whole trajectory again",
    )
    collect_wait_s: float = Field(
        0.02, gt=0, description="how long one collect call waits on the env group for a result"
    )
    exchange_wait_s: float = Field(
        0.02,
        gt=0,
        description="serving iteration: how long one exchange call waits on the generator for "
        "a finished turn (a turn asked for meanwhile is sent with the next call)",
    )
    action_timeout_s: float = Field(
        120.0,
        gt=0,
        description="the longest a trajectory waits for one action's result (the env group's "
        "own per-call limit, call_timeout_s, should be well under it)",
    )


class AgentError(RuntimeError):
    """A multi-turn rollout that cannot go on (an action past ``action_timeout_s``)."""


@dataclass
class Trajectory:
    request: int  # the prompt it answers, within the batch
    sample: int  # which of the prompt's n
    seed: int  # its request's seed
    session: int
    start: list[int] = field(default_factory=list)  # prompt tokens (+ first observation)
    ids: list[int] = field(default_factory=list)  # everything after the start
    sampled: list[int] = field(default_factory=list)  # 1 per id the model sampled
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    texts: list[str] = field(default_factory=list)  # the turns' texts, in order
    #: ("sampled" | "observation", text) in order after the prompt; an environment's first
    #: observation (part of the start) comes first
    segments: list[tuple[str, str]] = field(default_factory=list)
    env_reward: float = 0.0
    tool_calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    finish: str = ""
    done_at_start: bool = False  # the environment ended it at its reset
    began: float = 0.0
    seconds: float = 0.0  # from its session's opening to its end

    def extend(self, ids: list[int], log_probs: list[float] | None, version: int) -> None:
        self.ids += ids
        sampled = log_probs is not None
        self.sampled += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += [version if sampled else NO_VERSION] * len(ids)

    @property
    def length(self) -> int:
        return len(self.start) + len(self.ids)


@dataclass
class Turn:
    """One turn's request to the generator, and what came back."""

    key: int  # the trajectory's place in the batch: a call's rows go in this order
    ids: list[int]
    seed: int
    max_new: int
    done: asyncio.Future[tuple[list[int], list[float], str, str, int]]


class TurnServer:
    """Serves the trajectories' turn requests on one generator: whenever no call is in flight,
    every request waiting then goes out as one batch (continuous), or, in lock step, only once
    every live trajectory has asked. Records when the generator was busy."""

    def __init__(
        self,
        generator: Generator,
        sampling: SamplingConfig,
        stops: list[int],
        min_version: int,
        gate: WeightGate | None,
        lockstep: bool,
        sessions: bool = False,
        iteration: bool = False,
        wait_s: float = 0.02,
    ) -> None:
        self.generator = generator
        self.sampling = sampling
        self.stops = stops
        self.min_version = min_version
        self.gate = gate
        self.lockstep = lockstep
        self.sessions = sessions  # each turn names its trajectory (the generator keeps its KV)
        self.iteration = iteration  # turns join the generator's running batch (exchange)
        self.wait_s = wait_s
        self.channel = uuid.uuid4().hex  # this batch's turns at the generator
        self.positions = 0  # prompt positions the turns asked for
        self.reused = 0  # of which the generator took from kept sessions
        self.waiting: list[Turn] = []
        self.live = 0  # trajectories that may still ask for a turn
        self.busy_s = 0.0  # time a generation call was in flight
        self.calls = 0
        self.pad_id: int | None = None
        self._wake = asyncio.Event()

    async def turn(
        self, key: int, ids: list[int], seed: int, max_new: int
    ) -> tuple[list[int], list[float], str, str, int]:
        """(tokens, log-probs, text, finish, weight version) of one turn from ``ids``."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append(Turn(key, ids, seed, max_new, done))
        self._wake.set()
        return await done

    def leave(self) -> None:
        """A trajectory is finished: lock step no longer waits for it."""
        self.live -= 1
        self._wake.set()

    async def serve(self) -> None:
        """Until cancelled: send the waiting turns whenever there are any (and, in lock step,
        every live trajectory is among them)."""
        if self.iteration:
            await self._serve_iterations()
            return
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.waiting or (self.lockstep and len(self.waiting) < self.live):
                continue
            # in the trajectories' order, not their arrival's: in lock step every call is
            # then the same whatever the timing, and the run reproduces bitwise
            batch, self.waiting = sorted(self.waiting, key=lambda t: t.key), []
            try:
                await self._call(batch)
            except BaseException as exc:
                for t in batch:
                    if not t.done.done():
                        t.done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            if self.waiting:
                self._wake.set()

    async def _call(self, batch: list[Turn]) -> None:
        count = replicas(self.generator)
        affine = self.sessions and count > 1  # each trajectory's turns go where its KV is kept
        placed = by_replica(batch, count) if affine else [(t, 0) for t in batch]
        rows = [t for t, _ in placed]  # None: a filler for a replica with no turn; dropped
        prompts = TensorBatch.from_dict(
            non_tensors={
                "prompt_ids": [(t or batch[0]).ids for t in rows],
                "seed": [(t or batch[0]).seed for t in rows],
            }
        )
        if self.sessions:
            keys = [None if t is None else session_key(t.key) for t in rows]
            prompts.non_tensors[SESSION] = keys
        if affine:
            prompts.non_tensors[REPLICA] = [replica for _, replica in placed]
        longest = max(t.max_new for t in batch)
        sampling = self.sampling.model_copy(
            update={"n": 1, "max_new_tokens": longest, "stop_token_ids": self.stops}
        )
        padded = prompts if affine else fill_replicas(prompts, count)
        began = time.perf_counter()
        async with self.gate.generating() if self.gate else _nothing():
            reply = await self.generator.generate(padded, sampling, self.min_version)
        self.busy_s += time.perf_counter() - began
        self.calls += 1
        self.pad_id = int(reply.meta.get("pad_values", {}).get("input_ids", 0))
        version = int(reply.meta["weight_version"])
        ids, mask = reply.tensors["input_ids"], reply.tensors["response_mask"].bool()
        log_probs = reply.tensors["log_probs"]
        reused = reply.non_tensors.get(PREFIX_REUSED)
        self.positions += sum(len(t.ids) for t in batch)
        if reused:
            self.reused += sum(int(reused[row]) for row, t in enumerate(rows) if t is not None)
        for row, t in enumerate(rows):
            if t is None:
                continue
            tokens = ids[row][mask[row]].tolist()
            lps = log_probs[row][mask[row]].tolist()
            finish = str(reply.non_tensors["finish"][row])
            text = str(reply.non_tensors["response"][row])
            if len(tokens) > t.max_new:  # the call ran longer than this turn may
                tokens, lps, finish = tokens[: t.max_new], lps[: t.max_new], "length"
                text = ""  # not decoded here: a cut turn is never parsed
            t.done.set_result((tokens, lps, text, finish, version))

    async def _serve_iterations(self) -> None:
        """Iteration-level serving: every exchange sends the turns asked for since the last
        one and hands back the turns the generator finished. The gate is held while any turn
        is out (a push waits for them, as for a call)."""
        out: dict[int, Turn] = {}
        count = replicas(self.generator)
        sampling = self.sampling.model_copy(update={"n": 1, "stop_token_ids": self.stops})
        exchange = getattr(self.generator, "exchange")  # noqa: B009 (checked by run_trajectories)
        held: AbstractAsyncContextManager[Any] | None = None
        since = 0.0
        try:
            while True:
                if not self.waiting and not out:
                    if held is not None:
                        await held.__aexit__(None, None, None)
                        held = None
                        self.busy_s += time.perf_counter() - since
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                new, self.waiting = self.waiting, []
                if new and held is None:
                    held = self.gate.generating() if self.gate else _nothing()
                    await held.__aenter__()
                    since = time.perf_counter()
                requests = [
                    TurnRequest(
                        id=t.key,
                        prompt_ids=t.ids,
                        seed=t.seed,
                        max_new=t.max_new,
                        session=session_key(t.key) if self.sessions else None,
                        replica=t.key % count,
                    )
                    for t in new
                ]
                out.update((t.key, t) for t in new)
                self.positions += sum(len(t.ids) for t in new)
                results = await exchange(
                    self.channel, requests, sampling, self.wait_s, self.min_version
                )
                self.calls += 1
                for r in results:
                    t = out.pop(r.id)
                    self.reused += r.reused
                    self.pad_id = r.pad_id
                    t.done.set_result((r.tokens, r.log_probs, r.text, r.finish, r.version))
        except BaseException as exc:
            for t in [*out.values(), *self.waiting]:
                if not t.done.done():
                    t.done.set_exception(exc)
                    t.done.exception()  # retrieved here: its trajectory may be gone already
            raise
        finally:
            if held is not None:
                await held.__aexit__(None, None, None)


def by_replica(batch: list[Turn], count: int) -> list[tuple[Turn | None, int]]:
    """The turns with the replica that keeps their session (``key % count``: all of a
    trajectory's turns go to one), ordered by it; a filler (None) for a replica with no turn in
    this call (every replica of a call gets a row)."""
    found: list[tuple[Turn | None, int]] = []
    for replica in range(count):
        mine = [t for t in batch if t.key % count == replica]
        found += [(t, replica) for t in mine] or [(None, replica)]
    return found


class _nothing(AbstractAsyncContextManager[None]):
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class ActionDesk:
    """Sends the trajectories' actions to the env group as they come and hands each result to
    its trajectory as it finishes. One loop owns the env client (its calls queue on the group),
    alternating ``submit`` (everything that came in) and ``collect`` (whatever finished); it runs
    while actions are out and starts again with the next one. Every batch of trajectories on one
    env group goes through the same desk (batches generated ahead run at the same time), since a
    ``collect`` returns whatever finished, whoever submitted it."""

    def __init__(self, env: EnvClient, wait_s: float, timeout_s: float) -> None:
        self.env = env
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.pending: list[EnvAction] = []
        self.out: dict[int, asyncio.Future[EnvResult]] = {}
        self.waited_s = 0.0  # time the loop waited on results
        self._loop: asyncio.Task[None] | None = None

    async def act(self, action: EnvAction) -> EnvResult:
        done: asyncio.Future[EnvResult] = asyncio.get_running_loop().create_future()
        self.out[action.session] = done
        self.pending.append(action)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.ensure_future(self._serve())
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
        except TimeoutError:
            raise AgentError(
                f"session {action.session}: no result from role {self.env.role!r} within "
                f"{self.timeout_s:g} s (agent.action_timeout_s; the env's own per-call limit "
                "is its call_timeout_s)"
            ) from None
        finally:  # answered, timed out or cancelled: this session waits no more
            if self.out.get(action.session) is done:
                del self.out[action.session]

    async def _serve(self) -> None:
        try:
            while self.out or self.pending:
                if self.pending:
                    sent, self.pending = self.pending, []
                    await self.env.submit(sent)
                began = time.perf_counter()
                results = await self.env.collect(self.wait_s)
                self.waited_s += time.perf_counter() - began
                for result in results:
                    found = self.out.pop(result.session, None)
                    if found is not None and not found.done():
                        found.set_result(result)
        except Exception as exc:  # the env group failed: every action out fails with it
            for found in self.out.values():
                if not found.done():
                    found.set_exception(exc)
                    found.exception()  # retrieved here: its trajectory may be gone already
            self.out.clear()
            self.pending.clear()


@dataclass
class AgentRollout:
    """What one batch of trajectories needs: who generates, who acts, how."""

    generator: Generator
    env: EnvClient
    cfg: AgentConfig
    spec: EnvSpec
    gate: WeightGate | None = None
    first_session: int = 0
    desk: ActionDesk | None = None  # shared by the batches on one env group (default: its own)


def session_key(session: int) -> str:
    """A trajectory's session name at the generator (its env session, unique in a run)."""
    return f"t{session}"


def turn_seed(seed: int, sample: int, turn: int, part: int) -> int:
    """The sampling seed of one turn (``part``: a turn continued after a stop token that did not
    close a call) of sample ``sample`` of a request whose seed is ``seed``."""
    digest = hashlib.blake2b(f"{seed}/{sample}/{turn}/{part}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


async def run_trajectories(
    setup: AgentRollout, prompts: TensorBatch, sampling: SamplingConfig, min_version: int
) -> TensorBatch:
    """``sampling.n`` trajectories per prompt of ``prompts`` (which needs a ``seed`` column), as
    training rows, request-major like a generation call's reply."""
    cfg = setup.cfg
    trajectories, server = _prepare(setup, prompts, sampling, min_version)
    rows = _rows(prompts)
    desk = setup.desk or ActionDesk(setup.env, cfg.collect_wait_s, cfg.action_timeout_s)
    began = time.perf_counter()
    sessions = [t.session for t in trajectories]
    try:
        await _serve(setup, trajectories, rows, server, desk, sampling)
    except BaseException:  # the env group and the generator let go of them all the same
        await _let_go(setup, sessions, failed=True)
        raise
    elapsed = time.perf_counter() - began
    await _let_go(setup, sessions, failed=False)
    batch = _batch(trajectories, prompts, server.pad_id or 0, cfg.max_total_tokens)
    batch.meta["agent"] = agent_metrics(trajectories, elapsed, server)
    return batch


def _prepare(
    setup: AgentRollout, prompts: TensorBatch, sampling: SamplingConfig, min_version: int
) -> tuple[list[Trajectory], TurnServer]:
    """The batch's trajectories (``sampling.n`` per prompt, request-major) and the server of
    their turns on the generator."""
    spec, cfg = setup.spec, setup.cfg
    seeds = [int(s) for s in prompts.non_tensors["seed"]]
    n = sampling.n
    trajectories = [
        Trajectory(request=r, sample=j, seed=seeds[r], session=setup.first_session + r * n + j)
        for r in range(len(prompts))
        for j in range(n)
    ]
    stops = sorted({spec.eos_token_id, *spec.call_stop_token_ids})
    server = TurnServer(
        setup.generator,
        sampling,
        stops,
        min_version,
        setup.gate,
        cfg.serving == "lockstep",
        cfg.sessions,
        cfg.serving == "iteration",
        cfg.exchange_wait_s,
    )
    if server.iteration and not hasattr(setup.generator, "exchange"):
        raise AgentError(
            f"agent serving 'iteration' needs a rollout group as the generator (native or "
            f"vllm engine, tp 1); {setup.generator.role!r} serves whole calls: use serving 'continuous'"
        )
    return trajectories, server


async def _serve(
    setup: AgentRollout,
    trajectories: list[Trajectory],
    rows: list[dict[str, Any]],
    server: TurnServer,
    desk: ActionDesk,
    sampling: SamplingConfig,
) -> None:
    """Open the trajectories' sessions and run them all to their ends (the first failure of a
    trajectory or of the serving loop fails them all)."""
    spec, cfg = setup.spec, setup.cfg
    opened = await setup.env.open(
        [EnvOpen(session=t.session, row=rows[t.request]) for t in trajectories]
    )
    by_session = {o.session: o for o in opened}
    for t in trajectories:
        first = by_session[t.session]
        t.start = list(first.observation_ids)
        t.done_at_start = first.done
        if first.observation:
            t.segments.append(("start", first.observation))
        if first.error is not None:  # a reset that failed: the trajectory ends before a turn
            t.errors[first.error] += 1
    server.live = len(trajectories)
    loops = [asyncio.ensure_future(server.serve())]
    runs = [asyncio.ensure_future(_one(t, server, desk, spec, cfg, sampling)) for t in trajectories]
    try:
        waiting: set[asyncio.Future[None]] = {*runs, *loops}
        while not all(run.done() for run in runs):
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:  # a trajectory or a loop that failed fails the rollout
                failed = task.exception()
                if failed is not None:
                    raise failed
    finally:
        for task in [*loops, *runs]:
            task.cancel()


async def _let_go(setup: AgentRollout, sessions: list[int], failed: bool) -> None:
    """Close the trajectories' env sessions and (with ``sessions``) the generator's KV of them.
    After a failure, an error here is logged, not raised: the rollout's own error is the one the
    caller sees (and a group that is gone has nothing left to close)."""
    try:
        await setup.env.close(sessions)
        if setup.cfg.sessions:
            await setup.generator.drop_sessions([session_key(s) for s in sessions])
    except Exception:
        if not failed:
            raise
        log.warning("closing the sessions of a failed rollout failed too", exc_info=True)


async def _one(
    t: Trajectory,
    server: TurnServer,
    desk: ActionDesk,
    spec: EnvSpec,
    cfg: AgentConfig,
    sampling: SamplingConfig,
) -> None:
    t.began = time.perf_counter()
    try:
        if t.done_at_start:
            t.finish = "done"
            return
        part = used = 0  # a turn goes on after a stop token that closes no call: its pieces
        text = ""  # and the tokens and text of the turn so far
        while True:
            budget = min(sampling.max_new_tokens - used, cfg.max_total_tokens - t.length)
            if budget <= 0:  # only at a turn's start: a continuation checks before it goes on
                t.finish = "length"
                return
            tokens, lps, got, finish, version = await server.turn(
                t.session, t.start + t.ids, turn_seed(t.seed, t.sample, t.turns, part), budget
            )
            t.extend(tokens, lps, version)
            text += got
            used += len(tokens)
            last = tokens[-1] if tokens else None
            if finish == "stop" and last in spec.call_stop_token_ids and not spec.stateful:
                if not text.endswith(spec.call_close) and last != spec.eos_token_id:
                    # e.g. a '>' that closes no call: the same turn goes on, within what is
                    # left of the turn's max_new_tokens and the trajectory's max_total_tokens
                    left = min(sampling.max_new_tokens - used, cfg.max_total_tokens - t.length)
                    if left > 0:
                        part += 1
                        continue
                    finish = "length"  # the turn is cut at its limit, as one that ran out
            t.turns += 1
            t.texts.append(text)
            t.segments.append(("sampled", text))
            # tools: an answer without a call (or cut at the turn's limit) ends it; an
            # environment judges every turn's text and says when it is done
            ended = not spec.stateful and (finish == "length" or last == spec.eos_token_id)
            if ended:
                t.finish = finish
                return
            result = await desk.act(
                EnvAction(session=t.session, text=text, finish=finish, turn=t.turns - 1)
            )
            # an observation longer than what is left of the trajectory is cut there (a tool's
            # 4,000-token output would otherwise widen every row of the batch to it)
            room = max(0, cfg.max_total_tokens - t.length)
            t.extend(list(result.observation_ids[:room]), None, NO_VERSION)
            t.segments.append(("observation", result.observation))
            t.latencies.append(result.latency_s)
            if result.called is not None:
                t.tool_calls += 1
            if result.error is not None:
                t.errors[result.error] += 1
            if result.reward is not None:
                t.env_reward += float(result.reward)
            if result.done:
                t.finish = "done"
                return
            if t.turns >= cfg.max_turns:
                t.finish = "turns"
                return
            text, part, used = "", 0, 0
    finally:
        t.seconds = time.perf_counter() - t.began
        server.leave()


async def run_agents(
    setup: AgentRollout, prompts: TensorBatch, sampling: SamplingConfig, min_version: int
) -> TensorBatch:
    """Agent mode (the env role's ``agent``): ``sampling.n`` runs of the user's agent per prompt,
    each calling the env group's OpenAI-compatible endpoint; every call is a turn generated here
    on the run's generator. The rows are the trajectories as the env group recorded them (the
    ids sampled, the ids rendered between the turns) with the agent's reward as ``env_reward``."""
    cfg = setup.cfg
    trajectories, server = _prepare(setup, prompts, sampling, min_version)
    began = time.perf_counter()
    sessions = [t.session for t in trajectories]
    try:
        ends = await _serve_agents(setup, trajectories, _rows(prompts), server, sampling)
    except BaseException:
        await _let_go(setup, sessions, failed=True)
        raise
    elapsed = time.perf_counter() - began
    await _let_go(setup, sessions, failed=False)
    drift = 0
    mine: dict[str, list[float]] = {}
    faults: Counter[str] = Counter()
    said: dict[str, str] = {}  # the first message of each kind of fault
    for t in trajectories:
        end = ends[t.session]
        _recorded(t, end)
        drift += end.drift
        if end.fault is not None:
            faults[end.fault] += 1
            said.setdefault(end.fault, end.message)
        for key, value in end.metrics.items():
            mine.setdefault(key, []).append(value)
    if faults:  # one line a batch, not one an agent
        log.warning(
            "%d of %d agents failed (their rows train nothing): %s",
            sum(faults.values()),
            len(trajectories),
            "; ".join(f"{n} {kind}, e.g. {said[kind]}" for kind, n in sorted(faults.items())),
        )
    batch = _batch(trajectories, prompts, server.pad_id or 0, cfg.max_total_tokens)
    found = agent_metrics(trajectories, elapsed, server)
    found["agent/template_drift"] = float(drift)
    found["agent/faults"] = float(sum(faults.values()))
    found.update({f"agent/faults/{k}": float(v) for k, v in sorted(faults.items())})
    found.update({f"agent/user/{k}": sum(v) / len(v) for k, v in sorted(mine.items())})
    batch.meta["agent"] = found
    return batch


async def _serve_agents(
    setup: AgentRollout,
    trajectories: list[Trajectory],
    rows: list[dict[str, Any]],
    server: TurnServer,
    sampling: SamplingConfig,
) -> dict[int, AgentEnd]:
    """Start the agents, then until every one has ended: take their model calls, generate
    each as a turn, hand back the replies."""
    env, cfg = setup.env, setup.cfg
    await env.open([EnvOpen(session=t.session, row=rows[t.request]) for t in trajectories])
    by_session = {t.session: t for t in trajectories}
    for t in trajectories:
        t.began = time.perf_counter()
    server.live = len(trajectories)
    ends: dict[int, AgentEnd] = {}
    replies: list[AgentReply] = []
    answering: set[asyncio.Future[None]] = set()

    async def answer(ask: AgentAsk) -> None:
        replies.append(await _answer(ask, by_session[ask.session], server, sampling, cfg))

    loop = asyncio.ensure_future(server.serve())
    group = env.controller.group_of(env.role)
    incarnation = group.incarnation
    try:
        while len(ends) < len(trajectories):
            if group.incarnation != incarnation or group.dead is not None:
                # a call to a group being restarted waits for it and goes to the new process,
                # which never saw these agents: their batch runs again from its start
                raise AgentError(
                    f"env group {group.spec.name!r} died or was restarted: its agents are gone"
                )
            out = replies[:]
            del replies[:]
            got = await env.exchange(out, cfg.collect_wait_s)
            for ask in got.asks:
                if ask.session not in by_session:
                    raise AgentError(
                        f"role {env.role!r} asked a turn for session {ask.session}, "
                        "which is not in this batch"
                    )
                answering.add(asyncio.ensure_future(answer(ask)))
            for end in got.ends:
                if end.session in by_session and end.session not in ends:
                    ends[end.session] = end
                    t = by_session[end.session]
                    t.seconds = time.perf_counter() - t.began
                    server.leave()
            for task in [x for x in answering if x.done()]:
                answering.discard(task)
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if loop.done():
                loop.result()  # the serving loop ended: its error
    finally:
        for task in [loop, *answering]:
            task.cancel()
    return ends


def context_full(limit: int, length: int) -> str:
    """The refusal of a call whose conversation fills ``trainer.agent.max_total_tokens``, in
    OpenAI's words for it, which clients such as verifiers recognise (a truncated rollout)."""
    return (
        f"This model's maximum context length is {limit} tokens in this run "
        f"(trainer.agent.max_total_tokens), and the conversation is {length}"
    )


async def _answer(
    ask: AgentAsk, t: Trajectory, server: TurnServer, sampling: SamplingConfig, cfg: AgentConfig
) -> AgentReply:
    """One agent call as a turn, or the reason it is refused (the OpenAI error's message)."""

    def refuse(message: str, param: str | None = None) -> AgentReply:
        return AgentReply(session=ask.session, ask=ask.ask, error=message, param=param)

    for name, asked, run in (
        ("temperature", ask.temperature, sampling.temperature),
        ("top_p", ask.top_p, sampling.top_p),
    ):
        if asked is not None and abs(asked - run) > 1e-9:
            return refuse(
                f"{name}={asked:g}: this run samples with {name}={run:g} (the stage's "
                f"algorithm); leave it unset",
                name,
            )
    if ask.max_tokens is not None and ask.max_tokens > sampling.max_new_tokens:
        return refuse(
            f"max_tokens={ask.max_tokens} is more than this run's max_new_tokens="
            f"{sampling.max_new_tokens} a turn (the stage's algorithm.max_new_tokens)",
            "max_tokens",
        )
    if ask.turn >= cfg.max_turns:
        return refuse(f"the trajectory has had its {cfg.max_turns} turns (trainer.agent.max_turns)")
    room = cfg.max_total_tokens - len(ask.prompt_ids)
    budget = min(ask.max_tokens or sampling.max_new_tokens, sampling.max_new_tokens, room)
    if budget <= 0:
        return refuse(context_full(cfg.max_total_tokens, len(ask.prompt_ids)), "messages")
    seed = ask.seed if ask.seed is not None else turn_seed(t.seed, t.sample, ask.turn, ask.part)
    tokens, lps, text, finish, version = await server.turn(
        t.session, list(ask.prompt_ids), seed, budget
    )
    return AgentReply(
        session=ask.session,
        ask=ask.ask,
        tokens=tokens,
        log_probs=lps,
        text=text,
        finish="length" if finish == "length" else "stop",
        version=version,
    )


def _recorded(t: Trajectory, end: AgentEnd) -> None:
    """The trajectory as the env group recorded it."""
    size = len(end.ids)
    if not (len(end.sampled) == len(end.log_probs) == len(end.versions) == size):
        raise AgentError(
            f"session {end.session}: the recording's ids ({size}), sampled flags "
            f"({len(end.sampled)}), log-probs and versions differ in length"
        )
    t.start, t.ids = list(end.start), list(end.ids)
    t.sampled, t.log_probs = list(end.sampled), list(end.log_probs)
    t.versions = [v if m else NO_VERSION for v, m in zip(end.versions, end.sampled, strict=True)]
    t.turns, t.tool_calls = end.turns, end.tool_calls
    t.segments = [(str(k), str(x)) for k, x in end.segments]
    t.texts = [x for k, x in t.segments if k == "sampled"][-1:]
    t.env_reward = end.reward
    t.finish = end.finish or "stop"


def _rows(prompts: TensorBatch) -> list[dict[str, Any]]:
    names = [c for c in prompts.non_tensors if c not in NOT_ECHOED]
    return [{c: prompts.non_tensors[c][i] for c in names} for i in range(len(prompts))]


def _batch(
    trajectories: list[Trajectory], prompts: TensorBatch, pad_id: int, max_total: int
) -> TensorBatch:
    """Training rows: start then everything after it, right-padded; ``response_mask`` on the
    sampled tokens only; ``SAMPLE_BUDGET`` the sampled tokens each trajectory had room for."""
    tensors = token_rows(
        [TokenRow(t.start, t.ids, t.sampled, t.log_probs, t.versions) for t in trajectories],
        pad_id,
    )
    given = [t.length - sum(t.sampled) for t in trajectories]  # prompt and observations
    tensors[SAMPLE_BUDGET] = torch.tensor([max_total - g for g in given], dtype=torch.long)
    columns = [c for c in prompts.non_tensors if c not in NOT_ECHOED]
    non_tensors: dict[str, list[Any]] = {
        c: [prompts.non_tensors[c][t.request] for t in trajectories] for c in columns
    }
    non_tensors.update(
        response=[t.texts[-1] if t.texts else "" for t in trajectories],
        transcript=["".join(x for k, x in t.segments if k != "start") for t in trajectories],
        segments=[[list(x) for x in t.segments] for t in trajectories],
        finish=[t.finish for t in trajectories],
        request=[t.request for t in trajectories],
        env_reward=[t.env_reward for t in trajectories],
        turns=[t.turns for t in trajectories],
        tool_calls=[t.tool_calls for t in trajectories],
        seconds=[t.seconds for t in trajectories],
    )
    sampled = [v for t in trajectories for v, m in zip(t.versions, t.sampled, strict=True) if m]
    batch = TensorBatch.from_dict(tensors, non_tensors, {"pad_values": {"input_ids": pad_id}})
    batch.meta["weight_version"] = min(sampled) if sampled else 0
    batch.meta["last_weight_version"] = max(sampled) if sampled else 0
    return batch


def agent_metrics(
    trajectories: list[Trajectory], elapsed: float, server: TurnServer
) -> dict[str, float]:
    """Per batch: turns and tool calls per trajectory, tool errors by kind, tool latency
    p50/p99, the generator's idle share, and trajectories per second."""
    count = max(len(trajectories), 1)
    latencies = torch.tensor([x for t in trajectories for x in t.latencies], dtype=torch.float64)
    errors: Counter[str] = Counter()
    for t in trajectories:
        errors.update(t.errors)
    found = {
        "agent/turns": sum(t.turns for t in trajectories) / count,
        "agent/tool_calls": sum(t.tool_calls for t in trajectories) / count,
        "agent/tool_call_rate": sum(t.tool_calls > 0 for t in trajectories) / count,
        "agent/tool_errors": float(sum(errors.values())),
        "agent/generator_idle_share": max(0.0, 1.0 - server.busy_s / max(elapsed, 1e-9)),
        "agent/generate_calls": float(server.calls),
        # the share of the turns' prompt positions the generator did not prefill again
        "agent/prefix_reuse": server.reused / max(server.positions, 1),
        "agent/prefilled_positions": float(server.positions - server.reused),
        "agent/traj_per_s": len(trajectories) / max(elapsed, 1e-9),
        "agent/seconds": elapsed,
    }
    for kind, n in sorted(errors.items()):
        found[f"agent/tool_errors/{kind}"] = float(n)
    if latencies.numel():
        # no serving finishes the batch before its slowest trajectory's tools have run
        found["agent/tool_latency_max_total_s"] = max(sum(t.latencies) for t in trajectories)
        found["agent/tool_latency_p50_s"] = float(latencies.quantile(0.5))
        found["agent/tool_latency_p99_s"] = float(latencies.quantile(0.99))
    for finish, n in sorted(Counter(t.finish for t in trajectories).items()):
        found[f"agent/finish/{finish}"] = n / count
    return found
