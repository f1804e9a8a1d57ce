"""The env role: the tools or the environment of multi-turn rollouts, in a group of their own.

A multi-turn rollout (``controller/agent.py``) runs one coroutine per trajectory: it generates a
turn, hands the turn's text to this role, appends the observation tokens it gets back, and
generates the next turn. The role owns everything that needs the tokenizer or user code, so a
slow, hanging or crashing tool never blocks the controller's loop or a rank's generation:

* ``spec()``: what ends a turn (the model's EOS, the call format's close tag), the tools' schemas;
* ``open(sessions)``: a session per trajectory, and its start: the row's prompt tokenized as the
  generation engines do, then (an environment is built and ``reset(row)`` for each) the first
  observation, the text reset returned, tokenized as it is (no template);
* ``submit(actions)``: returns at once; each action runs on a worker thread (``workers`` at once),
  under ``call_timeout_s``;
* ``collect(wait_s)``: the actions finished since the last collect (waiting up to ``wait_s`` for
  the first), each an ``EnvResult`` with the observation's token ids;
* ``close(sessions)``: drops sessions (and calls an environment's ``close()``).

Config (``EnvConfig``): either ``tools``, import paths of functions (``roles/tools/``: a tool is a
typed function with a docstring), or ``environment``, the import path of a class with
``reset(row) -> str`` and ``step(text) -> (observation, reward, done, info)`` (``info`` is not
sent on); ``tokenizer``, the actor's model folder; ``format``, how the model writes a call
(``roles/tools/calls.py``); ``observation``, the template a result's text is wrapped in (by
default the format's for tools; an environment's observations are used as it writes them).

Nothing a tool or environment does escapes as an exception: it comes back as an observation the
model sees, with ``error`` naming what happened (``raised``, ``timeout``, ``not_text``,
``malformed``, ``unknown_tool``, ``sandbox_killed``, ``env``). A tool that runs past
``call_timeout_s`` gets its timeout observation at the deadline; its thread is left to finish and
its result is dropped. An environment whose reset or step failed or timed out ends its trajectory
(``done``): its state is unknown. Misuse by the controller (an unknown session, a second action
for a session whose first is still out) fails the call instead.

The group runs at nproc 1: sessions live in one process. Endpoints run one at a time on the
rank's main thread, so a ``collect`` that waits holds back the next ``submit`` until it returns:
collect with a short ``wait_s``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import inspect
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from threading import Lock
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from roles.base import Role, RoleContext
from roles.engines.generation.serve import prompt_ids
from roles.modeling.models import load_tokenizer
from roles.runtime.endpoint import RANK_ZERO, endpoint
from roles.tools import sandbox
from roles.tools.calls import CLOSE, EXAMPLES, OBSERVATIONS, Format, MalformedCall, parse_call
from roles.tools.failures import ToolFailure
from roles.tools.runner import Outbox, Runner
from roles.tools.schema import BadArguments, Tool, describe
from transport.agent import (
    AgentExchange,
    AgentReply,
    EnvAction,
    EnvOpen,
    EnvResult,
    EnvSpec,
    ErrorKind,
)
from transport.batch import TensorBatch
from transport.columns import PROMPT, PROMPT_IDS
from transport.imports import import_path
from transport.structs import reasons

if TYPE_CHECKING:
    from roles.agents.host import AgentHost

log = logging.getLogger(__name__)

SEARCH_TOOL = "roles.tools.search"
NOTE_ROOM = 80  # characters kept free for a "[... N more ... cut]" note


class EnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=list, description="tool functions by import path (package.module:fn)"
    )
    environment: str | None = Field(
        None, description="an environment class by import path (package.module:Class)"
    )
    agent: str | None = Field(
        None,
        description="an agent function by import path (package.module:run): async def run("
        "client: openai.AsyncOpenAI, row: dict) -> float | dict, run once per trajectory against "
        "this role's OpenAI-compatible endpoint (docs/agents.md)",
    )
    verifiers: str | None = Field(
        None,
        description="a verifiers environment by the import path of the function that builds it "
        "(package.module:load_environment), run as the agent: its rollout through this role's "
        "OpenAI-compatible endpoint, its rubric's reward as the reward (docs/agents.md)",
    )
    verifiers_args: dict[str, Any] = Field(
        default_factory=dict, description="verifiers: keyword arguments of load_environment"
    )
    agent_timeout_s: float = Field(
        300.0, gt=0, description="agent: the longest one trajectory's agent may run, seconds"
    )
    agent_chat: Literal["template", "plain"] = Field(
        "template",
        description="agent: how messages become tokens. template: the model's chat template "
        "(plain where it has none); plain: the contents one after another, a tool result in "
        "the observation template (for a model trained on raw text, such as the tiny one)",
    )
    agent_model: str = Field(
        "policy", min_length=1, description="agent: the model name the endpoint serves"
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments the environment class is built with"
    )
    tokenizer: str = Field(
        description="a model folder whose tokenizer the env uses; hybridflow run fills in the "
        "actor's"
    )
    format: Format = Field("hermes", description="how the model writes a tool call")
    observation: str | None = Field(
        None,
        description="template a result's text is wrapped in before tokenizing, with {text}; "
        "default: tools, per format (roles/tools/calls.py OBSERVATIONS); an environment, {text}",
    )
    call_timeout_s: float = Field(10.0, gt=0, description="time limit of one action, seconds")
    workers: int = Field(8, ge=1, description="actions that run at once")
    max_observation_chars: int = Field(
        4000, ge=100, description="longer results are cut to this, saying so in the text"
    )
    sandbox_memory_mb: int = Field(
        512,
        ge=32,
        description="python tool: memory limit, of each process's address space and, where a "
        "cgroup can be made, of all of a call's processes together",
    )
    sandbox_network: bool = Field(False, description="python tool: allow network access")
    sandbox_allow_weak: bool = Field(
        False,
        description="python tool: run even where the kernel cannot isolate it (no namespaces, "
        "Landlock or seccomp, or no uid of its own when not root); unprotected there, so off "
        "unless you accept that",
    )
    sandbox_timeout_s: float | None = Field(
        None, gt=0, description="python tool: wall-clock limit (default 0.9 x call_timeout_s)"
    )
    sandbox_processes: int = Field(
        64, ge=4, description="python tool: processes and threads of one call, in all"
    )
    sandbox_uid_base: int = Field(
        2_000_000_000,
        ge=65536,
        le=2**32 - 2 - (1 << 30),
        description="python tool: the first of the uids calls run as (as root); a range no "
        "account on the host uses, mapped in the role's user namespace",
    )
    search_documents: str | None = Field(
        None, description="search tool: a folder of .txt files or a JSONL file"
    )
    search_top_k: int = Field(3, ge=1, description="search tool: documents per answer")
    session_idle_s: float = Field(
        1800.0,
        gt=0,
        description="a session with no action for this long is closed when sessions are next "
        "opened (a controller that failed or died mid-rollout leaves none open for good)",
    )

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        given = [k for k in ("tools", "environment", "agent", "verifiers") if getattr(self, k)]
        if len(given) != 1:
            has = " and ".join(given) if given else "none of them"
            raise ValueError(
                f"an env role needs one of 'tools' (import paths package.module:function), "
                f"'environment' (package.module:Class), 'agent' (package.module:run) or "
                f"'verifiers' (package.module:load_environment), and has {has}"
            )
        if self.environment_args and self.environment is None:
            raise ValueError("'environment_args' is set but there is no 'environment'")
        if self.verifiers_args and self.verifiers is None:
            raise ValueError("'verifiers_args' is set but there is no 'verifiers'")
        if self.observation is not None and "{text}" not in self.observation:
            raise ValueError(
                f"'observation' {self.observation!r} has no {{text}}; it is the template the "
                "result's text is written into"
            )
        wants_search = any(p.partition(":")[0] == SEARCH_TOOL for p in self.tools)
        if wants_search != (self.search_documents is not None):
            raise ValueError(
                "the search tool needs search_documents (a folder of .txt files or a JSONL file)"
                if wants_search
                else f"search_documents is set but {SEARCH_TOOL}:search is not among the tools"
            )
        if self.sandbox_timeout_s is not None and self.sandbox_timeout_s >= self.call_timeout_s:
            raise ValueError(
                f"sandbox_timeout_s={self.sandbox_timeout_s:g} must be below call_timeout_s="
                f"{self.call_timeout_s:g}, so the sandbox stops the code and reports it first"
            )
        return self

    @property
    def agents(self) -> bool:
        """Trajectories are agents calling the endpoint: an ``agent`` or a ``verifiers``
        environment."""
        return self.agent is not None or self.verifiers is not None

    @property
    def template(self) -> str:
        """The observation template: as set; by default the format's for tools, and the text as
        it is for an environment (which writes its own observations)."""
        if self.observation is not None:
            return self.observation
        return "{text}" if self.environment is not None else OBSERVATIONS[self.format]


class SessionError(ValueError):
    """The controller named a session this role cannot act on (the message says why)."""


@dataclass(eq=False)
class Session:
    id: int
    env: Any = None  # the environment instance (tools: None)
    busy: bool = False  # an action is out
    done: bool = False
    touched: float = field(default_factory=time.monotonic)  # opened, or its last action's end


def load_config(config: dict[str, Any]) -> EnvConfig:
    try:
        return EnvConfig.model_validate(config)
    except ValidationError as exc:
        raise ValueError(f"bad env role config: {reasons(exc)}") from None


def load_tools(cfg: EnvConfig) -> dict[str, Tool]:
    """The tools of ``cfg``, by name, each checked against the call format."""
    tools: dict[str, Tool] = {}
    for path in cfg.tools:
        tool = describe(import_path(path, "tool", "function", callable), path)
        if tool.name in tools:
            raise ValueError(
                f"tools {tools[tool.name].path} and {path} share the name {tool.name!r}"
            )
        if cfg.format == "bracket" and len(tool.required) > 1:
            raise ValueError(
                f"tool {path} has required parameters {list(tool.required)}; the bracket format "
                "passes one argument, so give the others defaults or use format 'hermes'"
            )
        tools[tool.name] = tool
    return tools


def load_agent(cfg: EnvConfig, build: bool = True) -> Any:
    """The agent function of ``cfg``: its ``agent`` (``async def run(client, row)``), or its
    ``verifiers`` environment built and run as one (``build=False``: its function only
    imported, nothing of the user's run: the check before any process starts); the agents' own
    packages (the [agents] extra) checked; a ValueError saying what is missing or wrong."""
    path = cfg.agent or cfg.verifiers
    for package in ("openai", "aiohttp"):
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"agent {path!r} needs the {package!r} package: pip install 'hybridflow[agents]'"
            )
    if cfg.verifiers is not None:
        from roles.agents.verifiers_env import VerifiersAgent, load_verifiers

        env = load_verifiers(cfg.verifiers, cfg.verifiers_args, build)
        return VerifiersAgent(env, cfg.agent_model) if build else None
    return import_path(str(path), "agent", "async function", inspect.iscoroutinefunction)


def load_environment(path: str) -> type:
    found: type = import_path(path, "environment", "class", lambda c: isinstance(c, type))
    missing = [m for m in ("reset", "step") if not callable(getattr(found, m, None))]
    if missing:
        raise ValueError(
            f"environment {path} has no {' or '.join(missing)} method; an environment has "
            "reset(row) -> str and step(text) -> (observation, reward, done, info)"
        )
    return found


def as_text(value: object) -> str | None:
    """A tool's result as text: a string as it is, a number printed; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return str(value)
        except ValueError:  # an int past Python's digit limit for str (10**5000)
            return None
    return None


class EnvRole(Role):
    """Hosts tools or an environment; one session per trajectory."""

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx)
        if ctx.world_size != 1:
            raise ValueError(
                f"the env role keeps its sessions in one process; place it in a group of nproc 1 "
                f"(this group has {ctx.world_size})"
            )
        self.cfg = load_config(config)
        self.tokenizer = load_tokenizer(self.cfg.tokenizer)
        self._configure_builtins()
        self.tools = load_tools(self.cfg)
        if any(tool.fn is sandbox.python for tool in self.tools.values()):
            found = sandbox.current().check()  # refuses here where the kernel cannot isolate
            if found["weak"]:
                log.warning(
                    "the python tool runs WITHOUT %s (sandbox_allow_weak): model output it runs "
                    "is not contained there; reads are not restricted without files. %s",
                    ", ".join(found["weak"]),
                    found,
                )
            else:
                log.info("the python tool's sandbox here: %s", found)
        self.env_cls = load_environment(self.cfg.environment) if self.cfg.environment else None
        self._spec = self._make_spec()
        self.agents: AgentHost | None = None
        if self.cfg.agents:  # aiohttp and openai: the [agents] extra, only here
            from roles.agents.chat import Renderer
            from roles.agents.host import AgentHost

            fn = load_agent(self.cfg)
            self.agents = AgentHost(
                fn,
                Renderer(
                    self.tokenizer,
                    self.cfg.format,
                    self.cfg.observation,
                    plain=self.cfg.agent_chat == "plain",
                ),
                self.cfg.agent_model,
                self.cfg.agent_timeout_s,
                [*self._spec.call_stop_token_ids, self._spec.eos_token_id],
                self._spec.eos_token_id,
                self._spec.call_close,
            )
            log.info("agents call the OpenAI-compatible endpoint at %s", self.agents.url(0))
        self.runner = Runner(self.cfg.workers, self.cfg.call_timeout_s, name=f"{ctx.role}")
        self.outbox: Outbox[tuple[Session, EnvResult]] = Outbox()
        self.sessions: dict[int, Session] = {}
        self._lock = Lock()  # sessions, their flags and the outbox's order
        self._tokenizer_lock = Lock()  # a fast tokenizer is not safe to call from two threads

    def _configure_builtins(self) -> None:
        cfg = self.cfg
        timeout = cfg.sandbox_timeout_s or 0.9 * cfg.call_timeout_s
        sandbox.configure(
            sandbox.SandboxSettings(
                memory_mb=cfg.sandbox_memory_mb,
                timeout_s=timeout,
                network=cfg.sandbox_network,
                allow_weak=cfg.sandbox_allow_weak,
                processes=cfg.sandbox_processes,
                uid_base=cfg.sandbox_uid_base,
                # room for the sandbox's own note on what it cut, within the observation's limit
                output_chars=cfg.max_observation_chars - NOTE_ROOM,
            )
        )
        if cfg.search_documents is not None:
            from roles.tools import search  # bm25s: only for groups that search

            search.configure(cfg.search_documents, cfg.search_top_k)

    def _make_spec(self) -> EnvSpec:
        close = CLOSE[self.cfg.format]
        ids = self.tokenizer.encode(close, add_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        if not ids or eos is None:
            raise ValueError(
                f"the tokenizer of {self.cfg.tokenizer} has no end-of-sequence token or cannot "
                f"encode the close tag {close!r}"
            )
        return EnvSpec(
            eos_token_id=int(eos),
            call_stop_token_ids=[int(ids[-1])],
            call_close=close,
            tools=[tool.schema() for tool in self.tools.values()],
            format=self.cfg.format,
            stateful=self.env_cls is not None,
            agent=self.cfg.agents,
        )

    # -- endpoints --------------------------------------------------------------------------------

    @endpoint(RANK_ZERO)
    def spec(self) -> EnvSpec:
        """What ends a turn, the tools' schemas, the call format."""
        return self._spec

    @endpoint(RANK_ZERO)
    def open(self, sessions: list[EnvOpen]) -> list[EnvResult]:
        """A session per trajectory. Each result's ``observation_ids`` is the trajectory's start:
        its row's prompt as the generation engines tokenize it, then an environment's first
        observation (its ``observation``, the text reset returned; tools: none)."""
        self._expire()
        with self._lock:
            ids = [s.session for s in sessions]
            taken = sorted({i for i in ids if i in self.sessions or ids.count(i) > 1})
            if taken:
                raise SessionError(f"sessions {taken} are open already (or named twice)")
        if self.agents is not None:  # each agent starts now and renders its own prompt
            with self._lock:
                self.sessions.update({i: Session(i) for i in ids})
            for s in sessions:
                self.agents.start(s.session, s.row)
            return [EnvResult(session=i) for i in ids]
        starts = [self._start(s.row) for s in sessions]
        if self.env_cls is None:
            with self._lock:
                self.sessions.update({i: Session(i) for i in ids})
            return [
                EnvResult(session=i, observation_ids=s) for i, s in zip(ids, starts, strict=True)
            ]
        rounds = math.ceil((self.runner.load + len(sessions)) / self.cfg.workers) + 1
        futures = [
            self.runner.start(partial(self._reset, o), partial(self._late_reset, o))
            for o in sessions
        ]
        done, _ = concurrent.futures.wait(futures, timeout=rounds * self.cfg.call_timeout_s + 5)
        if len(done) < len(futures):  # cannot happen: every piece is settled by its deadline
            raise RuntimeError(f"{len(futures) - len(done)} resets were never settled")
        opened = [f.result() for f in futures]
        with self._lock:
            for result, env in opened:
                self.sessions[result.session] = Session(result.session, env, done=result.done)
        return [
            result.model_copy(update={"observation_ids": start + result.observation_ids})
            for (result, _), start in zip(opened, starts, strict=True)
        ]

    @endpoint(RANK_ZERO)
    def submit(self, actions: list[EnvAction]) -> int:
        """Start each action on a worker and return at once (how many were accepted)."""
        with self._lock:
            targets = self._check_actions(actions)
            for session in targets:
                session.busy = True
        work = self._step if self.env_cls is not None else self._call_tool
        for session, action in zip(targets, actions, strict=True):
            future = self.runner.start(
                partial(work, session, action), partial(self._late_action, session, action)
            )
            future.add_done_callback(partial(self._finished, session))
        return len(actions)

    @endpoint(RANK_ZERO)
    def collect(self, wait_s: float) -> list[EnvResult]:
        """The actions finished since the last collect; waits up to ``wait_s`` for the first."""
        if not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s} must be >= 0")
        finished = self.outbox.take(wait_s)
        with self._lock:
            return [r for s, r in finished if self.sessions.get(s.id) is s]

    @endpoint(RANK_ZERO)
    def exchange(self, replies: list[AgentReply], wait_s: float) -> AgentExchange:
        """Agent mode: hand the controller's replies to the agents' model calls; return the
        calls waiting and the agents finished (waiting up to ``wait_s`` for the first)."""
        if self.agents is None:
            raise SessionError("exchange is for agents; this env role has no 'agent'")
        if not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s} must be >= 0")
        with self._lock:
            unknown = sorted({r.session for r in replies if r.session not in self.sessions})
        if unknown:  # e.g. a restarted group: its sessions died with the last incarnation
            raise SessionError(f"replies to sessions that are not open: {unknown[:8]}")
        return self.agents.exchange(replies, wait_s)

    @endpoint(RANK_ZERO)
    def close(self, sessions: list[int]) -> int:
        """Drop sessions (an action still out is dropped too); how many were open."""
        if self.agents is not None:
            self.agents.close(sessions)
        with self._lock:
            closed = [self.sessions.pop(i) for i in dict.fromkeys(sessions) if i in self.sessions]
        for session in closed:
            if callable(getattr(session.env, "close", None)):
                self.runner.start(
                    partial(self._close_env, session), partial(self._late_close, session)
                )
        return len(closed)

    # -- sessions -------------------------------------------------------------------------------

    def _expire(self) -> None:
        """Close the sessions idle past ``session_idle_s`` (none with an action out)."""
        oldest = time.monotonic() - self.cfg.session_idle_s
        with self._lock:
            stale = [i for i, s in self.sessions.items() if not s.busy and s.touched < oldest]
        if stale:
            log.warning(
                "closing %d sessions idle for over %g s (session_idle_s): %s",
                len(stale),
                self.cfg.session_idle_s,
                stale[:8],
            )
            self.close(stale)

    def _start(self, row: dict[str, Any]) -> list[int]:
        """The row's prompt (``prompt`` text or ``prompt_ids``) as the generation engines read
        it (``roles/engines/generation/serve.py``); none when the row has neither."""
        given = {k: [row[k]] for k in (PROMPT, PROMPT_IDS) if row.get(k) is not None}
        if not given:
            return []
        with self._tokenizer_lock:
            return prompt_ids(TensorBatch.from_dict(non_tensors=given), self.tokenizer)[0]

    def _check_actions(self, actions: list[EnvAction]) -> list[Session]:
        targets, problems, seen = [], [], set()
        for action in actions:
            session = self.sessions.get(action.session)
            if session is None:
                problems.append(f"session {action.session} is not open")
            elif session.busy or action.session in seen:
                problems.append(
                    f"session {action.session} has an action out; collect its result first"
                )
            elif session.done:
                problems.append(f"session {action.session} is done; open a new session")
            seen.add(action.session)
            targets.append(session)
        if problems:
            raise SessionError("; ".join(problems))
        return [s for s in targets if s is not None]

    def _finished(self, session: Session, future: Future[EnvResult]) -> None:
        try:
            result = future.result()
        except Exception as exc:  # this role's own bug: the log has it, the model a short note
            log.exception("env action of session %d failed inside the env role", session.id)
            text = f"error: the env role failed: {exc}"
            if self.env_cls is not None:  # an environment's state is now unknown: it ends
                result = self._observe(session.id, text, time.monotonic(), error="env", done=True)
            else:
                result = self._observe(session.id, text, time.monotonic(), error="raised")
        with self._lock:
            session.busy = False
            session.touched = time.monotonic()
            session.done = session.done or result.done
            if self.sessions.get(session.id) is session:
                self.outbox.put((session, result))

    # -- tools ----------------------------------------------------------------------------------

    def _call_tool(self, session: Session, action: EnvAction) -> EnvResult:
        started = time.monotonic()
        observe = partial(self._observe, session.id, started=started)
        try:
            call = parse_call(self.cfg.format, action.text)
        except MalformedCall as exc:
            example = EXAMPLES[self.cfg.format]
            return observe(f"error: {exc}. Write a call as {example}", error="malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(sorted(self.tools))
            text = f"error: there is no tool {call.name!r}; the tools are: {names}"
            return observe(text, error="unknown_tool")
        called = partial(observe, called=tool.name)
        try:
            value = tool.fn(**tool.arguments(call.arguments))
        except BadArguments as exc:
            return called(f"error: {exc}", error="malformed")
        except ToolFailure as exc:
            return called(f"error: {exc}", error=exc.kind)
        except (Exception, SystemExit) as exc:  # the user's code: the model sees what it raised
            return called(f"error: {tool.name} raised {type(exc).__name__}: {exc}", error="raised")
        shown = as_text(value)
        if shown is None:
            return called(
                f"error: {tool.name} returned a {type(value).__name__}, not text", error="not_text"
            )
        return called(shown)

    def _late_action(self, session: Session, action: EnvAction, seconds: float) -> EnvResult:
        started = time.monotonic() - seconds
        limit = f"{self.cfg.call_timeout_s:g} s (call_timeout_s)"
        if self.env_cls is not None:
            text = f"error: the environment's step did not finish within {limit}"
            return self._observe(session.id, text, started, error="timeout", done=True)
        try:
            name: str | None = parse_call(self.cfg.format, action.text).name
        except MalformedCall:
            name = None
        called = name if name in self.tools else None
        text = f"error: {called or 'the tool'} did not finish within {limit} and was abandoned"
        return self._observe(session.id, text, started, error="timeout", called=called)

    # -- environments ---------------------------------------------------------------------------

    def _reset(self, opening: EnvOpen) -> tuple[EnvResult, Any]:
        started = time.monotonic()
        assert self.env_cls is not None
        try:
            env = self.env_cls(**self.cfg.environment_args)
            text = as_text(env.reset(dict(opening.row)))
        except (Exception, SystemExit) as exc:
            return self._env_failed(opening.session, "reset", exc, started), None
        if text is None:
            failed = TypeError("reset returned no text")
            return self._env_failed(opening.session, "reset", failed, started), None
        return self._observe(opening.session, text, started, template=False), env

    def _late_reset(self, opening: EnvOpen, seconds: float) -> tuple[EnvResult, Any]:
        limit = f"{self.cfg.call_timeout_s:g} s (call_timeout_s)"
        text = f"error: the environment's reset did not finish within {limit}"
        started = time.monotonic() - seconds
        return self._observe(opening.session, text, started, error="timeout", done=True), None

    def _step(self, session: Session, action: EnvAction) -> EnvResult:
        started = time.monotonic()
        try:
            out = session.env.step(action.text)
            text, reward, done = _step_result(out)
        except (Exception, SystemExit) as exc:
            return self._env_failed(session.id, "step", exc, started)
        return self._observe(session.id, text, started, reward=reward, done=done)

    def _env_failed(self, session: int, what: str, exc: BaseException, started: float) -> EnvResult:
        text = f"error: the environment's {what} raised {type(exc).__name__}: {exc}"
        return self._observe(session, text, started, error="env", done=True)

    def _close_env(self, session: Session) -> None:
        try:
            session.env.close()
        except Exception:  # the user's code; the session is gone either way
            log.warning("closing the environment of session %d raised", session.id, exc_info=True)

    def _late_close(self, session: Session, seconds: float) -> None:
        log.warning(
            "closing the environment of session %d did not finish within %g s (call_timeout_s)",
            session.id,
            seconds,
        )

    # -- observations ---------------------------------------------------------------------------

    def _observe(
        self,
        session: int,
        text: str,
        started: float,
        *,
        error: ErrorKind | None = None,
        called: str | None = None,
        reward: float | None = None,
        done: bool = False,
        template: bool = True,
    ) -> EnvResult:
        """The result the controller gets: ``text`` cut to ``max_observation_chars``, written into
        the template and tokenized (a finished trajectory with no text gets no tokens)."""
        limit = self.cfg.max_observation_chars
        if len(text) > limit:
            text = f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"
        ids = self._encode(text) if text else []
        if template and (text or not done):
            before, after = self.cfg.template.split("{text}", 1)
            ids = self._encode(before, trusted=True) + ids + self._encode(after, trusted=True)
            text = f"{before}{text}{after}"
        return EnvResult(
            session=session,
            observation_ids=ids,
            observation=text,
            reward=reward,
            done=done,
            called=called,
            error=error,
            latency_s=time.monotonic() - started,
        )

    def _encode(self, text: str, trusted: bool = False) -> list[int]:
        """Token ids of ``text``. What a tool or an environment wrote is not trusted: a
        ``</s>`` or ``<|im_end|>`` in it is those characters, never the special token (which
        would end the trajectory or fake a turn); the observation template's own are kept."""
        if not text:
            return []
        with self._tokenizer_lock:
            ids: list[int] = self.tokenizer.encode(
                text, add_special_tokens=False, split_special_tokens=not trusted
            )
        return ids


def _step_result(out: object) -> tuple[str, float | None, bool]:
    """(text, reward, done) of what an environment's step returned; TypeError if it is not
    ``(observation, reward, done, info)``."""
    if not (isinstance(out, tuple) and len(out) == 4):
        raise TypeError(
            f"step returned {type(out).__name__}, not (observation, reward, done, info)"
        )
    observation, reward, done, _ = out
    text = as_text(observation)
    if text is None:
        raise TypeError(f"step's observation is a {type(observation).__name__}, not text")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TypeError(f"step's reward is a {type(reward).__name__}, not a number")
    if reward is not None and not math.isfinite(reward):
        raise ValueError(f"step's reward is {reward}, not a finite number")
    return text, None if reward is None else float(reward), bool(done)
