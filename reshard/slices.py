"""Buckets as bytes: the sender cuts its slices of a bucket (views) and copies them once, back to
back, into the buffer that travels (a shared-memory segment, a ZeroMQ frame, a gloo message); the
receiver copies them out into its staging tensors. Both walk the bucket's moves in the same order,
so the buffer needs no index: offsets follow from the boxes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from reshard.layout import Box, Param, box_numel
from reshard.p2p import Move


def region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``tensor`` a box covers."""
    return tensor[tuple(slice(a, b) for a, b in box)]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def cut(
    bucket: Sequence[Move], params: Sequence[Param], held: Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    """The bucket's slices of the sender's tensors, in order (views, no copy)."""
    return [region(held[params[m.param].name], m.src_box) for m in bucket]


def join(parts: Sequence[torch.Tensor], private: bool = False) -> torch.Tensor:
    """Slices back to back as one flat uint8 tensor: one copy, or none for a single contiguous
    slice unless ``private`` (a buffer that must not alias the sender's tensors)."""
    if len(parts) == 1 and parts[0].is_contiguous() and not private:
        return parts[0].reshape(-1).view(torch.uint8)
    out = torch.empty(sum(p.numel() * p.element_size() for p in parts), dtype=torch.uint8)
    offset = 0
    for part in parts:
        n = part.numel() * part.element_size()
        out[offset : offset + n].view(part.dtype).view(part.shape).copy_(part)
        offset += n
    return out


def unpack(
    bucket: Sequence[Move],
    params: Sequence[Param],
    data: torch.Tensor,
    staging: Mapping[str, torch.Tensor],
) -> None:
    """Copy a received bucket (flat uint8) into the staging tensors."""
    offset = 0
    for move in bucket:
        dst = region(staging[params[move.param].name], move.dst_box)
        n = box_numel(move.dst_box) * dst.element_size()
        dst.copy_(data[offset : offset + n].view(dst.dtype).view(dst.shape))
        offset += n


def check_held(
    params: Sequence[Param],
    boxes: Mapping[str, Box],
    held: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """Every tensor a sender will slice has the dtype it reported and the shape of the box the
    plan says it holds."""
    for p in params:
        box = boxes.get(p.name)
        if box is None:
            continue
        tensor = held.get(p.name)
        if tensor is None:
            raise KeyError(f"this rank holds no tensor {p.name!r} the transfer plan sends")
        if tensor.dtype != dtype:
            raise ValueError(f"{p.name}: this rank holds {tensor.dtype}, it reported {dtype}")
        if tuple(tensor.shape) != box_shape(box):
            raise ValueError(
                f"{p.name}: this rank holds shape {list(tensor.shape)} but the plan expects "
                f"{list(box_shape(box))} (its layout differs from what it reported)"
            )
