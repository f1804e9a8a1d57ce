"""The training-engine interface the actor, critic, reference and reward roles program against.

An engine owns one model on the ranks of a role group (sharded however its backend likes), its
optimizer and schedule. Roles never touch the parallelism: they hand the engine a rank's shard of
a batch plus a function of the model's output, and get tensors back.

* ``infer(batch, read)`` runs the model without gradients, micro-batch by micro-batch, and
  returns ``read(output, micro_batch)`` concatenated over the rows — e.g. per-token log-probs.
* ``train_step(batch, loss_fn)`` is one optimizer step on the *global* batch (all data-parallel
  shards together): ``loss_fn`` gets each micro-batch with the global count of tokens and
  sequences under ``count_key``, so the sum of its results over micro-batches and ranks is the loss
  of the whole batch, whatever the split (see ``roles/modeling/losses.py``).
* ``save`` / ``load`` a sharded checkpoint (model, optimizer, schedule, RNG), ``export`` a plain
  Hugging Face folder, ``param_layout`` which dim of each parameter is split over tp and dp and
  which pipeline stage holds it, ``held_pieces`` this rank's pieces in that layout (the reshard
  module reads both: generation and weight syncs start from them).
* ``snapshot`` / ``restore_snapshot`` the state ``save`` holds, copied into files in shared
  memory that outlive the rank (``snapshot.py``): a restarted rank rolls back one step cheaply.
  Only the fsdp engine has them; the default refuses.
* LoRA (``cfg.lora``, fsdp only): ``synced_names`` the adapters a weight sync carries,
  ``reference_weights`` the reference of a LoRA run (adapters off, or as ``rebase_reference``
  froze them at an RL stage's start).

Output kinds: an ``lm`` engine returns logits ``[B, T, V]``; a ``token`` engine (critic, reward
model) returns one scalar per position ``[B, T]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from roles.engines.training.config import EngineConfig, OptimConfig
from roles.runtime.device import DtypeChoice
from transport.batch import TensorBatch
from transport.training import AdamStep

Head = Literal["lm", "token"]
Read = Callable[[torch.Tensor, TensorBatch], torch.Tensor]
LossFn = Callable[
    [torch.Tensor, TensorBatch, float, float], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


_NO_SNAPSHOTS = (
    "{} has no in-memory snapshots (they are built for backend: fsdp only); roll back to "
    "checkpoints instead: set trainer.save_every, and trainer.snapshot_every: 0"
)


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives: its full shape, the dim split over tp / over dp (or None) and
    the pipeline stage holding it (``reshard.layout.params_from_layout`` reads ``pp_stage``)."""

    shape: tuple[int, ...]
    tp_dim: int | None
    dp_dim: int | None
    pp_stage: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "shape": list(self.shape),
            "tp_dim": self.tp_dim,
            "dp_dim": self.dp_dim,
            "pp_stage": self.pp_stage,
        }


