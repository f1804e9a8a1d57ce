"""Datasets: rows of text read from JSON lines, Parquet or a built-in synthetic task.

Commands name a source and the columns they need; `read_rows` returns plain dicts and checks
every row on the way in, so a bad file fails at load time with the file, the line and the fix,
not mid-run. Columns beyond the named ones are kept: they are the row's metadata (a reward
function sees them). Tokenization happens in the roles, never here.

An SFT row is a (``prompt``, ``response``) pair or a conversation: ``messages``, a list of
``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` ending with an assistant
message (the chat format of OpenAI, TRL and verl data; other keys of a message are ignored, and a
tool call is written in the assistant's content, in the model's call format, not as
``tool_calls``). Only the assistant's turns are trained on (``roles/modeling/text.py``).

Sources:
- ``data.jsonl`` / ``data.json``: one JSON object per non-empty line; errors say ``FILE:LINE: ``
  with 1-based line numbers.
- ``data.parquet``: one row per record; errors say ``FILE: row N: `` with 1-based row numbers.
- ``FILE?prompt_key=question&answer_key=reward_model.ground_truth``: the file's own column names
  (a dotted name reaches into a nested record) renamed to the ones hybridflow reads (``KEYS``), as
  verl's ``data.prompt_key`` does; the row keeps its other columns.
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
from transport.columns import MESSAGES

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
    blank: bool = True  # False: an empty (or all-space) string is refused like a missing value
    #: required only when the row lacks this other column (which then stands in for it)
    unless: str = ""
    #: a further check of a present value, given the row too: what is wrong, or None
    check: Callable[[Any, Mapping[str, Any]], str | None] | None = None

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


MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def conversation_problem(messages: Any, row: Mapping[str, Any]) -> str | None:
    """What is wrong with an SFT row's ``messages`` (None when nothing is): each message a map
    with a known ``role`` and a string ``content``, an assistant message last, no ``tool_calls``
    (the call goes in the content), and no ``response`` beside them (which to train on?)."""
    if not messages:
        return "an empty list; give the messages, the last one the assistant's"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"messages[{i}] is {type(message).__name__} ({_preview(message)}), not a map"
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            return f"messages[{i}] has role {role!r}; use one of {', '.join(MESSAGE_ROLES)}"
        if message.get("tool_calls"):
            return (
                f"messages[{i}] ({role}) has tool_calls, which are not read; write the call in "
                "the assistant's content, in the model's call format"
            )
        if not isinstance(content, str):
            state = "is missing" if content is None else f"is {type(content).__name__}"
            return f"messages[{i}] ({role}): content {state}; every message needs text content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message, so nothing to train on"
    if messages[-1]["role"] != "assistant":
        return (
            f"the last message is a {messages[-1]['role']} message; a conversation to train on "
            "ends with the assistant's"
        )
    if row.get("response") is not None:
        return "given with a response column too; an SFT row has one or the other"
    return None


SFT_COLUMNS = (
    Column("prompt", str, unless=MESSAGES),
    Column("response", str, unless=MESSAGES),
    Column(MESSAGES, list, required=False, check=conversation_problem),
)
PREFERENCE_COLUMNS = (Column("prompt", str), Column("chosen", str), Column("rejected", str))
PROMPT_COLUMNS = (
    Column("prompt", str, blank=False),
    Column("answer", (str, int, float), required=False, blank=False),
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


#: ``FILE?KEY=COLUMN`` settings: the column hybridflow reads, by the key that renames it
KEYS = {
    "prompt_key": "prompt",
    "response_key": "response",
    "answer_key": "answer",
    "chosen_key": "chosen",
    "rejected_key": "rejected",
}


def combine(*uses: Sequence[Column]) -> tuple[Column, ...]:
    """The columns of every use of one source (an SFT stage and an RL stage reading one file):
    a row must satisfy each use, so nothing one use needs is skipped because another read the
    file first."""
    found: list[Column] = []
    for columns in uses:
        found.extend(c for c in columns if c not in found)
    return tuple(found)


def read_rows(source: str | Path, columns: Sequence[Column]) -> list[dict[str, Any]]:
    """Every row of `source`, each checked against `columns`; raises DatasetError otherwise."""
    if isinstance(source, str) and source.startswith(BUILTIN):
        rows = _builtin_rows(source)
        for number, row in enumerate(rows, 1):
            check_row(row, columns, f"{source}: row {number}")
        return rows
    path, renames = _file_source(source)
    if path.suffix not in SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)} "
            f"or {BUILTIN}NAME?key=value (tasks: {', '.join(TASKS)})"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    found = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path, columns)
    rows = [_renamed(row, renames, columns, where) for row, where in found]
    if not rows:
        raise DatasetError(f"{path}: no rows; expected at least one with {_needs(columns)}")
    return rows


def source_file(source: str | Path) -> Path | None:
    """The file a data source reads (``FILE?prompt_key=...``: FILE); None for a built-in task."""
    if isinstance(source, str) and source.startswith(BUILTIN):
        return None
    return _file_source(source)[0]


def _file_source(source: str | Path) -> tuple[Path, dict[str, str]]:
    """The file of ``FILE?prompt_key=COLUMN&...`` and its renames (hybridflow's name -> the
    file's column); a plain path (or an existing file whose name holds a ``?``) renames nothing."""
    text = str(source)
    name, sep, query = text.partition("?")
    if not sep or Path(text).is_file():
        return Path(text), {}
    renames: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, has_value, column = part.partition("=")
        if key not in KEYS or not has_value or not column or KEYS[key] in renames:
            raise DatasetError(
                f"{text}: cannot read {part!r}; after a file name give KEY=COLUMN pairs joined "
                f"by '&', KEY one of {', '.join(KEYS)} (each once), e.g. "
                f"{name}?prompt_key=question&answer_key=solution"
            )
        renames[KEYS[key]] = unquote(column)
    return Path(name), renames


def _renamed(
    row: dict[str, Any], renames: Mapping[str, str], columns: Sequence[Column], where: str
) -> dict[str, Any]:
    """``row`` with each renamed column under hybridflow's name, then checked."""
    if not renames:
        check_row(row, columns, where)
        return row
    out = dict(row)
    for ours, theirs in renames.items():
        found = _lookup(row, theirs)
        if found is _ABSENT:
            key = next(k for k, v in KEYS.items() if v == ours)
            raise DatasetError(
                f"{where}: column {theirs!r} (the file's {key}) is missing; the row has "
                f"{', '.join(sorted(row)) or 'no columns'}"
            )
        out.pop(theirs, None)
        out[ours] = found
    check_row(out, columns, where)
    return out


_ABSENT = object()


def _lookup(row: Mapping[str, Any], name: str) -> Any:
    """``row[name]``, or for ``a.b`` ``row["a"]["b"]`` when the row has no ``a.b`` column."""
    if name in row:
        return row[name]
    node: Any = row
    for part in name.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def check_row(row: Mapping[str, Any], columns: Sequence[Column], where: str) -> None:
    """Raise DatasetError, prefixed with `where`, when a column is missing or has a wrong type.

    An optional column may be absent or null; a required one may be neither.
    """
    for column in columns:
        value = row.get(column.name)
        if value is None:
            if column.required and (not column.unless or row.get(column.unless) is None):
                state = "is null" if column.name in row else "is missing"
                why = f" ({column.why})" if column.why else ""
                raise DatasetError(
                    f"{where}: column {column.name!r} {state}{why}; every row needs "
                    f"{_needs(columns)}{_rename_hint(column, row)}"
                )
        elif not column.accepts(value):
            raise DatasetError(
                f"{where}: column {column.name!r} is {type(value).__name__} "
                f"({_preview(value)}); expected {column.describe()}"
            )
        elif not column.blank and isinstance(value, str) and not value.strip():
            why = f" ({column.why})" if column.why else ""
            raise DatasetError(
                f"{where}: column {column.name!r} is an empty string{why}; give it a value "
                "or leave the row out"
            )
        elif column.check is not None and (problem := column.check(value, row)) is not None:
            raise DatasetError(f"{where}: column {column.name!r}: {problem}")


def _rename_hint(column: Column, row: Mapping[str, Any]) -> str:
    """How to point a column hybridflow reads at another of the file's columns."""
    key = next((k for k, v in KEYS.items() if v == column.name), None)
    if key is None:
        return ""
    others = ", ".join(sorted(k for k in row if k != column.name)) or "none"
    return (
        f" (the row's other columns: {others}; to read another one as {column.name!r}, "
        f"name the data FILE?{key}=COLUMN)"
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


def _jsonl_rows(path: Path, columns: Sequence[Column]) -> list[tuple[dict[str, Any], str]]:
    """(row, where) of each line holding one; a line that is not a JSON object is an error."""
    rows = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    where = f"{path}:{number}"
                    rows.append((_parse_line(line, columns, where), where))
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
    return row


def _parquet_rows(path: Path) -> list[tuple[dict[str, Any], str]]:
    """(row, where) of each row of a Parquet file."""
    # pyarrow is imported here so the controller pays for it only when it reads Parquet.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise DatasetError(f"{path}: not a readable Parquet file ({error})") from error
    return [(row, f"{path}: row {number}") for number, row in enumerate(rows, 1)]


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
    """The required columns; those another column can stand in for are given with it as the
    alternative ("prompt (str) and response (str), or messages (list)")."""
    needed = [c for c in columns if c.required and not c.unless]
    text = [c.describe() for c in needed]
    for other in dict.fromkeys(c.unless for c in columns if c.required and c.unless):
        these = [c for c in columns if c.required and c.unless == other]
        instead = next((c for c in columns if c.name == other), Column(other, object))
        group = " and ".join(c.describe() for c in these if c.name not in {n.name for n in needed})
        text.append(f"{group}, or {replace(instead, required=True).describe()}")
    return ", ".join(text) or "any columns"


def _preview(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
