"""verifiers environments as agents (``roles/agents/verifiers_env.py``): the example's
``vf.ToolEnv`` and ``vf.SingleTurnEnv`` (``examples/agents/verifiers_env.py``) run their own
rollouts against the env role's OpenAI-compatible endpoint through verifiers' own client; this
test answers their calls as the controller would, from a script. The model's bracket call reaches
verifiers as ``tool_calls``, verifiers runs the tool, its result is recorded as the observation,
and the rubric's reward and metrics are the trajectory's. A conversation the run cannot extend is
a truncated rollout scored by the rubric (verifiers reads the refusal as a context overflow), and
so is an empty answer; another refused call ends the trajectory as a counted fault, not a silent
zero."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from controller.agent import context_full
from roles.agents.chat import Renderer
from roles.agents.host import AgentHost
from roles.agents.verifiers_env import VerifiersAgent, load_verifiers
from tests.roles.test_agent_host import answered as ids
from transport.agent import AgentEnd, AgentReply

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
PATH = "verifiers_env:load_environment"


@pytest.mark.timeout(120)
def test_a_tool_and_a_single_turn_environment_run_through_the_endpoint(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    agents = {
        kind: VerifiersAgent(load_verifiers(PATH, {"kind": kind}), "policy")
        for kind in ("tool", "single")
    }

    async def by_kind(client: Any, row: dict[str, Any]) -> Any:
        return await agents[row["kind"]](client, row)

    close, eos = tokenizer.encode("]", add_special_tokens=False)[-1], tokenizer.eos_token_id
    host = AgentHost(
        by_kind, Renderer(tokenizer, "bracket", " = {text}\n", plain=True), "policy", 20.0,
        [close, eos], eos, "]",
    )  # fmt: skip
    # what each session's "model" does: a call then an answer, an answer, or a refusal
    plans = [
        ("tool", "right"),
        ("tool", "wrong"),
        ("single", "right"),
        ("tool", "full"),
        ("tool", "refused"),
        ("single", "empty"),
    ]
    for i, (kind, _) in enumerate(plans):
        host.start(i, {"prompt": "12*34=", "answer": "408", "kind": kind})
    call, right, wrong = (
        ids(tokenizer, "[calculator 12*34]", False),
        ids(tokenizer, "408", True),
        ids(tokenizer, "407", True),
    )
    asked: dict[int, list[list[int]]] = {}
    ends: dict[int, AgentEnd] = {}
    replies: list[AgentReply] = []
    deadline = time.monotonic() + 60
    while len(ends) < len(plans):
        assert time.monotonic() < deadline, f"ended: {sorted(ends)}"
        got = host.exchange(replies, 0.05)
        replies = []
        for ask in got.asks:
            asked.setdefault(ask.session, []).append(ask.prompt_ids)
            kind, plan = plans[ask.session]
            if plan in ("full", "refused") and ask.turn == 1:
                message = context_full(24, len(ask.prompt_ids)) if plan == "full" else "no"
                replies.append(
                    AgentReply(session=ask.session, ask=ask.ask, error=message, param="messages")
                )
                continue
            toks = call if kind == "tool" and ask.turn == 0 else wrong if plan == "wrong" else right
            toks = [eos] if plan == "empty" else toks
            replies.append(
                AgentReply(
                    session=ask.session,
                    ask=ask.ask,
                    tokens=toks,
                    log_probs=[-0.5] * len(toks),
                    text=tokenizer.decode(toks, skip_special_tokens=True),
                    finish="stop",
                    version=3,
                )
            )
        ends.update((e.session, e) for e in got.ends)

    # the tool environment: the call parsed into tool_calls, verifiers ran the calculator, its
    # result is the observation, the answer is scored by the rubric
    tool = ends[0]
    assert tool.fault is None and tool.reward == 1.0, (tool.fault, tool.message)
    assert tool.metrics == {
        "vf/exact_answer": 1.0,
        "vf/num_turns": 2.0,
        "vf/total_tool_calls": 1.0,
        "vf/calculator_calls": 1.0,
    }
    observation = ids(tokenizer, " = 408\n", False)
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("12*34=", add_special_tokens=False)]
    assert tool.start == prompt and asked[0] == [prompt, prompt + call + observation]
    assert tool.ids == call + observation + right
    assert tool.sampled == [1] * len(call) + [0] * len(observation) + [1] * len(right)
    assert tool.turns == 2 and tool.tool_calls == 1 and tool.drift == 0
    assert ends[1].fault is None and ends[1].reward == 0.0  # the rubric's zero
    single = ends[2]  # one turn, no tools offered
    assert single.fault is None and single.reward == 1.0 and single.turns == 1
    assert single.metrics == {"vf/exact_answer": 1.0, "vf/num_turns": 1.0}
    # a full context: verifiers ends the rollout truncated and the rubric scores what is there
    assert ends[3].fault is None and ends[3].reward == 0.0 and ends[3].turns == 1
    # any other refusal: a counted fault naming verifiers' error
    assert ends[4].fault == "raised" and "the verifiers rollout failed" in ends[4].message
    # an empty answer (verifiers' EmptyModelResponseError) is the model's: scored, no fault
    assert ends[5].fault is None and ends[5].reward == 0.0 and ends[5].ids == [eos]
    assert host.close(list(range(len(plans)))) == len(plans)
    host.shutdown()


def test_a_bad_environment_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    with pytest.raises(ValueError, match="kind 'nope': use 'single' or 'tool'"):
        load_verifiers(PATH, {"kind": "nope"})
    with pytest.raises(ValueError, match="unexpected keyword argument 'turns'"):
        load_verifiers(PATH, {"turns": 3})
    with pytest.raises(ValueError, match=r"returned a dict, not a vf\.Environment"):
        load_verifiers("json:loads", {"s": "{}"})
    assert load_verifiers(PATH, {"kind": "nope"}, build=False) is None  # checked, not built
