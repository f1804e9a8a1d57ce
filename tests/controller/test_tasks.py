"""Built-in arithmetic tasks: deterministic, disjoint splits, right answers; the tool-use demo's
conversations; the guessing game's prompts and demonstrated games, byte for byte what a multi-turn
rollout against GuessNumber holds."""

from __future__ import annotations

import functools
import inspect
import random
import re
from collections import Counter
from typing import Any

import pytest

from controller.tasks import (
    HERMES_SYSTEM,
    OBSERVATION,
    SPLITS,
    TASKS,
    arithmetic,
    game_messages,
    guess_number,
    play,
    preference,
    problems,
    tool_arithmetic,
    tool_problems,
)
from roles.engines.generation.serve import prompt_ids
from roles.modeling.models import build_tokenizer
from roles.modeling.text import encode_conversation
from roles.tools.games import GuessNumber
from transport.batch import TensorBatch

PROMPT = re.compile(r"^(\d+)([-+*])(\d+)=$")


def evaluate(prompt: str) -> int:
    match = PROMPT.match(prompt)
    assert match, prompt
    a, op, b = int(match[1]), match[2], int(match[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    assert arithmetic(50, "train", seed=3) == arithmetic(50, "train", seed=3)
    assert arithmetic(50, "train", seed=3) != arithmetic(50, "train", seed=4)
    assert preference(50, "test", seed=3) == preference(50, "test", seed=3)


@pytest.mark.parametrize("ops", ["+", "+-", "+-*"])
def test_splits_are_disjoint_and_cover_the_problem_space(ops: str) -> None:
    prompts = {split: {p.prompt for p in problems(split, ops=ops)} for split in SPLITS}
    assert not prompts["train"] & prompts["sft"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["sft"] & prompts["test"]
    per_op = {"+": 100 * 100, "-": 100 * 101 // 2, "*": 100 * 100}
    assert sum(len(p) for p in prompts.values()) == sum(per_op[op] for op in ops)


def test_commuted_problems_share_a_split() -> None:
    test = {p.prompt for p in problems("test")}
    for prompt in test:
        a, b = prompt.rstrip("=").split("+")
        assert f"{b}+{a}=" in test


def test_sampled_rows_stay_in_their_split_for_any_seed() -> None:
    held_out = {p.prompt for p in problems("test")}
    for seed in range(3):
        assert not {r["prompt"] for r in arithmetic(2000, "train", seed=seed)} & held_out
        assert not {r["prompt"] for r in arithmetic(1000, "sft", seed=seed)} & held_out
        assert not {r["prompt"] for r in preference(1000, "train", seed=seed)} & held_out


def test_test_split_has_at_least_500_distinct_problems() -> None:
    assert len(problems("test")) >= 500
    rows = arithmetic(len(problems("test")), "test")
    assert len({r["prompt"] for r in rows}) == len(problems("test"))


def test_without_replacement_up_to_the_split_size_then_with() -> None:
    size = len(problems("test"))
    assert len({r["prompt"] for r in arithmetic(size, "test")}) == size
    rows = arithmetic(size + 10, "test")
    assert len(rows) == size + 10
    assert len({r["prompt"] for r in rows}) <= size


@pytest.mark.parametrize("ops", ["+", "+-*"])
def test_answers_are_correct_and_never_negative(ops: str) -> None:
    for row in arithmetic(500, "train", seed=1, ops=ops):
        assert row["response"] == row["answer"] == str(evaluate(row["prompt"]))
        assert int(row["answer"]) >= 0
        assert row["data_source"] == "arithmetic"


def test_max_operand_bounds_the_operands() -> None:
    for row in arithmetic(200, "train", max_operand=9, ops="+-"):
        assert all(int(x) <= 9 for x in re.split(r"[-+=]", row["prompt"]) if x)


def test_preference_rejected_is_near_non_negative_and_wrong_in_the_units_digit() -> None:
    rows = preference(3000, "train", seed=2, ops="+-*", kinds="near")
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected", "kind", "data_source"}
        assert row["chosen"] == str(evaluate(row["prompt"]))
        rejected = int(row["rejected"])
        assert rejected >= 0
        assert 1 <= abs(rejected - int(row["chosen"])) <= 9
        assert row["rejected"][-1] != row["chosen"][-1]
    signs = {int(r["rejected"]) > int(r["chosen"]) for r in rows}
    assert signs == {True, False}


def test_preference_mixes_operand_copies_and_bad_formats() -> None:
    rows = preference(900, "train", seed=4, kinds="near,operand,format")
    kinds = {kind: [r for r in rows if r["kind"] == kind] for kind in ("near", "operand", "format")}
    assert all(len(group) > 200 for group in kinds.values())
    for row in rows:
        assert row["rejected"] != row["chosen"] and row["chosen"] == str(evaluate(row["prompt"]))
    for row in kinds["operand"]:
        operands = re.split(r"[-+*=]", row["prompt"])[:2]
        assert row["rejected"] in operands or row["chosen"] in operands  # fallback: a near miss
    for row in kinds["format"]:
        assert row["chosen"] in row["rejected"] and not row["rejected"].isdigit()
    assert {r["kind"] for r in preference(100, "train")} == {"operand", "format"}  # the default
    with pytest.raises(ValueError, match="kinds='near,typo'"):
        preference(5, "train", kinds="near,typo")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "dev"}, "split='dev' is not one of train, sft, test"),
        ({"n": 0}, "n=0 must be at least 1"),
        ({"ops": "/"}, "ops='/' must be distinct characters"),
        ({"ops": "++"}, "ops='\\+\\+' must be distinct"),
        ({"ops": ""}, "ops='' must be"),
        ({"max_operand": -1}, "max_operand=-1 must be at least 0"),
        ({"max_operand": 0, "split": "test"}, "has no problems with max_operand=0"),
    ],
)
def test_bad_options_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    options: dict[str, object] = {"n": 5, "split": "train", **kwargs}
    takers = [t for t in TASKS.values() if set(options) <= set(inspect.signature(t).parameters)]
    assert len(takers) >= 2
    for task in takers:
        with pytest.raises(ValueError, match=message):
            task(**options)


