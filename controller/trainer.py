"""The trainer: stages of SFT and RL over the roles, validation, checkpoints, exact resume.

A run is a list of stages (e.g. SFT then GRPO). Each stage configures the optimizers it trains
with, then loops; every record goes to the metric sinks (JSONL, TensorBoard, the live view).
Validation generates greedily on held-out prompts and scores them with the reward role; it runs
at the start of the run, at each stage boundary, every ``val_every`` RL steps and at the end, so
``summary.json`` can say what the random model, the SFT checkpoint and the RL result score.

Checkpoints (``run_dir/checkpoints/step_NNNNNN``) hold every trained role's sharded state
(weights, optimizer, schedule, RNG) and ``controller.json`` (stage, step, data position, the
stage's KL controller and Lagrange multiplier, validations so far, the dtype each
model-holding role computed in). They are written into ``step_NNNNNN.partial`` and renamed, so
a crash never leaves a half checkpoint; the last ``keep_last`` are kept. Resuming reloads the
newest and continues with the same data order and the same per-request sampling seeds, so a
resumed run reproduces the straight run exactly.

Precision is part of that: ``dtype: auto`` is resolved on the ranks at every start (a CPU probe
that can flip between starts on one machine, or another machine's GPU), so a resumed run could
continue a bf16 run in fp32, and its summary would then claim fp32 for all of it. Resuming
therefore refuses (``PrecisionChanged``) when a role's resolved dtype differs from the one its
checkpoint records, naming the role, both dtypes and the setting that fixes the choice
(``--set roles.<role>.dtype=<recorded>``). It refuses rather than pins: the dtype is decided on
the ranks when their engines are built, before the controller reads any checkpoint, and a run
should not change what its configuration says behind the user's back.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from controller.agent import AgentConfig
from controller.algorithm_config import AlgorithmConfig
from controller.algorithms import step_program
from controller.clients import EngineClient
from controller.metrics import Sample, sample_sinks
from controller.rollouts import (
    Rollout,
    RolloutPipeline,
    StageRollouts,
    load_pending,
    memory_metrics,
    request_seed,
    save_pending,
    staleness_metrics,
)
from controller.scoring import notes_of, scores, stashed
from controller.snapshots import Snapshot, Snapshots
from controller.steps import BaseModelClient, Roles, State, first_rows
from controller.supervised import text_batch
from controller.sync import WeightSync
from transport.batch import TensorBatch
from transport.columns import SCORES
from transport.sampling import SamplingConfig
from transport.training import OptimConfig
from transport.weight_sync import WeightSyncSettings

Rows = list[dict[str, Any]]
Sink = Callable[[dict[str, Any]], None]
TIMING_PREFIXES = ("time/", "perf/", "mem/")  # what differs between runs of the same work


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    steps: int = Field(0, ge=0)
    epochs: int | None = Field(
        None, ge=1, description="instead of steps: passes over the data (steps = epochs x batches)"
    )
    data: str = Field(description="training rows: JSONL, Parquet or builtin:...")
    optim: dict[str, Any] | None = Field(
        None,
        description="the actor's optimizer for this stage (transport/training.py OptimConfig; "
        "a decaying schedule's total_steps defaults to the stage's optimizer steps)",
    )
    shuffle: bool = Field(True, description="false: rows in file order, epoch after epoch")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> _Stage:
        if self.epochs is not None and self.steps:
            raise ValueError("give steps or epochs, not both")
        return self

    def rows_per_step(self) -> int:
        raise NotImplementedError

    def resolve_epochs(self, n_rows: int) -> None:
        """Turn ``epochs`` into ``steps`` once the data's size is known."""
        if self.epochs is not None:
            self.steps = self.epochs * max(1, n_rows // self.rows_per_step())

    def optimizer_steps(self) -> int:
        return self.steps

    def fill_total_steps(self, optim: dict[str, Any] | None) -> OptimConfig | None:
        """The optimizer config; a decaying schedule spans the stage's optimizer steps unless
        told otherwise (validated here: a warm-up must fit in those steps)."""
        if optim is None:
            return None
        if optim.get("schedule", "constant") == "constant":
            return OptimConfig.model_validate(optim)
        return OptimConfig.model_validate({"total_steps": max(1, self.optimizer_steps()), **optim})

    def optims(self) -> dict[str, OptimConfig]:
        """Role → optimizer config this stage sets at its start."""
        found = self.fill_total_steps(self.optim)
        return {"actor": found} if found is not None else {}


class SFTStage(_Stage):
    kind: Literal["sft"] = "sft"
    batch_size: int = Field(32, ge=1)
    val_data: str | None = Field(None, description="held-out (prompt, response) rows for loss")
    val_every: int = Field(0, ge=0, description="steps between held-out loss checks")
    response_only: bool = True
    pack: bool = False

    def rows_per_step(self) -> int:
        return self.batch_size


class RLStage(_Stage):
    kind: Literal["rl"] = "rl"
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic_optim: dict[str, Any] | None = None
    ptx_data: str | None = Field(None, description="Safe-RLHF pretraining rows (prompt, response)")
    init_from_actor: bool = Field(
        True,
        description="after an earlier stage trained the actor: start the reference from its "
        "weights and the critics from its backbone (the usual 'SFT model' start)",
    )

    def rows_per_step(self) -> int:
        return self.algorithm.prompts_per_step

    def optimizer_steps(self) -> int:
        return self.steps * self.algorithm.ppo_epochs * self.algorithm.mini_batches

    def optims(self) -> dict[str, OptimConfig]:
        found = super().optims()
        critic = self.fill_total_steps(self.critic_optim)
        if critic is not None:
            found["critic"] = critic
            if self.algorithm.name == "safe_rlhf":
                found["cost_critic"] = critic
        return found

    @model_validator(mode="after")
    def _ptx(self) -> RLStage:
        safe = self.algorithm.safe
        if safe is not None and safe.ptx_coef and not self.ptx_data:
            raise ValueError("algorithm.safe.ptx_coef > 0 needs the stage's ptx_data (SFT rows)")
        return self


Stage = Annotated[SFTStage | RLStage, Field(discriminator="kind")]


class LogSamples(BaseModel):
    """How many generated answers the trainer logs, and how often (``samples.jsonl``,
    TensorBoard's text tab, ``hybridflow report``)."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(4, ge=0, description="samples logged each time (0: none)")
    every: int = Field(
        10, ge=1, description="RL steps between logged rollout samples (each stage's first is)"
    )


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    val_data: str | None = Field(None, description="held-out prompts scored greedily")
    val_every: int = Field(0, ge=0, description="RL steps between validations (0: stage ends)")
    val_max_new_tokens: int = Field(16, ge=1)
    prompt_template: str | None = Field(
        None,
        description="format string applied to every generation prompt, with the row's columns "
        "as fields, e.g. a chat turn around {prompt}; the model's own bos comes first",
    )
    save_every: int = Field(
        0, ge=0, description="steps between checkpoints (0: by wall time, save_every_s)"
    )
    save_every_s: float = Field(
        600.0,
        ge=0,
        description="with save_every 0: a checkpoint after the first step that ends this many "
        "seconds after the last one (0: only at each stage's end)",
    )
    agent: AgentConfig | None = Field(
        None,
        description="multi-turn rollouts: every RL batch and validation is generated turn by "
        "turn with the 'env' role's tools or environment (docs/agentic.md)",
    )
    keep_last: int = Field(2, ge=1, description="checkpoints kept; older ones are deleted")
    snapshot_every: int | None = Field(
        None,
        ge=0,
        description="steps between in-memory snapshots of the trained roles' state (shared "
        "memory on their hosts: it outlives a rank, not the machine), which a rollback after a "
        "death resumes from when newer than the last checkpoint (docs/deploy.md, "
        "'Supervision'); unset: every step when a stateful group has a restart policy, else "
        "none; 0: none; backend: fsdp only",
    )
    log_samples: LogSamples = Field(
        default_factory=LogSamples,
        description="generated answers logged with their prompt and reward: at every "
        "validation (greedy) and every few RL steps (sampled)",
    )
    export: bool = Field(True, description="export the final actor as a Hugging Face folder")
    weight_sync: WeightSyncSettings = Field(
        default_factory=WeightSyncSettings,
        description="how the actor's weights reach a rollout group, the reference and critics "
        "(rank to rank, never through the controller; controller/sync.py)",
    )


def epoch_batches(
    n_rows: int, size: int, seed: int, start: int, count: int, shuffle: bool = True
) -> list[list[int]]:
    """Row indices of batches ``start .. start+count-1``: each epoch a fresh seeded shuffle,
    a batch never spans epochs. A pure function of its arguments, so resuming is exact."""
    if n_rows < size:
        raise ValueError(f"{n_rows} rows cannot fill a batch of {size}")
    per_epoch = n_rows // size
    found = []
    for b in range(start, start + count):
        epoch, within = divmod(b, per_epoch)
        order = _epoch_order(n_rows, seed, epoch, shuffle)
        found.append(list(order[within * size : (within + 1) * size]))
    return found


@functools.lru_cache(maxsize=2)
def _epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(n_rows))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        stages: Sequence[SFTStage | RLStage],
        roles: Roles,
        clients: dict[str, EngineClient],
        data: dict[str, Rows],
        run_dir: Path,
        trainable: Sequence[str],
        sinks: Sequence[Sink] = (),
        stop_after: int | None = None,
        snapshots: Snapshots | None = None,
        score_name: str = "acc",
    ) -> None:
        self.cfg, self.stages, self.roles, self.clients = cfg, list(stages), roles, clients
        self.snapshots = snapshots
        self.data, self.run_dir, self.trainable = data, run_dir, list(trainable)
        self.sinks = list(sinks)
        self.sample_sinks = sample_sinks(sinks)
        self.stop_after = stop_after  # global step to checkpoint and stop at (as if interrupted)
        self.stop_requested = False  # Ctrl-C: checkpoint after the step in flight, then stop
        #: what the validation score is, as the summary names it: ``acc`` (a rule's 0/1 reward,
        #: the default), ``rm_score`` (a reward model's), ``judge_score`` (an LLM judge's)
        self.score_name = score_name
        self.last_save = time.monotonic()  # (the run's start counts as one, for save_every_s)
        self.ckpt_dir = run_dir / "checkpoints"
        self.validations: list[dict[str, Any]] = []
        self.restored: dict[int, TensorBatch] = {}  # pending batches read from a checkpoint
        self.resumed_state: dict[str, Any] | None = None  # the stage's State, from a checkpoint
        self.t0 = time.perf_counter()
        self.weights = WeightSync(roles.actor, cfg.weight_sync)
        self.pipeline = RolloutPipeline(roles, self.weights, cfg.agent)
        self.saved_step = -1
        self.snapshot_s = 0.0  # how long the last in-memory snapshot took
        self.precision: dict[str, dict[str, str]] = {}
        self.state = State.initial(AlgorithmConfig())  # each RL stage starts its own

    def saved_step_on_disk(self) -> int:
        """The global step of the newest complete checkpoint (0: none)."""
        return newest_step(self.ckpt_dir) or 0

    @property
    def global_step(self) -> int:
        """Training steps taken (SFT and RL): the actor's policy version (controller/rollouts.py)."""
        return self.pipeline.version

    # -- the run ------------------------------------------------------------------------------

    async def run(self, resume: bool = False) -> dict[str, Any]:
        try:
            return await self._run(resume)
        except _Stopped:
            found = {"stopped_at": self.global_step, "steps": self.global_step}
            return found | ({"interrupted": True} if self.stop_requested else {})

    def request_stop(self) -> None:
        """Finish the step in flight, write a checkpoint, then stop (``run`` returns
        ``stopped_at``): what the first Ctrl-C asks for."""
        self.stop_requested = True

    async def _run(self, resume: bool) -> dict[str, Any]:
        start_stage, start_step = 0, 0
        self.precision = await self._precision()
        if resume:
            start_stage, start_step = await self._restore()
        else:
            await self._validate("init")
        for index in range(start_stage, len(self.stages)):
            stage = self.stages[index]
            first = start_step if index == start_stage else 0
            if first == 0:
                await self._configure(index)
                if index > 0 and isinstance(stage, RLStage):
                    if stage.init_from_actor:
                        await self._init_from_actor()
                    await self._validate(f"before:{stage.name}")
            if isinstance(stage, SFTStage):
                await self._sft(index, stage, first)
            else:
                self.state = State.initial(stage.algorithm)
                if first and self.resumed_state is not None:
                    self.state.load_state_dict(self.resumed_state)
                await self._rl(index, stage, first)
            if self.saved_step != self.global_step:
                await self._save(index, stage.steps)
        final = await self._validate("final")
        if self.cfg.export:
            await self.roles.actor.export(str((self.run_dir / "export" / "actor").resolve()))
        return self._summary(final)

    def _summary(self, final: dict[str, Any]) -> dict[str, Any]:
        def score(tag_prefix: str, key: str = "val/score") -> float | None:
            for v in self.validations:
                if str(v["tag"]).startswith(tag_prefix):
                    found = v.get(key, v.get("record", {}).get(key))
                    return None if found is None else float(found)
            return None

        calls = {}
        if final and "val/tool_call_rate" in final:  # multi-turn: how often the model called
            calls = {
                "val_tool_calls_before": score("before:", "val/tool_call_rate"),
                "val_tool_calls_after": float(final["val/tool_call_rate"]),
            }
        return {
            f"val_{self.score_name}_init": score("init"),
            f"val_{self.score_name}_before": score("before:"),
            f"val_{self.score_name}_after": float(final["val/score"]) if final else None,
            "val_score_is": self.score_name,
            **calls,
            "steps": self.global_step,
            "precision": self.precision,
            "validations": self.validations,
        }

    async def _precision(self) -> dict[str, dict[str, str]]:
        """Per model-holding role: the dtype it computes in (``dtype: auto`` resolved on its
        ranks) and why, so a result says what it ran in."""
        found = {role: await client.precision() for role, client in self.clients.items()}
        if self.roles.rollout is not None:
            found["rollout"] = await self.roles.rollout.precision()
        return found

    def _emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink(record)

    # -- stages -------------------------------------------------------------------------------

    async def _configure(self, index: int) -> None:
        """The optimizers in force at stage ``index``: the newest each role was given."""
        effective: dict[str, OptimConfig] = {}
        for stage in self.stages[: index + 1]:
            effective.update(stage.optims())
        for role, optim in effective.items():
            if role in self.clients:
                await self.clients[role].configure_optim(optim)

    async def _init_from_actor(self) -> None:
        """The reference becomes the actor as it is now; critics take its backbone. A LoRA
        actor that is its own reference freezes a copy of its adapters as the reference's."""
        if self.global_step == 0:
            return
        if isinstance(self.roles.reference, BaseModelClient):
            await self.roles.actor.rebase_reference()
        targets = [r for r in ("reference", "critic", "cost_critic") if r in self.clients]
        for role in targets:  # rank to rank (or a copy inside a shared group): reshard/remote.py
            client = self.clients[role]
            await self.weights.push(client, self.global_step, strict=role == "reference")

    async def _sft(self, index: int, stage: SFTStage, first: int) -> None:
        rows = self.data[stage.data]
        seed = self.cfg.seed + 7919 * index
        for k in range(first, stage.steps):
            (picked,) = epoch_batches(len(rows), stage.batch_size, seed, k, 1, stage.shuffle)
            batch = text_batch([rows[i] for i in picked], ("prompt", "response"))
            start = time.perf_counter()
            metrics = await self.roles.actor.sft_step(
                batch, response_only=stage.response_only, pack=stage.pack
            )
            self.pipeline.trained()
            record = self._record(stage, k, {f"train/{n}": v for n, v in metrics.items()})
            record["time/step_s"] = time.perf_counter() - start
            if stage.val_data and stage.val_every and (k + 1) % stage.val_every == 0:
                held_out = text_batch(self.data[stage.val_data], ("prompt", "response"))
                found = await self.roles.actor.sft_eval(held_out, response_only=stage.response_only)
                record["val/loss"] = float(found["loss"])
            self._emit(record)
            await self._maybe_save(index, stage, k)

    async def _rl(self, index: int, stage: RLStage, first: int) -> None:
        cfg, rows = stage.algorithm, self.data[stage.data]
        seed = self.cfg.seed + 7919 * index
        program = step_program(cfg)
        plan = StageRollouts(
            cfg,
            stage.steps,
            seed,
            lambda k: self._prompts(rows, cfg.prompts_per_step, seed, k, stage.shuffle),
            # dynamic sampling's extra rounds: other draws of the data, one seed per round
            lambda k, r: self._prompts(rows, cfg.prompts_per_step, seed + 104729 * r, k, True),
        )
        restored, self.restored = self.restored, {}
        async with self.pipeline.stage(plan, restored):
            for k in range(first, stage.steps):
                self.state.timings, self.state.spans = {}, {}
                timer = self.state.timer()
                start = time.perf_counter()
                async with timer("gen"):
                    rollout = await self.pipeline.next(k, timer)
                metrics = await program(self.roles, rollout.batch, cfg, self.state, k)
                if cfg.safe is not None and cfg.safe.ptx_coef and stage.ptx_data:
                    await self._ptx(stage, seed, k)
                self.pipeline.trained()  # the actor's weights are now this step's
                if not cfg.max_staleness:
                    async with timer("sync"):
                        self.pipeline.sync_bytes = self.pipeline.sync_controller_bytes = 0
                        self.pipeline.sync_controller_weight_bytes = 0
                        await self.pipeline.sync()
                    metrics["sync/bytes"] = self.pipeline.sync_bytes  # rank 0's, 0: no sync
                    # the weights go rank to rank: the controller carries the sync's commands
                    metrics["sync/controller_bytes"] = self.pipeline.sync_controller_bytes
                    weights = self.pipeline.sync_controller_weight_bytes  # of it, tensors
                    metrics["sync/controller_weight_bytes"] = weights
                record = self._rl_record(stage, k, rollout, metrics, start)
                if k % self.cfg.log_samples.every == 0:
                    await self._rollout_samples(stage.name, rollout.batch)
                if self.cfg.val_every and (k + 1) % self.cfg.val_every == 0 and k + 1 < stage.steps:
                    record.update(await self._validate(f"{stage.name}:{k + 1}", emit=False))
                self._emit(record)
                await self._maybe_save(index, stage, k)

    def _rl_record(
        self,
        stage: RLStage,
        k: int,
        rollout: Rollout,
        metrics: dict[str, Any],
        start: float,
    ) -> dict[str, Any]:
        """Step k's record: the step's metrics, timings and timeline, versions and staleness."""
        memory = memory_metrics(rollout.batch, metrics)  # takes the peaks out of metrics
        record = self._record(stage, k, {f"train/{n}": v for n, v in metrics.items()})
        elapsed = time.perf_counter() - start
        record.update({f"time/{n}_s": v for n, v in self.state.timings.items()})
        record.update(self._timeline(start, rollout.span, rollout.batch.meta.get("stream")))
        record["time/step_s"] = elapsed
        # tokens generated, not only those trained on (dynamic sampling drops groups)
        dynamic = rollout.batch.meta.get("dynamic", {})
        generated = dynamic.get("rollout/dynamic/generated_tokens", metrics["response/tokens"])
        record["perf/tokens_per_s"] = generated / max(elapsed, 1e-9)
        record["train/weight_version"] = self.pipeline.version
        record.update(staleness_metrics(rollout.behind, stage.algorithm.max_staleness))
        if "reshard_s" in rollout.batch.meta:  # the actor generated at its gen_tp (reshard/)
            record["time/reshard_s"] = float(rollout.batch.meta["reshard_s"])
        record.update(memory)
        record.update(rollout.batch.meta.get("agent", {}))
        record.update(rollout.batch.meta.get("dynamic", {}))
        return record

    def _timeline(
        self,
        start: float,
        gen: tuple[float, float] | None,
        stream: list[dict[str, list[float]]] | None = None,
    ) -> dict[str, float]:
        """Flat ``time/timeline/<stage>@<role>_start_s`` / ``_end_s`` offsets from the step's start
        (a batch generated ahead starts and ends before 0), and the step's start in the run.

        The step's stages (prepare, update, sync) are the actor's lanes, generation the
        generator's; every role a step calls has its own lanes besides, one per call
        (``compute_values@critic``, ``update_critic@critic``, ``compute_reward@reward``, ...:
        ``Timer.lane`` in ``controller/algorithms.py``), so each group's busy time is known. A
        batch scored while it streamed in (``stream``: its ``meta["stream"]``, seconds since its
        generation began) gives the scoring roles' ``compute_reward`` lanes."""
        where = {"prepare": "actor", "update": "actor", "sync": "actor"}
        found = {"time/timeline/step_start_s": start - self.t0}
        spans = dict(self.state.spans)
        if gen is not None:
            spans["generate"] = gen
            where["generate"] = self.pipeline.generator.role
            scoring = _streamed_scoring(gen[0], stream or [])
            scorers = [r for r in (self.roles.reward, self.roles.cost) if r is not None]
            if scoring is not None:
                spans.update({f"compute_reward@{r.role}": scoring for r in scorers})
        for name, (begin, end) in spans.items():
            lane = name if "@" in name else f"{name}@{where[name]}" if name in where else None
            if lane is not None:
                found[f"time/timeline/{lane}_start_s"] = begin - start
                found[f"time/timeline/{lane}_end_s"] = end - start
        return found

    async def _ptx(self, stage: RLStage, seed: int, k: int) -> None:
        assert stage.ptx_data and stage.algorithm.safe is not None
        rows = self.data[stage.ptx_data]
        size = min(len(rows), stage.algorithm.prompts_per_step)
        (picked,) = epoch_batches(len(rows), size, seed + 1, k, 1)
        batch = text_batch([rows[i] for i in picked], ("prompt", "response"))
        await self.roles.actor.sft_step(batch, scale=stage.algorithm.safe.ptx_coef)

    def _prompts(self, rows: Rows, size: int, seed: int, k: int, shuffle: bool) -> TensorBatch:
        (picked,) = epoch_batches(len(rows), size, seed, k, 1, shuffle)
        batch = self._prompt_batch([rows[i] for i in picked])
        batch.non_tensors["seed"] = [request_seed(seed, k, i) for i in range(len(picked))]
        return batch

    def _prompt_batch(self, rows: Rows) -> TensorBatch:
        """Generation requests: every column but ``response`` (templated ``prompt``), and a
        ``uid`` per request that its samples carry back."""
        chosen = [self._templated(row) for row in rows]
        columns = sorted({c for row in chosen for c in row if c != "response"})
        batch = TensorBatch.from_dict(
            non_tensors={c: [row.get(c) for row in chosen] for c in columns}
        )
        batch.non_tensors["uid"] = list(range(len(chosen)))
        return batch

    def _templated(self, row: dict[str, Any]) -> dict[str, Any]:
        if self.cfg.prompt_template is None:
            return row
        return {**row, "prompt": self.cfg.prompt_template.format(**row)}

    def _record(self, stage: SFTStage | RLStage, k: int, values: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.global_step, "stage": stage.name, "stage_step": k + 1, **values}

    # -- validation -----------------------------------------------------------------------------

    async def _validate(self, tag: str, emit: bool = True) -> dict[str, Any]:
        """Greedy answers to the held-out prompts, scored by the reward role: the mean score
        overall and per ``data_source`` (for a 0/1 rule reward, the accuracy)."""
        if not self.cfg.val_data:
            return {}
        if self.validations and self.validations[-1]["step"] == self.global_step:
            last = self.validations[-1]  # nothing trained since: same weights, same answers
            self.validations.append({**last, "tag": tag})
            return dict(last["record"])
        prompts = self._prompt_batch(self.data[self.cfg.val_data])
        await self.pipeline.sync()
        start = time.perf_counter()
        sampling = SamplingConfig(temperature=0.0, n=1, max_new_tokens=self.cfg.val_max_new_tokens)
        answers = await self.pipeline.generate(prompts, sampling)
        score, _ = await scores(self.roles.reward, answers)
        record: dict[str, Any] = {
            "val/score": float(score.mean()),
            "val/length": float(answers.tensors["response_mask"].float().sum(-1).mean()),
            "time/val_s": time.perf_counter() - start,
        }
        agent = answers.meta.get("agent", {})
        for key in ("tool_call_rate", "turns", "tool_errors"):  # multi-turn validation
            if f"agent/{key}" in agent:
                record[f"val/{key}"] = float(agent[f"agent/{key}"])
        sources = answers.non_tensors.get("data_source")
        if sources:
            for source in sorted({str(s) for s in sources}):
                pick = torch.tensor([str(s) == source for s in sources])
                record[f"val/score/{source}"] = float(score[pick].mean())
        self.validations.append(
            {
                "tag": tag,
                "step": self.global_step,
                "val/score": record["val/score"],
                "record": record,
            }
        )
        count = min(self.cfg.log_samples.count, len(answers))
        self._log_samples("validation", tag, answers, list(range(count)), score[:count])
        if emit:
            self._emit({"step": self.global_step, "stage": tag, **record})
        return record

    # -- samples: what the model said ---------------------------------------------------------

    async def _rollout_samples(self, stage: str, batch: TensorBatch) -> None:
        """A few of the step's samples, one per prompt, with the scores the step used: kept in
        the batch when it was scored while streaming in, else asked again for these rows only
        (a reward role scores the same row the same: rules are functions of the row, and a
        reward model does not train during RL)."""
        picked = _spread(batch, self.cfg.log_samples.count)
        if not picked or not self.sample_sinks:
            return
        found = stashed(batch, self.roles.reward.role)
        if found is not None:
            score = found[SCORES].float()[picked]
            self._log_samples("rollout", stage, batch, picked, score)
            return
        rows = batch.index(picked)
        score, _ = await scores(self.roles.reward, rows)  # (its notes go into rows)
        self._log_samples("rollout", stage, rows, list(range(len(picked))), score)

    def _log_samples(
        self, kind: str, stage: str, batch: TensorBatch, rows: list[int], score: torch.Tensor
    ) -> None:
        """Hand rows ``rows`` of ``batch`` to the sample sinks, with their scores (in order)."""
        if not rows or not self.sample_sinks:
            return
        text = batch.non_tensors
        found: list[Sample] = []
        for row, value in zip(rows, score.tolist(), strict=True):
            sample: Sample = {"step": self.global_step, "stage": stage, "kind": kind}
            sample["prompt"] = text["prompt"][row]
            sample["response"] = text["response"][row]
            sample["reward"] = float(value)
            kept = ("answer", "finish", "turns", "tool_calls", "env_reward", "segments")
            sample.update({c: text[c][row] for c in kept if c in text})
            sample.update(notes_of(batch, self.roles.reward.role, row))  # e.g. a judge's verdict
            found.append(sample)
        for sink in self.sample_sinks:
            sink.samples(found)

    # -- checkpoints ----------------------------------------------------------------------------

    async def _maybe_save(self, index: int, stage: SFTStage | RLStage, k: int) -> None:
        every = self.cfg.save_every
        stop = self.global_step == self.stop_after or self.stop_requested
        due = every and self.global_step % every == 0
        if not every and self.cfg.save_every_s:
            due = time.monotonic() - self.last_save >= self.cfg.save_every_s
        if (stop or due) and k + 1 < stage.steps:
            await self._save(index, k + 1)
        elif stop:
            await self._save(index, stage.steps)
        if stop:
            raise _Stopped
        snap = self.snapshots
        if snap is not None and snap.every and self.global_step % snap.every == 0:
            if self.saved_step != self.global_step and k + 1 < stage.steps:
                await self._snapshot(snap, index, k + 1)

    async def _snapshot(self, snap: Snapshots, stage: int, stage_step: int) -> None:
        """The trained roles' state into shared memory (each rank copies into files it mapped
        at the first snapshot, two slots so a death mid-copy leaves the previous one whole), and
        the controller's part beside it in this process."""
        start = time.perf_counter()
        for role in self.trainable:
            folder = str((snap.folder / role).resolve())
            await self.clients[role].snapshot(folder, self.global_step)
        state = self._controller_state(stage, stage_step)
        pending = await self.pipeline.drain()
        snap.latest = Snapshot(state, dict(pending))
        self.snapshot_s = time.perf_counter() - start

    async def _save(self, stage: int, stage_step: int) -> Path:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        final = self.ckpt_dir / f"step_{self.global_step:06d}"
        aside = final.with_name(final.name + ".partial")
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir()
        for role in self.trainable:  # colocated roles would queue anyway; keep the order fixed
            await self.clients[role].save(str((aside / role).resolve()))
        state = self._controller_state(stage, stage_step)
        pending = await self.pipeline.drain()
        if pending:  # generated ahead (max_staleness): the resumed run trains on these
            save_pending(aside / "pending", stage, pending)
        (aside / "controller.json").write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(aside, final)
        self.saved_step = self.global_step
        self.last_save = time.monotonic()
        for old in checkpoints(self.ckpt_dir)[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _controller_state(self, stage: int, stage_step: int) -> dict[str, Any]:
        """The controller's part of a checkpoint (``controller.json``)."""
        return {
            "stage": stage,
            "stage_step": stage_step,
            "global_step": self.global_step,
            # rows of the stage's data consumed; the order itself is a pure function of
            # (seed, stage, step), so this is all a resume needs to continue the data stream
            "data_position": stage_step * self.stages[stage].rows_per_step(),
            # the stage's own (an SFT stage's checkpoint holds none)
            "algorithm": (
                self.state.state_dict() if isinstance(self.stages[stage], RLStage) else None
            ),
            "validations": list(self.validations),
            "precision": self.precision,  # checked on resume (_check_precision)
        }

    async def _restore(self) -> tuple[int, int]:
        """The newest of the last checkpoint and (after a rollback) the last in-memory snapshot."""
        found = checkpoints(self.ckpt_dir)
        snap = self.snapshots.latest if self.snapshots is not None else None
        on_disk = self.saved_step_on_disk() if found else -1
        if snap is not None and self.snapshots is not None and snap.step > on_disk:
            return await self._restore_snapshot(self.snapshots.folder, snap)
        if not found:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint under {self.ckpt_dir} (a run writes one at "
                "each stage end and every trainer.save_every steps)"
            )
        latest = found[-1]
        saved = json.loads((latest / "controller.json").read_text())
        self._check_precision(latest, saved.get("precision") or {})
        stage = int(saved["stage"])
        await self._configure(stage)
        for role in self.trainable:
            await self.clients[role].load(str((latest / role).resolve()))
        pending_stage, pending = load_pending(latest / "pending")
        if pending and pending_stage != stage:
            raise RuntimeError(
                f"{latest}: pending batches of stage {pending_stage} in a checkpoint of stage "
                f"{stage}; the checkpoint is inconsistent"
            )
        return self._restored(saved, pending)

    async def _restore_snapshot(self, folder: Path, snap: Snapshot) -> tuple[int, int]:
        saved = snap.state
        self._check_precision(folder, saved.get("precision") or {})  # restarted ranks re-resolve
        await self._configure(int(saved["stage"]))
        for role in self.trainable:
            await self.clients[role].restore_snapshot(str((folder / role).resolve()), snap.step)
        return self._restored(saved, dict(snap.pending))

    def _restored(self, saved: dict[str, Any], pending: dict[int, TensorBatch]) -> tuple[int, int]:
        """Take the controller's part of a checkpoint or snapshot; the stage and step to go on
        from."""
        stage, stage_step = int(saved["stage"]), int(saved["stage_step"])
        # the rollout group gets these weights at the first sync (it always pushes)
        self.pipeline.version = int(saved["global_step"])
        self.resumed_state = saved["algorithm"]
        self.validations = list(saved["validations"])
        self.restored = pending
        self.saved_step = self.global_step
        if stage_step >= self.stages[stage].steps:
            return stage + 1, 0
        return stage, stage_step

    def _check_precision(self, checkpoint: Path, saved: dict[str, dict[str, str]]) -> None:
        """Refuse to resume when a role now computes in another dtype than ``checkpoint``
        records (the module docstring says why); a role the checkpoint does not name, or one
        no longer placed, is not compared."""
        changed = {
            role: (was["dtype"], self.precision[role])
            for role, was in sorted(saved.items())
            if role in self.precision and self.precision[role]["dtype"] != was["dtype"]
        }
        if not changed:
            return
        said = "; ".join(
            f"role {role!r} computed in {was} then, now in {now['dtype']} ({now['reason']})"
            for role, (was, now) in changed.items()
        )
        fix = " ".join(f"--set roles.{role}.dtype={was}" for role, (was, _) in changed.items())
        raise PrecisionChanged(
            f"{checkpoint}: {said}. Resume in the checkpoint's precision with {fix} (the "
            "role's dtype: setting), or start a new run to change it"
        )


def _streamed_scoring(
    began: float, stream: list[dict[str, list[float]]]
) -> tuple[float, float] | None:
    """When a streamed batch's sub-batches were scored: the first start to the last end, in
    ``perf_counter`` seconds (``stream``'s are since its generation ``began``); None: none was."""
    pieces = [piece["score"] for piece in stream if "score" in piece]
    if not pieces:
        return None
    return began + min(a for a, _ in pieces), began + max(b for _, b in pieces)


def _spread(batch: TensorBatch, count: int) -> list[int]:
    """Up to ``count`` rows of ``batch``: the first sample of each prompt, then others."""
    if "uid" not in batch.non_tensors:
        return list(range(min(count, len(batch))))
    first = first_rows(batch)
    chosen = set(first)
    return (first + [i for i in range(len(batch)) if i not in chosen])[:count]


class PrecisionChanged(RuntimeError):
    """A resumed run would compute a role in another dtype than its checkpoint was written in."""


class _Stopped(Exception):
    """``stop_after`` was reached; the checkpoint is written."""


def checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a ``.partial`` one is an interrupted write)."""
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith("step_") and "." not in p.name
    )


def newest_step(folder: Path) -> int | None:
    """The global step of the newest complete checkpoint under ``folder`` (None: there is none)."""
    found = checkpoints(folder)
    if not found:
        return None
    return int(json.loads((found[-1] / "controller.json").read_text())["global_step"])
