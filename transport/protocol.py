"""The wire protocol between the controller, coordinators and ranks.

Every message is one ZeroMQ multipart message: frame 0 is a msgpack header
``[version, type, call_id, body]``; frames 1.. carry raw tensor bytes that the header's tensor
descriptors point at (see ``transport.codec``). ``body`` is a msgpack map whose keys depend on the
type. The version byte comes first so a peer from another release is refused with a reason rather
than misread.

| type     | direction                          | body                                             |
|----------|------------------------------------|--------------------------------------------------|
| HELLO    | coordinator → controller, rank → 0 | roles, world_size, layout, version, token, host… |
| WELCOME  | controller → coordinator           | group                                            |
| REFUSE   | controller → coordinator           | reason                                           |
| CALL     | controller → coordinator → ranks   | role, method, args, kwargs                       |
| REPLY    | back along the same path           | result                                           |
| ERROR    | back along the same path           | role, rank, exc_type, message, traceback         |
| DEAD     | coordinator → controller           | roles, rank, cause                               |
| SHUTDOWN | controller → coordinator → ranks   | reason                                           |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pydantic import StrictInt

from transport.structs import StructError, from_map, to_map

PROTOCOL_VERSION = 1
#: the key under which a role reports its rank's peak memory over a call: in the meta of the
#: batch ``generate`` returns and in the metrics of ``update_policy`` (bytes; device allocator
#: on CUDA, process resident set on the host)
PEAK_MEMORY = "peak_memory_bytes"


class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REFUSE = 3
    CALL = 4
    REPLY = 5
    ERROR = 6
    DEAD = 7
    SHUTDOWN = 8


class Transfer(enum.StrEnum):
    """Names of the transfer protocols: how a role group's coordinator splits a call's arguments
    over its ranks and collects their results. The role side (``roles/runtime/endpoint.py``)
    implements them; the controller's clients name the one each endpoint uses; a group reports
    these names, as they are, for every endpoint it serves."""

    ONE_TO_ALL = "one-to-all"  # same args to every rank, rank 0's result
    DP_SPLIT = "dp-split"  # batches split over dp ranks; results concatenated (or listed) by dp
    RANK_ZERO = "rank-zero"  # only rank 0 runs
    DP_REDUCED = "dp-split/reduced"  # dp-split in, rank 0's (already reduced) result out
    DP_RAGGED = "dp-split/ragged"  # dp-split, ragged [B, T] columns right-padded and concatenated
    # the paper's 3D_ALL_MICRO_DP: split over the d * d_g generation replicas of the layout's
    # generation tp (reshard/), each replica's first tp rank's rows concatenated in order (ragged)
    MICRO_DP = "3d-all-micro-dp"
    # list arguments routed item by item to the dp rank their ``replica`` field names (every
    # rank runs, with its items or none); the ranks' lists concatenated in dp order
    DP_ROUTED = "dp-routed"


class ProtocolError(ValueError):
    """A message that cannot be accepted: the receiver logs the reason and carries on."""


@dataclass(frozen=True)
class Layout:
    """A group's parallel layout. Ranks are ordered tp fastest, then pp, then dp (the standard
    grouping: tp/pp peers on consecutive ranks, dp at stride pp * tp)."""

    dp: StrictInt = 1  # StrictInt: a struct from the wire holds ints, not bools or strings
    tp: StrictInt = 1
    pp: StrictInt = 1
    #: The generation layout of the 3D-HybridEngine (reshard/): tensor and pipeline sizes while
    #: the group generates; 0 means the same as training. Each must divide its training size.
    gen_tp: StrictInt = 0
    gen_pp: StrictInt = 0

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"layout.{name}={value!r} must be a positive integer")
        for name, train in (("gen_tp", self.tp), ("gen_pp", self.pp)):
            value = getattr(self, name)
            if type(value) is not int or value < 0 or (value and train % value):
                raise ValueError(
                    f"layout.{name}={value!r} must be 0 (as training) or divide {name[4:]}={train}"
                )

    @property
    def generation_tp(self) -> int:
        return self.gen_tp or self.tp

    @property
    def generation_pp(self) -> int:
        return self.gen_pp or self.pp

    @property
    def resharded(self) -> bool:
        """Whether generation runs at another layout than training."""
        return (self.generation_tp, self.generation_pp) != (self.tp, self.pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank in this group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a group of {self.world_size}")
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return dp * self.pp * self.tp + pp * self.tp + tp

    def to_wire(self) -> dict[str, int]:
        """The plain map a hello carries (a peer that has not registered may send no extension,
        so the hello cannot hold the struct itself; calls carry it nested in their structs)."""
        return to_map(self)

    @classmethod
    def from_wire(cls, data: Any) -> Layout:
        """A hello's layout map, which must name dp, tp and pp; ``ProtocolError`` otherwise."""
        if not isinstance(data, dict) or not {"dp", "tp", "pp"} <= data.keys():
            raise ProtocolError(f"layout must be a map with dp, tp and pp, got {data!r}")
        try:
            return from_map(cls, data)
        except StructError as exc:
            raise ProtocolError(f"bad layout {data!r}: {exc}") from exc

    @classmethod
    def for_world(
        cls, world_size: int, tp: int = 1, pp: int = 1, gen_tp: int = 0, gen_pp: int = 0
    ) -> Layout:
        """The layout with the given tp and pp over ``world_size`` ranks; dp is what remains."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if world_size % (tp * pp):
            raise ValueError(
                f"tp={tp} x pp={pp} does not divide world_size={world_size}; "
                f"choose tp and pp whose product divides {world_size}"
            )
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp, gen_tp=gen_tp, gen_pp=gen_pp)


@dataclass
class Message:
    type: MsgType
    call_id: int = 0
    body: dict[str, Any] = field(default_factory=dict)


# Keys each type's body must carry; checked on receipt so handlers can index without guards.
REQUIRED_KEYS: dict[MsgType, tuple[str, ...]] = {
    MsgType.HELLO: ("roles", "world_size", "layout", "version", "token", "host", "pid"),
    MsgType.WELCOME: ("group",),
    MsgType.REFUSE: ("reason",),
    MsgType.CALL: ("role", "method", "args", "kwargs"),
    MsgType.REPLY: ("result",),
    MsgType.ERROR: ("role", "rank", "exc_type", "message", "traceback"),
    MsgType.DEAD: ("roles", "rank", "cause"),
    MsgType.SHUTDOWN: (),
}


def check_body(msg_type: MsgType, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(f"{msg_type.name} body must be a map, got {type(body).__name__}")
    missing = [k for k in REQUIRED_KEYS[msg_type] if k not in body]
    if missing:
        raise ProtocolError(f"{msg_type.name} body lacks {', '.join(missing)}")
    return body