def test_noise_marks_a_seeded_fraction_of_responses_and_keeps_answers() -> None:
    clean = arithmetic(2000, "sft", seed=3)
    noisy = arithmetic(2000, "sft", seed=3, noise=0.5)
    assert [r["prompt"] for r in clean] == [r["prompt"] for r in noisy]
    assert [r["answer"] for r in clean] == [r["answer"] for r in noisy]
    marked = [r for r in noisy if r["response"] != r["answer"]]
    assert all(r["response"] == r["answer"] + "!" for r in marked)
    assert 0.45 < len(marked) / 2000 < 0.55
    assert noisy == arithmetic(2000, "sft", seed=3, noise=0.5)
    assert all(r["response"].endswith("!") for r in arithmetic(50, "sft", noise=1.0))
    with pytest.raises(ValueError, match="noise"):
        arithmetic(5, "sft", noise=1.5)


def test_explain_style_restates_the_problem_after_the_answer() -> None:
    rows = arithmetic(20, "sft", seed=1, style="explain", noise=0.5)
    for row, plain in zip(rows, arithmetic(20, "sft", seed=1, noise=0.5), strict=True):
        assert row["response"] == f"{plain['response']} because {row['prompt']}{row['answer']}"
    with pytest.raises(ValueError, match="style"):
        arithmetic(5, "sft", style="long")


def test_tool_problems_split_disjointly_and_cover_a_times_b() -> None:
    prompts = {split: {p.prompt for p in tool_problems(split)} for split in SPLITS}
    assert not prompts["train"] & prompts["sft"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["sft"] & prompts["test"]
    assert sum(len(p) for p in prompts.values()) == 990 * 98  # a in 10..999, b in 2..99
    for found in prompts.values():  # a commuted problem is in the same split
        for a, b in ((12, 34), (45, 67), (99, 10), (23, 98)):
            assert (f"{a}*{b}=" in found) == (f"{b}*{a}=" in found)


def test_tool_arithmetic_prompt_rows_of_train_and_test() -> None:
    rows = tool_arithmetic(300, "test", seed=2)
    held_out = {r["prompt"] for r in rows}
    assert not held_out & {r["prompt"] for r in tool_arithmetic(3000, "train", seed=2)}
    for row in rows:
        assert set(row) == {"prompt", "answer", "data_source"}
        assert row["answer"] == str(evaluate(row["prompt"]))
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("*"))
        assert 10 <= a <= 999 and 2 <= b <= 99
    assert rows == tool_arithmetic(300, "test", seed=2)


