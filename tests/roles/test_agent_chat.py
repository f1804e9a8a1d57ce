"""Rendering an agent's OpenAI messages to token ids (``roles/agents/chat.py``): the first call
tokenized once, later calls extending the recording with only what is new, the sampled turns
never re-tokenized, a drifting history counted, the model's calls parsed into ``tool_calls``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from roles.agents.chat import BadRequest, Given, Recording, Renderer, call_text

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def sample(r: Renderer, rec: Recording, text: str) -> None:
    """What the endpoint records for a turn the generator sampled as ``text``'s tokens."""
    ids = r.encode(text, first=False)
    rec.sample(ids, [-0.5] * len(ids), 3, text)
    rec.given.append(Given(raw=text, full=text, call_ids=[]))


def test_plain_rendering_is_the_env_roles_token_stream(tokenizer: Any) -> None:
    """Without a chat template: BOS and the prompt, the sampled call, the tool result in the
    observation template; the second call adds only the observation's ids."""
    r = Renderer(tokenizer, "bracket", " = {text}\n", plain=True)
    assert not r.templated
    rec = Recording()
    first = [{"role": "user", "content": "708*62="}]
    new, drifted = r.extend(rec, r.chat(first, TOOLS, rec.given))
    assert (new, drifted) == ([], False)
    assert rec.start == [
        tokenizer.bos_token_id,
        *tokenizer.encode("708*62=", add_special_tokens=False),
    ]
    sample(r, rec, "[calculator 708*62]")
    history = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {}}]},
        {"role": "tool", "tool_call_id": "x", "content": "43896"},
    ]
    text = r.chat(history, TOOLS, rec.given)
    assert text == "708*62=[calculator 708*62] = 43896\n"
    new, drifted = r.extend(rec, text)
    assert not drifted and new == tokenizer.encode(" = 43896\n", add_special_tokens=False)
    rec.observe(new, " = 43896\n")
    assert rec.sampled == [1] * 19 + [0] * len(new)
    assert rec.versions == [3] * 19 + [-1] * len(new)


def test_sampled_tokens_are_kept_even_where_their_text_tokenizes_otherwise(tokenizer: Any) -> None:
    """The generator's ids for a turn stand whatever the text would tokenize to: a later call
    whose rendering matches the recording's text (not its ids) extends it with only the new
    text's ids, and the odd sampled ids stay."""
    r = Renderer(tokenizer, "bracket", " = {text}\n", plain=True)
    rec = Recording()
    r.extend(rec, r.chat([{"role": "user", "content": "2*3="}], None, rec.given))
    odd = [*tokenizer.encode("6", add_special_tokens=False), tokenizer.eos_token_id]
    rec.sample(odd, [-0.1] * len(odd), 1, "6")
    rec.given.append(Given(raw="6", full=r.decode(odd), call_ids=[]))
    more = [
        {"role": "user", "content": "2*3="},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "4*5="},
    ]
    new, drifted = r.extend(rec, r.chat(more, None, rec.given))
    assert not drifted
    assert rec.ids == odd  # the EOS the model sampled stays where it was
    assert r.decode(new) == "\n4*5="


def test_an_edited_history_is_a_drift_and_the_recording_starts_over(tokenizer: Any) -> None:
    r = Renderer(tokenizer, "bracket", " = {text}\n", plain=True)
    rec = Recording()
    r.extend(rec, r.chat([{"role": "user", "content": "2*3="}], None, rec.given))
    sample(r, rec, "7")
    edited = [{"role": "user", "content": "2*4="}, {"role": "assistant", "content": "7"}]
    edited.append({"role": "user", "content": "again"})
    new, drifted = r.extend(rec, r.chat(edited, None, rec.given))
    assert drifted and new == [] and rec.drift == 1
    assert rec.ids == [] and r.decode(rec.start) == r.decode(r.encode("2*4=7\nagain", True))


def test_a_chat_template_renders_tool_results_as_hermes_responses(tokenizer: Any) -> None:
    """With a ChatML template: the endpoint's own turns are rendered as sampled (the call as
    the model wrote it, not the client's tool_calls), tool results as one <tool_response> user
    turn; the recording's text is the rendering's prefix, so only the rest is appended."""
    tiny = tokenizer.chat_template  # "role: content" lines
    tokenizer.chat_template = CHATML
    try:
        r = Renderer(tokenizer, "hermes")
        assert r.templated
        rec = Recording()
        first = [{"role": "system", "content": "calc"}, {"role": "user", "content": "2*3?"}]
        r.extend(rec, r.chat(first, TOOLS, rec.given))
        assert r.decode(rec.start) == (
            "<|im_start|>system\ncalc<|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
        sample(r, rec, call)
        content, calls = r.tool_calls(call, "call_7", TOOLS)
        assert content is None and calls[0]["id"] == "call_7_0"
        assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2*3"}
        history = [
            *first,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_7_0", "content": "6"},
            {"role": "tool", "tool_call_id": "call_7_1", "content": "7"},
        ]
        new, drifted = r.extend(rec, r.chat(history, TOOLS, rec.given))
        assert not drifted
        assert r.decode(new) == (
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n"
            "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
    finally:
        tokenizer.chat_template = tiny


def test_calls_parse_into_openai_tool_calls_and_bad_ones_stay_text(tokenizer: Any) -> None:
    bracket = Renderer(tokenizer, "bracket")
    content, calls = bracket.tool_calls("Let me see [calculator 12*34]", "c", TOOLS)
    assert content == "Let me see"
    assert calls == [
        {
            "id": "c_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "12*34"})},
        }
    ]
    assert bracket.tool_calls("408", "c", TOOLS) == ("408", [])
    hermes = Renderer(tokenizer, "hermes")
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes.tool_calls(broken, "c", TOOLS) == (broken, [])
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    assert [c["function"]["name"] for c in hermes.tool_calls(two, "c", None)[1]] == ["a", "b"]
    # an agent's own few-shot call is written as the model would write it
    assert call_text("bracket", "calculator", '{"expression": "1+1"}') == "[calculator 1+1]"


def test_bad_messages_are_refused_by_field(tokenizer: Any) -> None:
    r = Renderer(tokenizer, "bracket", plain=True)
    with pytest.raises(BadRequest, match="messages must be a non-empty list"):
        r.chat([], None, [])
    with pytest.raises(BadRequest, match=r"messages\[1\].role must be"):
        r.chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], None, [])
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(BadRequest, match=r"messages\[0\].content\[0\] is a 'image_url' part"):
        r.chat([{"role": "user", "content": image}], None, [])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert r.chat([{"role": "user", "content": parts}], None, []) == "ab"
