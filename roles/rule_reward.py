"""The rule-based reward role: a Python function named by import path scores each row
(``roles/reward.py`` says how; the model-based reward is there). A module of its own so that the
experiment checker, which reads ``RuleReward``'s settings in the controller's process, imports no
model code (transformers, the training engines: seconds of every run's and mesh's start)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from roles.base import Role, RoleContext
from roles.rules import needed_columns
from roles.runtime.endpoint import DP_SPLIT, endpoint
from transport.batch import TensorBatch
from transport.imports import import_path

RuleFn = Callable[[str, str, dict[str, Any]], Any]


class RewardError(ValueError):
    """A reward function failed or returned something that is not a score."""


def load_function(path: str) -> RuleFn:
    """``package.module:function`` → the callable, with errors that say what is wrong."""
    try:
        found: RuleFn = import_path(path, "reward function", "function", callable)
    except ValueError as exc:
        raise RewardError(str(exc)) from exc
    return found


def text_rows(batch: TensorBatch, tokenizer: Any) -> tuple[list[str], list[str]]:
    """(prompts, responses) of a batch: its text columns, or its tokens decoded."""
    if "prompt" in batch.non_tensors and "response" in batch.non_tensors:
        return list(batch.non_tensors["prompt"]), list(batch.non_tensors["response"])
    if tokenizer is None:
        raise RewardError(
            "the batch has no 'prompt'/'response' text columns and this reward role has no "
            "tokenizer to decode its tokens; set the role's 'tokenizer' to a model folder"
        )
    from roles.modeling.text import decode_rows  # transformers: only rows given as tokens

    return decode_rows(tokenizer, batch)


def metadata(batch: TensorBatch, row: int) -> dict[str, Any]:
    """Row ``row``'s columns other than prompt and response (a ``metadata`` map flattened)."""
    skip = {"prompt", "response"}
    meta = {k: v[row] for k, v in batch.non_tensors.items() if k not in skip}
    nested = meta.pop("metadata", None)
    return {**meta, **nested} if isinstance(nested, dict) else meta


class RuleReward(Role):
    """Scores rows with a Python function named by import path."""

    def __init__(self, ctx: RoleContext, function: str, tokenizer: str | None = None) -> None:
        super().__init__(ctx)
        self.path = function
        self.fn = load_function(function)
        self.needs = needed_columns(self.fn)
        self.tokenizer = None
        if tokenizer:
            from roles.modeling.models import load_tokenizer  # transformers: only when asked

            self.tokenizer = load_tokenizer(tokenizer)

    @endpoint(DP_SPLIT)
    def compute_reward(self, batch: TensorBatch) -> TensorBatch:
        """``scores`` ``[B]`` (float32) plus ``reward/<key>`` for extra numeric dict keys."""
        prompts, responses = text_rows(batch, self.tokenizer)
        scores, extras = [], []
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            result = self._call(row, prompt, response, metadata(batch, row))
            scores.append(result.pop("score"))
            extras.append(result)
        columns = {"scores": torch.tensor(scores, dtype=torch.float32)}
        for key in sorted(set().union(*extras)) if extras else []:
            values = [float(extra.get(key, math.nan)) for extra in extras]
            columns[f"reward/{key}"] = torch.tensor(values, dtype=torch.float32)
        return TensorBatch.from_dict(columns)

    def _call(self, row: int, prompt: str, response: str, meta: dict[str, Any]) -> dict[str, Any]:
        where = (
            f"row {row} of this rank's shard (prompt={prompt[:80]!r}, response={response[:80]!r})"
        )
        missing = [c for c in self.needs if meta.get(c) is None]
        if missing:
            raise RewardError(
                f"reward function {self.path} needs column(s) {missing} and {where} has none "
                "(missing or null); give every row of the data a value"
            )
        try:
            result = self.fn(prompt, response, meta)
        except Exception as exc:  # the user's code: report it with the row, keep serving
            raise RewardError(
                f"reward function {self.path} raised {type(exc).__name__}: {exc} on {where}"
            ) from exc
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(
                    f"reward function {self.path} returned a dict without 'score' on {where}"
                )
            # extra numbers become columns; anything else is the function's business
            result = {
                k: v
                for k, v in result.items()
                if k == "score" or (isinstance(v, int | float) and not isinstance(v, bool))
            }
        else:
            result = {"score": result}
        if isinstance(result["score"], bool) or not isinstance(result["score"], int | float):
            raise RewardError(
                f"reward function {self.path} returned score {result['score']!r} "
                f"(a {type(result['score']).__name__}), not a number, on {where}"
            )
        return result
