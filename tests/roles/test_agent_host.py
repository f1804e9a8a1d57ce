"""The agents' OpenAI-compatible endpoint with the real ``openai`` SDK (``roles/agents/host.py``):
agents run in their threads and call it over HTTP; this test answers their calls as the
controller would (``exchange``), from a script. Each way an agent can go wrong ends only its own
trajectory, counted; refused requests get OpenAI's error shape, which the SDK raises as its own
errors; streaming, completions and the model list work as the SDK expects; what is recorded is
exactly what was answered."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai
import pytest

from roles.agents.chat import Renderer
from roles.agents.host import AgentHost
from transport.agent import AgentEnd, AgentReply

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SEEN: dict[str, Any] = {}  # what the agents saw, by behaviour


async def agent(client: openai.AsyncOpenAI, row: dict[str, Any]) -> Any:
    """One agent per behaviour named in the row."""
    how = row["how"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    if how == "calculator":  # a plain tool-calling loop
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, logprobs=True
            )
            message = reply.choices[0].message
            SEEN.setdefault("calculator", []).append(reply)
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments)["expression"]
                a, b = expression.split("*")
                result = str(int(a) * int(b))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return {"reward": float(message.content == "408"), "turns_seen": len(messages)}
    if how == "agents_sdk":  # the OpenAI Agents SDK: its Runner, a function_tool
        from agents import (
            Agent,
            OpenAIChatCompletionsModel,
            Runner,
            function_tool,
            set_tracing_disabled,
        )

        set_tracing_disabled(True)  # no trace export to OpenAI's servers

        @function_tool
        def calculator(expression: str) -> str:
            """Multiply two integers written as a*b."""
            a, b = expression.split("*")
            return str(int(a) * int(b))

        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
        found = await Runner.run(Agent(name="calc", model=model, tools=[calculator]), "12*34=")
        SEEN["agents_sdk"] = found.final_output
        return float(found.final_output == "408")
    if how == "stream":
        stream = await client.chat.completions.create(
            model="policy", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        SEEN["stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        SEEN["stream_usage"] = chunks[-1].usage.completion_tokens
        return 0.5
    if how == "completions":
        done = await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
        models = await client.models.list()
        SEEN["completions"] = (done.choices[0].text, [m.id for m in models.data])
        return 0.25
    if how == "refused":  # each refusal is the SDK's own error; the agent carries on
        for bad in (
            {"model": "gpt-4o"},
            {"n": 2},
            {"response_format": {"type": "json_object"}},
            {"top_logprobs": 3},
        ):
            try:
                await client.chat.completions.create(
                    **{"model": "policy", "messages": messages, **bad}
                )
            except openai.APIStatusError as exc:
                SEEN.setdefault("refused", []).append((exc.status_code, exc.body))
        await client.chat.completions.create(model="policy", messages=messages)
        return 1.0
    if how == "raises":
        await client.chat.completions.create(model="policy", messages=messages)
        raise RuntimeError("the agent's own bug")
    if how == "hangs":
        await asyncio.sleep(3600)
    if how == "blocks":  # blocks its thread: no cancellation reaches it
        time.sleep(30)
    if how == "silent":
        return 1.0
    if how == "nan":
        await client.chat.completions.create(model="policy", messages=messages)
        return float("nan")
    raise AssertionError(how)


def answered(tokenizer: Any, text: str, eos: bool) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [*ids, tokenizer.eos_token_id] if eos else ids


@pytest.mark.timeout(120)
def test_agents_call_the_endpoint_with_the_sdk_and_each_fault_ends_only_its_own(
    tokenizer: Any,
) -> None:
    close = tokenizer.encode("]", add_special_tokens=False)[-1]
    eos = tokenizer.eos_token_id
    host = AgentHost(
        agent, Renderer(tokenizer, "bracket", " = {text}\n", plain=True), "policy", 8.0,
        [close, eos], eos, "]",
    )  # fmt: skip
    hows = [
        "calculator",
        "agents_sdk",
        "stream",
        "completions",
        "refused",
        "raises",
        "hangs",
        "blocks",
    ]
    hows += ["silent", "nan"]
    for i, how in enumerate(hows):
        host.start(i, {"prompt": "12*34=", "answer": 408, "how": how})
    # the "generator": a call for the calculator, then the answer; every other call one answer
    call = answered(tokenizer, "[calculator 12*34]", eos=False)
    final = answered(tokenizer, "408", eos=True)
    asked: dict[int, list[list[int]]] = {}
    ends: dict[int, AgentEnd] = {}
    replies: list[AgentReply] = []
    deadline = time.monotonic() + 60
    while len(ends) < len(hows):
        assert time.monotonic() < deadline, f"ended: {sorted(ends)}"
        got = host.exchange(replies, 0.05)
        replies = []
        for ask in got.asks:
            asked.setdefault(ask.session, []).append(ask.prompt_ids)
            calls = hows[ask.session] in ("calculator", "agents_sdk") and ask.turn == 0
            toks = call if calls else final
            replies.append(
                AgentReply(
                    session=ask.session,
                    ask=ask.ask,
                    tokens=toks,
                    log_probs=[-0.25] * len(toks),
                    text=tokenizer.decode(toks, skip_special_tokens=True),
                    finish="stop",
                    version=7,
                )
            )
        ends.update((e.session, e) for e in got.ends)
    by = {hows[i]: e for i, e in ends.items()}

    # the calculator: its call parsed into tool_calls, the result rendered as the observation,
    # the answer; the recording is the prompt, the sampled ids, the observation, the sampled ids
    calc = by["calculator"]
    assert calc.fault is None and calc.reward == 1.0 and calc.metrics == {"turns_seen": 4.0}
    first, second = SEEN["calculator"]
    tool_call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(tool_call.function.arguments) == {"expression": "12*34"}
    assert [lp.logprob for lp in first.choices[0].logprobs.content] == [-0.25] * len(call)
    assert second.choices[0].message.content == "408"
    observation = tokenizer.encode(" = 408\n", add_special_tokens=False)
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("12*34=", add_special_tokens=False)]
    assert calc.start == prompt and asked[0] == [prompt, prompt + call + observation]
    assert calc.ids == call + observation + final
    assert calc.sampled == [1] * len(call) + [0] * len(observation) + [1] * len(final)
    assert calc.log_probs == [-0.25] * len(call) + [0.0] * len(observation) + [-0.25] * len(final)
    assert calc.turns == 2 and calc.tool_calls == 1 and calc.drift == 0
    assert [k for k, _ in calc.segments] == ["sampled", "observation", "sampled"]

    sdk = by["agents_sdk"]
    assert SEEN["agents_sdk"] == "408" and sdk.fault is None and sdk.reward == 1.0
    assert sdk.turns == 2 and sdk.tool_calls == 1 and sdk.drift == 0
    assert [k for k, _ in sdk.segments] == ["sampled", "observation", "sampled"]
    assert SEEN["stream"] == "408" and by["stream"].reward == 0.5
    assert SEEN["stream_usage"] == len(final)
    assert SEEN["completions"] == ("408", ["policy"])
    # refusals: OpenAI's status and error shape, naming the field; no turn was generated for them
    codes = [(status, body["code"], body["param"]) for status, body in SEEN["refused"]]
    assert codes == [
        (404, "model_not_found", "model"),
        (400, "unsupported_parameter", "n"),
        (400, "unsupported_parameter", "response_format"),
        (400, "unsupported_parameter", "top_logprobs"),
    ]
    assert "this run serves 'policy'" in SEEN["refused"][0][1]["message"]
    assert len(asked[hows.index("refused")]) == 1 and by["refused"].reward == 1.0

    faults = {how: (e.fault, e.message) for how, e in by.items() if e.fault}
    assert faults["raises"] == ("raised", "RuntimeError: the agent's own bug")
    assert faults["hangs"][0] == faults["blocks"][0] == "timeout"
    assert "agent_timeout_s" in faults["blocks"][1]
    assert faults["silent"][0] == "no_call"
    assert faults["nan"][0] == "bad_return" and "finite number" in faults["nan"][1]
    assert set(faults) == {"raises", "hangs", "blocks", "silent", "nan"}
    # a faulty trajectory trains nothing: its sampled tokens are unmarked, its reward 0
    assert by["raises"].ids and not any(by["raises"].sampled) and by["raises"].reward == 0
    assert host.close(list(range(len(hows)))) == len(hows)
    host.shutdown()
