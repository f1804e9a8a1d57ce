"""A calculator agent written against the OpenAI API: a plain tool-calling loop with the
``openai`` SDK, nothing of hybridflow in it. ``examples/agents/tool_use.yaml`` trains the model it
calls; pointed at any OpenAI-compatible server it runs the same.

    async def run(client, row) -> float       the reward: 1.0 for the right product, else 0.0
    async def run_chat(client, row) -> float  the same with a system message, for chat models
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as 708*62.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MODEL = "policy"
SYSTEM = "You are a helpful assistant. You can use a calculator."
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """+, - and * on integers (the agent's own tool: never eval)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot compute {ast.unparse(node)!r}")

    return str(value(ast.parse(expression, mode="eval").body))


async def run(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """The question as the only message (the tiny model reads raw text: ``708*62=``)."""
    return await solve(client, [{"role": "user", "content": row["prompt"]}], row["answer"])


async def run_chat(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """A chat model's conversation: a system message, then the question."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    return await solve(client, messages, row["answer"])


async def solve(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], answer: Any) -> float:
    for _ in range(3):
        try:
            reply = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS
            )
        except openai.BadRequestError:  # the conversation outgrew the context: no answer
            return 0.0
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as exc:  # the model's call was wrong: it reads why
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    words = (message.content or "").split()
    return 1.0 if words and words[0] == str(answer) else 0.0
