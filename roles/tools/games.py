"""GuessNumber: a small stateful environment, the example of what an environment class looks like.

An environment is any class with ``reset(row) -> str`` (the first observation) and
``step(text) -> (observation, reward, done, info)``; the env role builds one instance per
trajectory (with the role's ``environment_args`` as keywords), so instance attributes are the
trajectory's state. ``close()``, when the class has one, is called when the trajectory's session
is closed.

The game: the data row holds the secret number (``row["secret"]``); each turn the model names a
number (the last integer in its text counts), and the game answers higher or lower. A right guess
earns reward 1 and ends the game; after ``max_moves`` wrong guesses it ends with reward 0.
"""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    """Guess a secret number between ``low`` and ``high`` in at most ``max_moves`` guesses."""

    def __init__(self, low: int = 1, high: int = 100, max_moves: int = 7) -> None:
        if low > high or max_moves < 1:
            raise ValueError(
                f"GuessNumber needs low <= high and max_moves >= 1 (got low={low}, high={high}, "
                f"max_moves={max_moves})"
            )
        self.low, self.high, self.max_moves = low, high, max_moves
        self.secret = low
        self.moves = 0

    def reset(self, row: dict[str, Any]) -> str:
        if "secret" not in row:
            raise KeyError("GuessNumber needs a 'secret' column in the data row")
        secret = int(row["secret"])
        if not self.low <= secret <= self.high:
            raise ValueError(f"secret {secret} is outside [{self.low}, {self.high}]")
        self.secret, self.moves = secret, 0
        return f"Guess my number from {self.low} to {self.high}."

    def step(self, text: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.moves += 1
        found = _INTEGER.findall(text)
        left = self.max_moves - self.moves
        if not found:
            return "Say a number.", 0.0, left <= 0, {"moves": self.moves}
        guess = int(found[-1])
        if guess == self.secret:
            return f"{guess} is right.", 1.0, True, {"moves": self.moves}
        hint = "higher" if guess < self.secret else "lower"
        if left <= 0:
            return f"{guess} is wrong; it was {self.secret}.", 0.0, True, {"moves": self.moves}
        return f"{guess}? Go {hint}.", 0.0, False, {"moves": self.moves}
