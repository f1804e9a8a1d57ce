"""Rows as the megatron engine hands them to GPTModel (``roles/engines/training/megatron/rows.py``):
left-aligned so RoPE's column = the token's position, outputs moved back to the caller's columns,
and rows it cannot run refused with what to change."""

from __future__ import annotations

import pytest
import torch

from roles.engines.training.megatron.rows import RowError, causal_mask, left_align, restore
from transport.batch import TensorBatch


def rows(mask: list[list[int]]) -> TensorBatch:
    m = torch.tensor(mask)
    ids = (torch.arange(m.numel()).view(m.shape) + 10) * m
    return TensorBatch.from_dict({"input_ids": ids, "attention_mask": m})


def test_left_and_right_padding_become_left_aligned_rows() -> None:
    batch = rows([[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    got = left_align(batch)
    assert got.offsets.tolist() == [2, 0, 0]
    assert got.input_ids.tolist() == [
        [12, 13, 14, 0, 0, 0],
        [16, 17, 0, 0, 0, 0],
        [22, 23, 24, 25, 26, 27],
    ]


def test_trailing_padding_is_trimmed_or_padded_to_a_fixed_shape() -> None:
    batch = rows([[0, 1, 1, 0], [1, 0, 0, 0]])
    assert left_align(batch).input_ids.tolist() == [[11, 12], [14, 0]]
    fixed = left_align(batch, width=3, rows=4)
    assert fixed.input_ids.tolist() == [[11, 12, 0], [14, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_outputs_return_to_the_callers_columns() -> None:
    batch = rows([[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    got = left_align(batch, rows=3)
    output = got.input_ids.float()[..., None] * torch.tensor([1.0, -1.0])  # [B', W, 2]
    back = restore(output, got)
    assert back.shape == (2, 6, 2)
    assert back[..., 0].tolist() == (batch["input_ids"].float()).tolist()
    assert torch.equal(back[..., 1], -back[..., 0])


def test_restore_passes_gradients_back_to_the_model_columns() -> None:
    batch = rows([[0, 1, 1], [1, 1, 1]])
    got = left_align(batch)
    output = torch.ones(2, 3, requires_grad=True)
    restore(output, got).sum().backward()
    assert output.grad is not None
    assert output.grad.tolist() == [[1, 1, 0], [1, 1, 1]]  # row 0's last model column: unseen


def test_rows_it_cannot_run_are_refused() -> None:
    with pytest.raises(RowError, match="padding between real tokens"):
        left_align(rows([[1, 0, 1]]))
    packed = rows([[1, 1, 1]]).union(
        TensorBatch.from_dict({"segment_ids": torch.tensor([[1, 1, 2]])})
    )
    with pytest.raises(RowError, match="packed rows"):
        left_align(packed)


def test_the_mask_hides_later_keys() -> None:
    assert causal_mask(3)[0, 0].tolist() == [
        [False, True, True],
        [False, False, True],
        [False, False, False],
    ]
