"""The device seam: which device a rank computes on and which collective backend its group uses.

A placement names each group's device kind (``device: cpu|cuda``, carried to the ranks as
``HYBRIDFLOW_DEVICE``). This module turns that kind and the rank's ``LOCAL_RANK`` into a
``RankDevice``: ``cpu`` with gloo, or ``cuda:LOCAL_RANK`` with NCCL. ``init_group`` joins the
process group with its backend, and roles read it from ``RoleContext.device`` (mesh device type,
autocast device type) — so no engine spells a device or a backend out. ``decide`` is a pure
function of its inputs (how many CUDA devices this machine has is one), so tests check every
decision without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transport.device import HOST, DeviceKind

#: the collective backend of each device kind
BACKENDS = {DeviceKind.CPU: "gloo", DeviceKind.CUDA: "nccl"}


class DeviceError(RuntimeError):
    """A group asked for a device this machine cannot give it."""


@dataclass(frozen=True)
class RankDevice:
    """One rank's device and its group's collective backend."""

    kind: DeviceKind
    device: torch.device
    backend: str

    @property
    def type(self) -> str:
        """The device type torch APIs take (``init_device_mesh``, ``torch.autocast``)."""
        return self.device.type

    def activate(self) -> None:
        """Make this rank's device the current one (before the process group starts)."""
        if self.kind == DeviceKind.CUDA:
            torch.cuda.set_device(self.device)


#: every cpu rank's decision
HOST_DEVICE = RankDevice(DeviceKind.CPU, HOST, BACKENDS[DeviceKind.CPU])


def decide(kind: DeviceKind, local_rank: int, cuda_devices: int, group: str) -> RankDevice:
    """The device and backend of the rank ``local_rank`` (its index on this machine) of
    ``group`` when the machine has ``cuda_devices`` CUDA devices; a ``DeviceError`` naming the
    group and the setting when the machine cannot serve the kind."""
    kind = DeviceKind(kind)  # a plain "cpu" from a caller's config is fine; "tpu" is not
    if kind == DeviceKind.CPU:
        return HOST_DEVICE
    if cuda_devices == 0:
        raise DeviceError(
            f"group {group!r} has device={kind} but this machine has no CUDA device "
            f"(torch.cuda.is_available() is False); set placement.{group}.device: "
            f"{DeviceKind.CPU} (hybridflow role --device {DeviceKind.CPU}), or run the group on "
            "a machine with GPUs"
        )
    if not 0 <= local_rank < cuda_devices:
        raise DeviceError(
            f"group {group!r} has device={kind}: LOCAL_RANK={local_rank} but this machine has "
            f"{cuda_devices} CUDA device(s); start at most {cuda_devices} rank(s) per machine"
        )
    return RankDevice(kind, torch.device(kind, local_rank), BACKENDS[kind])


def cuda_devices() -> int:
    """CUDA devices this process can use (0 without CUDA, without touching any device)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(kind: DeviceKind, local_rank: int, group: str) -> RankDevice:
    """``decide`` for this machine."""
    return decide(kind, local_rank, cuda_devices() if kind == DeviceKind.CUDA else 0, group)


def check_device(kind: DeviceKind, group: str, ranks_here: int) -> None:
    """Fail fast when this machine cannot run ``ranks_here`` ranks of ``group`` (local ranks
    0 .. ranks_here - 1): a launcher calls this before it starts any of them here."""
    rank_device(kind, ranks_here - 1, group)
