"""The rollout pipeline: the one owner of generation in an RL run.

``RolloutPipeline`` turns step k's prompts into step k's generated batch. It owns everything
between the data and an algorithm step (``controller/algorithms.py``), which then only scores,
estimates advantages and learns:

* **the generation call**: ``generator.generate(prompts, sampling, min_version)``, the one call
  the colocated actor and a rollout group both take (``controller/clients/``);
* **generate-ahead** (``AlgorithmConfig.max_staleness: k``): while step n trains, the batches of
  steps n+1..n+k are out, each on the weights the generator held at its launch;
* **streaming and partial rollout** (``stream_chunks``, ``partial_rollout``;
  ``controller/streaming.py``) and the ``WeightGate`` that makes weight pushes and generation
  calls take turns;
* **weight syncs** to a separate rollout group (``sync``; rank to rank, ``controller/sync.py``);
* **ReMax's greedy baseline**, generated and scored right after the samples, on their weights;
* **dynamic sampling** (DAPO, ``AlgorithmConfig.dynamic_sampling``): the batch is scored as it
  is generated, groups whose samples all scored alike are dropped and more prompts are generated
  (on the same weights, seeded per round) until ``prompts_per_step`` informative groups are in or
  ``max_rounds`` extra rounds were drawn; generated ahead like any batch under ``max_staleness``;
* **policy versions**, in one unit defined here.

**Policy version.** The policy version of a set of actor weights is the number of training steps
(SFT and RL; one each, however many optimizer updates a step makes) that made them: 0 for the
initial weights, and after the trainer's global step s the actor's weights are version s. It is
the trainer's global step (``Trainer.global_step`` reads ``RolloutPipeline.version``); weight
pushes carry it to a rollout group, which refuses to generate on weights older than the
``min_version`` a call names; each generated row carries the version that sampled it as its
``policy_version`` column (``stamp``), and each response token as ``token_versions``
(``controller/streaming.py``). A batch trains at step n only if no row is more than
``max_staleness`` versions behind the learner (``check_staleness``). The colocated actor always
generates on its newest weights, so it never lags. The batches still pending when a checkpoint is
written go into it (``save_pending`` / ``load_pending``), so a resumed run trains on exactly the
batches the straight run would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from controller.agent import (
    TRAJECTORY_COLUMNS,
    ActionDesk,
    AgentConfig,
    AgentRollout,
    run_agents,
    run_trajectories,
)
from controller.algorithm_config import AlgorithmConfig
from controller.scoring import ask, finite, keep_notes, stash, stashed
from controller.steps import Roles, Timer, rewarded, with_columns
from controller.streaming import (
    Generator,
    WeightGate,
    concat_padded,
    fill_replicas,
    replicas,
    stream,
)
from controller.sync import WeightSync, WeightSyncError
from transport.batch import TensorBatch
from transport.columns import SCORES
from transport.protocol import PEAK_MEMORY
from transport.sampling import SamplingConfig

VERSION = "policy_version"
log = logging.getLogger("hybridflow.rollouts")


class StalenessError(RuntimeError):
    """A batch older than ``max_staleness`` reached training: a bug in the pipeline, not input."""


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of request ``index`` of step ``step`` (-1: the step's batch seed)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class StageRollouts:
    """What the pipeline needs of an RL stage: its settings, its steps, the seed of its sampling
    and ``prompts(k)``, the prompts of its step k (with a ``uid`` and a ``seed`` per request)."""

    cfg: AlgorithmConfig
    steps: int
    seed: int
    prompts: Callable[[int], TensorBatch]
    #: prompts of extra round r >= 1 of step k (dynamic sampling); None: the stage draws none
    more: Callable[[int, int], TensorBatch] | None = None


@dataclass
class Rollout:
    """Step k's batch as it reaches training: the rows, each row's staleness (learner version
    minus the version that sampled it) and when its generation ran (perf_counter seconds)."""

    batch: TensorBatch
    behind: torch.Tensor
    span: tuple[float, float] | None


class RolloutPipeline:
    """Generation for the trainer: step k's batch (``next``), weight syncs (``sync``), the
    policy version (``version``; ``trained`` counts one step), validation's calls
    (``generate``). Use ``async with pipeline.stage(...)`` around an RL stage's loop."""

    def __init__(self, roles: Roles, weights: WeightSync, agent: AgentConfig | None = None) -> None:
        self.roles = roles
        self.weights = weights
        self.agent = agent  # multi-turn rollouts through an env role (controller/agent.py)
        self._agent_setup: AgentRollout | None = None
        self._sessions = 0  # env sessions opened so far: each trajectory gets a new one
        self.gate = WeightGate()  # weight pushes to the rollout group vs. its generation calls
        self.version = 0  # policy version of the actor's weights (see the module docstring)
        # policy version a separate rollout group holds; None: not known (a new pipeline, e.g.
        # after a rollback, whose group may hold a failed attempt's weights): the first sync
        # pushes whatever the group says it holds
        self.synced: int | None = None
        self.sync_bytes = 0  # what the last sync moved into the rollout group's rank 0
        self.sync_controller_bytes = 0  # what crossed the controller meanwhile (commands only)
        self.sync_controller_weight_bytes = 0  # of that, tensor payloads (0 by design)
        self.ahead: dict[int, asyncio.Future[TensorBatch]] = {}  # step -> batch out or done
        self._spans: dict[int, tuple[float, float]] = {}  # step -> when its batch generated
        self._stage: StageRollouts | None = None
        self._rollout_group = ""  # the rollout role's group, when it is restarted alone
        self._supervise()

    def _supervise(self) -> None:
        """A rollout group the controller restarts gets the actor's weights before it serves."""
        rollout = self.roles.rollout
        supervisor = rollout.controller.supervisor if rollout is not None else None
        if rollout is not None and supervisor is not None:
            self._rollout_group = rollout.controller.group_of(rollout.role).spec.name
            supervisor.restore[self._rollout_group] = self._restore_rollout

    async def _restore_rollout(self) -> None:
        """A restarted rollout group holds its initial weights (version 0): push the actor's
        current ones, outside the gate (nothing generates on the new group before this
        returns; calls the death failed are then sent again). Batches still out on it under
        ``max_staleness`` are so regenerated on the newest weights: rows fresher than stamped."""
        assert self.roles.rollout is not None
        version = self.version
        if version:
            await self.weights.push(self.roles.rollout, version)
        self.synced = version

    @property
    def generator(self) -> Generator:
        return self.roles.generator

    @property
    def held(self) -> int:
        """The policy version of the weights the generator samples from now."""
        if self.roles.rollout is None:
            return self.version
        if self.synced is None:
            raise RuntimeError("the rollout group's weights are not known before the first sync")
        return self.synced

    @property
    def switch(self) -> bool:
        """Partial rollout 'switch': a push need not wait for the batches out."""
        partial = self._stage.cfg.partial_rollout if self._stage else None
        return partial is not None and partial.on_update == "switch"

    def trained(self) -> None:
        """The actor's weights took one more training step (SFT or RL)."""
        self.version += 1

    async def generate(self, prompts: TensorBatch, sampling: SamplingConfig) -> TensorBatch:
        """One generation call on the generator's current weights (validation's); with an agent
        configured, one trajectory per prompt and sample."""
        if self.agent is not None:
            seeded = TensorBatch(dict(prompts.tensors), dict(prompts.non_tensors), prompts.meta)
            seeded.non_tensors.setdefault("seed", list(range(len(prompts))))
            return await self._trajectories(seeded, sampling, self.held)
        # fewer prompts than the generator's replicas: each gets one, the extras' samples go
        padded = fill_replicas(prompts, replicas(self.generator))
        reply = await self.generator.generate(padded, sampling, self.held)
        return reply if len(padded) == len(prompts) else reply[: len(prompts) * sampling.n]

    async def _trajectories(
        self, prompts: TensorBatch, sampling: SamplingConfig, version: int
    ) -> TensorBatch:
        """Multi-turn rollouts of ``prompts`` (``controller/agent.py``)."""
        assert self.agent is not None
        env = self.roles.env
        if env is None:
            raise RuntimeError("trainer.agent needs a role named 'env'; none is placed")
        if self._agent_setup is None:
            spec = await env.spec()
            desk = ActionDesk(env, self.agent.collect_wait_s, self.agent.action_timeout_s)
            self._agent_setup = AgentRollout(
                self.generator, env, self.agent, spec, self.gate, desk=desk
            )
        first = self._sessions
        self._sessions += len(prompts) * sampling.n
        setup = dataclasses.replace(self._agent_setup, first_session=first)
        group = env.controller.group_of(env.role)
        while True:
            incarnation = group.incarnation
            try:
                run = run_agents if setup.spec.agent else run_trajectories
                return await run(setup, prompts, sampling, version)
            except Exception:
                if not await self._env_restarted(group.spec.name, incarnation):
                    raise
                log.warning(
                    "env group %r was restarted: its sessions are gone; the %d trajectories of "
                    "the batch run again from their start, with the same seeds",
                    group.spec.name,
                    len(prompts) * sampling.n,
                )

    async def _env_restarted(self, name: str, incarnation: int) -> bool:
        """Whether the env group was (or is being) restarted since ``incarnation``: its open
        sessions died with it, so the trajectories that used them are run again."""
        assert self.roles.env is not None
        controller = self.roles.env.controller
        supervisor, group = controller.supervisor, controller.groups[name]
        if supervisor is None:
            return False
        if group.dead is not None and not await supervisor.recovered(name):
            return False
        await supervisor.serving(name)
        return group.incarnation != incarnation and group.dead is None

    async def sync(self) -> None:
        """The actor's weights to a separate rollout group when it holds older ones, after the
        batches it is still generating (they were promised the older weights) unless partial
        rollout switches them to the new weights at their next chunk."""
        rollout = self.roles.rollout
        if rollout is None or self.synced == self.version:
            return
        version = self.version
        if not self.switch:
            await self.drain()
        try:
            async with self.gate.push():
                pushed = await self.weights.push(rollout, version)
            self.sync_bytes = int(pushed.get("received", {}).get("bytes", 0))
            self.sync_controller_bytes = int(pushed.get("controller_bytes", 0))
            self.sync_controller_weight_bytes = int(pushed.get("controller_weight_bytes", 0))
        except WeightSyncError:  # the rollout group died during the push, and was restarted?
            supervisor = rollout.controller.supervisor
            if supervisor is None or not await supervisor.recovered(self._rollout_group):
                raise
            if self.synced is not None and self.synced >= version:
                return  # its restore gave it these weights (or newer)
            async with self.gate.push():
                await self.weights.push(rollout, version)
        self.synced = version

    async def drain(self) -> dict[int, TensorBatch]:
        """Wait for every batch generated ahead; step -> batch."""
        return {m: await task for m, task in sorted(self.ahead.items())}

    @asynccontextmanager
    async def stage(
        self, plan: StageRollouts, restored: dict[int, TensorBatch] | None = None
    ) -> AsyncIterator[None]:
        """An RL stage's rollouts; ``restored``: batches generated ahead, from a checkpoint."""
        self._stage = plan
        self.ahead = {m: _done(batch) for m, batch in (restored or {}).items()}
        try:
            yield
        finally:
            for task in self.ahead.values():
                task.cancel()
            self.ahead, self._stage = {}, None

    async def next(self, k: int, timer: Timer) -> Rollout:
        """Step k's batch: the one generated ahead, or generated now on the newest weights.
        Under ``max_staleness: lag`` the batches up to k + lag are launched first."""
        plan = self._plan()
        lag = plan.cfg.max_staleness
        if lag:
            await self._launch(range(k, min(k + lag + 1, plan.steps)), timer)
        batch = await (self.ahead.pop(k) if k in self.ahead else self._rollout(k))
        behind = check_staleness(batch, self.version, lag, k)
        return Rollout(batch, behind, self._spans.pop(k, None))

    def _plan(self) -> StageRollouts:
        if self._stage is None:
            raise RuntimeError("RolloutPipeline.next outside 'async with pipeline.stage(...)'")
        return self._stage

    async def _launch(self, steps: Sequence[int], timer: Timer) -> None:
        """Start generating the batches of ``steps`` not yet out. On a rollout group they run in
        the background after one sync (which first waits for the group's batches in flight); the
        colocated actor generates them here, one after another, on the weights it has now."""
        missing = [m for m in steps if m not in self.ahead]
        if not missing:
            return
        if self.roles.rollout is None:
            for m in missing:
                self.ahead[m] = _done(await self._rollout(m, sync=False))
            return
        async with timer("sync"):
            await self.sync()
        for m in missing:
            self.ahead[m] = asyncio.ensure_future(self._rollout(m, sync=False))

    async def _rollout(self, k: int, sync: bool = True) -> TensorBatch:
        """Batch k on the generator's weights now, stamped with their version."""
        plan = self._plan()
        cfg = plan.cfg
        prompts = plan.prompts(k)
        if sync:
            await self.sync()
        version = self.held
        began = time.perf_counter()
        batch = await self._generate(prompts, cfg, request_seed(plan.seed, k, -1), version)
        if cfg.dynamic_sampling is not None:
            batch = await self._informative(batch, plan, k, version)
        if cfg.greedy_baseline:
            baseline = await self._greedy_baseline(batch, cfg, k, version)
            batch = with_columns(batch, remax_baseline=baseline)
        self._spans[k] = (began, time.perf_counter())
        return stamp(batch, version)

    async def _generate(
        self, prompts: TensorBatch, cfg: AlgorithmConfig, seed: int, version: int
    ) -> TensorBatch:
        if self.agent is not None:
            return await self._trajectories(prompts, cfg.sampling(seed), version)
        return await stream(
            self.roles,
            prompts,
            cfg.sampling(seed),
            sub_batches=cfg.stream_chunks,
            partial=cfg.partial_rollout,
            min_version=version,
            gate=self.gate,
        )

    async def _informative(
        self, batch: TensorBatch, plan: StageRollouts, k: int, version: int
    ) -> TensorBatch:
        """Dynamic sampling: the first ``prompts_per_step`` groups (by ``uid``) whose scores are
        not all equal, from ``batch`` and up to ``max_rounds`` further rounds of prompts; the
        first round's batch as it is when no group was informative. The scores stay in the
        batch (``controller/scoring.py``), so the step does not ask for them again."""
        cfg, reward = plan.cfg, self.roles.reward
        if cfg.dynamic_sampling is None or plan.more is None:
            raise RuntimeError("dynamic sampling needs the stage's extra prompts (plan.more)")
        want, first = cfg.prompts_per_step, batch
        kept: list[TensorBatch] = []
        groups = drawn = informative = rounds = generated = 0
        for r in range(cfg.dynamic_sampling.max_rounds + 1):
            if r:
                seed = request_seed(plan.seed, k, -1 - r)
                batch = await self._generate(plan.more(k, r), cfg, seed, version)
            rounds += 1
            generated += int(batch.tensors["response_mask"].sum())
            found = stashed(batch, reward.role)
            if found is None:
                reply = await ask(reward, batch)
                keep_notes(batch, reward.role, reply)
                found = reply.tensors
            stash(batch, reward.role, found)
            uids = [int(u) for u in batch.non_tensors["uid"]]
            useful = informative_groups(finite(found[SCORES])[0], uids)
            drawn += len(set(uids))
            informative += len(useful)
            taken = useful[: want - groups]
            if taken:
                kept.append(renumbered(batch, taken, groups, version))
                groups += len(taken)
            if groups >= want:
                break
        out = concat_padded(kept) if kept else first
        out.meta["dynamic"] = {
            "rollout/dynamic/rounds": float(rounds),
            "rollout/dynamic/drawn_groups": float(drawn),
            "rollout/dynamic/informative_frac": informative / max(drawn, 1),
            "rollout/dynamic/kept_groups": float(groups),
            # what was generated (every round), and the share of it the step trains on
            "rollout/dynamic/generated_tokens": float(generated),
            "rollout/dynamic/kept_token_share": float(out.tensors["response_mask"].sum())
            / max(generated, 1),
        }
        return out

    async def _greedy_baseline(
        self, batch: TensorBatch, cfg: AlgorithmConfig, k: int, version: int
    ) -> torch.Tensor:
        """Per row, the reward of its prompt's greedy response on the weights that sampled
        ``batch`` (ReMax's baseline)."""
        prompts = first_of_each(batch)
        sampling = cfg.sampling(k, greedy=True)
        if self.agent is not None:
            greedy = await self._trajectories(prompts, sampling, version)
        else:
            greedy = await self.generator.generate(prompts, sampling, version)
        base, _ = await rewarded(self.roles, greedy, cfg)  # shaped as the samples are
        return base[index_of(batch, greedy)]


