"""Built-in arithmetic tasks: deterministic, disjoint splits, right answers; the tool-use demo's
conversations."""

from __future__ import annotations

import inspect
import re

import pytest

from controller.tasks import (
    OBSERVATION,
    SPLITS,
    TASKS,
    arithmetic,
    preference,
    problems,
    tool_arithmetic,
    tool_problems,
)

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
