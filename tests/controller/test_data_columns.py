"""Bring your own data: a file's own column names mapped to the ones hybridflow reads
(``FILE?prompt_key=question``), blank answers refused by file and row, and every use of a source
checked (an SFT stage reading a file does not exempt the RL stage reading it too)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from controller.data import (
    PROMPT_COLUMNS,
    SFT_COLUMNS,
    DatasetError,
    combine,
    read_rows,
    require,
    source_file,
)
from controller.tasks import PARAMETERS, TASKS

SCORED = require(PROMPT_COLUMNS, ["answer"], "the reward function f reads it")


def jsonl(path: Path, *rows: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_verl_style_parquet_file_is_read_through_its_own_column_names(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.parquet"
    rows = [
        {"question": "1+1?", "reward_model": {"ground_truth": "2", "style": "rule"}, "id": 7},
        {"question": "2+3?", "reward_model": {"ground_truth": "5", "style": "rule"}, "id": 8},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"row 1: column 'prompt' is missing.*prompt_key="):
        read_rows(path, SCORED)  # what a verl user meets first: the fix is in the message
    found = read_rows(f"{path}?prompt_key=question&answer_key=reward_model.ground_truth", SCORED)
    assert [(r["prompt"], r["answer"], r["id"]) for r in found] == [
        ("1+1?", "2", 7),
        ("2+3?", "5", 8),
    ]
    assert "question" not in found[0]  # renamed, not copied
    assert source_file(f"{path}?prompt_key=question") == path  # what an existence check looks at
    assert source_file("builtin:arithmetic?n=1&split=test") is None


def test_jsonl_columns_are_renamed_for_sft(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "trl.jsonl", {"prompt": "Hi", "completion": "Hello"})
    assert read_rows(f"{path}?response_key=completion", SFT_COLUMNS) == [
        {"prompt": "Hi", "response": "Hello"}
    ]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("question_key=q", "cannot read 'question_key=q'"),
        ("prompt_key", "cannot read 'prompt_key'"),
        ("prompt_key=a&prompt_key=b", "cannot read 'prompt_key=b'"),
    ],
)
def test_a_bad_mapping_names_the_keys_there_are(tmp_path: Path, query: str, message: str) -> None:
    path = jsonl(tmp_path / "d.jsonl", {"q": "x", "answer": "1"})
    with pytest.raises(DatasetError, match=re.escape(message) + ".*prompt_key, response_key"):
        read_rows(f"{path}?{query}", SCORED)


def test_a_row_without_the_mapped_column_names_file_line_and_key(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", {"q": "x", "answer": "1"}, {"answer": "2"})
    with pytest.raises(
        DatasetError, match=re.escape(f"{path}:2: column 'q' (the file's prompt_key)")
    ):
        read_rows(f"{path}?prompt_key=q", SCORED)


@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_answer_is_refused_naming_file_and_row(tmp_path: Path, blank: str) -> None:
    path = jsonl(
        tmp_path / "d.jsonl", {"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": blank}
    )
    with pytest.raises(
        DatasetError, match=re.escape(f"{path}:2: column 'answer' is an empty string")
    ):
        read_rows(path, SCORED)
    # and in Parquet, by row number
    table = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": blank}]), table)
    with pytest.raises(
        DatasetError, match=re.escape(f"{table}: row 1: column 'answer' is an empty")
    ):
        read_rows(table, SCORED)


def test_an_empty_prompt_is_refused_for_generation_but_not_for_sft(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", {"prompt": "", "response": "text", "answer": "1"})
    with pytest.raises(DatasetError, match="column 'prompt' is an empty string"):
        read_rows(path, SCORED)
    assert read_rows(path, SFT_COLUMNS)[0]["prompt"] == ""  # plain text to learn: no prompt


def test_a_source_used_by_sft_and_rl_is_checked_for_both(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "d.jsonl", {"prompt": "1+1=", "response": "2"})
    assert read_rows(path, SFT_COLUMNS)  # enough for the SFT stage...
    with pytest.raises(
        DatasetError, match=re.escape("column 'answer' is missing (the reward function f")
    ):
        read_rows(path, combine(SFT_COLUMNS, SCORED))  # ...not for the RL stage on the same file
    both = combine(SFT_COLUMNS, SCORED)
    assert [c.name for c in both].count("prompt") == 2  # SFT's prompt may be blank, RL's not
    assert len(combine(SFT_COLUMNS, SFT_COLUMNS)) == len(SFT_COLUMNS)


def test_every_builtin_task_parameter_is_described() -> None:
    for name, task in TASKS.items():
        missing = set(inspect.signature(task).parameters) - set(PARAMETERS)
        assert not missing, f"controller/tasks.py PARAMETERS lacks {sorted(missing)} of {name}"
