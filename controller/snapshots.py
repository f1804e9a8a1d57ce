"""In-memory snapshots as the controller holds them (``trainer.snapshot_every``): the trained
roles' state lives in shared memory on their hosts (``roles/engines/training/snapshot.py``);
the controller's part of the snapshot, and which one is newest, lives here, outside any one
trainer, so the trainer after a rollback finds it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transport.batch import TensorBatch


@dataclass
class Snapshot:
    """An in-memory snapshot: the controller's part of a checkpoint (``controller.json``'s
    fields) and the batches generated ahead; the roles' parts are in shared memory under
    ``Snapshots.folder``."""

    state: dict[str, Any]
    pending: dict[int, TensorBatch]

    @property
    def step(self) -> int:
        return int(self.state["global_step"])


@dataclass
class Snapshots:
    """Where the trained roles' snapshots go (a folder in shared memory, one per role) and the
    newest complete one; outlives a trainer, so the one after a rollback finds it."""

    folder: Path
    every: int
    latest: Snapshot | None = None
