"""Supervised programs over the roles: SFT of the actor, Bradley-Terry training of a reward model.

Both are the same short loop — batches of text rows to a dp-split training endpoint, a held-out
evaluation every ``eval_every`` steps and at the end — and hold no model code: the roles tokenize
their own shard. ``deploy/commands/train.py`` wraps them as ``hybridflow sft`` and ``hybridflow rm``.

    actor = ActorClient(controller, "actor")
    for rows in batches(train, cfg):
        metrics = await actor.sft_step(text_batch(rows, ("prompt", "response")))
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from controller.clients import ActorClient, RewardModelClient
from transport.batch import TensorBatch
from transport.columns import MESSAGES

Log = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 100
    batch_size: int = 32
    eval_every: int = 25  # 0: only before and after
    seed: int = 0


def batches(rows: Sequence[dict[str, Any]], cfg: LoopConfig) -> Iterator[list[dict[str, Any]]]:
    """``cfg.steps`` batches, each epoch a fresh seeded shuffle; a batch never spans epochs."""
    rng = random.Random(cfg.seed)
    order: list[int] = []
    for _ in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order = list(range(len(rows)))
            rng.shuffle(order)
        picked, order = order[: cfg.batch_size], order[cfg.batch_size :]
        yield [rows[i] for i in picked]


def text_batch(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> TensorBatch:
    """The named text columns of each row, as the roles' text endpoints take them.

    An SFT row may be a conversation instead of a (prompt, response) pair: when any row has
    ``messages``, they travel in a ``messages`` column (``role`` and ``content`` of each message;
    None for the other rows), and a named column such a row lacks travels as None.
    """
    conversations = [None if row.get(MESSAGES) is None else _turns(row[MESSAGES]) for row in rows]
    pairs = list(zip(rows, conversations, strict=True))
    texts = {c: [row[c] if talk is None else row.get(c) for row, talk in pairs] for c in columns}
    if any(talk is not None for talk in conversations):
        texts[MESSAGES] = conversations
    return TensorBatch.from_dict(non_tensors=texts)


def _turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """A conversation with only what the roles read of each message."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


async def supervised(
    train: Sequence[dict[str, Any]],
    cfg: LoopConfig,
    step: Callable[[TensorBatch], Any],
    evaluate: Callable[[], Any],
    columns: Sequence[str],
    log: Log,
) -> dict[str, Any]:
    """The shared loop: evaluate, train ``cfg.steps`` batches (evaluating every ``eval_every``),
    evaluate again; every record goes to ``log``. Returns the first and last evaluation."""
    first = await evaluate()
    log({"step": 0, **{f"val/{k}": v for k, v in first.items()}})
    last = first
    for i, rows in enumerate(batches(train, cfg), start=1):
        metrics = await step(text_batch(rows, columns))
        record: dict[str, Any] = {"step": i, **{f"train/{k}": v for k, v in metrics.items()}}
        if i == cfg.steps or (cfg.eval_every and i % cfg.eval_every == 0):
            last = await evaluate()
            record.update({f"val/{k}": v for k, v in last.items()})
        log(record)
    return {"before": first, "after": last, "steps": cfg.steps}


async def sft(
    actor: ActorClient,
    train: Sequence[dict[str, Any]],
    val: Sequence[dict[str, Any]],
    cfg: LoopConfig,
    log: Log,
    response_only: bool = True,
    pack: bool = False,
) -> dict[str, Any]:
    """Next-token training of the actor on (prompt, response) rows, or conversations (rows with
    ``messages``: trained on the assistant's turns only); reports held-out loss.
    ``pack`` packs training rows into context-long rows (the loss is the same, padding goes)."""
    columns = ("prompt", "response")
    held_out = text_batch(val, columns)

    async def step(batch: TensorBatch) -> dict[str, float]:
        return await actor.sft_step(batch, response_only=response_only, pack=pack)

    async def evaluate() -> dict[str, float]:
        result = await actor.sft_eval(held_out, response_only=response_only)
        return {"loss": result["loss"]}

    return await supervised(train, cfg, step, evaluate, columns, log)


async def reward_model(
    model: RewardModelClient,
    train: Sequence[dict[str, Any]],
    val: Sequence[dict[str, Any]],
    cfg: LoopConfig,
    log: Log,
) -> dict[str, Any]:
    """Bradley-Terry training on (prompt, chosen, rejected) rows; reports held-out accuracy
    (the fraction of pairs where chosen scores above rejected), also per ``kind`` of pair."""
    columns = ("prompt", "chosen", "rejected")
    held_out = text_batch(val, columns)

    async def step(batch: TensorBatch) -> dict[str, float]:
        return await model.train_pairs(batch)

    async def evaluate() -> dict[str, float]:
        scores = await model.score_pairs(held_out)
        margin = scores.tensor("chosen") - scores.tensor("rejected")
        found = {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}
        for kind in sorted({str(row["kind"]) for row in val if "kind" in row}):
            rows = torch.tensor([row.get("kind") == kind for row in val])
            found[f"accuracy/{kind}"] = float((margin[rows] > 0).float().mean())
        return found

    return await supervised(train, cfg, step, evaluate, columns, log)
