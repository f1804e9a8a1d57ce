"""Rows as megatron's ``GPTModel`` takes them: each row's first real token at column 0.

megatron-core's rotary embedding gives column ``j`` the position ``j`` whatever ``position_ids``
say, while our rows may be left-padded (positions are ``cumsum(mask) - 1``). Moving each row left
by its padding makes the two agree, and then a causal mask alone is the right attention: every
real token sees exactly the real tokens before it (trailing padding sees garbage nobody reads).
The model's outputs are moved back so callers get them in their own columns.

Packed rows (``segment_ids``: several sequences in one row) would need positions that restart
and a block-causal mask; they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transport.batch import TensorBatch


class RowError(ValueError):
    """Rows this engine cannot run, with what to change."""


@dataclass
class Rows:
    """One micro-batch: the caller's rows and the model's view of them."""

    micro: TensorBatch  # as the caller gave it (its own columns)
    input_ids: torch.Tensor  # [B, W] left-aligned, W = the longest row
    offsets: torch.Tensor  # [B] padding columns moved off the front of each row
    real: bool = True  # False: a masked-out copy run only to keep the pipeline's count

    @property
    def width(self) -> int:
        return int(self.micro.tensor("input_ids").shape[1])


def left_align(micro: TensorBatch, width: int = 0, rows: int = 0) -> Rows:
    """``micro`` with each row moved left to its first real token, trailing padding trimmed to
    the longest row, or padded to ``width`` columns and ``rows`` rows when given (a fixed
    shape: the extra rows are padding nobody reads)."""
    if "segment_ids" in micro.tensors:
        raise RowError(
            "the megatron engine runs one sequence per row; packed rows (segment_ids, e.g. "
            "sft_step(pack=True)) are not supported: use pack: false or backend: fsdp"
        )
    ids, mask = micro.tensor("input_ids"), micro.tensor("attention_mask").bool()
    columns = torch.arange(mask.shape[1], device=mask.device)
    lengths = mask.sum(-1)
    offsets = torch.where(lengths > 0, mask.float().argmax(-1), 0)  # first real column
    inside = (columns[None, :] >= offsets[:, None]) & (
        columns[None, :] < (offsets + lengths)[:, None]
    )
    if bool((inside != mask).any()):
        raise RowError(
            "attention_mask has padding between real tokens; the megatron engine takes rows "
            "padded on the left and/or right only"
        )
    width = max(1, width or int(lengths.max()))
    aligned = shift(ids, offsets, width, fill=0)
    if rows > len(aligned):
        aligned = torch.cat([aligned, aligned.new_zeros(rows - len(aligned), width)])
    return Rows(micro, aligned, offsets)


def shift(values: torch.Tensor, offsets: torch.Tensor, width: int, fill: int = 0) -> torch.Tensor:
    """``out[i, j] = values[i, j + offsets[i]]`` for ``j < width`` (``fill`` past the end)."""
    total = values.shape[1]
    index = torch.arange(width, device=values.device)[None, :] + offsets[:, None]
    valid = index < total
    picked = values.gather(1, index.clamp(max=total - 1))
    return torch.where(valid, picked, torch.full_like(picked, fill))


def restore(output: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Model output ``[B', W, ...]`` → ``[B, T, ...]`` in the caller's columns (zero where the
    model saw no token of the row; rows past the caller's ``B`` dropped); differentiable."""
    output = output[: len(rows.micro)]
    batch, width = output.shape[:2]
    if not bool(rows.offsets.any()):  # right padding only: the columns are the caller's
        pad = [0, 0] * (output.dim() - 2) + [0, rows.width - width]
        return torch.nn.functional.pad(output, pad)
    index = torch.arange(rows.width, device=output.device)[None, :] - rows.offsets[:, None]
    valid = (index >= 0) & (index < width)
    index = index.clamp(0, width - 1)
    expand = index.view(batch, rows.width, *([1] * (output.dim() - 2)))
    picked = output.gather(1, expand.expand(batch, rows.width, *output.shape[2:]))
    keep = valid.view(batch, rows.width, *([1] * (output.dim() - 2)))
    return torch.where(keep, picked, torch.zeros_like(picked))


def causal_mask(width: int, device: torch.device | None = None) -> torch.Tensor:
    """megatron's attention mask: ``True`` where a query must not see a key ``[1, 1, W, W]``."""
    ones = torch.ones(width, width, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)[None, None]
