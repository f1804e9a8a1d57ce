"""What a multi-turn rollout and an environment group say to each other.

A multi-turn rollout (``controller/agent.py``) runs one coroutine per trajectory on the controller:
generate a turn, hand the sampled text to the ``env`` role group (``roles/env.py``), append the
observation tokens it returns, generate the next turn. The env group hosts the user's tools (plain
functions) or environment (``reset`` / ``step``) and owns everything that needs a tokenizer or user
code: parsing the model's tool call, running it under limits, wrapping its result in the
observation template and tokenizing it. The controller only moves token ids and text.

The exchange, all typed structs (``transport/structs.py``):

* ``EnvSpec`` (``env.spec()``): the tokens that end a turn (the model's end of sequence and the
  tool-call close tag's last token), the tools' JSON schemas, the call format;
* ``EnvOpen`` → ``EnvResult`` (``env.open(...)``): a new session per trajectory, from its data row,
  and the trajectory's start as ``observation_ids``: the row's prompt tokenized as the generation
  engines tokenize it, then an environment's first observation (``observation``: its text);
* ``EnvAction`` (``env.submit(...)``): a turn's sampled text (and ids), returned at once; the
  action runs on the group's workers while the group takes more;
* ``EnvResult`` (``env.collect(wait_s)``): the actions finished since the last collect (waiting up to
  ``wait_s`` for the first): the observation's token ids (never re-tokenised by anyone after), the
  environment's reward, whether the trajectory is done, and what went wrong if anything did
  (``error``: ``raised``, ``timeout``, ``not_text``, ``malformed``, ``unknown_tool``,
  ``sandbox_killed``), which the model sees as its observation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: what can go wrong in one action; each is counted in the step's metrics (``tools/errors/<kind>``)
ErrorKind = Literal[
    "raised", "timeout", "not_text", "malformed", "unknown_tool", "sandbox_killed", "env"
]


class EnvSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    eos_token_id: int = Field(description="the model's end of sequence: a final answer")
    call_stop_token_ids: list[int] = Field(
        description="a turn that ends on one of these may hold a tool call (the close tag's last "
        "token); the env decides whether it does"
    )
    call_close: str = Field(
        "",
        description="the text a tool call ends with; a turn stopped on a call stop token "
        "whose text does not end so goes on generating (multi-token close tags)",
    )
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="OpenAI-style schemas of the tools"
    )
    format: str = Field(description="the tool-call format the env parses")
    stateful: bool = Field(False, description="an environment (reset/step), not tools")
    agent: bool = Field(False, description="agent functions calling an OpenAI endpoint")


class EnvOpen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    row: dict[str, Any] = Field(default_factory=dict, description="the trajectory's data row")


class EnvAction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    text: str = Field(description="the turn's sampled text, decoded")
    finish: Literal["stop", "length"] = Field(description="why the turn ended")
    turn: int = Field(ge=0)


class EnvResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    observation_ids: list[int] = Field(
        default_factory=list, description="tokens appended to the trajectory (loss mask 0)"
    )
    observation: str = Field("", description="the observation's text, for logs and viewers")
    reward: float | None = Field(None, description="the environment's reward for this step")
    done: bool = False
    called: str | None = Field(None, description="the tool called, if any")
    error: ErrorKind | None = None
    latency_s: float = Field(0.0, ge=0, description="time the action ran on the env group")


# -- agents written against the OpenAI API (roles/agents/) ------------------------------------------
#
# In agent mode the env group runs the user's agent function, one per trajectory, with an OpenAI
# client whose base_url is the group's own endpoint for that trajectory. Each chat or completion
# call there becomes an ``AgentAsk``; the controller generates the turn on the run's generator and
# answers with an ``AgentReply``; when the agent returns, its ``AgentEnd`` carries the trajectory as
# recorded (the exact ids sampled and those rendered between the turns) and its reward. Both go
# through one call, ``env.exchange(replies, wait_s)``.

#: what can go wrong with an agent; each ends its trajectory, is counted
#: (``agent/faults/<kind>``) and leaves a row without trained tokens
AgentFault = Literal["raised", "timeout", "no_call", "bad_return"]


class AgentAsk(BaseModel):
    """One model call of an agent: the turn to generate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    ask: int = Field(ge=0, description="the call's number within its session")
    prompt_ids: list[int] = Field(description="the whole context: recorded ids, then the new ones")
    turn: int = Field(ge=0, description="the trajectory's turn this call samples")
    part: int = Field(0, ge=0, description="a turn continued after a stop that closed no call")
    max_tokens: int | None = Field(None, description="max_tokens as the agent asked (None: unset)")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, description="the agent's own seed, if it set one")


class AgentReply(BaseModel):
    """The controller's answer to an ``AgentAsk``: the sampled turn, or why there is none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    ask: int = Field(ge=0)
    tokens: list[int] = Field(default_factory=list)
    log_probs: list[float] = Field(default_factory=list)
    text: str = ""
    finish: Literal["stop", "length", ""] = ""
    version: int = 0
    error: str | None = Field(None, description="the request is refused: the OpenAI error message")
    param: str | None = Field(None, description="the request field the error is about")


class AgentEnd(BaseModel):
    """A finished agent: its reward, its trajectory as recorded, what went wrong."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session: int = Field(ge=0)
    reward: float = 0.0
    metrics: dict[str, float] = Field(default_factory=dict, description="the agent's own numbers")
    fault: AgentFault | None = None
    message: str = Field("", description="the fault's error line")
    start: list[int] = Field(default_factory=list, description="the first call's prompt ids")
    ids: list[int] = Field(default_factory=list, description="everything after the start")
    sampled: list[int] = Field(default_factory=list, description="1 per id the model sampled")
    log_probs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    segments: list[list[str]] = Field(
        default_factory=list, description="[kind, text] after the start: sampled or observation"
    )
    turns: int = 0
    tool_calls: int = 0
    drift: int = Field(0, description="calls whose rendered context did not extend the recording")
    finish: str = ""


class AgentExchange(BaseModel):
    """What ``env.exchange`` returns: the model calls waiting, the agents that finished."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    asks: list[AgentAsk] = Field(default_factory=list)
    ends: list[AgentEnd] = Field(default_factory=list)
