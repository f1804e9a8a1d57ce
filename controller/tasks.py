"""Built-in synthetic tasks: small arithmetic problems with exact answers.

They let an experiment run end to end with no data to download: SFT teaches the answer format, a
reward model learns to rank the right result above a wrong one, and a rule reward scores rollouts.
`controller.data.read_rows` reads them as ``builtin:arithmetic?n=2000&split=train&seed=0``.

Every problem belongs to exactly one split ("train", "sft" or "test") by a stable hash of the
problem itself, never of the seed, the sample size or the operand range: the splits are disjoint
for every setting, so test numbers are really held out. For commutative operators the hash ignores
operand order, so ``45+37`` is never trained on while ``37+45`` is tested. Subtraction problems
have ``a >= b``, so no answer is negative. Sampling within a split is deterministic given the seed.

``builtin:tool_arithmetic`` is the demo of tool use: products too hard for a small model to
compute, which it can answer exactly by calling a calculator tool (``examples/tool_use.yaml``).
``builtin:guess_number`` is the demo of a stateful environment: games of
``roles.tools.games:GuessNumber``, with demonstrations by a bisecting and a random player
(``examples/guess_number.yaml``).

The rule rewards that score these answers live with the reward role: ``roles/rules.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import random
from collections.abc import Callable
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
    n: int,
    split: str,
    seed: int = 0,
    max_operand: int = 99,
    ops: str = "+",
    noise: float = 0.0,
    style: str = "short",
) -> list[dict[str, Any]]:
    """n rows {prompt, response, answer, data_source} drawn from one split.

    Drawn without replacement when the split has at least n problems, with replacement otherwise.
    ``noise``: the fraction of rows (each row by a seeded coin) whose ``response`` is written
    ``"<answer>!"`` — demonstrations in a format the exact-answer reward rejects, as when part of
    an SFT corpus follows another convention. ``answer`` stays the plain number.
    ``style``: "short" answers with the number; "explain" adds a restatement ("82 because
    37+45=82", about 20 tokens), for work where response length matters (benchmarks).
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise={noise} must be a fraction in [0, 1]")
    if style not in STYLES:
        raise ValueError(f"style={style!r}: use one of {STYLES}")
    coin = random.Random(f"noise/{seed}")
    rows = []
    for p in _sample(n, split, max_operand, ops, random.Random(seed)):
        response = p.answer + "!" if coin.random() < noise else p.answer
        if style == "explain":
            response += f" because {p.prompt}{p.answer}"
        rows.append(
            {
                "prompt": p.prompt,
                "response": response,
                "answer": p.answer,
                "data_source": "arithmetic",
            }
        )
    return rows


STYLES = ("short", "explain")


#: How a rejected answer goes wrong, in the spirit of real preference data: a near miss (units
#: digit wrong), an operand copied as the answer, or the right number in a wrong format.
REJECTION_KINDS = ("near", "operand", "format")
_FORMATS = ("{} {}", "{}!!", "={}", "{}+", "{}?")


def preference(
    n: int,
    split: str,
    seed: int = 0,
    max_operand: int = 99,
    ops: str = "+",
    kinds: str = "operand,format",
) -> list[dict[str, Any]]:
    """n rows {prompt, chosen, rejected, kind, data_source}: the right answer against a wrong one.

    ``kinds`` (comma-separated, drawn uniformly per row) says how the rejected answer is wrong:
    ``operand`` — one of the operands copied (a common failure of small models); ``format`` — the
    right number with stray characters; ``near`` — the right one plus or minus k, k in 1..9, never
    below zero, so its units digit is always wrong. ``near`` is not in the default mix: it needs
    the units-digit rule of addition, which the 1M-parameter model does not learn in a few hundred
    steps (it stays at chance; see docs/training.md), while the other two are learnt quickly.
    """
    chosen_kinds = [k for k in kinds.split(",") if k]
    unknown = sorted(set(chosen_kinds) - set(REJECTION_KINDS))
    if unknown or not chosen_kinds:
        raise ValueError(f"kinds={kinds!r}: use a comma-separated subset of {REJECTION_KINDS}")
    rng = random.Random(seed)
    rows = []
    for p in _sample(n, split, max_operand, ops, rng):
        kind = rng.choice(chosen_kinds)
        rows.append(
            {
                "prompt": p.prompt,
                "chosen": p.answer,
                "rejected": _reject(p, kind, rng),
                "kind": kind,
                "data_source": "preference",
            }
        )
    return rows


def _reject(p: Problem, kind: str, rng: random.Random) -> str:
    right = int(p.answer)
    if kind == "operand" and str(p.a) != p.answer and str(p.b) != p.answer:
        return str(rng.choice((p.a, p.b)))
    if kind == "format":
        return rng.choice(_FORMATS).format(p.answer, p.answer)
    k = rng.randint(1, 9)  # near, and the fallback when an operand equals the answer
    return str(right - k if rng.random() < 0.5 and right >= k else right + k)


#: How the demo model calls the calculator (the env role's ``bracket`` format): the tool's name, a
#: space, the expression, a closing bracket (the turn's stop token).
CALL = "[calculator {expression}]"
#: The env role's observation template in examples/tool_use.yaml, ``{text}`` the tool's result:
#: what follows a call in the trajectory, before the final answer ("123*45=[calculator 123*45] =
#: 5535\n5535"). An SFT tool message holds it rendered, so SFT and RL see the same bytes.
OBSERVATION = " = {text}\n"
#: tool_arithmetic's call formats: the env role's (``roles/tools/calls.py``)
CALL_FORMATS = ("bracket", "hermes")
#: calls=hermes: the system message of every conversation, which the experiment's
#: prompt_template writes too (examples/smollm2_tools.yaml; a test renders both and compares)
HERMES_SYSTEM = "You are a helpful assistant. You can use a calculator."
#: calls=hermes: the user's question, and how a result comes back (the env role's hermes
#: observation between its user turn's header and end)
QUESTION = "What is {expression}?"
HERMES_RESPONSE = "<tool_response>\n{text}\n</tool_response>"
# The operands of tool_arithmetic: mostly 3-digit by 2-digit products, past what the 1M-parameter
# model learns to compute (it learns 2-digit sums, not long multiplication).
_TOOL_A = range(10, 1000)
_TOOL_B = range(2, 100)


@functools.cache
def tool_problems(split: str) -> tuple[Problem, ...]:
    """Every tool_arithmetic problem (a*b, a in 10..999, b in 2..99) of one split, in order.
    The split is the problem's own (``Problem.split``), as for ``arithmetic``."""
    _check_options(split, 0, "*")
    return tuple(
        problem for a in _TOOL_A for b in _TOOL_B if (problem := Problem(a, "*", b)).split == split
    )


def tool_arithmetic(
    n: int, split: str, seed: int = 0, tool_share: float = 0.3, calls: str = "bracket"
) -> list[dict[str, Any]]:
    """n multiplication problems the model can solve exactly only by calling a calculator tool.

    The ``train`` and ``test`` splits give prompt rows {prompt, answer, data_source} (an RL
    stage's, a validation's). The ``sft`` split gives conversations {messages, answer,
    data_source}: ``round(n * tool_share)`` of them (seeded) demonstrate the tool — the user's
    prompt, the assistant's call ``[calculator 123*45]``, the tool's observation (``OBSERVATION``
    rendered: `` = 5535\n``), the assistant's ``5535`` — and the rest answer at once with the
    right number, which the model cannot learn to compute, so it learns to guess. RL then finds
    that calling pays. Rows are drawn as in ``arithmetic``.

    ``calls=hermes`` writes the rows for a chat model (``examples/smollm2_tools.yaml``): the
    prompt is a question ("What is 708*62?", ``QUESTION``) the experiment's ``prompt_template``
    puts into a chat turn after ``HERMES_SYSTEM``; a conversation starts with that system message,
    the call is ``<tool_call>{"name": "calculator", "arguments": {"expression": "708*62"}}
    </tool_call>`` and the result comes back as a user turn ``<tool_response>\n43896\n
    </tool_response>``: rendered by the model's chat template, the bytes the env role's hermes
    format writes in a rollout (``roles/tools/calls.py``).
    """
    if calls not in CALL_FORMATS:
        raise ValueError(f"calls={calls!r} must be one of {', '.join(CALL_FORMATS)}")
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share={tool_share} must be a fraction in [0, 1]")
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    rng = random.Random(seed)
    pool = tool_problems(split)
    picked = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
    called = set(random.Random(f"tool/{seed}").sample(range(n), round(n * tool_share)))
    rows = []
    for i, p in enumerate(picked):
        row: dict[str, Any] = {"answer": p.answer, "data_source": "tool_arithmetic"}
        if split == "sft":
            demonstrate = _hermes_demonstration if calls == "hermes" else _demonstration
            row = {"messages": demonstrate(p, i in called), **row}
        else:
            row = {"prompt": _question(p) if calls == "hermes" else p.prompt, **row}
        rows.append(row)
    return rows


def _question(p: Problem) -> str:
    return QUESTION.format(expression=p.prompt.removesuffix("="))


def _hermes_demonstration(p: Problem, call: bool) -> list[dict[str, str]]:
    system = {"role": "system", "content": HERMES_SYSTEM}
    user = {"role": "user", "content": _question(p)}
    answer = {"role": "assistant", "content": p.answer}
    if not call:
        return [system, user, answer]
    arguments = {"expression": p.prompt.removesuffix("=")}
    request = json.dumps({"name": "calculator", "arguments": arguments})
    return [
        system,
        user,
        {"role": "assistant", "content": f"<tool_call>{request}</tool_call>"},
        {"role": "user", "content": HERMES_RESPONSE.format(text=p.answer)},
        answer,
    ]


def _demonstration(p: Problem, call: bool) -> list[dict[str, str]]:
    user = {"role": "user", "content": p.prompt}
    answer = {"role": "assistant", "content": p.answer}
    if not call:
        return [user, answer]
    expression = p.prompt.removesuffix("=")
    return [
        user,
        {"role": "assistant", "content": CALL.format(expression=expression)},
        {"role": "tool", "content": OBSERVATION.format(text=p.answer)},
        answer,
    ]


#: The prompt of every guess_number row. The environment's first observation follows it, so a
#: game reads "Game: Guess my number from 1 to 16.[8]8? Go higher.[12]12? Go lower.[10]10 is right."
GAME_PROMPT = "Game: "
#: How a demonstration writes a guess: the env role's ``bracket`` format, whose "]" ends the turn;
#: GuessNumber reads the last integer of the turn's text.
GUESS = "[{guess}]"
#: GuessNumber's texts (``roles/tools/games.py``, which the controller does not import): the first
#: observation and the answer to a wrong guess ({hint}: higher or lower), which a demonstration's
#: user and tool messages hold byte for byte. tests/controller/test_tasks.py plays demonstrations
#: against GuessNumber itself to keep the two the same.
GAME_START = "Guess my number from {low} to {high}."
GAME_HINT = "{guess}? Go {hint}."
#: how a demonstration's player guesses among the numbers the hints still allow: the lower
#: midpoint, any of them at random, or the lowest (counting up)
PLAYERS = ("bisect", "random", "scan")


def guess_number(
    n: int,
    split: str,
    low: int = 1,
    high: int = 16,
    seed: int = 0,
    max_moves: int = 5,
    weak: str = "random",
    weak_share: float = 0.5,
) -> list[dict[str, Any]]:
    """Games of GuessNumber (a secret number in [low, high], guessed with hints higher/lower);
    train and test rows are prompts {prompt, secret}, sft rows demonstrated games {messages}.
    The splits share secrets: a game is only its secret, and a range as small as 1..16 has too
    few to hold some out; test rows take every secret in turn, so n = high - low + 1 scores each
    once.

    ``train``: rows {prompt, secret, data_source}, the secrets drawn uniformly (seeded).
    ``test``: the same columns, the secrets low, low+1, ..., high, low, ... in order (the seed is
    not used): with greedy play a validation's score is then the share of secrets won.
    ``sft``: rows {messages, secret, player, data_source}, each a whole game: the user's message is
    the prompt and GuessNumber's first observation (``GAME_PROMPT`` + ``GAME_START``); then the
    player's guesses as assistant messages (``[8]``: the bracket format's "]" ends a turn), each
    wrong one answered by a tool message holding GuessNumber's reply (``8? Go higher.``), until
    the right guess or ``max_moves`` guesses (the last assistant message; GuessNumber's last reply
    is not part of it). ``round(n * weak_share)`` of the games (seeded) are played by a weak
    player, the rest by one who bisects the numbers the hints still allow (the lower midpoint),
    which on 1..16 always wins within 5 guesses. The weak player (``weak``) guesses among those
    numbers at random (it wins about 77% of 1..16 games within 5 moves) or scans them from the
    lowest up (it wins only when the secret is at most ``low + max_moves - 1``): demonstrations
    RL can improve on. ``max_moves`` must be the environment's (``environment_args``).
    """
    _check_split(split)
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    if low > high:
        raise ValueError(f"low={low} must be at most high={high}")
    if max_moves < 1:
        raise ValueError(f"max_moves={max_moves} must be at least 1")
    if weak not in PLAYERS[1:]:
        raise ValueError(f"weak={weak!r} is not one of {', '.join(PLAYERS[1:])}")
    if not 0.0 <= weak_share <= 1.0:
        raise ValueError(f"weak_share={weak_share} must be a fraction in [0, 1]")
    row = {"prompt": GAME_PROMPT, "data_source": "guess_number"}
    if split == "test":
        size = high - low + 1
        return [{**row, "secret": low + i % size} for i in range(n)]
    draw = random.Random(f"guess_number/{split}/{seed}")
    secrets = [draw.randint(low, high) for _ in range(n)]
    if split == "train":
        return [{**row, "secret": secret} for secret in secrets]
    weaks = set(random.Random(f"players/{seed}").sample(range(n), round(n * weak_share)))
    guesser = random.Random(f"guesses/{seed}")
    rows = []
    for i, secret in enumerate(secrets):
        player = weak if i in weaks else "bisect"
        guesses = play(secret, low, high, max_moves, player, guesser)
        rows.append(
            {
                "messages": game_messages(guesses, secret, low, high),
                "secret": secret,
                "player": player,
                "data_source": "guess_number",
            }
        )
    return rows


def play(
    secret: int, low: int, high: int, max_moves: int, player: str, rng: random.Random
) -> list[int]:
    """The guesses of one game: until the right one, at most ``max_moves``. Of the numbers the
    hints still allow, ``bisect`` guesses the lower midpoint, ``random`` any (drawn with ``rng``),
    ``scan`` the lowest."""
    if player not in PLAYERS:
        raise ValueError(f"player={player!r} is not one of {', '.join(PLAYERS)}")
    guesses: list[int] = []
    while len(guesses) < max_moves and (not guesses or guesses[-1] != secret):
        if player == "bisect":
            guess = (low + high) // 2
        else:
            guess = rng.randint(low, high) if player == "random" else low
        guesses.append(guess)
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return guesses


def game_messages(guesses: list[int], secret: int, low: int, high: int) -> list[dict[str, str]]:
    """A game as a conversation: the prompt and first observation, then each guess and, after all
    but the last, GuessNumber's reply to it."""
    messages = [{"role": "user", "content": GAME_PROMPT + GAME_START.format(low=low, high=high)}]
    for i, guess in enumerate(guesses):
        messages.append({"role": "assistant", "content": GUESS.format(guess=guess)})
        if i < len(guesses) - 1:
            hint = "higher" if guess < secret else "lower"
            messages.append({"role": "tool", "content": GAME_HINT.format(guess=guess, hint=hint)})
    return messages


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": arithmetic,
    "preference": preference,
    "tool_arithmetic": tool_arithmetic,
    "guess_number": guess_number,
}