def informative_groups(score: torch.Tensor, uids: Sequence[int]) -> list[int]:
    """The uids, in order of first appearance, whose rows' scores are not all equal."""
    low: dict[int, float] = {}
    high: dict[int, float] = {}
    for uid, value in zip(uids, score.tolist(), strict=True):
        low[uid] = min(low.get(uid, value), value)
        high[uid] = max(high.get(uid, value), value)
    return [uid for uid in low if high[uid] > low[uid]]


def renumbered(batch: TensorBatch, uids: Sequence[int], offset: int, version: int) -> TensorBatch:
    """The rows of groups ``uids``, their uids renumbered ``offset``, ``offset`` + 1, ... in
    that order (rounds of dynamic sampling each number their prompts from 0)."""
    new = {uid: offset + i for i, uid in enumerate(uids)}
    rows = [i for i, u in enumerate(batch.non_tensors["uid"]) if int(u) in new]
    part = batch.index(rows)
    part.non_tensors["uid"] = [new[int(u)] for u in part.non_tensors["uid"]]
    part.meta.setdefault("weight_version", version)
    part.meta.setdefault("last_weight_version", part.meta["weight_version"])
    return part


def _done(batch: TensorBatch) -> asyncio.Future[TensorBatch]:
    found: asyncio.Future[TensorBatch] = asyncio.get_running_loop().create_future()
    found.set_result(batch)
    return found


