"""Settings of a weight transfer between two role groups (``reshard/remote.py`` runs it).

They live in ``transport/`` because both sides need them: the controller validates them when the
experiment loads (``trainer.weight_sync``) and passes them, as a small dict, with each transfer
command; the role ranks read them back with ``WeightSyncSettings.model_validate``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SyncPath = Literal["auto", "shm", "group", "zmq"]


class WeightSyncSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: SyncPath = Field(
        "auto",
        description="how slices travel between a pair of ranks: auto picks shared memory on one "
        "host, a stateless gloo group spanning both groups on one cluster, ZeroMQ frames "
        "(CURVE-encrypted off the host) across clusters; shm, group or zmq force one",
    )
    bucket_mb: float = Field(
        64.0, gt=0, description="largest bucket of slices sent as one message (MiB)"
    )
    stall_s: float = Field(
        60.0,
        gt=0,
        description="a transfer with no progress for this long fails, naming the ranks it waits "
        "for (a dead rank is usually noticed sooner, when its connection closes)",
    )

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))