def test_hermes_rows_ask_the_same_problems_in_a_chat_and_call_in_json() -> None:
    """calls=hermes: the same problems and answers as bracket rows; prompts are questions, a
    demonstration is system, user, call, tool response (a user turn), answer."""
    plain, chat = (
        tool_arithmetic(50, "test", seed=4),
        tool_arithmetic(50, "test", seed=4, calls="hermes"),
    )
    assert [r["answer"] for r in plain] == [r["answer"] for r in chat]
    assert [f"What is {r['prompt'][:-1]}?" for r in plain] == [r["prompt"] for r in chat]
    rows = tool_arithmetic(40, "sft", seed=5, tool_share=0.25, calls="hermes")
    called = [r["messages"] for r in rows if len(r["messages"]) == 5]
    assert len(called) == 10
    system, user, call, response, answer = called[0]
    assert system == {"role": "system", "content": HERMES_SYSTEM}
    expression = user["content"].removeprefix("What is ").removesuffix("?")
    product = evaluate(expression + "=")
    request = '{"name": "calculator", "arguments": {"expression": "' + expression + '"}}'
    assert call["content"] == f"<tool_call>{request}</tool_call>"
    assert response == {
        "role": "user",
        "content": f"<tool_response>\n{product}\n</tool_response>",
    }
    assert answer == {"role": "assistant", "content": str(product)}
    with pytest.raises(ValueError, match="calls='xml' must be one of bracket, hermes"):
        tool_arithmetic(5, "sft", calls="xml")


def test_tool_arithmetic_sft_conversations_by_hand() -> None:
    rows = tool_arithmetic(200, "sft", seed=5, tool_share=0.5)
    called = [r for r in rows if len(r["messages"]) == 4]
    direct = [r for r in rows if len(r["messages"]) == 2]
    assert len(called) == 100 and len(direct) == 100
    row = called[0]
    prompt = row["messages"][0]["content"]
    expression, answer = prompt.removesuffix("="), str(evaluate(prompt))
    assert row == {
        "messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": f"[calculator {expression}]"},
            {"role": "tool", "content": f" = {answer}\n"},
            {"role": "assistant", "content": answer},
        ],
        "answer": answer,
        "data_source": "tool_arithmetic",
    }
    assert OBSERVATION.format(text=answer) == f" = {answer}\n"
    for row in direct:
        prompt = row["messages"][0]["content"]
        assert row["messages"] == [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": str(evaluate(prompt))},
        ]
    sft = {r["messages"][0]["content"] for r in rows}
    assert not sft & {p.prompt for p in tool_problems("test")}


@pytest.mark.parametrize(("n", "share", "calls"), [(10, 0.3, 3), (7, 0.5, 4), (50, 0.0, 0)])
def test_tool_share_is_honoured_exactly_and_seeded(n: int, share: float, calls: int) -> None:
    rows = tool_arithmetic(n, "sft", seed=1, tool_share=share)
    assert sum(len(r["messages"]) == 4 for r in rows) == calls
    assert rows == tool_arithmetic(n, "sft", seed=1, tool_share=share)
    assert all(len(r["messages"]) == 4 for r in tool_arithmetic(n, "sft", tool_share=1.0))
    with pytest.raises(ValueError, match=r"tool_share=1\.5 must be a fraction"):
        tool_arithmetic(n, "sft", tool_share=1.5)


# -- guess_number -----------------------------------------------------------------------------


