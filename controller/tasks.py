"""Built-in synthetic tasks: small arithmetic problems with exact answers.

They let an experiment run end to end with no data to download: SFT teaches the answer format, a
reward model learns to rank the right result above a wrong one, and a rule reward scores rollouts.
`controller.data.read_rows` reads them as ``builtin:arithmetic?n=2000&split=train&seed=0``.

Every problem belongs to exactly one split ("train", "sft" or "test") by a stable hash of the
problem itself, never of the seed, the sample size or the operand range: the splits are disjoint
for every setting, so test numbers are really held out. For commutative operators the hash ignores
operand order, so ``45+37`` is never trained on while ``37+45`` is tested. Subtraction problems
have ``a >= b``, so no answer is negative. Sampling within a split is deterministic given the seed.

This module imports only the standard library, so a reward role can import `arithmetic_reward`
without pulling in the controller.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import random
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

SPLITS = ("train", "sft", "test")
_BUCKETS = 10
# Out of ten hash buckets: 10% test (~1000 of the 10,000 default problems), 20% sft, 70% train.
_SPLIT_OF_BUCKET = (
    "test",
    "sft",
    "sft",
    "train",
    "train",
    "train",
    "train",
    "train",
    "train",
    "train",
)
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_COMMUTATIVE = frozenset("+*")


class Problem(NamedTuple):
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(_OPS[self.op](self.a, self.b))

    @property
    def split(self) -> str:
        a, b = sorted((self.a, self.b)) if self.op in _COMMUTATIVE else (self.a, self.b)
        digest = hashlib.blake2b(f"{a}{self.op}{b}".encode(), digest_size=8).digest()
        return _SPLIT_OF_BUCKET[int.from_bytes(digest, "big") % _BUCKETS]


@functools.cache
def problems(split: str, max_operand: int = 99, ops: str = "+") -> tuple[Problem, ...]:
    """Every problem of one split with operands in [0, max_operand], in a fixed order."""
    _check_options(split, max_operand, ops)
    found = tuple(
        problem
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if (problem := Problem(a, op, b)).split == split and (op != "-" or a >= b)
    )
    if not found:
        raise ValueError(
            f"split={split!r} has no problems with max_operand={max_operand}; raise max_operand"
        )
    return found


def arithmetic(
    n: int, split: str, seed: int = 0, max_operand: int = 99, ops: str = "+"
) -> list[dict[str, Any]]:
    """n rows {prompt, response, answer, data_source} drawn from one split.

    Drawn without replacement when the split has at least n problems, with replacement otherwise.
    """
    return [
        {
            "prompt": p.prompt,
            "response": p.answer,
            "answer": p.answer,
            "data_source": "arithmetic",
        }
        for p in _sample(n, split, max_operand, ops, random.Random(seed))
    ]


def preference(
    n: int, split: str, seed: int = 0, max_operand: int = 99, ops: str = "+"
) -> list[dict[str, Any]]:
    """n rows {prompt, chosen, rejected, data_source}: the right answer against a near miss.

    The rejected answer is the right one plus or minus k, k in 1..9 (sign at random, but never
    below zero), so its units digit is always wrong: a reward model can learn to rank the pairs
    from the units-digit rule alone.
    """
    rng = random.Random(seed)
    rows = []
    for p in _sample(n, split, max_operand, ops, rng):
        right = int(p.answer)
        k = rng.randint(1, 9)
        wrong = right - k if rng.random() < 0.5 and right >= k else right + k
        rows.append(
            {
                "prompt": p.prompt,
                "chosen": p.answer,
                "rejected": str(wrong),
                "data_source": "preference",
            }
        )
    return rows


def arithmetic_reward(prompt: str, response: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the response's first whitespace-separated token equals metadata["answer"], else 0.

    Text after that token is ignored (" 82 because 37+45=82" scores 1.0). Special tokens are the
    caller's to strip: "82</s>" scores 0.0. `prompt` is unused; rule rewards share one signature.
    """
    if "answer" not in metadata:
        raise ValueError("arithmetic_reward needs metadata['answer']; add an 'answer' column")
    tokens = response.split(maxsplit=1)
    return 1.0 if tokens and tokens[0] == _answer_text(metadata["answer"]) else 0.0


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": arithmetic,
    "preference": preference,
}


def _answer_text(answer: object) -> str:
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def _sample(n: int, split: str, max_operand: int, ops: str, rng: random.Random) -> list[Problem]:
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    pool = problems(split, max_operand, ops)
    return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)


def _check_options(split: str, max_operand: int, ops: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)}")
    if max_operand < 0:
        raise ValueError(f"max_operand={max_operand} must be at least 0")
    if not ops or set(ops) - set(_OPS) or len(set(ops)) != len(ops):
        raise ValueError(f"ops={ops!r} must be distinct characters from {''.join(_OPS)!r}")
