"""Two verifiers environments (Prime Intellect's ``verifiers`` package, its classic API) with
nothing of hybridflow in them: ``vf-eval`` or any verifiers trainer runs them the same. The
experiments beside this file train them through the env group's OpenAI-compatible endpoint:

    load_environment(kind="single")  a vf.SingleTurnEnv: the answer in one turn
                                     (examples/agents/verifiers_arithmetic.yaml)
    load_environment(kind="tool")    a vf.ToolEnv with a calculator tool
                                     (examples/agents/verifiers_tool_use.yaml)

Both score with one vf.Rubric: 1.0 when the first word of the model's last message is the
answer. Their own
datasets (a few generated problems, built only when verifiers asks for them) are what ``vf-eval``
would read; a hybridflow run takes the stage's rows instead.
"""

from __future__ import annotations

import random
from typing import Any

import verifiers as vf
from calculator_agent import calculate  # the same tool as the plain OpenAI agent's


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 708*62.

    Args:
        expression: integers joined by +, - or *
    """
    return calculate(expression)


def exact_answer(completion: Any, answer: str) -> float:
    """1.0 when the first word of the model's last message is the answer (a rollout cut short
    after a tool result scores its last assistant message, not the tool's)."""
    said = [m for m in completion or [] if getattr(m, "role", None) == "assistant"]
    content = getattr(said[-1], "content", None) if said else None
    words = content.split() if isinstance(content, str) else []
    return 1.0 if words and words[0] == str(answer) else 0.0


def problems(n: int = 64, seed: int = 0) -> Any:
    """A few multiplications as a verifiers dataset (question, answer)."""
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(n)]
    return Dataset.from_list([{"question": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs])


def load_environment(kind: str = "tool", max_turns: int = 3) -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact_answer])
    if kind == "single":
        return vf.SingleTurnEnv(dataset=problems, rubric=rubric)
    if kind == "tool":
        return vf.ToolEnv(
            dataset=problems,
            tools=[calculator],
            max_turns=max_turns,
            rubric=rubric,
            error_formatter=lambda exc: f"error: {exc}",  # what the plain agent's loop says
        )
    raise ValueError(f"kind {kind!r}: use 'single' or 'tool'")