#: What each parameter of a task means, for the reference in docs/experiments.md
#: (``deploy/docgen.py``; a test checks every parameter of every task is here).
PARAMETERS = {
    "n": "rows to draw (arithmetic tasks: without replacement while the split has that many "
    "problems)",
    "split": "train, sft or test: for the arithmetic tasks disjoint sets of problems (a stable "
    "hash of each problem); guess_number's share secrets",
    "seed": "which rows are drawn, and the seeded choices per row (noise, tool calls, players)",
    "max_operand": "operands range over 0..max_operand",
    "ops": "operators to draw from, written together: any of + - * (e.g. ops=+-)",
    "noise": "fraction of rows whose response is written '<answer>!', a format the exact-answer "
    "reward rejects",
    "style": "short (the number) or explain (the number, then a restatement: ~20 tokens)",
    "kinds": "how the rejected answer is wrong, comma-separated: operand, format, near",
    "tool_share": "fraction of sft rows that call the calculator (the rest answer directly)",
    "calls": "tool_arithmetic's call format: bracket (the byte-level demo model's) or hermes (a "
    "chat model's JSON calls in ChatML turns)",
    "low": "the smallest secret number",
    "high": "the largest secret number",
    "max_moves": "guesses a game allows; the environment's own (its environment_args)",
    "weak": "how the weak player of sft games guesses: random (any number the hints allow) or "
    "scan (the lowest)",
    "weak_share": "fraction of sft games played by the weak player (the rest bisect)",
}


def _sample(n: int, split: str, max_operand: int, ops: str, rng: random.Random) -> list[Problem]:
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    pool = problems(split, max_operand, ops)
    return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)}")


def _check_options(split: str, max_operand: int, ops: str) -> None:
    _check_split(split)
    if max_operand < 0:
        raise ValueError(f"max_operand={max_operand} must be at least 0")
    if not ops or set(ops) - set(_OPS) or len(set(ops)) != len(ops):
        raise ValueError(f"ops={ops!r} must be distinct characters from {''.join(_OPS)!r}")
