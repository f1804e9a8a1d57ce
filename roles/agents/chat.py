"""OpenAI chat requests as token ids, and the trajectory recorded as it was sampled.

An agent sends its whole conversation on every call. What was sampled is never re-tokenized: the
first call's messages are rendered by the model's chat template (or, for a tokenizer without one,
written plainly one after another) and tokenized once; every later call is rendered the same way
and must extend the recording. Its assistant messages that this endpoint returned are rendered as
the exact text sampled (the tool calls as the model wrote them, not as the client re-serialized
them), its tool results in the call format's observation (hermes: a ``<tool_response>`` user
turn). When the new rendering begins with the recorded ids, or with their text, only what follows
is tokenized and appended (the observation, loss mask 0). When it does not (a template that drops
earlier reasoning, an agent that edits its history), that is a **drift**: it is counted, and the
recording starts again from the new context, whose earlier turns are then prompt, not trained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from threading import Lock
from typing import Any

from roles.tools.calls import CLOSE, OBSERVATIONS, OPEN, Format, MalformedCall, parse_call

OBSERVED = -1  # the version of a token not sampled (the controller's NO_VERSION)


class BadRequest(ValueError):
    """A request the endpoint refuses: the OpenAI error's message and the field it names."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class Given:
    """An assistant message this endpoint returned."""

    raw: str  # the sampled text, special tokens left out
    full: str  # the sampled text with them (what a template-less rendering writes)
    call_ids: list[str]


@dataclass
class Recording:
    """One trajectory as sampled: its start (the first call's context) and what followed."""

    start: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[list[str]] = field(default_factory=list)
    given: list[Given] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    drift: int = 0
    finish: str = ""

    @property
    def context(self) -> list[int]:
        return self.start + self.ids

    def observe(self, ids: list[int], text: str) -> None:
        if ids:
            self.ids += ids
            self.sampled += [0] * len(ids)
            self.log_probs += [0.0] * len(ids)
            self.versions += [OBSERVED] * len(ids)
            self.segments.append(["observation", text])

    def sample(self, ids: list[int], log_probs: list[float], version: int, text: str) -> None:
        self.ids += ids
        self.sampled += [1] * len(ids)
        self.log_probs += log_probs
        self.versions += [version] * len(ids)
        self.segments.append(["sampled", text])


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{where}.content[{i}] is a {kind!r} part; only text parts are supported",
                    f"{where}.content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", where)


def call_text(fmt: Format, name: str, arguments: str) -> str:
    """A tool call as the model would write it in ``fmt`` (for assistant messages an agent wrote
    itself, such as few-shot examples)."""
    if fmt == "hermes":
        try:
            args = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            args = arguments
        return f"{OPEN[fmt]}{json.dumps({'name': name, 'arguments': args})}{CLOSE[fmt]}"
    try:
        loaded = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        loaded = arguments
    value = next(iter(loaded.values()), "") if isinstance(loaded, dict) else loaded
    return f"{OPEN[fmt]}{name} {value}{CLOSE[fmt]}"


