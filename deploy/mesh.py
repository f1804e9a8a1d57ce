"""The mesh as a library: an experiment's models, roles and placement started as ``hybridflow
run`` starts them, handed to the user's own program as typed clients and a few primitives.

    import hybridflow as hf

    async def main() -> None:
        async with hf.mesh("examples/quickstart.yaml") as m:
            rows = [{"prompt": "1+2=", "answer": "3"}]  # the reward reads the row's answer
            batch = await m.sample(rows, hf.SamplingConfig(n=4, max_new_tokens=8))
            scores, _ = await m.score(batch)
            ...  # advantages, then m.train_step(batch, hf.PolicyLossConfig())

``mesh`` checks the file as ``hybridflow run`` does (before any process starts), makes its models
in a run folder, starts its groups on this machine (or, with ``clusters``, on the clusters of a
cluster spec, as ``hybridflow run --clusters``) under supervision, and stops them all on the way
out. The file's ``stages`` are not run (a file without any is fine); ``trainer.agent`` makes
``sample`` multi-turn through the env group. ``Mesh`` keeps the actor's policy version: every
optimizer step counts one, and ``sample`` first brings a separate rollout group up to it (rank to
rank, the same weight sync as a run). Records given to ``log`` go to ``RUN_DIR/metrics.jsonl``
(and TensorBoard when the file's ``logging`` asks), which ``hybridflow report`` reads.

Faults stay below the loop (``Recovery``): a dead stateless group is restarted and its call sent
again; when a training group with a restart policy loses a rank, every training group is
restarted and restored from the in-memory snapshot taken after the last change of their state,
the ``forward_backward`` calls since it are replayed, and the failed call runs again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import yaml

from controller.clients import (
    ActorClient,
    CriticClient,
    EnvClient,
    ReferenceClient,
    RewardClient,
    RolloutClient,
)
from controller.data import PROMPT_COLUMNS, SFT_COLUMNS, read_rows
from controller.datum import Datum, batch_of, sampled_at
from controller.metrics import JsonlSink, TensorBoardSink
from controller.placement import GroupSpec
from controller.rollouts import RolloutPipeline, request_seed
from controller.scoring import scores
from controller.server import Controller
from controller.steps import BaseModelClient, Roles
from controller.supervisor import Supervisor
from controller.sync import WeightSync
from deploy.clusters import cluster_plan
from deploy.experiment import (
    Experiment,
    ExperimentError,
    check,
    load,
    model_path,
    prepare_models,
    reference_in_actor,
)
from deploy.groups import build_groups
from deploy.launchers.forkserver import prestart
from deploy.launchers.local import SHM_ROOT, SocketFolder, sweep_socket_folders
from deploy.session import cluster_session, local_session
from transport.batch import TensorBatch
from transport.columns import TEMPERATURE
from transport.errors import CallTimeoutError
from transport.sampling import SamplingConfig
from transport.settings import Timeouts
from transport.training import AdamStep, OptimConfig, PolicyLossConfig, Reduction

log = logging.getLogger("hybridflow.mesh")
R = TypeVar("R")
#: what the training primitives take: a batch in the training layout, or rows of token ids
Rows = TensorBatch | Sequence[Datum]
#: a loss ``forward_backward`` takes: a policy loss, or the next-token loss by name
Loss = PolicyLossConfig | Literal["cross_entropy"]


@dataclass(frozen=True)
class Accumulated:
    """One ``forward_backward`` call as the mesh keeps it until the next optimizer step."""

    batch: TensorBatch
    loss: Loss
    temperature: float
    reduction: Reduction


@dataclass
class Recovery:
    """What brings the training roles back after one of their ranks died, below the user's
    loop: an in-memory snapshot of their state after each change (an optimizer step, a fresh
    optimizer, a loaded state) and the optimizer each was given; the ``forward_backward`` calls
    since the snapshot (their gradients are not in it) are the mesh's ``accumulated``."""

    folder: Path  # under /dev/shm: one folder per role, two slots per rank
    label: int = 0  # the newest complete snapshot's number (0: none yet)
    optims: dict[str, OptimConfig] = field(default_factory=dict)
    rollbacks: int = 0


