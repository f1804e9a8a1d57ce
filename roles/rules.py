"""Built-in rule rewards, named in a reward role's config by import path.

A rule reward is ``fn(prompt, response, metadata) -> float | dict`` (see ``roles/reward.py``).
``roles.rules:arithmetic_reward`` scores the built-in arithmetic task (``controller/tasks.py``),
whose rows carry the exact answer as ``metadata["answer"]``; ``tool_arithmetic_reward`` scores the
final answer of a multi-turn rollout on the tool-use demo task; ``env_reward`` passes on what an
environment awarded over a multi-turn rollout.

A rule reward that reads a data column declares it with ``@needs("answer")``: the experiment
loader (``deploy/experiment.py``) then checks, before anything starts, that every row of the
data the reward scores has that column (not null), and names the file and row that lacks it;
without the check such a row would reach the reward as ``None`` and score 0 silently. The
reward role checks it again per row (``roles/reward.py``), for controllers started by hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
NEEDS = "needs_columns"  # the attribute ``needs`` sets; read it with ``needed_columns``


def needs(*columns: str) -> Callable[[F], F]:
    """Declare the data columns (row metadata) a rule reward cannot score without."""

    def mark(fn: F) -> F:
        setattr(fn, NEEDS, tuple(columns))
        return fn

    return mark


def needed_columns(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The columns ``fn`` declared with ``needs`` (none when it declared nothing)."""
    found = getattr(fn, NEEDS, ())
    if not isinstance(found, tuple) or not all(isinstance(c, str) for c in found):
        raise TypeError(f"{getattr(fn, '__name__', fn)}.{NEEDS} must be a tuple of column names")
    return found


@needs("answer")
def arithmetic_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the response's first whitespace-separated token equals metadata["answer"], else 0.

    Text after that token is ignored (" 82 because 37+45=82" scores 1.0). Special tokens are the
    caller's to strip: "82</s>" scores 0.0. `prompt` is unused; rule rewards share one signature.
    """
    return _first_word_is_answer("arithmetic_reward", response, metadata)


@needs("answer")
def tool_arithmetic_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the final answer's first whitespace-separated word equals metadata["answer"].

    For ``builtin:tool_arithmetic`` (``examples/tool_use.yaml``): in a multi-turn rollout
    ``response`` is the final turn, after any tool call and its observation, so a right answer
    scores the same whether the calculator computed it or the model did. A trajectory that ends
    on a call ("[calculator 123*45]", out of turns) has no answer and scores 0.0.
    """
    return _first_word_is_answer("tool_arithmetic_reward", response, metadata)


def _first_word_is_answer(name: str, response: str, metadata: Mapping[str, Any]) -> float:
    if "answer" not in metadata:
        raise ValueError(f"{name} needs metadata['answer']; add an 'answer' column")
    words = response.split(maxsplit=1)
    return 1.0 if words and words[0] == _answer_text(metadata["answer"]) else 0.0


def _answer_text(answer: object) -> str:
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def length_cost(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """A cost for Safe-RLHF examples: the response's length in characters (whitespace trimmed),
    so a cost threshold caps how long answers may be. `prompt` and `metadata` are unused."""
    return float(len(response.strip()))


@needs("answer")
def last_number_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the last integer in the response equals metadata["answer"] ("7 + 6 = 13" scores
    for 13): the usual final-answer extraction for chatty models. 0.0 without a number."""
    if "answer" not in metadata:
        raise ValueError("last_number_reward needs metadata['answer']; add an 'answer' column")
    numbers = re.findall(r"-?\d+", response)
    return 1.0 if numbers and numbers[-1] == _answer_text(metadata["answer"]) else 0.0


def env_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """The environment's own reward: the sum of the rewards its ``step`` returned over the
    trajectory (``metadata["env_reward"]``), for an env role hosting an environment such as
    ``roles.tools.games:GuessNumber`` (``examples/guess_number.yaml``). A game won on the third
    move scores 1.0, one lost or cut short 0.0; the turns' text is not read here.

    The column is written by the multi-turn rollout, not by the data, so it is not declared with
    ``needs``; without ``trainer.agent`` there is none, and this raises a ValueError saying so.
    """
    if "env_reward" not in metadata:
        raise ValueError(
            "env_reward comes from a multi-turn rollout: set trainer.agent (and an env role with "
            "an environment); this row has no 'env_reward' column"
        )
    value = metadata["env_reward"]
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(
            f"env_reward: metadata['env_reward'] is {value!r} (a {type(value).__name__}), not a "
            "number"
        )
    return float(value)