class Renderer:
    """Messages to text and token ids with the model's tokenizer (one thread at a time)."""

    def __init__(
        self, tokenizer: Any, fmt: Format, observation: str | None = None, plain: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.observation = observation or OBSERVATIONS[fmt]
        self.templated = not plain and bool(getattr(tokenizer, "chat_template", None))
        self.lock = Lock()

    # -- rendering ------------------------------------------------------------------------------

    def chat(self, messages: Any, tools: list[dict[str, Any]] | None, given: list[Given]) -> str:
        """The conversation as the text the model reads next (the assistant's turn opened)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        turns: list[dict[str, str]] = []
        mine = 0  # assistant messages seen: the k-th is the k-th this endpoint returned
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in (
                "system", "developer", "user", "assistant", "tool",
            ):  # fmt: skip
                raise BadRequest(
                    f"{where}.role must be system, developer, user, assistant or tool", where
                )
            role, text = m["role"], text_of(m.get("content"), where)
            if role == "assistant":
                if mine < len(given):
                    mark = given[mine]
                    text = mark.raw if self.templated else mark.full
                else:  # written by the agent: its calls as the model would write them
                    for call in m.get("tool_calls") or []:
                        fn = call.get("function", {}) if isinstance(call, dict) else {}
                        text += call_text(
                            self.fmt, str(fn.get("name", "")), str(fn.get("arguments", ""))
                        )
                mine += 1
                turns.append({"role": "assistant", "content": text})
            elif role == "tool":
                turns.append({"role": "tool", "content": text})
            else:
                turns.append({"role": "system" if role == "developer" else role, "content": text})
        return self._templated(turns, tools) if self.templated else self._plain(turns)

    def _templated(self, turns: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
        # tool results as the call format's observation: hermes models (Qwen, SmolLM2's chat
        # fine-tunes) read them as a <tool_response> user turn, consecutive ones in one turn
        merged: list[dict[str, str]] = []
        for t in turns:
            if t["role"] == "tool":
                block = f"<tool_response>\n{t['content']}\n</tool_response>"
                if merged and merged[-1].get("tool"):
                    merged[-1]["content"] += "\n" + block
                else:
                    merged.append({"role": "user", "content": block, "tool": "1"})
            else:
                merged.append(t)
        clean = [{"role": t["role"], "content": t["content"]} for t in merged]
        with self.lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    clean, tools=tools or None, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # the template's own check (e.g. roles must alternate)
                raise BadRequest(f"the model's chat template refused the messages: {exc}") from exc
        return str(text)

    def _plain(self, turns: list[dict[str, str]]) -> str:
        """No chat template: the contents one after another; a tool result in the format's
        observation; a system or user message after a turn on a line of its own."""
        out = ""
        for t in turns:
            if t["role"] == "tool":
                out += self.observation.replace("{text}", t["content"])
            elif t["role"] == "assistant":
                out += t["content"]
            else:
                if out and not out.endswith("\n"):
                    out += "\n"
                out += t["content"] + ("\n" if t["role"] == "system" else "")
        return out

    # -- token ids ------------------------------------------------------------------------------

    def encode(self, text: str, first: bool) -> list[int]:
        with self.lock:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            bos = self.tokenizer.bos_token_id
        # a plain rendering is a prompt as the generation engines read one: BOS, then the text
        # (a chat template writes its own)
        if first and not self.templated and bos is not None:
            ids = [int(bos), *ids]
        return ids

    def decode(self, ids: list[int], special: bool = True) -> str:
        with self.lock:
            return str(
                self.tokenizer.decode(
                    ids, skip_special_tokens=not special, clean_up_tokenization_spaces=False
                )
            )

    def extend(self, rec: Recording, text: str) -> tuple[list[int], bool]:
        """(the new ids the call's context adds to the recording, whether it drifted). With
        nothing recorded, or after a drift, the recording starts over from ``text``."""
        if not rec.start:
            rec.start = self.encode(text, first=True)
            return [], False
        whole = self.encode(text, first=True)
        context = rec.context
        if whole[: len(context)] == context:
            return whole[len(context) :], False
        said = self.decode(context)
        bos = self.tokenizer.bos_token
        if not self.templated and bos and said.startswith(bos) and not text.startswith(bos):
            said = said[len(bos) :]
        if text.startswith(said):
            return self.encode(text[len(said) :], first=False), False
        rec.drift += 1
        rec.start, rec.ids, rec.sampled, rec.log_probs, rec.versions = whole, [], [], [], []
        return [], True

    # -- what the model wrote, as OpenAI shapes -------------------------------------------------

    def tool_calls(
        self, text: str, call_id: str, tools: list[dict[str, Any]] | None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a sampled turn: every complete call in the format, parsed;
        text that holds none (or only a malformed one) is content."""
        open_tag, close_tag = OPEN[self.fmt], CLOSE[self.fmt]
        calls: list[dict[str, Any]] = []
        first = text.find(open_tag)
        if first < 0 or close_tag not in text[first:]:
            return text, []
        pieces = re.findall(re.escape(open_tag) + r".*?" + re.escape(close_tag), text, re.DOTALL)
        for piece in pieces:
            try:
                call = parse_call(self.fmt, piece)
            except MalformedCall:
                return text, []
            if isinstance(call.arguments, dict):
                arguments = call.arguments
            elif call.arguments is None:
                arguments = {}
            else:
                arguments = {_first_parameter(tools, call.name): call.arguments}
            calls.append(
                {
                    "id": f"{call_id}_{len(calls)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(arguments)},
                }
            )
        content = text[:first].strip()
        return content or None, calls


def _first_parameter(tools: list[dict[str, Any]] | None, name: str) -> str:
    """The parameter a one-argument call (the bracket format's) fills: the named tool's first
    required one, as the request's ``tools`` describe it; else ``input``."""
    for tool in tools or []:
        fn = tool.get("function", {}) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            params = fn.get("parameters", {}) or {}
            names = list(params.get("required") or []) or list(params.get("properties") or {})
            if names:
                return str(names[0])
    return "input"
