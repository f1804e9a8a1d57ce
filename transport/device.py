"""The device vocabulary every package shares: which kinds of device a group may run on, and
whether a tensor sits in host memory.

The rank runtime decides a rank's actual device and collective backend
(``roles/runtime/device.py``); the controller validates a placement's ``device`` setting and the
wire code checks a tensor is in host memory before it serialises it. Neither may import ``roles``,
so the names they share live here, and no other module spells a device or backend out.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class DeviceKind(StrEnum):
    """Where a role group's ranks compute (a placement's ``device`` setting)."""

    CPU = "cpu"
    CUDA = "cuda"


#: the torch.distributed backend of each device kind
BACKENDS = {DeviceKind.CPU: "gloo", DeviceKind.CUDA: "nccl"}

#: host memory: where tensors must be to go on the wire or into shared memory
HOST = torch.device(DeviceKind.CPU)


def in_host_memory(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are in host memory (readable without a device copy)."""
    return t.device.type == DeviceKind.CPU
