"""Training rows a person builds from token lists (Tinker's ``Datum``), without knowing
``TensorBatch``'s column conventions: ``Mesh.forward_backward``, ``train_step`` and
``log_probs`` take a list of them where they take a batch.

    rows = [hf.Datum(prompt=[1, 5, 7], response=[9, 2], advantages=0.5, old_log_probs=[-1.2, -0.3])]
    await m.forward_backward(rows, hf.PolicyLossConfig(kind="importance_sampling"))
    await m.forward_backward([hf.Datum(prompt=p, response=r) for p, r in demos], "cross_entropy")

Rows made from a sampled batch (``datums``) keep the temperature it was drawn at, so the losses'
log-probs are taken at the temperature of the sampler's ``old_log_probs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transport.batch import TensorBatch
from transport.columns import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    OLD_LOG_PROBS,
    PAD_VALUES,
    RATIO_MASK,
    RESPONSE_MASK,
    TEMPERATURE,
    WEIGHTS,
)

#: the per-response-token inputs of a loss a Datum may carry, by its field and column name
LOSS_INPUTS = {
    "advantages": ADVANTAGES,
    "old_log_probs": OLD_LOG_PROBS,
    "weights": WEIGHTS,
    "ratio_mask": RATIO_MASK,
}


@dataclass(frozen=True)
class Datum:
    """One training row from token ids: ``prompt`` (read, not trained on), then ``response``
    (the tokens a loss is on), and the loss's inputs per response token: ``advantages`` (one
    number for every token, or one per token), ``old_log_probs`` (the sampler's, e.g. a sampled
    batch's ``log_probs``, or recomputed; one per token) and cross-entropy's ``weights`` (one
    number or one per token; default 1). ``ratio_mask``: GSPO's, 1 on the response tokens whose
    mean log-ratio is the sequence's ratio (default: every response token). ``temperature``:
    the one the row was sampled at, which its log-probs are taken at (``datums`` copies a
    sampled batch's; None: 1, or the call's)."""

    prompt: Sequence[int]
    response: Sequence[int]
    advantages: float | Sequence[float] | None = None
    old_log_probs: Sequence[float] | None = None
    weights: float | Sequence[float] | None = None
    ratio_mask: Sequence[float] | None = None
    temperature: float | None = None


def datums(
    batch: TensorBatch,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> list[Datum]:
    """A batch in the training layout (what ``sample`` returns) as ``Datum`` rows: each row's
    prompt and response tokens (padding dropped) and the loss inputs given, each one number
    per row (``[B]``) or one per position (``[B, T]``, aligned with ``input_ids``: the
    response's are taken), and the temperature the batch was sampled at. ValueError naming the
    row whose response has gaps (a multi-turn row's observation tokens: train on the batch
    itself) or an input of the wrong shape."""
    ids, attention = batch.tensor(INPUT_IDS), batch.tensor(ATTENTION_MASK).bool()
    response = batch.tensor(RESPONSE_MASK).bool()
    given = {"advantages": advantages, "old_log_probs": old_log_probs, "weights": weights}
    for name, value in given.items():
        if value is not None and tuple(value.shape) not in ((len(ids),), tuple(ids.shape)):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; give one number per row "
                f"({len(ids)},) or one per position {tuple(ids.shape)}"
            )
    drawn = batch.meta.get(TEMPERATURE)
    temperature = None if drawn is None else float(drawn)
    found = []
    for i in range(len(ids)):
        where = response[i].nonzero().flatten()
        if len(where) == 0:
            raise ValueError(f"row {i}: no response tokens (response_mask is all 0)")
        start, end = int(where[0]), int(where[-1]) + 1
        if len(where) != end - start:
            raise ValueError(
                f"row {i}: its response_mask has gaps (a multi-turn row's observations); "
                "train on the batch itself"
            )
        inputs: dict[str, Any] = {}
        for name, value in given.items():
            if value is not None:
                inputs[name] = float(value[i]) if value.dim() == 1 else value[i, start:end].tolist()
        if "old_log_probs" in inputs and isinstance(inputs["old_log_probs"], float):
            raise ValueError("old_log_probs: give one per position [B, T]")
        prompt = ids[i, :start][attention[i, :start]].tolist()
        found.append(Datum(prompt, ids[i, start:end].tolist(), **inputs, temperature=temperature))
    return found


def batch_of(data: Sequence[Datum], pad_id: int = 0) -> TensorBatch:
    """``data`` in the training layout: ``input_ids`` (prompt then response, right-padded with
    ``pad_id``), ``attention_mask``, ``response_mask`` (1 on response tokens) and each loss input
    the rows carry at its response positions (0 elsewhere); the rows' sampling temperature in
    ``meta["temperature"]``. ValueError naming the row and field when a row is empty, a
    per-token list does not match its response, only some rows carry an input, a prompt is
    empty, or two rows were sampled at different temperatures."""
    if not data:
        raise ValueError("no rows: give at least one Datum")
    for i, row in enumerate(data):
        if not row.response:
            raise ValueError(f"row {i}: response is empty; a loss needs at least one token")
        if not row.prompt:  # its first response token would have nothing to be predicted from
            raise ValueError(
                f"row {i}: prompt is empty; the first response token is predicted from the "
                "token before it: start the prompt with the tokenizer's BOS token"
            )
    width = max(len(r.prompt) + len(r.response) for r in data)
    ids = torch.full((len(data), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(data), width, dtype=torch.long)
    response = torch.zeros(len(data), width, dtype=torch.long)
    for i, row in enumerate(data):
        start, end = len(row.prompt), len(row.prompt) + len(row.response)
        ids[i, :end] = torch.tensor([*row.prompt, *row.response], dtype=torch.long)
        attention[i, :end] = 1
        response[i, start:end] = 1
    tensors = {INPUT_IDS: ids, ATTENTION_MASK: attention, RESPONSE_MASK: response}
    for name, column in LOSS_INPUTS.items():
        given = [getattr(r, name) is not None for r in data]
        if any(given) and not all(given):
            missing = given.index(False)
            raise ValueError(f"row {missing}: {name} is missing; give it on every row or none")
        if all(given):
            tensors[column] = _per_token(data, name, width)
    meta: dict[str, Any] = {PAD_VALUES: {INPUT_IDS: pad_id}}
    temperature = sampled_at(data)
    if temperature is not None:
        meta[TEMPERATURE] = temperature
    return TensorBatch(tensors, {}, meta)


def sampled_at(data: Sequence[Datum]) -> float | None:
    """The temperature ``data`` was sampled at (None: no row says); ValueError naming a row
    whose temperature is not the others' (one call computes its log-probs at one)."""
    first = next((i for i, r in enumerate(data) if r.temperature is not None), None)
    if first is None:
        return None
    found = data[first].temperature
    for i, row in enumerate(data):
        if row.temperature is not None and row.temperature != found:
            raise ValueError(
                f"row {i}: temperature {row.temperature} is not row {first}'s {found}; rows "
                "sampled at different temperatures go in separate calls"
            )
    return found


def _per_token(data: Sequence[Datum], name: str, width: int) -> torch.Tensor:
    found = torch.zeros(len(data), width, dtype=torch.float32)
    for i, row in enumerate(data):
        value = getattr(row, name)
        start, n = len(row.prompt), len(row.response)
        if isinstance(value, int | float):
            found[i, start : start + n] = float(value)
            continue
        if len(value) != n:
            raise ValueError(
                f"row {i}: {name} has {len(value)} values for {n} response tokens; give one "
                "per response token" + (" or one number" if name != "old_log_probs" else "")
            )
        found[i, start : start + n] = torch.tensor([float(v) for v in value])
    return found
