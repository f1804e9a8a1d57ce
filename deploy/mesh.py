"""The mesh as a library: an experiment's models, roles and placement started as ``hybridflow
run`` starts them, handed to the user's own program as typed clients and a few primitives.

    import hybridflow as hf

    async def main() -> None:
        async with hf.mesh("examples/quickstart.yaml") as m:
            batch = await m.sample(["1+2="], hf.SamplingConfig(n=4, max_new_tokens=8))
            scores, _ = await m.score(batch)
            ...  # advantages, then m.train_step(batch, hf.PolicyLossConfig())

``mesh`` checks the file as ``hybridflow run`` does (before any process starts), makes its models
in a run folder, starts its groups on this machine under supervision (a dead stateless group is
restarted and its call sent again), and stops them all on the way out. The file's ``stages`` are
not run (a file without any is fine); ``trainer.agent`` makes ``sample`` multi-turn through the
env group. ``Mesh`` keeps the actor's policy version: every ``train_step`` counts one, and
``sample`` first brings a separate rollout group up to it (rank to rank, the same weight sync as a
run). Records given to ``log`` go to ``RUN_DIR/metrics.jsonl`` (and TensorBoard when the file's
``logging`` asks), which ``hybridflow report`` reads.

Not built yet (docs/api.md says so): a user's step program inside an experiment, groups on
SLURM or other hosts (``hybridflow run --clusters`` does that for the built-in programs), and
replaying a training call after a training rank died (a run rolls back to its last snapshot
instead).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from controller.algorithms import Roles
from controller.clients import (
    ActorClient,
    CriticClient,
    EnvClient,
    ReferenceClient,
    RewardClient,
    RolloutClient,
)
from controller.data import PROMPT_COLUMNS, SFT_COLUMNS, read_rows
from controller.metrics import JsonlSink, TensorBoardSink
from controller.rollouts import RolloutPipeline
from controller.scoring import scores
from controller.server import Controller
from controller.sync import WeightSync
from deploy.experiment import (
    Experiment,
    ExperimentError,
    check,
    load,
    prepare_models,
    reference_in_actor,
)
from deploy.groups import build_groups
from deploy.session import local_session
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig
from transport.training import OptimConfig, PolicyLossConfig


@dataclass
class Mesh:
    """A started mesh: its clients, its run folder and the primitives of a training loop."""

    controller: Controller
    exp: Experiment
    run_dir: Path
    roles: Roles
    pipeline: RolloutPipeline
    sinks: list[Any] = field(default_factory=list)

    # -- the clients -------------------------------------------------------------------------

    @property
    def actor(self) -> ActorClient:
        return self.roles.actor

    @property
    def reward(self) -> RewardClient:
        return self.roles.reward

    @property
    def reference(self) -> ReferenceClient | None:
        return self.roles.reference

    @property
    def critic(self) -> CriticClient | None:
        return self.roles.critic

    @property
    def rollout(self) -> RolloutClient | None:
        return self.roles.rollout

    @property
    def env(self) -> EnvClient | None:
        return self.roles.env

    @property
    def teacher(self) -> ReferenceClient | None:
        return self.roles.teacher

    @property
    def version(self) -> int:
        """The actor's policy version: training steps taken through this mesh."""
        return self.pipeline.version

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
            base = 0 if sampling.seed is None else sampling.seed
            batch.non_tensors["seed"] = [base + i for i in range(len(batch))]
        await self.pipeline.sync()
        return await self.pipeline.generate(batch, sampling)

    async def log_probs(self, batch: TensorBatch, role: str = "actor") -> torch.Tensor:
        """Per-token log-probs ``[B, T]`` of ``batch``'s tokens under a model role (``actor``,
        ``reference``, ``teacher``; a LoRA actor's ``reference`` is itself, adapters off)."""
        client = {"actor": self.actor, "reference": self.reference, "teacher": self.teacher}.get(
            role
        )
        if client is None:
            raise ValueError(
                f"no model role {role!r} in this mesh; it has {sorted(self.roles_placed)}"
            )
        out = await client.compute_log_prob(batch.select(list(TOKEN_COLUMNS), []))
        found: torch.Tensor = out.tensors["log_probs"]
        return found

    async def score(self, batch: TensorBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per row from the reward role (a rule, a model or a judge), and the batch
        means of its extras (``reward/<key>``); a non-finite score counts 0 (``scores``)."""
        return await scores(self.reward, batch)

    async def train_step(self, batch: TensorBatch, loss: PolicyLossConfig) -> dict[str, float]:
        """One optimizer step of the actor on ``batch`` (``old_log_probs`` and ``advantages``
        per token besides the token columns) with the policy loss ``loss``; the policy version
        counts it. Returns the loss's metrics."""
        found = await self.actor.update_policy(batch.select(self._policy_columns(batch), []), loss)
        self.pipeline.trained()
        return found

    async def forward_backward(
        self, batch: TensorBatch, loss: PolicyLossConfig
    ) -> dict[str, float]:
        """The policy loss's forward and backward on ``batch`` (as ``train_step`` needs it);
        the gradients add to those of earlier calls until ``optim_step``. Each call's loss is
        normalised by its own batch (``loss.agg``), so two calls on halves give the sum of the
        halves' gradients. The loss's metrics."""
        return await self.actor.forward_backward(
            batch.select(self._policy_columns(batch), []), loss
        )

    async def optim_step(self) -> dict[str, float]:
        """One optimizer step of the actor on the gradients accumulated by ``forward_backward``
        (clipped, scheduled); counts one policy version. ``grad_norm`` and ``lr``."""
        found = await self.actor.optim_step()
        self.pipeline.trained()
        return found

    def _policy_columns(self, batch: TensorBatch) -> list[str]:
        wanted = [*TOKEN_COLUMNS, "old_log_probs", "advantages"]
        return wanted + [c for c in ("ref_log_probs", "rollout_log_probs") if c in batch.tensors]

    async def sft_step(self, rows: Sequence[dict[str, str]]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on ``(prompt, response)`` rows (the loss
        on the response tokens); the policy version counts it."""
        batch = TensorBatch.from_dict(
            non_tensors={
                "prompt": [r["prompt"] for r in rows],
                "response": [r["response"] for r in rows],
            }
        )
        found = await self.actor.sft_step(batch, response_only=True)
        self.pipeline.trained()
        return found

    async def configure_optim(self, optim: OptimConfig, role: str = "actor") -> None:
        """A fresh optimizer and schedule for a training role (as a stage starts one)."""
        client = self.roles.engines().get(role)
        if client is None:
            raise ValueError(f"no training role {role!r} in this mesh")
        await client.configure_optim(optim)

    async def sync_weights(self) -> int:
        """Bring a separate rollout group up to the actor's weights (nothing to do when the
        actor generates); the version it now serves."""
        await self.pipeline.sync()
        return self.version

    async def save_state(self, name: str) -> Path:
        """Every training role's state (weights, optimizer, schedule, RNG) under
        ``RUN_DIR/state/NAME/<role>``, each written aside and renamed (the checkpoint format)."""
        folder = self.run_dir / "state" / name
        for role, client in self.roles.engines().items():
            await client.save(str((folder / role).resolve()))
        (folder / "mesh.json").write_text(yaml.safe_dump({"version": self.version}))
        return folder

    async def load_state(self, name: str) -> int:
        """What ``save_state(name)`` wrote, back into the training roles; the policy version."""
        folder = self.run_dir / "state" / name
        for role, client in self.roles.engines().items():
            await client.load(str((folder / role).resolve()))
        self.pipeline.version = int(yaml.safe_load((folder / "mesh.json").read_text())["version"])
        return self.version

    async def export(self, path: str | Path) -> Path:
        """The actor as a plain Hugging Face folder (and a PEFT adapter folder beside it for
        LoRA)."""
        return Path(await self.actor.export(str(Path(path).resolve())))

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """One record (``step``: default the policy version) into the run's sinks."""
        record = {"step": self.version if step is None else step, "stage": "api", **metrics}
        for sink in self.sinks:
            sink(record)

    @property
    def roles_placed(self) -> list[str]:
        return list(self.controller.role_group)


TOKEN_COLUMNS = ("input_ids", "attention_mask", "response_mask")


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
    experiment: str | Path, *overrides: str, run_dir: str | Path | None = None
) -> AsyncIterator[Mesh]:
    """Start the groups of ``experiment`` (``--set``-style ``overrides``) on this machine, yield
    the ``Mesh``, and stop them all on the way out (an error included)."""
    exp = load(experiment, overrides)  # its stages, if any, are not run
    check(exp, run=False)
    folder = (
        Path(run_dir) if run_dir else Path("runs") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    prepare_models(exp, folder)
    groups = build_groups(exp, folder)
    resolved = exp.model_dump(mode="json", exclude={"quick"})
    (folder / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    sinks: list[Any] = [JsonlSink(folder / "metrics.jsonl")]
    if exp.logging.tensorboard:
        sinks.append(TensorBoardSink(folder / "tensorboard"))
    try:
        async with local_session(groups, run_dir=folder) as controller:
            roles = Roles.placed(controller, reference_in_actor(exp))
            weights = WeightSync(roles.actor, exp.trainer.weight_sync)
            pipeline = RolloutPipeline(roles, weights, exp.trainer.agent)
            yield Mesh(controller, exp, folder, roles, pipeline, sinks)
    finally:
        for sink in sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def run(main: Any) -> Any:
    """Run an ``async def main()`` of a user's script (uvloop when installed; Ctrl-C stops
    the groups cleanly)."""
    from deploy.terminal import run_async

    return run_async(main)


__all__ = ["ExperimentError", "Mesh", "mesh", "prompt_batch", "rows", "run"]