def first_of_each(batch: TensorBatch) -> TensorBatch:
    """One row per prompt (by ``uid``), text columns only: the prompts a batch was drawn from."""
    made = ("response", "finish", "request", *TRAJECTORY_COLUMNS)
    keep = [k for k in batch.non_tensors if k not in made]
    seen: dict[Any, int] = {}
    for i, uid in enumerate(batch.non_tensors["uid"]):
        seen.setdefault(uid, i)
    return batch.select([], keep, []).index(torch.tensor(list(seen.values()), dtype=torch.long))


def index_of(batch: TensorBatch, per_prompt: TensorBatch) -> torch.Tensor:
    """For each row of ``batch``, the row of ``per_prompt`` with the same ``uid``."""
    where = {uid: i for i, uid in enumerate(per_prompt.non_tensors["uid"])}
    return torch.tensor([where[u] for u in batch.non_tensors["uid"]], dtype=torch.long)


def stamp(batch: TensorBatch, version: int) -> TensorBatch:
    """``batch`` with a ``policy_version`` column: the generator's weight version, per row."""
    column = torch.full((len(batch),), version, dtype=torch.long)
    return TensorBatch(
        {**batch.tensors, VERSION: column}, dict(batch.non_tensors), dict(batch.meta)
    )


def check_staleness(batch: TensorBatch, learner: int, limit: int, step: int) -> torch.Tensor:
    """Per-row staleness (learner version - sampled version); raises if any row exceeds
    ``limit`` or was sampled from weights newer than the learner's."""
    behind = learner - batch.tensors[VERSION]
    if len(behind) and (int(behind.max()) > limit or int(behind.min()) < 0):
        raise StalenessError(
            f"step {step}: the batch was sampled with policy versions "
            f"{sorted(set(batch.tensors[VERSION].tolist()))} but the learner is at {learner}; "
            f"algorithm.max_staleness={limit} allows 0..{limit} versions behind"
        )
    return behind


