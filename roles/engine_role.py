"""What every model-holding role shares: its training engine, checkpoints and in-memory
snapshots, export and layout.

Actor, reference, critic and reward-model roles subclass ``EngineRole``; their own files hold only
what differs (which head, which loss). The placement config of such a role is an ``EngineConfig``
(``roles/engines/training/config.py``): ``{"model": PATH, "dtype": "auto", "micro_batch_size": 8,
"optim": {"lr": 1e-5, ...}}``; ``optim: null`` freezes the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from roles.base import Role, RoleContext
from roles.engines.training.config import EngineConfig
from roles.engines.training.factory import build_engine
from roles.engines.training.interface import Head, TrainingEngine
from roles.runtime.endpoint import ONE_TO_ALL, RANK_ZERO, endpoint
from roles.weight_sync import WeightSink, WeightSource
from transport.protocol import Layout
from transport.training import OptimConfig


class EngineRole(WeightSource, WeightSink, Role):
    """Also a weight source and sink (``roles/weight_sync.py``): the actor gives its weights to a
    rollout group, the reference and critics take them from the actor."""

    head: Head = "lm"
    frozen = False  # True: the role never trains, whatever its config says

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx)
        if self.frozen:
            config = {**config, "optim": None}
        self.engine: TrainingEngine = build_engine(
            EngineConfig.model_validate(config), ctx, head=self.head
        )
        self.register_source()

    # -- weight transfers (roles/weight_sync.py) ------------------------------------------------

    def _send_shards(self) -> bool:
        """Whether each rank sends its FSDP shard as it is (no all-gather first): possible when
        every dp-sharded parameter is cut along another dim than tp cuts it (tp = 1, or a
        row-parallel weight); a dim cut by both is strided, not one box per rank."""
        layout = self.engine.param_layout()
        return all(p.dp_dim is None or p.dp_dim != p.tp_dim for p in layout.values())

    @contextmanager
    def held_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's pieces (``TrainingEngine.held_pieces``), read without autograd."""
        with torch.no_grad():
            if self._send_shards():
                yield self._synced(self.engine.held_pieces())
                return
            with self.engine.full_weights():
                yield self._synced(self.engine.held_pieces())

    def _synced(self, pieces: dict[str, Any]) -> dict[str, Any]:
        """The pieces a weight sync carries: all, or with LoRA only the adapters."""
        names = self.engine.synced_names()
        return pieces if names is None else {k: v for k, v in pieces.items() if k in names}

    def weight_specs(self) -> list[dict[str, Any]]:
        shards = self._send_shards()
        return [
            {
                "name": name,
                "shape": list(p.shape),
                "tp_dim": p.tp_dim,
                "dp_dim": p.dp_dim if shards else None,
                "stage": p.pp_stage,
            }
            for name, p in self._synced(self.engine.param_layout()).items()
        ]

    def weight_dtype(self) -> torch.dtype:
        return torch.float32  # engines keep fp32 master weights (autocast computes in bf16)

    def sink_layout(self) -> Layout:
        return Layout(dp=self.ctx.world_size)  # whole tensors; the engine cuts its own shards

    def sink_names(self) -> set[str]:
        """What a weight sync into this role may fill: every parameter, or with LoRA the
        adapters (the base stays the model folder's, as on the sending side)."""
        names = self.engine.synced_names()
        return set(self.engine.param_layout()) if names is None else names

    def adopt(self, staged: dict[str, torch.Tensor], strict: bool, version: int) -> None:
        # ``accept`` held the offered names to ``sink_names`` already: a LoRA sink's strict
        # sync is its adapters alone, which leaves its (frozen) base weights out
        self.engine.load_full_state(staged, strict and self.engine.synced_names() is None)

    def sum_over_dp(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.engine.sum_over_dp(values)

    @endpoint(ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Sharded checkpoint (model, optimizer, schedule, RNG), written atomically."""
        self.engine.save(path)
        return str(Path(path))

    @endpoint(ONE_TO_ALL)
    def configure_optim(self, optim: OptimConfig) -> int:
        """A fresh optimizer and schedule, e.g. at the start of a training stage; returns the
        optimizer steps taken so far. (A controller that sends the fields as a map still works.)"""
        if self.frozen:
            raise ValueError(f"{type(self).__name__} is frozen; it has no optimizer to configure")
        self.engine.configure_optim(OptimConfig.model_validate(optim))
        return self.engine.step

    @endpoint(ONE_TO_ALL)
    def load(self, path: str) -> int:
        """Restore a checkpoint written by ``save`` at the same layout; returns its step."""
        self.engine.load(path)
        return self.engine.step

    @endpoint(ONE_TO_ALL)
    def snapshot(self, folder: str, step: int) -> int:
        """What ``save`` holds, copied into shared-memory files under ``folder/rank{r}/`` as the
        snapshot of the controller's ``step`` (two slots: a death mid-copy leaves the previous
        snapshot whole); returns the bytes this rank wrote. Backend fsdp only."""
        return self.engine.snapshot(Path(folder), step)

    @endpoint(ONE_TO_ALL)
    def restore_snapshot(self, folder: str, step: int) -> int:
        """The snapshot of ``step`` from ``folder/rank{r}/`` (into a restarted rank too);
        returns its engine step. FileNotFoundError if no complete one of ``step`` is there."""
        return self.engine.restore_snapshot(Path(folder), step)

    @endpoint(ONE_TO_ALL)
    def load_state(self, state: dict[str, torch.Tensor], strict: bool = True) -> int:
        """Whole weights from another role (e.g. the actor's ``state_dict`` after SFT into the
        reference, or its backbone into a critic with ``strict=False``); the optimizer stays."""
        return self.engine.load_full_state(state, strict)

    @endpoint(ONE_TO_ALL)
    def export(self, path: str) -> str:
        """The full weights as a plain Hugging Face folder."""
        self.engine.export(path)
        return str(Path(path))

    @endpoint(RANK_ZERO)
    def progress(self) -> dict[str, int]:
        """Optimizer steps taken and ``forward_backward`` calls waiting for the next one (calls
        run in order: this answers after any call sent before it)."""
        return {"step": self.engine.step, "accumulated": self.engine.accumulated}

    @endpoint(ONE_TO_ALL)
    def discard_gradients(self) -> None:
        """Drop the gradients ``forward_backward`` accumulated."""
        self.engine.discard_gradients()

    @endpoint(RANK_ZERO)
    def precision(self) -> dict[str, str]:
        """The dtype the engine computes in (``dtype: auto`` resolved) and why."""
        return {"dtype": self.engine.precision.dtype, "reason": self.engine.precision.reason}

    @endpoint(RANK_ZERO)
    def param_layout(self) -> dict[str, dict[str, object]]:
        """Per parameter: full shape, the dim split over tp and the dim split over dp."""
        return {name: layout.as_dict() for name, layout in self.engine.param_layout().items()}
