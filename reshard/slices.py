"""Buckets as bytes: the sender packs its slices of a bucket into one flat buffer, the receiver
copies them out into its staging tensors. Both walk the bucket's moves in the same order, so the
buffer needs no index: offsets follow from the boxes."""

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


def bucket_bytes(bucket: Sequence[Move], params: Sequence[Param]) -> int:
    return sum(m.nbytes(params) for m in bucket)


def pack(
    bucket: Sequence[Move], params: Sequence[Param], held: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The bucket's slices of the sender's tensors, back to back, as one flat uint8 tensor (no
    copy when the bucket is one contiguous slice)."""
    if len(bucket) == 1:
        only = region(held[params[bucket[0].param].name], bucket[0].src_box)
        if only.is_contiguous():
            return only.reshape(-1).view(torch.uint8)
    out = torch.empty(bucket_bytes(bucket, params), dtype=torch.uint8)
    offset = 0
    for move in bucket:
        src = region(held[params[move.param].name], move.src_box)
        n = src.numel() * src.element_size()
        out[offset : offset + n].view(src.dtype).view(src.shape).copy_(src)
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