@dataclass
class Mesh:
    """A started mesh: its clients, its run folder and the primitives of a training loop."""

    controller: Controller
    exp: Experiment
    run_dir: Path
    roles: Roles
    pipeline: RolloutPipeline
    sinks: list[Any] = field(default_factory=list)
    recovery: Recovery | None = None
    #: the actor's ``forward_backward`` calls whose gradients wait for its next optimizer step:
    #: replayed after a rollback, or after a cancelled call
    accumulated: list[Accumulated] = field(default_factory=list)
    #: the actor engine's optimizer steps as this mesh last knew them (None: ask it)
    _steps: int | None = None
    #: a training call cancelled or timed out ("step" or "gradients"), settled before the next
    _interrupted: str | None = None
    #: a change of state (``load_state``, ``configure_optim``, ``rebase``) cancelled or timed
    #: out once begun: run again in full before the next call
    _unfinished: Callable[[], Awaitable[None]] | None = None

    # -- the clients -------------------------------------------------------------------------

    @property
    def actor(self) -> ActorClient:
        """The actor's client (every endpoint an ``async`` method)."""
        return self.roles.actor

    @property
    def reward(self) -> RewardClient:
        """The reward role's client: a rule, a reward model or an LLM judge."""
        return self.roles.reward

    @property
    def reference(self) -> ReferenceClient | None:
        """The reference model's client (a LoRA actor's own, adapters off), or None."""
        return self.roles.reference

    @property
    def critic(self) -> CriticClient | None:
        """The critic's client, or None."""
        return self.roles.critic

    @property
    def rollout(self) -> RolloutClient | None:
        """A separate rollout group's client, or None (the actor generates)."""
        return self.roles.rollout

    @property
    def env(self) -> EnvClient | None:
        """The environment/tools role's client (multi-turn), or None."""
        return self.roles.env

    @property
    def teacher(self) -> ReferenceClient | None:
        """The teacher model's client (distillation), or None."""
        return self.roles.teacher

    @property
    def version(self) -> int:
        """The actor's policy version: optimizer steps taken through this mesh."""
        return self.pipeline.version

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The actor model's tokenizer (Hugging Face's; loaded in this process when first asked
        for), to turn sampled tokens into text or prompts into ids."""
        from roles.modeling.models import load_tokenizer

        name = self.exp.roles["actor"].model
        if name is None:
            raise ValueError("the actor names no model (roles.actor.model)")
        return load_tokenizer(model_path(self.exp, name, self.run_dir))

    @property
    def roles_placed(self) -> list[str]:
        """The names of the roles this mesh placed."""
        return list(self.controller.role_group)

    # -- the primitives ----------------------------------------------------------------------

    async def sample(
        self,
        prompts: Sequence[str] | Sequence[dict[str, Any]] | TensorBatch,
        sampling: SamplingConfig,
    ) -> TensorBatch:
        """``sampling.n`` responses per prompt on the newest weights, in the training layout
        (``input_ids``, ``attention_mask``, ``response_mask``, the generator's ``log_probs``)
        with the text (``prompt``, ``response``, ``request``: the prompt's index, ``uid``, and
        a data row's other columns, which the reward role reads) and
        ``meta["weight_version"]``. Multi-turn through the env group with ``trainer.agent``."""
        if isinstance(prompts, TensorBatch):  # the caller's batch stays as it was given
            batch = TensorBatch(dict(prompts.tensors), dict(prompts.non_tensors), prompts.meta)
        else:
            batch = prompt_batch(prompts)
        if "uid" not in batch.non_tensors:
            batch.non_tensors["uid"] = list(range(len(batch)))
        if self.pipeline.agent is not None and "seed" not in batch.non_tensors:
            batch.non_tensors["seed"] = request_seeds(sampling.seed, len(batch))

        async def call() -> TensorBatch:
            await self.pipeline.sync()
            return await self.pipeline.generate(batch, sampling)

        await self._settle()
        found = await self._safely(call)
        found.meta[TEMPERATURE] = sampling.temperature  # what the training primitives default to
        return found

    async def log_probs(
        self, batch: Rows, role: str = "actor", temperature: float | None = None
    ) -> torch.Tensor:
        """Per-token log-probs ``[B, T]`` of ``batch``'s tokens (a batch, or ``Datum`` rows)
        under a model role (``actor``, ``reference``, ``teacher``; a LoRA actor's ``reference``
        is itself, adapters off), aligned with ``input_ids``, at ``temperature`` (default: the
        temperature a ``sample``d batch was drawn at, else 1; 0, greedy, reads them at 1), as
        the sampler computed them."""
        client = {"actor": self.actor, "reference": self.reference, "teacher": self.teacher}.get(
            role
        )
        if client is None:
            raise ValueError(
                f"no model role {role!r} in this mesh; it has {sorted(self.roles_placed)}"
            )
        t = temperature_of(batch, temperature)
        tokens = as_batch(batch).select(list(TOKEN_COLUMNS), [])
        await self._settle()
        out = await self._safely(lambda: client.compute_log_prob(tokens, t))
        found: torch.Tensor = out.tensors["log_probs"]
        return found

    async def score(self, batch: TensorBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per row from the reward role (a rule, a model or a judge), and the batch
        means of its extras (``reward/<key>``); a non-finite score counts 0."""
        return await self._safely(lambda: scores(self.reward, batch))

    async def train_step(
        self, batch: Rows, loss: PolicyLossConfig, temperature: float | None = None
    ) -> dict[str, float]:
        """One optimizer step of the actor on ``batch`` (``old_log_probs`` and ``advantages``
        per token besides the token columns; or ``Datum`` rows with both) with the policy loss
        ``loss`` at ``temperature`` (as ``log_probs``); the policy version counts it. Returns
        the loss's metrics."""
        t = temperature_of(batch, temperature)
        picked = self._columns(as_batch(batch), loss)
        return await self._step(lambda: self.actor.update_policy(picked, loss, t))

    async def forward_backward(
        self,
        batch: Rows,
        loss: Loss,
        temperature: float | None = None,
        reduction: Reduction = "mean",
    ) -> dict[str, float]:
        """A loss's forward and backward on ``batch`` (a batch, or ``Datum`` rows): a policy
        loss (``hf.PolicyLossConfig``; the batch as ``train_step`` needs it, at ``temperature``
        as ``log_probs``) or ``"cross_entropy"`` (the next-token loss of the response tokens,
        times a ``weights`` column when given). The gradients add to those of earlier calls
        until ``optim_step``. ``reduction="mean"``: each call's loss is normalised by its own
        batch (``loss.agg``), so two calls on halves give twice the gradient of one call on
        both; ``"sum"``: not normalised, so calls on parts add up to one call on the whole
        (Tinker's losses; its ``loss`` is a sum, its other metrics stay means). The loss's
        metrics."""
        call = self._recorded(batch, loss, temperature, reduction)
        return await self._accumulate(call, lambda: self._forward_backward(call))

    async def forward_backward_log_probs(
        self,
        batch: Rows,
        loss: Loss,
        temperature: float | None = None,
        reduction: Reduction = "mean",
    ) -> tuple[dict[str, float], torch.Tensor]:
        """``forward_backward``, and the per-token log-probs ``[B, T]`` (aligned with
        ``input_ids``, 0 outside the responses) its loss saw, from the same forward: what
        Tinker's ``forward_backward`` returns. A replay after a fault recomputes only the
        gradients."""
        call = self._recorded(batch, loss, temperature, reduction)
        if not isinstance(loss, PolicyLossConfig) and loss != "cross_entropy":
            raise ValueError(f"loss {loss!r}: give a hf.PolicyLossConfig or 'cross_entropy'")
        out = await self._accumulate(
            call,
            lambda: self.actor.forward_backward_kept(
                call.batch, loss, call.temperature, call.reduction
            ),
        )
        found: torch.Tensor = out.tensors["log_probs"]
        return dict(out.meta["metrics"]), found

    def _recorded(
        self, batch: Rows, loss: Loss, temperature: float | None, reduction: Reduction
    ) -> Accumulated:
        """A gradient-adding call as the mesh records it: the columns its loss reads."""
        return Accumulated(
            self._columns(as_batch(batch), loss),
            loss,
            temperature_of(batch, temperature),
            reduction,
        )

    async def _accumulate(self, call: Accumulated, run: Callable[[], Awaitable[R]]) -> R:
        """A gradient-adding call, recorded for a replay once it ran; one that may have run
        partly (cancelled, timed out, failed) is settled before the next call."""
        await self._settle()
        try:
            found = await self._safely(run)
        except BaseException:  # cancelled or timed out (it may have run), or failed on the
            self._interrupted = "gradients"  # ranks, which then dropped every pending gradient
            raise
        self.accumulated.append(call)  # replayed after a rollback or a cancel
        return found

    async def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        """One optimizer step of the actor on the gradients accumulated by ``forward_backward``
        (clipped, scheduled; ``adam``: this step's own AdamW settings, learning rate, betas,
        eps, weight decay and clipping, in place of the optimizer's and the schedule's, the
        moments carried on, as Tinker's ``AdamParams``); counts one policy version.
        ``grad_norm``, ``lr`` and ``skipped`` (1: the norm was not finite, and the step left
        the weights as they were)."""
        return await self._step(lambda: self.actor.optim_step(adam))

    async def _step(self, step: Callable[[], Awaitable[dict[str, float]]]) -> dict[str, float]:
        """An actor call that takes one optimizer step, counted as one policy version. Cancelled
        or timed out, it may still run on the ranks: ``_settle`` finds out before the next call."""
        await self._settle()
        if self._steps is None:
            self._steps = (await self._safely(self.actor.progress))["step"]
        # a rollback while it runs forgets the count (``_steps``), and brings the engine back to
        # the snapshot of this count before the call runs again
        before = self._steps

        async def call() -> dict[str, float]:
            found = await step()
            await self._changed()
            return found

        try:
            found = await self._safely(call)
        except (asyncio.CancelledError, CallTimeoutError):
            self._interrupted = "step"
            raise
        self._steps = before + 1
        self.pipeline.trained()
        return found

    async def _settle(self) -> None:
        """Resolve a training call that was cancelled (Ctrl-C, a notebook's stop button) or timed
        out: the ranks ran it all the same unless it never left (calls run in order, so
        ``progress`` answers after it). A step that ran is counted (policy version, snapshot)
        with a warning; gradients a cancelled ``forward_backward`` added are taken back (dropped,
        and the calls before it replayed), so running it again counts them once. A
        ``forward_backward`` that failed on the ranks left none there, its own or earlier
        calls': those are replayed. A change of state may have run on some roles' ranks, or
        all, or none, and the mesh's record of it (version, snapshot, optimizer) was not made:
        it runs again in full (loading a state, a fresh optimizer and a rebase are each the
        same done twice)."""
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is not None:
            try:
                await self._safely(unfinished)
            except BaseException:
                self._unfinished = unfinished
                raise
        kind, self._interrupted = self._interrupted, None
        if kind is None:
            return
        try:
            now = await self._safely(self.actor.progress)
            if kind == "step" and self._steps is not None and now["step"] > self._steps:
                log.warning(
                    "an optimizer step whose call was cancelled ran on the ranks: counted as "
                    "policy version %d",
                    self.version + 1,
                )
                self._steps = now["step"]
                await self._changed()
                self.pipeline.trained()
            elif now["accumulated"] != len(self.accumulated):
                await self._safely(self._replay)
        except BaseException:
            self._interrupted = kind  # still unsettled: the next call tries again
            raise

    async def _change(self, call: Callable[[], Awaitable[None]]) -> None:
        """``call``, a change of the training roles' state made of several calls; cancelled or
        timed out, it is completed before the next call (``_settle``)."""
        await self._settle()
        try:
            await self._safely(call)
        except (asyncio.CancelledError, CallTimeoutError):
            self._unfinished = call
            raise

    async def _replay(self) -> None:
        """The actor's gradients rebuilt from the calls the mesh recorded (``accumulated``)."""
        await self.actor.discard_gradients()
        for call in self.accumulated:
            await self._forward_backward(call)

    def _forward_backward(self, call: Accumulated) -> Awaitable[dict[str, float]]:
        loss = call.loss
        if isinstance(loss, PolicyLossConfig):
            return self.actor.forward_backward(call.batch, loss, call.temperature, call.reduction)
        if loss == "cross_entropy":
            return self.actor.forward_backward_nll(call.batch, call.reduction)
        raise ValueError(f"loss {loss!r}: give a hf.PolicyLossConfig or 'cross_entropy'")

    @staticmethod
    def _columns(batch: TensorBatch, loss: Loss) -> TensorBatch:
        """The columns ``loss`` reads, checked before any call (the missing one named)."""
        if isinstance(loss, PolicyLossConfig):
            wanted = [*TOKEN_COLUMNS, "old_log_probs", "advantages"]
            extra: tuple[str, ...] = ("ref_log_probs", "rollout_log_probs", "ratio_mask")
        else:
            wanted, extra = list(TOKEN_COLUMNS), ("weights",)
        batch.require_tensors(*wanted)
        return batch.select(wanted + [c for c in extra if c in batch.tensors], [])

    async def sft_step(self, rows: Sequence[dict[str, str]]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on ``(prompt, response)`` rows (the loss
        on the response tokens); the policy version counts it."""
        batch = TensorBatch.from_dict(
            non_tensors={
                "prompt": [r["prompt"] for r in rows],
                "response": [r["response"] for r in rows],
            }
        )

        return await self._step(lambda: self.actor.sft_step(batch, response_only=True))

    async def configure_optim(self, optim: OptimConfig, role: str = "actor") -> None:
        """A fresh optimizer and schedule for a training role (as a stage starts one)."""
        client = self.roles.engines().get(role)
        if client is None:
            raise ValueError(f"no training role {role!r} in this mesh")

        async def call() -> None:
            await client.configure_optim(optim)
            if self.recovery is not None:
                self.recovery.optims[role] = optim
            # the actor's gradients go with its optimizer; another role's leaves them pending
            await self._changed(discarded=role == "actor")

        await self._change(call)

    async def rebase(self, role: str = "reference") -> None:
        """``role`` takes the actor's weights as they are now, rank to rank: the reference a KL
        term is measured against becomes the SFT'd actor (else it stays the initial weights),
        and a critic takes the actor's backbone (``init_from_actor`` in an experiment file). A
        LoRA actor that is its own reference freezes a copy of its adapters as the reference's.
        Snapshotted with the training roles, so a rollback after a fault keeps it."""
        own = role == "reference" and isinstance(self.roles.reference, BaseModelClient)
        if role == "actor" or not (own or role in self.roles.engines()):
            have = sorted(r for r in self.roles.engines() if r != "actor")
            raise ValueError(f"rebase: no model role {role!r} to set from the actor; {have}")

        async def call() -> None:
            if own:
                await self.actor.rebase_reference()
            else:
                client = self.roles.engines()[role]
                await self.pipeline.weights.push(client, self.version, strict=role == "reference")
            await self._changed(discarded=False)  # the actor's own gradients stay pending

        await self._change(call)

    async def sync_weights(self) -> int:
        """Bring a separate rollout group up to the actor's weights (nothing to do when the
        actor generates); the version it now serves."""
        await self._settle()
        await self._safely(self.pipeline.sync)
        return self.version

    async def save_state(self, name: str) -> Path:
        """Every training role's state (weights, optimizer, schedule, RNG) under
        ``RUN_DIR/state/NAME/<role>``, each written aside and renamed (the checkpoint format)."""
        folder = self.run_dir / "state" / name

        async def call() -> None:
            for role, client in self.roles.engines().items():
                await client.save(str((folder / role).resolve()))

        await self._settle()
        await self._safely(call)
        (folder / "mesh.json").write_text(yaml.safe_dump({"version": self.version}))
        return folder

    async def load_state(self, name: str) -> int:
        """What ``save_state(name)`` wrote, back into the training roles; the policy version."""
        folder = self.run_dir / "state" / name
        version = int(yaml.safe_load((folder / "mesh.json").read_text())["version"])

        async def call() -> None:
            for role, client in self.roles.engines().items():
                await client.load(str((folder / role).resolve()))  # pending gradients dropped
            await self._changed()
            self.pipeline.version = version
            # a rollout group holds another branch's weights, whatever version they were: push
            self.pipeline.synced = None
            self._steps = None

        await self._change(call)
        return self.version

    async def export(self, path: str | Path) -> Path:
        """The actor as a plain Hugging Face folder (and a PEFT adapter folder beside it for
        LoRA)."""
        where = str(Path(path).resolve())
        await self._settle()
        return Path(await self._safely(lambda: self.actor.export(where)))

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """One record (``step``: default the policy version) into the run's sinks."""
        record = {"step": self.version if step is None else step, "stage": "api", **metrics}
        for sink in self.sinks:
            sink(record)

    # -- faults below the loop -----------------------------------------------------------------

    def _record_event(self, event: dict[str, Any]) -> None:
        """A supervision event (fault, restart, rollback) as a record of the run's metrics, at
        the policy version it happened at."""
        record = {"step": self.version, "stage": "api", **event}
        for sink in self.sinks:
            sink(record)

    async def _safely(self, call: Callable[[], Awaitable[R]]) -> R:
        """``call()``; when it fails because a rank of a training group died and the group's
        restart policy allows, every training group is restarted, brought back to the last
        snapshot (and the ``forward_backward`` calls since it replayed) and ``call`` runs again:
        the loop sees a slower call. Other failures are the caller's."""
        while True:
            try:
                return await call()
            except Exception:
                if not await self._roll_back():
                    raise

    async def _roll_back(self) -> bool:
        supervisor = self.controller.supervisor
        if self.recovery is None or not isinstance(supervisor, Supervisor):
            return False
        fault = await supervisor.stateful_fault()
        if fault is None:
            return False
        rec = self.recovery
        log.warning(
            "group %r died (rank %s: %s); restarting the training groups from the snapshot "
            "of version %d and running the call again",
            fault[0],
            fault[1],
            fault[2],
            self.version,
        )
        await supervisor.rollback(fault, len(self.accumulated))
        rec.rollbacks += 1
        self.pipeline.weights = WeightSync(self.roles.actor, self.exp.trainer.weight_sync)
        self.pipeline.synced = None  # the first sync pushes, whatever the rollout group holds
        for role, client in self.roles.engines().items():
            if role in rec.optims:
                await client.configure_optim(rec.optims[role])
            if rec.label:
                await client.restore_snapshot(str((rec.folder / role).resolve()), rec.label)
        self._steps = None
        for call in self.accumulated:
            await self._forward_backward(call)
        return True

    async def _changed(self, discarded: bool = True) -> None:
        """The training roles' state changed as a whole (an optimizer step, a fresh optimizer,
        a loaded state): snapshot it (to shared memory, two slots per rank, so a death while
        copying leaves the previous one whole). ``discarded``: the actor's accumulated gradients
        went with the change (not so when another role got a fresh optimizer): forgotten once
        the snapshot is whole, since a death while it is taken restores the previous one, and
        the calls that made them are replayed on it before the change runs again."""
        rec = self.recovery
        if rec is not None:
            label = rec.label + 1
            for role, client in self.roles.engines().items():
                await client.snapshot(str((rec.folder / role).resolve()), label)
            rec.label = label
        if discarded:
            self.accumulated.clear()


TOKEN_COLUMNS = ("input_ids", "attention_mask", "response_mask")


def request_seeds(seed: int, count: int) -> list[int]:
    """Each request's seed for a multi-turn ``sample`` call: a hash of (the call's seed, the
    request), as a single-turn call seeds (seed, request, sample); ``seed + i`` would make
    request i of the call seeded ``s + 1`` replay request i + 1 of the call seeded ``s``."""
    return [request_seed(seed, 0, i) for i in range(count)]


def temperature_of(rows: Rows, given: float | None) -> float:
    """The temperature log-probs of ``rows`` are computed at: ``given``, else the one a
    ``sample``d batch records (``meta["temperature"]``) or its ``Datum`` rows carry, else 1."""
    if given is not None:
        return given
    if isinstance(rows, TensorBatch):
        return float(rows.meta.get(TEMPERATURE, 1.0))
    found = sampled_at(rows)
    return 1.0 if found is None else found


def as_batch(rows: Rows) -> TensorBatch:
    """A batch as given, or ``Datum`` rows in the training layout (``batch_of``)."""
    return rows if isinstance(rows, TensorBatch) else batch_of(rows)


def prompt_batch(prompts: Sequence[str] | Sequence[dict[str, Any]]) -> TensorBatch:
    """Prompts as the generators take them: texts, or data rows (``prompt`` and any columns)."""
    rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    names = list(dict.fromkeys(k for r in rows for k in r))
    return TensorBatch.from_dict(non_tensors={k: [r.get(k) for r in rows] for k in names})


def rows(source: str, sft: bool = False) -> list[dict[str, Any]]:
    """A dataset's rows (a JSONL or Parquet file, ``FILE?prompt_key=...``, or
    ``builtin:NAME?key=value``), checked: ``prompt`` (and ``answer``, ...) for RL, ``prompt``
    and ``response`` with ``sft``."""
    return read_rows(source, SFT_COLUMNS if sft else PROMPT_COLUMNS)


@asynccontextmanager
async def mesh(
    experiment: str | Path,
    *overrides: str,
    run_dir: str | Path | None = None,
    clusters: str | Path | None = None,
) -> AsyncIterator[Mesh]:
    """Start the groups of ``experiment`` (``--set``-style ``overrides``) on this machine, or
    each on the cluster a cluster spec names (``clusters``: the file ``hybridflow run
    --clusters`` takes; SLURM, ssh, Ray, by hand), yield the ``Mesh``, and stop them all on the way
    out (an error included)."""
    exp = load(experiment, overrides)  # its stages, if any, are not run
    check(exp, run=False)
    plan = cluster_plan(Path(clusters), exp) if clusters is not None else None
    folder = (
        Path(run_dir) if run_dir else Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    prestart()  # the fork server imports while the models are prepared
    prepare_models(exp, folder)
    groups = build_groups(exp, folder)
    resolved = exp.model_dump(mode="json", exclude={"quick"})
    (folder / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    sinks: list[Any] = [JsonlSink(folder / "metrics.jsonl")]
    if exp.logging.tensorboard:
        sinks.append(TensorBoardSink(folder / "tensorboard"))
    session: AbstractAsyncContextManager[Controller]
    if plan is not None:
        session = cluster_session(
            groups, plan.spec, plan.where, folder, Timeouts.from_env(), _announce
        )
    else:
        session = local_session(groups, run_dir=folder)
    snapshots: SocketFolder | None = None
    try:
        async with session as controller:
            roles = Roles.placed(controller, reference_in_actor(exp))
            weights = WeightSync(roles.actor, exp.trainer.weight_sync)
            pipeline = RolloutPipeline(roles, weights, exp.trainer.agent)
            found = Mesh(controller, exp, folder, roles, pipeline, sinks)
            if isinstance(controller.supervisor, Supervisor):  # faults and restarts recorded
                controller.supervisor.on_event = found._record_event  # as under hybridflow run
            if _recoverable(found):
                sweep_socket_folders(Path(SHM_ROOT))
                snapshots = SocketFolder(Path(SHM_ROOT))
                found.recovery = Recovery(snapshots.path)
                await found._changed()  # the state the groups started with
            yield found
    finally:
        if snapshots is not None:
            snapshots.remove()
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def _recoverable(m: Mesh) -> bool:
    """Whether a training group may be restarted below the loop: a stateful group has a restart
    policy (``placement.NAME.restart``) and every training role snapshots (fsdp; megatron
    roles do not)."""
    supervisor = m.controller.supervisor
    if not isinstance(supervisor, Supervisor) or not supervisor.restarts_stateful():
        return False
    backends = [m.exp.roles[r].settings().get("backend") for r in m.roles.engines()]
    return "megatron" not in backends


def _announce(group: GroupSpec, command: str) -> None:
    log.warning("start group %s by hand with:\n  %s", group.name, command)


def run(main: Any) -> Any:
    """Run an ``async def main()`` of a user's script (uvloop when installed; Ctrl-C stops
    the groups cleanly)."""
    from deploy.terminal import run_async

    return run_async(main)


__all__ = ["ExperimentError", "Mesh", "mesh", "prompt_batch", "rows", "run"]
