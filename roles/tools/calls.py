"""Reading a tool call from the text of a turn, in the format the model writes calls in.

A turn that holds a call ends with the format's close tag (the rollout stops generating on the
close tag's last token, ``EnvSpec.call_stop_token_ids``), so the call is the last one in the text:

* ``hermes`` (Qwen / Hermes chat models): ``<tool_call>{"name": "calculator", "arguments":
  {"expression": "2+3"}}</tool_call>``, JSON between the tags; ``arguments`` may also be a JSON
  string holding that object, as some models write it;
* ``bracket`` (compact, for small byte-level models): ``[calculator 12*34]``, the tool's name,
  one space, and the rest up to the closing ``]`` as the string value of the tool's first
  parameter (``[name]`` calls a tool without arguments). The argument cannot hold ``]`` (the
  turn stops there) nor ``[`` (the call starts at the last one).

The observation a call's result is wrapped in before it is tokenized (``OBSERVATIONS``) differs
per format: hermes closes the assistant's turn and hands the result back as a user turn in
``<tool_response>`` tags, as Qwen's chat template does, then opens the next assistant turn;
bracket writes `` = result`` and a new line after the call, so ``[calculator 12*34] = 408``
reads as one line of working.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["bracket", "hermes"]

OPEN: dict[str, str] = {"bracket": "[", "hermes": "<tool_call>"}
CLOSE: dict[str, str] = {"bracket": "]", "hermes": "</tool_call>"}
OBSERVATIONS: dict[str, str] = {
    "bracket": " = {text}\n",
    "hermes": (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
}
EXAMPLES: dict[str, str] = {
    "bracket": "[tool_name argument]",
    "hermes": '<tool_call>{"name": "tool_name", "arguments": {"parameter": "value"}}</tool_call>',
}

_BRACKET = re.compile(r"([A-Za-z_][\w.-]*)(?: (.*))?", re.DOTALL)


class MalformedCall(ValueError):
    """The text does not hold a call the format can read (the message says what is wrong)."""


@dataclass(frozen=True)
class Call:
    name: str
    #: a JSON object (hermes), one string (bracket) or nothing (a bracket call without one)
    arguments: dict[str, Any] | str | None


def parse_call(fmt: Format, text: str) -> Call:
    """The call at the end of ``text``; raises MalformedCall saying what is wrong."""
    body = _last_tagged(fmt, text)
    return _bracket(body) if fmt == "bracket" else _hermes(body)


def _last_tagged(fmt: Format, text: str) -> str:
    open_tag, close_tag = OPEN[fmt], CLOSE[fmt]
    trimmed = text.rstrip()
    if not trimmed.endswith(close_tag):
        raise MalformedCall(f"the turn does not end with {close_tag!r}, so it holds no call")
    end = len(trimmed) - len(close_tag)
    start = trimmed.rfind(open_tag, 0, end)
    if start < 0:
        raise MalformedCall(f"the turn ends with {close_tag!r} but has no {open_tag!r} before it")
    return trimmed[start + len(open_tag) : end]


def _bracket(body: str) -> Call:
    match = _BRACKET.fullmatch(body)
    if match is None:
        raise MalformedCall(
            f"[{body}] does not start with a tool name followed by one space and the argument"
        )
    return Call(match.group(1), match.group(2))


def _hermes(body: str) -> Call:
    try:
        found = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad JSON, a number past int's digit limit,
        raise MalformedCall(f"the call is not valid JSON ({_short(exc)})") from None  # deep nesting
    if not isinstance(found, dict):
        raise MalformedCall(f"the call is a JSON {type(found).__name__}, not an object")
    name = found.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedCall('the call has no "name" string')
    arguments = found.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise MalformedCall(
                f'"arguments" is a string that is not JSON ({_short(exc)})'
            ) from None
    if not isinstance(arguments, dict):
        raise MalformedCall(f'"arguments" is a JSON {type(arguments).__name__}, not an object')
    extra = sorted(set(found) - {"name", "arguments"})
    if extra:
        raise MalformedCall(f'the call has keys {extra} besides "name" and "arguments"')
    return Call(name, arguments)


def _short(exc: BaseException) -> str:
    """Why JSON was refused, in a line (a recursion error says it with no detail)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).splitlines()[0][:200]
