"""Datasets from real JSONL and Parquet files: good rows round-trip, bad ones name file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from controller.data import (
    PREFERENCE_COLUMNS,
    PROMPT_COLUMNS,
    SFT_COLUMNS,
    Column,
    DatasetError,
    read_rows,
    write_jsonl,
)
from controller.tasks import problems

ROWS: list[dict[str, Any]] = [
    {"prompt": "1+1=", "response": "2", "source": "hand", "weight": 0.5},
    {"prompt": "Name a colour.", "response": "Blue — ünïcode too", "tags": ["a", "b"]},
]


def at(source: Path | str) -> str:
    """The start of an error message about `source`, as a regular expression."""
    return re.escape(str(source))


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_line(**extra: Any) -> str:
    return json.dumps({"prompt": "p", "response": "r", **extra})


def test_jsonl_round_trip_keeps_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    write_jsonl(path, ROWS)
    assert read_rows(path, SFT_COLUMNS) == ROWS
    assert read_rows(str(path), SFT_COLUMNS) == ROWS


def test_json_suffix_blank_lines_and_optional_columns(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "prompts.json",
        '{"prompt": "2+2=", "answer": 4}',
        "",
        "   ",
        '{"prompt": "x", "answer": null, "data_source": "hand"}',
        '{"prompt": "y"}',
    )
    rows = read_rows(path, PROMPT_COLUMNS)
    assert [r["prompt"] for r in rows] == ["2+2=", "x", "y"]


def test_write_jsonl_replaces_atomically_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    write_jsonl(path, ROWS)
    write_jsonl(path, ROWS[:1])
    assert read_rows(path, SFT_COLUMNS) == ROWS[:1]

    def failing() -> Any:
        yield ROWS[0]
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError):
        write_jsonl(path, failing())
    assert read_rows(path, SFT_COLUMNS) == ROWS[:1]
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]


def test_parquet_round_trip_keeps_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "pairs.parquet"
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 2},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_rows(path, PREFERENCE_COLUMNS) == rows


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "p", "response": ', "invalid JSON .*; expected one JSON object per line"),
        ('["p", "r"]', "a JSON list, not an object; expected one object per line"),
        ('"just text"', "a JSON str, not an object"),
        (
            '{"response": "r"}',
            "column 'prompt' is missing; every row needs prompt \\(str\\) and response "
            "\\(str\\), or messages \\(list\\)",
        ),
        ('{"prompt": null, "response": "r"}', "column 'prompt' is null"),
        ('{"prompt": 42, "response": "r"}', "column 'prompt' is int \\(42\\); expected prompt"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write_lines(tmp_path / "data.jsonl", good_line(), "", bad_line, good_line())
    with pytest.raises(DatasetError, match=f"^{at(path)}:3: {message}"):
        read_rows(path, SFT_COLUMNS)


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_a_number(tmp_path: Path, value: bool) -> None:
    path = write_lines(tmp_path / "p.jsonl", json.dumps({"prompt": "p", "answer": value}))
    with pytest.raises(DatasetError, match=f"^{at(path)}:1: column 'answer' is bool"):
        read_rows(path, PROMPT_COLUMNS)
    flags = [Column("prompt", str), Column("answer", bool)]
    assert read_rows(path, flags) == [{"prompt": "p", "answer": value}]


def test_number_kinds_accept_int_and_float(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "p", "score": s}) for s in (1, 2.5)]
    path = write_lines(tmp_path / "s.jsonl", *lines)
    rows = read_rows(path, [Column("prompt", str), Column("score", (int, float))])
    assert [r["score"] for r in rows] == [1, 2.5]


def test_long_values_are_shortened_in_messages(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", json.dumps({"prompt": ["x" * 500], "response": "r"}))
    with pytest.raises(DatasetError) as caught:
        read_rows(path, SFT_COLUMNS)
    assert "..." in str(caught.value)
    assert len(str(caught.value)) < 200 + len(str(path))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(
        DatasetError, match=f"^{at(path)}: no rows; expected at least one with prompt"
    ):
        read_rows(path, SFT_COLUMNS)


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9", "response": "r"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=f"^{at(path)}: not UTF-8"):
        read_rows(path, SFT_COLUMNS)


def test_unknown_suffix_names_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("prompt,response\n")
    with pytest.raises(DatasetError, match=r"data\.csv: unsupported file type '\.csv'; use one of"):
        read_rows(path, SFT_COLUMNS)
    with pytest.raises(DatasetError, match=r"\.jsonl, \.json, \.parquet or builtin:"):
        read_rows(tmp_path / "data", SFT_COLUMNS)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.parquet"
    with pytest.raises(DatasetError, match=f"^{at(path)}: no such file"):
        read_rows(path, SFT_COLUMNS)
    folder = tmp_path / "shards.jsonl"
    folder.mkdir()
    with pytest.raises(DatasetError, match=f"^{at(folder)}: not a file"):
        read_rows(folder, SFT_COLUMNS)


def test_parquet_missing_column_names_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    with pytest.raises(DatasetError, match=f"^{at(path)}: row 1: column 'response' is missing"):
        read_rows(path, SFT_COLUMNS)


def test_parquet_bad_row_is_numbered_from_one(tmp_path: Path) -> None:
    path = tmp_path / "sft.parquet"
    pq.write_table(
        pa.table({"prompt": ["a", "b", None, "d"], "response": ["1", "2", "3", "4"]}), path
    )
    with pytest.raises(DatasetError, match=f"^{at(path)}: row 3: column 'prompt' is null"):
        read_rows(path, SFT_COLUMNS)
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": [1, 2]}), path)
    with pytest.raises(DatasetError, match=f"^{at(path)}: row 1: column 'response' is int"):
        read_rows(path, SFT_COLUMNS)


def test_unreadable_and_empty_parquet(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=f"^{at(path)}: not a readable Parquet file"):
        read_rows(path, SFT_COLUMNS)
    empty = tmp_path / "empty.parquet"
    schema = pa.schema([("prompt", pa.string()), ("response", pa.string())])
    pq.write_table(schema.empty_table(), empty)
    with pytest.raises(DatasetError, match=f"^{at(empty)}: no rows"):
        read_rows(empty, SFT_COLUMNS)


def test_builtin_arithmetic_through_read_rows() -> None:
    rows = read_rows("builtin:arithmetic?n=10&split=test", PROMPT_COLUMNS)
    held_out = {p.prompt for p in problems("test")}
    assert len(rows) == 10
    assert all(r["prompt"] in held_out and r["data_source"] == "arithmetic" for r in rows)
    assert rows == read_rows("builtin:arithmetic?n=10&split=test&seed=0", SFT_COLUMNS)


def test_builtin_options_keep_plus_signs() -> None:
    rows = read_rows(
        "builtin:arithmetic?n=300&split=train&seed=1&ops=+-&max_operand=9", SFT_COLUMNS
    )
    assert {"+", "-"} <= {c for r in rows for c in r["prompt"]}
    pairs = read_rows("builtin:preference?n=5&split=sft", PREFERENCE_COLUMNS)
    assert len(pairs) == 5


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "builtin:nope?n=1",
            "unknown task 'nope'; known tasks: arithmetic, preference, tool_arithmetic",
        ),
        ("builtin:arithmetic?n=1&split=test&size=3", "unknown parameter 'size'; arithmetic takes"),
        ("builtin:arithmetic?n=1&n=2&split=test", "repeated parameter 'n'"),
        ("builtin:arithmetic?n&split=test", "valueless parameter 'n'"),
        ("builtin:arithmetic?n=ten&split=test", "n='ten' is not int; arithmetic takes n \\(int\\)"),
        ("builtin:arithmetic?split=test", "missing parameter 'n'"),
        ("builtin:arithmetic?n=1&split=dev", "split='dev' is not one of train, sft, test"),
        ("builtin:arithmetic?n=1&split=test&ops=/", "ops='/' must be distinct characters"),
    ],
)
def test_bad_builtin_source_lists_what_is_valid(source: str, message: str) -> None:
    with pytest.raises(DatasetError, match=f"^{at(source)}: {message}"):
        read_rows(source, SFT_COLUMNS)


def test_builtin_rows_are_checked_against_the_columns() -> None:
    source = "builtin:arithmetic?n=2&split=test"
    with pytest.raises(DatasetError, match="row 1: column 'chosen' is missing"):
        read_rows(source, PREFERENCE_COLUMNS)


CALL = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "12*34="},
    {"role": "assistant", "content": "[calculator 12*34]"},
    {"role": "tool", "content": " = 408\n"},
    {"role": "assistant", "content": "408"},
]


def test_sft_rows_may_be_conversations(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "chat.jsonl",
        json.dumps({"messages": CALL, "answer": "408"}),
        good_line(),
        json.dumps({"messages": CALL[1:], "prompt": "12*34="}),  # a prompt may ride along
    )
    rows = read_rows(path, SFT_COLUMNS)
    assert rows[0] == {"messages": CALL, "answer": "408"} and rows[1]["response"] == "r"
    parquet = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CALL}]), parquet)
    assert read_rows(parquet, SFT_COLUMNS) == [{"messages": CALL}]


def message(**fields: Any) -> dict[str, Any]:
    return {"role": "user", "content": "hi", **fields}


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"messages": []}, "column 'messages': an empty list"),
        ({"messages": "hi"}, re.escape("column 'messages' is str ('hi'); expected messages (list")),
        ({"messages": [message(), "hi"]}, re.escape("messages[1] is str ('hi'), not a map")),
        (
            {"messages": [message(role="bot"), message(role="assistant")]},
            re.escape("messages[0] has role 'bot'; use one of system, user, assistant, tool"),
        ),
        (
            {"messages": [message(), {"role": "assistant"}]},
            re.escape("messages[1] (assistant): content is missing"),
        ),
        (
            {"messages": [message(), message(role="assistant", content=7)]},
            re.escape("messages[1] (assistant): content is int"),
        ),
        (
            {"messages": [message(), message(role="assistant", tool_calls=[{"id": 1}])]},
            re.escape("messages[1] (assistant) has tool_calls, which are not read"),
        ),
        ({"messages": [message()]}, "no assistant message, so nothing to train on"),
        (
            {"messages": [*CALL[1:3], CALL[3]]},
            "the last message is a tool message; a conversation to train on ends with the "
            "assistant's",
        ),
        (
            {"messages": CALL, "response": "408"},
            "given with a response column too; an SFT row has one or the other",
        ),
        (
            {"answer": "408"},
            re.escape(
                "column 'prompt' is missing; every row needs prompt (str) and response (str), "
                "or messages (list)"
            ),
        ),
    ],
)
def test_bad_conversation_names_file_line_and_message(
    tmp_path: Path, row: dict[str, Any], problem: str
) -> None:
    path = write_lines(tmp_path / "chat.jsonl", good_line(), json.dumps(row))
    with pytest.raises(DatasetError, match=f"^{at(path)}:2: .*{problem}"):
        read_rows(path, SFT_COLUMNS)


def test_builtin_tool_arithmetic_through_read_rows() -> None:
    rows = read_rows("builtin:tool_arithmetic?n=20&split=sft&tool_share=0.25&seed=3", SFT_COLUMNS)
    assert sum(len(r["messages"]) == 4 for r in rows) == 5
    prompts = read_rows("builtin:tool_arithmetic?n=5&split=test", PROMPT_COLUMNS)
    assert all("*" in r["prompt"] and r["answer"].isdigit() for r in prompts)
    with pytest.raises(DatasetError, match="tool_share='lots' is not float"):
        read_rows("builtin:tool_arithmetic?n=5&split=sft&tool_share=lots", SFT_COLUMNS)