def test_bisect_plays_the_lower_midpoint_by_hand() -> None:
    rng = random.Random(0)  # unused by bisect
    assert play(13, 1, 16, 5, "bisect", rng) == [8, 12, 14, 13]
    assert play(8, 1, 16, 5, "bisect", rng) == [8]
    assert play(16, 1, 16, 5, "bisect", rng) == [8, 12, 14, 15, 16]  # the longest: 5 guesses
    assert play(1, 1, 16, 5, "bisect", rng) == [8, 4, 2, 1]
    assert play(16, 1, 16, 4, "bisect", rng) == [8, 12, 14, 15]  # out of moves: lost
    # every secret of 1..16 is won within 5 guesses
    assert max(len(play(s, 1, 16, 99, "bisect", rng)) for s in range(1, 17)) == 5


def test_scan_counts_up_from_the_lowest_number_left_by_hand() -> None:
    rng = random.Random(0)
    assert play(3, 1, 16, 5, "scan", rng) == [1, 2, 3]
    assert play(5, 1, 16, 5, "scan", rng) == [1, 2, 3, 4, 5]
    assert play(9, 1, 16, 5, "scan", rng) == [1, 2, 3, 4, 5]  # lost: 9 is past 5 moves
    assert play(12, 10, 20, 3, "scan", rng) == [10, 11, 12]
    with pytest.raises(ValueError, match="player='linear' is not one of bisect, random, scan"):
        play(3, 1, 16, 5, "linear", rng)


def test_scanning_demonstrations_win_exactly_the_low_secrets() -> None:
    rows = guess_number(64, "sft", seed=1, weak="scan", weak_share=0.75)
    scans = [r for r in rows if r["player"] == "scan"]
    assert len(scans) == 48 and {r["player"] for r in rows} == {"scan", "bisect"}
    for row in scans:
        guesses = list(range(1, min(row["secret"], 5) + 1))
        assert row["messages"] == game_messages(guesses, row["secret"], 1, 16)


def test_a_demonstrated_game_by_hand() -> None:
    assert game_messages([8, 12, 14, 13], 13, 1, 16) == [
        {"role": "user", "content": "Game: Guess my number from 1 to 16."},
        {"role": "assistant", "content": "[8]"},
        {"role": "tool", "content": "8? Go higher."},
        {"role": "assistant", "content": "[12]"},
        {"role": "tool", "content": "12? Go higher."},
        {"role": "assistant", "content": "[14]"},
        {"role": "tool", "content": "14? Go lower."},
        {"role": "assistant", "content": "[13]"},
    ]
    # a lost game ends on its last (wrong) guess
    assert game_messages([3, 9], 5, 1, 9)[-2:] == [
        {"role": "tool", "content": "3? Go higher."},
        {"role": "assistant", "content": "[9]"},
    ]


def test_the_random_player_guesses_only_what_the_hints_allow() -> None:
    rng = random.Random(3)
    for secret in range(1, 17):
        for _ in range(20):
            low, high = 1, 16
            guesses = play(secret, 1, 16, 5, "random", rng)
            assert 1 <= len(guesses) <= 5
            assert len(set(guesses)) == len(guesses)
            for guess in guesses:
                assert low <= guess <= high
                low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
            assert guesses[-1] == secret or len(guesses) == 5


def test_sft_rows_share_random_players_exactly_and_are_seeded() -> None:
    rows = guess_number(40, "sft", seed=2, weak_share=0.25)
    assert [r["player"] for r in rows].count("random") == 10
    assert rows == guess_number(40, "sft", seed=2, weak_share=0.25)
    assert rows != guess_number(40, "sft", seed=3, weak_share=0.25)
    for row in rows:
        assert set(row) == {"messages", "secret", "player", "data_source"}
        assert 1 <= row["secret"] <= 16 and row["data_source"] == "guess_number"
        if row["player"] == "bisect":
            guesses = play(row["secret"], 1, 16, 5, "bisect", random.Random())
            assert row["messages"] == game_messages(guesses, row["secret"], 1, 16)
    bisecting = guess_number(30, "sft", weak_share=0.0)
    assert all(r["player"] == "bisect" for r in bisecting)
    won = [r["messages"][-1]["content"] == f"[{r['secret']}]" for r in bisecting]
    assert all(won)  # bisection always wins 1..16 in 5 moves


