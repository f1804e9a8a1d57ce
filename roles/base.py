"""What every role sees of its process: rank, group, layout, device.

A role is a plain class whose constructor takes a ``RoleContext`` plus its own config keywords and
whose endpoints are marked with ``@endpoint`` (``roles/runtime/endpoint.py``). The controller names
the class by import path (``package.module:Class``) in the placement, so which roles share a group
is configuration; ``roles/runtime/host.py`` builds the instances on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from roles.runtime.device import RankDevice
from transport.protocol import Layout


@dataclass
class RoleContext:
    role: str
    group: str
    rank: int
    world_size: int
    layout: Layout
    process_group: dist.ProcessGroup | None
    #: where this rank computes and its group's backend (``roles/runtime/device.py``); engines
    #: take mesh and autocast device types from here
    device: RankDevice

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]


class Role:
    """Base class of roles (optional: any class with endpoints and this constructor works)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
