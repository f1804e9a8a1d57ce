"""What a weight transfer between two role groups carries through the controller
(``reshard/remote.py`` runs it; ``controller/sync.py`` strings the calls together).

Both sides need these, so they live in ``transport/``:

- ``WeightSyncSettings``: how slices travel and how long a stall may last. The controller
  validates them when the experiment loads (``trainer.weight_sync``) and passes them with each
  transfer command.
- the descriptions the calls exchange: the source group's ``Source`` (its layout, dtype, parameter
  shapes and splits, where each rank runs: ``weight_source``), the target group's ``Target`` (its
  layout, the names it takes, each rank's ``Inbox``: ``open_receive``) and what each side reports
  (``WeightsSent`` from ``send_weights``, ``WeightsReceived`` from ``receive_weights`` and
  ``copy_from``).

All are structs (``transport/structs.py``): the codec carries them as they are and validates every
field on receipt. The descriptions are frozen dataclasses because the ranks build them (nothing to
validate there) and ``reshard/`` reads them in its inner loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from transport.protocol import Layout

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


@dataclass(frozen=True)
class Peer:
    """Where a rank runs: its host (``transport.channel.host_id``) and cluster (empty: the one
    cluster). ``reshard.peers.this_peer`` makes this rank's."""

    host: str
    cluster: str


@dataclass(frozen=True)
class Source:
    """A group that gives weights, as every sink plans a transfer from it."""

    role: str
    layout: Layout
    dtype: str  # float32, bfloat16 or float16
    #: ``{"name", "shape", "tp_dim", "dp_dim", "stage"}`` of every parameter, full shapes
    #: (``EngineRole.weight_specs``; ``reshard.p2p.params_from_wire`` checks each entry)
    params: list[dict[str, Any]]
    peers: list[Peer]  # by rank


@dataclass(frozen=True)
class Inbox:
    """Where one target rank takes buckets."""

    peer: Peer
    token: str
    ipc: str | None = None
    tcp: str | None = None
    key: str | None = None  # the tcp socket's CURVE public key (z85)


@dataclass(frozen=True)
class Target:
    """A group whose inboxes are open for one weight version."""

    role: str
    layout: Layout
    accept: list[str]  # the parameter names it takes
    splits: dict[str, int]  # tp dim of each parameter the target splits (others: whole)
    inboxes: list[Inbox]  # by rank
    store: str | None = None  # host:port of the stateless group's TCPStore
    group_key: str | None = None


@dataclass(frozen=True)
class WeightsSent:
    """What source rank 0 sent."""

    bytes: int
    seconds: float
    paths: dict[str, str]  # target rank → the path its slices took (shm, group or zmq)
    prepare_s: float  # gathering the pieces to send, before the first byte went


@dataclass(frozen=True)
class WeightsReceived:
    """What target rank 0 took."""

    version: int
    bytes: int
    receive_s: float | None = None  # every bucket in (a transfer from another group)
    swap_s: float | None = None  # the staged pieces swapped in
