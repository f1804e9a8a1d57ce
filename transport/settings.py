"""Timeouts and limits shared by every process of a run.

Each wait in hybridflow has a timeout, and each timeout error names the field here that raises it,
so a user who hits one knows the knob (``timeouts.call_s`` and so on). Limits that are not
timeouts live here too because every process must agree on them: the largest frame accepted, how
long rank 0 busy-polls for its ranks' answers, and what the controller's socket takes from a peer
(``controller_*``, ``stranger_messages``: see docs/mesh.md, "Limits on the controller's socket").
The settings travel to role processes as JSON in one environment variable, so a group started by
hand or by SLURM agrees with its controller.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

ENV_VAR = "HYBRIDFLOW_TIMEOUTS"


class Timeouts(BaseModel):
    """Every wait's limit, in seconds (and the limits every process must agree on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call_s: float = Field(600.0, gt=0, description="one role call, controller side")
    connect_s: float = Field(120.0, gt=0, description="groups registering with the controller")
    group_init_s: float = Field(
        60.0, gt=0, description="torch.distributed group set-up and collectives"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="ZeroMQ heartbeat interval on TCP links")
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="silence before a TCP peer is dropped"
    )
    shutdown_s: float = Field(5.0, gt=0, description="grace before stragglers are killed")
    max_frame_bytes: int = Field(
        16 << 30, gt=0, description="largest tensor frame a receiver accepts"
    )
    spin_us: float = Field(
        150.0,
        ge=0,
        description="rank 0 polls this long for the other ranks' answers before it sleeps: a "
        "wake-up costs 45-75 us on a small VM, an answer to a short call comes sooner",
    )
    controller_frame_bytes: int = Field(
        256 << 20,
        gt=0,
        description="largest frame the controller's socket takes (ZeroMQ MAXMSGSIZE): a peer "
        "that sends a bigger one is disconnected before it is buffered. Batches travel as one "
        "frame per tensor from groups on another host (same-host groups use shared memory); "
        "256 MiB holds e.g. an int64 [8192, 4096] column. Weights never pass the controller",
    )
    controller_queue: int = Field(
        1000,
        gt=0,
        description="messages the controller's socket queues per peer, each way (ZeroMQ "
        "SNDHWM/RCVHWM): a peer that sends faster waits; replies a stranger never reads are "
        "dropped; calls to a group beyond it wait in the controller in order",
    )
    stranger_messages: int = Field(
        4,
        gt=0,
        description="messages a peer may send the controller before it has registered (a "
        "coordinator sends one hello); the next one closes its connection",
    )

    def to_env(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls) -> Timeouts:
        raw = os.environ.get(ENV_VAR)
        return cls.model_validate_json(raw) if raw else cls()