def memory_metrics(batch: TensorBatch, metrics: dict[str, float]) -> dict[str, float]:
    """``mem/generate_peak_gib`` and ``mem/train_peak_gib``: the peak memory of the step's
    generation (of the rank whose meta the batch carries) and of its largest policy update,
    which is taken out of ``metrics`` (it is no result of training: runs of the same work
    differ in it, as in timings)."""
    found = {}
    if PEAK_MEMORY in batch.meta:
        found["mem/generate_peak_gib"] = float(batch.meta[PEAK_MEMORY]) / 2**30
    train = metrics.pop(f"actor/{PEAK_MEMORY}", None)
    if train is not None:
        found["mem/train_peak_gib"] = float(train) / 2**30
    return found


def staleness_metrics(behind: torch.Tensor, limit: int) -> dict[str, float]:
    """Mean and max staleness, and how many rows were 0, 1, .., ``limit`` versions behind."""
    if behind.numel() == 0:
        return {"train/staleness": 0.0, "train/staleness_max": 0.0}
    found = {
        "train/staleness": float(behind.float().mean()),
        "train/staleness_max": float(behind.max()),
    }
    counts = torch.bincount(behind, minlength=limit + 1)
    found.update({f"staleness/k={i}": float(counts[i]) for i in range(limit + 1)})
    return found


def save_pending(folder: Path, stage: int, batches: dict[int, TensorBatch]) -> None:
    """Each batch as ``<step>.safetensors`` (tensors) + ``<step>.json`` (text columns, meta)."""
    folder.mkdir(parents=True, exist_ok=True)
    for step, batch in batches.items():
        tensors = {k: v.contiguous() for k, v in batch.tensors.items()}
        save_file(tensors, str(folder / f"{step}.safetensors"))
        rest = {"stage": stage, "non_tensors": batch.non_tensors, "meta": batch.meta}
        (folder / f"{step}.json").write_text(json.dumps(rest))


def load_pending(folder: Path) -> tuple[int | None, dict[int, TensorBatch]]:
    """(stage, step -> batch) as ``save_pending`` wrote them; (None, {}) when there are none."""
    found: dict[int, TensorBatch] = {}
    stage: int | None = None
    if not folder.is_dir():
        return None, found
    for path in sorted(folder.glob("*.json")):
        rest: dict[str, Any] = json.loads(path.read_text())
        stage = int(rest["stage"])
        tensors = load_file(str(path.with_suffix(".safetensors")))
        found[int(path.stem)] = TensorBatch(tensors, rest["non_tensors"], rest["meta"])
    return stage, found
