"""Scores of generated rows from a reward role (or a cost role): the one place that decides what
such a role is sent, and where a batch keeps the scores it got while it was still streaming in.

A reward role is sent the token columns and every text column of the rows except the ones the
generation pipeline adds for its own bookkeeping (``finish``, ``request``): the prompt, the
response and whatever columns the data rows carried (``answer``, ``data_source``, ...), which a
rule function reads as its metadata.

``controller/streaming.py`` scores each sub-batch as it arrives and ``stash``-es the result in the
batch as ``<role>:scores`` (and ``<role>:reward/<key>``) columns; ``scores`` reads them back, or
asks the role when the batch was not scored so. An algorithm step calls ``scores`` either way.
"""

from __future__ import annotations

from typing import Any

import torch

from controller.clients import RewardClient
from transport.batch import TensorBatch
from transport.columns import FINISH, REQUEST, SCORES, TOKENS

REFUSED = "refused"  # [B] bool, per scoring role: the row's score was not a finite number
#: text columns the pipeline adds to generated rows; a reward role is not sent them
BOOKKEEPING = (FINISH, REQUEST)


def request(batch: TensorBatch) -> TensorBatch:
    """The columns of ``batch`` a reward role is sent (not what scoring roles wrote in it)."""
    text = [k for k in batch.non_tensors if k not in BOOKKEEPING and ":" not in k]
    return batch.select(TOKENS, text, [])


def keep_notes(batch: TensorBatch, role: str, reply: TensorBatch) -> None:
    """A scoring role's text per row (an LLM judge's ``verdict``) kept in ``batch`` as
    ``<role>:<name>`` columns, so the logged samples show why a row scored as it did."""
    for name, column in reply.non_tensors.items():
        batch.non_tensors[f"{role}:{name}"] = list(column)


def notes_of(batch: TensorBatch, role: str, row: int) -> dict[str, Any]:
    """Row ``row``'s notes from scoring role ``role`` (``keep_notes``), by name."""
    prefix = f"{role}:"
    return {k[len(prefix) :]: v[row] for k, v in batch.non_tensors.items() if k.startswith(prefix)}


async def ask(role: RewardClient, batch: TensorBatch) -> TensorBatch:
    """``scores`` ``[B]`` (and ``reward/<key>`` extras) of ``batch``'s rows from ``role``."""
    return await role.compute_reward(request(batch))


def stash(batch: TensorBatch, role: str, found: dict[str, torch.Tensor]) -> None:
    """Keep the columns ``role`` returned for ``batch``'s rows in the batch itself."""
    for key, column in found.items():
        batch.tensors[f"{role}:{key}"] = column


def stashed(batch: TensorBatch, role: str) -> dict[str, torch.Tensor] | None:
    """The columns reward role ``role`` returned for ``batch``'s rows while it streamed in
    (``scores``, ``reward/<key>``), or None when it was not scored so."""
    prefix = f"{role}:"
    if f"{prefix}{SCORES}" not in batch.tensors:
        return None
    return {k[len(prefix) :]: v for k, v in batch.tensors.items() if k.startswith(prefix)}


async def scores(role: RewardClient, batch: TensorBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """One score per row, plus the batch means of any ``reward/<key>`` extras. A score that is
    not a finite number (a reward function's nan or inf) is refused: it counts 0, the row is
    marked ``<role>:refused`` in ``batch`` (its advantages are zeroed before any update:
    ``refused_rows``) and ``reward/non_finite`` is the share of such rows."""
    found = stashed(batch, role.role)
    if found is None:
        reply = await ask(role, batch)
        keep_notes(batch, role.role, reply)
        found = reply.tensors
    extras = {k: float(v.float().mean()) for k, v in found.items() if k.startswith("reward/")}
    score, bad = finite(found[SCORES])
    if bad.any():
        batch.tensors[f"{role.role}:{REFUSED}"] = bad
        extras["reward/non_finite"] = float(bad.float().mean())
    return score, extras


def finite(score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``score`` as floats with every non-finite value 0, which rows those were)."""
    score = score.float()
    bad = ~torch.isfinite(score)
    return torch.where(bad, torch.zeros_like(score), score), bad


def refused_rows(batch: TensorBatch) -> torch.Tensor | None:
    """[B] the rows a reward or cost role gave no finite score (``scores``), or None."""
    marks = [v for k, v in batch.tensors.items() if k.endswith(f":{REFUSED}")]
    if not marks:
        return None
    found = marks[0].clone()
    for mark in marks[1:]:
        found |= mark
    return found
