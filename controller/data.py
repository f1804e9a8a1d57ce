"""Datasets: rows of text read from JSON lines, Parquet or a built-in synthetic task.

Commands name a source and the columns they need; `read_rows` returns plain dicts and checks
every row on the way in, so a bad file fails at load time with the file, the line and the fix,
not mid-run. Columns beyond the named ones are kept: they are the row's metadata (a reward
function sees them). Tokenization happens in the roles, never here.

Sources:
- ``data.jsonl`` / ``data.json``: one JSON object per non-empty line; errors say ``FILE:LINE: ``
  with 1-based line numbers.
- ``data.parquet``: one row per record; errors say ``FILE: row N: `` with 1-based row numbers.
- ``builtin:NAME?key=value&...``: a task from `controller.tasks.TASKS`, e.g.
  ``builtin:arithmetic?n=2000&split=train&seed=0``.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from controller.tasks import TASKS

SUFFIXES = (".jsonl", ".json", ".parquet")
BUILTIN = "builtin:"


class DatasetError(ValueError):
    """A source that cannot be read or a row that does not fit; the message says where and why."""


@dataclass(frozen=True)
class Column:
    """A field every row must have (or may have, when not required), and its allowed types."""

    name: str
    kind: type | tuple[type, ...]
    required: bool = True
    why: str = ""  # who needs it, said when it is missing (e.g. "the reward function f reads it")

    @property
    def kinds(self) -> tuple[type, ...]:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)

    def describe(self) -> str:
        types = "any value" if object in self.kinds else " | ".join(k.__name__ for k in self.kinds)
        return f"{self.name} ({types})" if self.required else f"{self.name} ({types}, optional)"

    def accepts(self, value: object) -> bool:
        # bool is a subclass of int, but True is not a number a dataset means to hold.
        if isinstance(value, bool) and bool not in self.kinds:
            return False
        return isinstance(value, self.kinds)


SFT_COLUMNS = (Column("prompt", str), Column("response", str))
PREFERENCE_COLUMNS = (Column("prompt", str), Column("chosen", str), Column("rejected", str))
PROMPT_COLUMNS = (
    Column("prompt", str),
    Column("answer", (str, int, float), required=False),
    Column("data_source", str, required=False),
)


def require(columns: Sequence[Column], names: Iterable[str], why: str) -> tuple[Column, ...]:
    """`columns` with each of `names` made required (a new column of any type when absent), so a
    row without it fails at load time saying `why` it is needed."""
    names = list(names)
    out = [
        replace(c, required=True, why=why) if c.name in names and not c.required else c
        for c in columns
    ]
    known = {c.name for c in columns}
    return (*out, *(Column(n, object, why=why) for n in names if n not in known))


def read_rows(source: str | Path, columns: Sequence[Column]) -> list[dict[str, Any]]:
    """Every row of `source`, each checked against `columns`; raises DatasetError otherwise."""
    if isinstance(source, str) and source.startswith(BUILTIN):
        rows = _builtin_rows(source)
        for number, row in enumerate(rows, 1):
            check_row(row, columns, f"{source}: row {number}")
        return rows
    path = Path(source)
    if path.suffix not in SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)} "
            f"or {BUILTIN}NAME?key=value (tasks: {', '.join(TASKS)})"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    rows = _parquet_rows(path, columns) if path.suffix == ".parquet" else _jsonl_rows(path, columns)
    if not rows:
        raise DatasetError(f"{path}: no rows; expected at least one with {_needs(columns)}")
    return rows


def check_row(row: Mapping[str, Any], columns: Sequence[Column], where: str) -> None:
    """Raise DatasetError, prefixed with `where`, when a column is missing or has a wrong type.

    An optional column may be absent or null; a required one may be neither.
    """
    for column in columns:
        value = row.get(column.name)
        if value is None:
            if column.required:
                state = "is null" if column.name in row else "is missing"
                why = f" ({column.why})" if column.why else ""
                raise DatasetError(
                    f"{where}: column {column.name!r} {state}{why}; every row needs "
                    f"{_needs(columns)}"
                )
        elif not column.accepts(value):
            raise DatasetError(
                f"{where}: column {column.name!r} is {type(value).__name__} "
                f"({_preview(value)}); expected {column.describe()}"
            )


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write rows as JSON lines, atomically: readers see the old file or the whole new one."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _jsonl_rows(path: Path, columns: Sequence[Column]) -> list[dict[str, Any]]:
    rows = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    rows.append(_parse_line(line, columns, f"{path}:{number}"))
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path}: not UTF-8 text ({error.reason}); save it as UTF-8") from error
    return rows


def _parse_line(line: str, columns: Sequence[Column], where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(
            f"{where}: invalid JSON ({error.msg} at column {error.colno}); "
            "expected one JSON object per line"
        ) from error
    if not isinstance(row, dict):
        raise DatasetError(
            f"{where}: a JSON {type(row).__name__}, not an object; expected one object per line "
            f"with {_needs(columns)}"
        )
    check_row(row, columns, where)
    return row


def _parquet_rows(path: Path, columns: Sequence[Column]) -> list[dict[str, Any]]:
    # pyarrow is imported here so the controller pays for it only when it reads Parquet.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise DatasetError(f"{path}: not a readable Parquet file ({error})") from error
    for number, row in enumerate(rows, 1):
        check_row(row, columns, f"{path}: row {number}")
    return rows


def _builtin_rows(source: str) -> list[dict[str, Any]]:
    name, _, query = source.removeprefix(BUILTIN).partition("?")
    task = TASKS.get(name)
    if task is None:
        raise DatasetError(f"{source}: unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    arguments = _task_arguments(source, name, task, query)
    try:
        return task(**arguments)
    except ValueError as error:
        raise DatasetError(f"{source}: {error}") from error


def _task_arguments(source: str, name: str, task: Callable[..., Any], query: str) -> dict[str, Any]:
    """Query parameters converted to the task's annotated types (int or str)."""
    hints = typing.get_type_hints(task)
    parameters = inspect.signature(task).parameters
    usage = f"{name} takes " + ", ".join(
        f"{p} ({hints[p].__name__}{'' if v.default is v.empty else ', optional'})"
        for p, v in parameters.items()
    )
    arguments: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        # Split by hand: parse_qs would read "ops=+-" as " -".
        key, sep, text = part.partition("=")
        if key not in parameters or key in arguments or not sep:
            problem = "unknown" if key not in parameters else "repeated" if sep else "valueless"
            raise DatasetError(f"{source}: {problem} parameter {key!r}; {usage}")
        try:
            arguments[key] = hints[key](unquote(text))
        except ValueError as error:
            raise DatasetError(
                f"{source}: {key}={text!r} is not {hints[key].__name__}; {usage}"
            ) from error
    missing = [p for p, v in parameters.items() if v.default is v.empty and p not in arguments]
    if missing:
        raise DatasetError(f"{source}: missing parameter {missing[0]!r}; {usage}")
    return arguments


def _needs(columns: Sequence[Column]) -> str:
    return ", ".join(c.describe() for c in columns if c.required) or "any columns"


def _preview(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