def test_train_and_test_rows_are_prompts_and_test_takes_every_secret_in_turn() -> None:
    test = guess_number(20, "test", seed=7)
    assert [r["secret"] for r in test] == [*range(1, 17), 1, 2, 3, 4]
    assert test == guess_number(20, "test", seed=8)  # the test split does not use the seed
    assert all(
        r == {"prompt": "Game: ", "secret": r["secret"], "data_source": "guess_number"}
        for r in test
    )
    train = guess_number(500, "train", low=3, high=7, seed=1)
    assert {r["secret"] for r in train} == {3, 4, 5, 6, 7}
    assert train == guess_number(500, "train", low=3, high=7, seed=1)
    assert [r["secret"] for r in train] != [
        r["secret"] for r in guess_number(500, "train", low=3, high=7, seed=2)
    ]
    assert set(train[0]) == {"prompt", "secret", "data_source"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low": 5, "high": 4}, "low=5 must be at most high=4"),
        ({"max_moves": 0}, "max_moves=0 must be at least 1"),
        ({"weak_share": -0.1}, r"weak_share=-0\.1 must be a fraction in \[0, 1\]"),
        ({"weak": "bisect"}, "weak='bisect' is not one of random, scan"),
        ({"split": "val"}, "split='val' is not one of train, sft, test"),
    ],
)
def test_guess_number_rejects_bad_options(kwargs: dict[str, object], message: str) -> None:
    options: dict[str, object] = {"n": 4, "split": "sft", **kwargs}
    with pytest.raises(ValueError, match=message):
        guess_number(**options)  # type: ignore[arg-type]


def rollout_ids(row: dict[str, Any], messages: list[dict[str, str]]) -> tuple[list[int], str]:
    """What a multi-turn rollout holds when the model plays ``messages``' assistant turns against
    GuessNumber(1, 16, 5): the prompt as the engines tokenize it, reset's text, then each turn and
    step's observation as returned (an environment's default template is {text}); without the
    last observation, which is returned beside."""
    tokenizer = build_tokenizer()
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    env = GuessNumber(low=1, high=16, max_moves=5)
    prompts = TensorBatch.from_dict(non_tensors={"prompt": [row["prompt"]]})
    first = env.reset(row)
    assert messages[0] == {"role": "user", "content": row["prompt"] + first}
    ids = prompt_ids(prompts, tokenizer)[0] + encode(first)
    observation, done = "", False
    for message in messages[1:]:
        if message["role"] == "assistant":
            assert not done
            ids += encode(message["content"])
            observation, _, done, _ = env.step(message["content"])
            ids += encode(observation)
        else:  # the demonstration's tool message is what step returned
            assert message == {"role": "tool", "content": observation}
    assert done
    return ids[: len(ids) - len(encode(observation))], observation


def test_a_rendered_demonstration_is_byte_for_byte_a_rollout_against_guess_number() -> None:
    tokenizer = build_tokenizer()
    rows = guess_number(64, "sft", seed=4)
    prompt = guess_number(1, "train")[0]["prompt"]
    endings: Counter[str] = Counter()
    longest = 0
    for row in rows:
        ids, mask = encode_conversation(tokenizer, row["messages"])
        played, last = rollout_ids({"prompt": prompt, "secret": row["secret"]}, row["messages"])
        # the rollout goes on to the last observation; the demonstration ends in eos instead
        assert ids == [*played, tokenizer.eos_token_id]
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        turns = "".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
        assert trained == turns + tokenizer.eos_token  # the player's guesses (and eos) only
        endings[f"{row['player']}: {'won' if last.endswith('is right.') else 'lost'}"] += 1
        longest = max(longest, len(played) + len(tokenizer.encode(last, add_special_tokens=False)))
    assert set(endings) == {"bisect: won", "random: won", "random: lost"}
    assert endings["bisect: won"] == 32
    # a whole game, the last observation included, fits the tiny model's 512 positions easily
    assert longest <= 140
