"""Text rows → the token batch every engine reads, and back.

A training row is ``<bos> prompt response <eos>`` right-padded to the longest row of the batch:

* ``input_ids``, ``attention_mask`` ``[B, T]``;
* ``response_mask`` ``[B, T]``: the response tokens and the closing ``<eos>`` — the tokens a policy
  is trained on (or every token after ``<bos>`` when the whole sequence is the target).

Tokenization happens on the role's ranks (each on its own data-parallel shard), not in the
controller, which never loads model code. Rows longer than the model's context are cut from the
right; how many were cut is reported, never hidden.

**Packing** puts several sequences into one row (first fit, in order) to save padding work. A
``segment_ids`` column (1, 2, ... per sequence, 0 for padding) tells the engine to restart
positions at each sequence and to mask attention across them, so a packed batch gives the same
per-token losses as the unpacked one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from transport.batch import TensorBatch


def encode_rows(
    tokenizer: Any,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_len: int,
    response_only: bool = True,
    pack: bool = False,
) -> tuple[TensorBatch, int]:
    """Tokenize (prompt, response) pairs; returns the batch and the number of rows truncated."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    rows, masks, cut = [], [], 0
    for prompt, response in zip(prompts, responses, strict=True):
        head = [bos, *tokenizer.encode(prompt, add_special_tokens=False)]
        tail = [*tokenizer.encode(response, add_special_tokens=False), eos]
        ids = head + tail
        target = [0] * len(head) + [1] * len(tail) if response_only else [0] + [1] * (len(ids) - 1)
        if len(ids) > max_len:
            ids, target, cut = ids[:max_len], target[:max_len], cut + 1
        rows.append(ids)
        masks.append(target)
    if pack:
        return pack_rows(rows, masks, max_len, tokenizer.pad_token_id), cut
    return pad_rows(rows, masks, tokenizer.pad_token_id), cut


def pad_rows(
    rows: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad: int
) -> TensorBatch:
    """Right-pad token rows into ``input_ids`` / ``attention_mask`` / ``response_mask``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
        response[i, : len(row)] = torch.tensor(target, dtype=torch.long)
    return TensorBatch.from_dict(
        {"input_ids": ids, "attention_mask": attention, "response_mask": response}
    )


def pack_rows(
    rows: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], max_len: int, pad: int
) -> TensorBatch:
    """Sequences packed first-fit into rows of at most ``max_len`` tokens, with ``segment_ids``."""
    bins: list[tuple[list[int], list[int], list[int]]] = []  # ids, targets, segment ids
    for row, target in zip(rows, targets, strict=True):
        home = next((b for b in bins if len(b[0]) + len(row) <= max_len), None)
        if home is None:
            home = ([], [], [])
            bins.append(home)
        segment = (home[2][-1] + 1) if home[2] else 1
        home[0].extend(row)
        home[1].extend(target)
        home[2].extend([segment] * len(row))
    batch = pad_rows([b[0] for b in bins], [b[1] for b in bins], pad)
    segments = torch.zeros_like(batch.tensors["input_ids"])
    for i, (_, _, seg) in enumerate(bins):
        segments[i, : len(seg)] = torch.tensor(seg, dtype=torch.long)
    return batch.union(TensorBatch.from_dict({"segment_ids": segments}))


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting at each new segment of a row."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: a token sees earlier tokens of its own segment. Padding sees only
    itself, so no attention row is empty (an empty row is NaN under softmax)."""
    width = segment_ids.shape[1]
    index = torch.arange(width, device=segment_ids.device)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = index[None, :] <= index[:, None]
    return ((same & causal) | torch.eye(width, dtype=torch.bool, device=segment_ids.device))[
        :, None
    ]


def decode_rows(tokenizer: Any, batch: TensorBatch) -> tuple[list[str], list[str]]:
    """(prompt text, response text) of each row of a token batch, special tokens dropped."""
    ids, attention = batch.tensor("input_ids"), batch.tensor("attention_mask")
    response = batch.tensor("response_mask")
    prompts, responses = [], []
    for row, att, resp in zip(ids, attention.bool(), response.bool(), strict=True):
        prompts.append(tokenizer.decode(row[att & ~resp].tolist(), skip_special_tokens=True))
        responses.append(tokenizer.decode(row[resp].tolist(), skip_special_tokens=True))
    return prompts, responses


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (where a sequence-scoring head reads)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    positions = positions.expand_as(attention_mask)
    return (positions * attention_mask.bool()).max(-1).values