class TrainingEngine(ABC):
    """One model trained (or frozen) over the ranks of a role group."""

    cfg: EngineConfig
    module: torch.nn.Module  # the model as this rank holds it (its shards)
    model_config: Any  # the Hugging Face config of the model
    step: int  # optimizer steps taken
    #: ``forward_backward`` calls whose gradients wait for the next ``optim_step``
    accumulated: int = 0
    precision: DtypeChoice  # what ``autocast`` computes in, and why
    #: whether ``held_pieces`` returns the engine's own weight tensors (reshard may re-point
    #: them into a generation shard while a ``generate`` runs) rather than views or copies
    held_in_place: bool = True
    #: whether ``full_weights`` yields a Hugging Face module the generation engines can run;
    #: if not, the actor generates through reshard (``roles/engines/hybrid.py``)
    generates_in_place: bool = True

    @abstractmethod
    def infer(self, batch: TensorBatch, read: Read) -> torch.Tensor: ...

    @abstractmethod
    def train_step(
        self, batch: TensorBatch, loss_fn: LossFn, count_key: str = "response_mask"
    ) -> dict[str, float]: ...

    def forward_backward(
        self, batch: TensorBatch, loss_fn: LossFn, count_key: str = "response_mask"
    ) -> dict[str, float]:
        """``train_step``'s forward and backward alone: the gradients add to those of earlier
        calls since the last ``optim_step`` (each call's loss normalised by its own batch)."""
        raise NotImplementedError(
            f"{type(self).__name__} takes whole optimizer steps only (train_step)"
        )

    def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        """One optimizer step on the gradients ``forward_backward`` accumulated: clip, step,
        schedule (``adam``: this step's own settings instead); returns ``grad_norm`` (before
        clipping) and ``lr``."""
        raise NotImplementedError(
            f"{type(self).__name__} takes whole optimizer steps only (train_step)"
        )

    def discard_gradients(self) -> None:
        """Drop what ``forward_backward`` accumulated (``accumulated`` back to 0). Engines that
        take whole steps only hold none between calls."""
        self.accumulated = 0

    @abstractmethod
    def configure_optim(self, optim: OptimConfig) -> None:
        """Replace the optimizer and schedule (fresh moments, schedule from step 0)."""

    @abstractmethod
    def full_weights(self) -> AbstractContextManager[torch.nn.Module]:
        """The model with whole (dp-unsharded) weights while the block runs."""

    @abstractmethod
    def autocast(self) -> AbstractContextManager[Any]:
        """The compute-dtype context of this engine's forward passes."""

    @abstractmethod
    def sum_over_dp(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum per-rank values over the data-parallel ranks (same keys on every rank)."""

    @abstractmethod
    def save(self, path: str | Path) -> None: ...

    @abstractmethod
    def load(self, path: str | Path) -> None: ...

    def snapshot(self, folder: Path, step: int) -> int:
        """This rank's training state (what ``save`` holds) into ``folder/rank{r}/`` as the
        snapshot of the controller's ``step``; returns the bytes written."""
        raise NotImplementedError(_NO_SNAPSHOTS.format(type(self).__name__))

    def restore_snapshot(self, folder: Path, step: int) -> int:
        """The snapshot of ``step`` from ``folder/rank{r}/`` into this engine (a restarted one
        too); returns the engine's step. ``FileNotFoundError`` if no complete one is there."""
        raise NotImplementedError(_NO_SNAPSHOTS.format(type(self).__name__))

    @abstractmethod
    def export(self, path: str | Path) -> None: ...

    def synced_names(self) -> set[str] | None:
        """The parameters a weight sync carries (None: all of them). With LoRA only the
        adapters: a generator holds the same frozen base from the model folder."""
        return None

    def reference_weights(self) -> AbstractContextManager[torch.nn.Module]:
        """The reference of a LoRA run for the block: the adapters as ``rebase_reference``
        froze them, or (never re-based) switched off, the base model; engines without adapters
        refuse."""
        raise NotImplementedError(f"{type(self).__name__} has no lora adapters to switch off")

    def rebase_reference(self) -> None:
        """The adapters as they are now become the reference's (``reference_weights``): an RL
        stage after SFT measures its KL from the SFT model. Kept in checkpoints and snapshots."""
        raise NotImplementedError(f"{type(self).__name__} has no lora adapters to re-base")

    @abstractmethod
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight whole on rank 0 (empty elsewhere); all ranks must call it."""

    @abstractmethod
    def load_full_state(self, state: dict[str, torch.Tensor], strict: bool = True) -> int:
        """Whole weights into this engine's layout (``strict=False``: the shared names)."""

    @abstractmethod
    def param_layout(self) -> dict[str, ParamLayout]: ...

    @abstractmethod
    def held_pieces(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter of its pipeline stage, in Hugging Face names,
        cut as ``param_layout`` says (its tp shard, and its dp shard where ``dp_dim`` is set),
        detached from autograd. Call it inside ``full_weights`` for whole weights over dp."""
