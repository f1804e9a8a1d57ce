"""A tool's schema and argument check, read from the function itself.

``describe(fn)`` reads a tool function once, when the env role starts:

* its **name** is the function's name;
* its **description** is the docstring's first paragraph;
* its **parameters** come from the signature's type hints (every parameter needs one), each
  described by its entry in a Google-style ``Args:`` section when there is one; a parameter with
  a default is optional.

The result, a ``Tool``, gives the OpenAI-style schema the model is shown (``Tool.schema()``) and
checks the arguments of a call against the signature (``Tool.arguments(...)``), with pydantic's
lax conversions (``"3"`` is accepted for an ``int``) and a ``BadArguments`` error naming each
field that does not fit.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from transport.structs import reasons


class ToolDefinitionError(ValueError):
    """A function that cannot be a tool as written (the message says what to change)."""


class BadArguments(ValueError):
    """A call's arguments do not fit the tool's signature (the message names the fields)."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    path: str
    description: str
    parameters: type[BaseModel]
    #: the first parameter: the bracket format's one argument (None for a tool without any)
    first: str | None
    required: tuple[str, ...]

    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        parameters = _without_titles(self.parameters.model_json_schema())
        parameters.setdefault("properties", {})
        parameters["required"] = list(self.required)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }

    def arguments(self, given: dict[str, Any] | str | None) -> dict[str, Any]:
        """The keyword arguments to call the tool with: a dict checked against the signature, or
        one string (the bracket format) as the value of the first parameter."""
        if isinstance(given, str):
            if self.first is None:
                raise BadArguments(f"{self.name} takes no arguments, and was given {given!r}")
            given = {self.first: given}
        try:
            checked = self.parameters.model_validate(given or {})
        except ValidationError as exc:
            raise BadArguments(f"bad arguments for {self.name}: {reasons(exc)}") from None
        return {name: getattr(checked, name) for name in type(checked).model_fields}


def describe(fn: Callable[..., Any], path: str) -> Tool:
    """The ``Tool`` of function ``fn`` (named ``path`` in errors); raises ToolDefinitionError."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ToolDefinitionError(f"tool {path} has no usable __name__; write it as a function")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolDefinitionError(
            f"tool {path} has no docstring; its first paragraph is the description the model "
            "sees, so write one"
        )
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolDefinitionError(f"cannot read the signature of tool {path}: {exc}") from exc
    described = parameter_docs(doc)
    fields: dict[str, Any] = {}
    required = []
    for param in signature.parameters.values():
        fields[param.name] = _field(path, param, hints, described.get(param.name))
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    try:
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        model.model_json_schema()
    except Exception as exc:  # pydantic's many schema errors: say which tool, and why
        raise ToolDefinitionError(
            f"tool {path}: its parameters have no JSON schema: {exc}"
        ) from exc
    first = next(iter(signature.parameters), None)
    return Tool(name, fn, path, description(doc), model, first, tuple(required))


def _field(
    path: str, param: inspect.Parameter, hints: dict[str, Any], text: str | None
) -> tuple[Any, Any]:
    if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        raise ToolDefinitionError(
            f"tool {path}: parameter {param.name!r} is {param.kind.description}; a tool is called "
            "with keyword arguments, so write plain named parameters"
        )
    if param.name not in hints:
        raise ToolDefinitionError(
            f"tool {path}: parameter {param.name!r} has no type hint; the model is shown its "
            "type and calls are checked against it, so annotate it (e.g. `str`)"
        )
    default = ... if param.default is inspect.Parameter.empty else param.default
    hint = hints[param.name]
    if text:
        hint = Annotated[hint, Field(description=text)]
    return hint, default


def description(doc: str) -> str:
    """The docstring's first paragraph, on one line."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


_SECTION = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def parameter_docs(doc: str) -> dict[str, str]:
    """``{parameter: description}`` from a Google-style ``Args:`` section (empty without one)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line.strip())), None)
    if start is None:
        return {}
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    entry_indent: int | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # the next section (Returns:, Raises:, ...) or prose
        if entry_indent is None:
            entry_indent = indent
        match = _ENTRY.match(line.strip()) if indent == entry_indent else None
        if match:
            current = found.setdefault(match.group(1).lstrip("*"), [])
            current.append(match.group(2).strip())
        elif current is not None:
            current.append(line.strip())
    return {name: " ".join(p for p in parts if p) for name, parts in found.items()}


_DATA_KEYS = ("default", "examples", "const", "enum")


def _without_titles(node: Any) -> Any:
    """A pydantic JSON schema without its generated ``title`` keys (property names stay)."""
    if isinstance(node, list):
        return [_without_titles(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "patternProperties") and isinstance(value, dict):
            out[key] = {name: _without_titles(schema) for name, schema in value.items()}
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = _without_titles(value)
    return out
