"""Agent functions and the OpenAI-compatible endpoint they call, inside the env role's process.

``agent: module:run`` names ``async def run(client: openai.AsyncOpenAI, row: dict) -> float |
dict``. Each trajectory runs it once in a thread of its own (its own event loop), with a client
whose ``base_url`` is this process's endpoint for that trajectory
(``http://127.0.0.1:PORT/s/SESSION/v1``): its calls are the trajectory's turns. The endpoint
(aiohttp, in a thread and event loop of its own) renders each call to token ids
(``roles/agents/chat.py``) and hands it out as an ``AgentAsk``; the controller generates the turn
on the run's generator and answers with an ``AgentReply`` (``exchange``). The agent's return is its
reward (a number, or a dict with ``reward`` and other numbers, its metrics).

What an agent does wrong ends only its trajectory, counted (``AgentFault``): it raised
(``raised``), ran past ``agent_timeout_s`` (``timeout``; an agent that blocks its thread is
abandoned there), returned no usable reward (``bad_return``) or never called the model
(``no_call``). A request the endpoint cannot serve gets OpenAI's error shape, so the agent sees
it as ``openai.BadRequestError`` (or ``NotFoundError`` for a model name the run does not serve).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from roles.agents.chat import BadRequest, Given, Recording, Renderer
from transport.agent import AgentAsk, AgentEnd, AgentExchange, AgentFault, AgentReply

log = logging.getLogger(__name__)

#: request fields the endpoint reads; every other known OpenAI field it refuses by name when set
#: to something other than its default, and unknown ones it ignores as OpenAI does
READ = {
    "model", "messages", "prompt", "tools", "tool_choice", "n", "temperature", "top_p",
    "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "stream",
    "stream_options", "user", "metadata", "store", "parallel_tool_calls", "echo",
}  # fmt: skip
REFUSED = {
    "response_format": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0,
    "functions": None, "function_call": None, "audio": None, "modalities": None,
    "prediction": None, "reasoning_effort": None, "web_search_options": None, "best_of": 1,
    "suffix": None,
}  # fmt: skip
GRACE_S = 1.0  # past its deadline, an agent blocking its thread is declared timed out


@dataclass(eq=False)
class AgentSession:
    id: int
    row: dict[str, Any]
    deadline: float
    rec: Recording = field(default_factory=Recording)
    busy: bool = False  # a model call is out
    ended: bool = False
    closed: bool = False
    turns: int = 0


class AgentHost:
    """Runs agents, serves their model calls to the controller, records their trajectories."""

    def __init__(
        self,
        fn: Callable[..., Any],
        renderer: Renderer,
        model_name: str,
        timeout_s: float,
        stop_ids: list[int],
        eos_id: int,
        close_tag: str,
    ) -> None:
        self.fn = fn
        self.renderer = renderer
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.stop_ids = stop_ids
        self.eos_id = eos_id
        self.close_tag = close_tag
        self.key = secrets.token_hex(16)
        self._tls = ssl.create_default_context()
        self.sessions: dict[int, AgentSession] = {}
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._asks: list[AgentAsk] = []
        self._ends: list[AgentEnd] = []
        self._waiting: dict[tuple[int, int], asyncio.Future[AgentReply]] = {}
        self._next_ask = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="agent-http", daemon=True
        )
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(30)

    # -- the role's side (its main thread) ------------------------------------------------------

    def url(self, session: int) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session}/v1"

    def start(self, session: int, row: dict[str, Any]) -> None:
        s = AgentSession(session, dict(row), time.monotonic() + self.timeout_s)
        with self._lock:
            self.sessions[session] = s
        threading.Thread(
            target=self._drive, args=(s,), name=f"agent-{session}", daemon=True
        ).start()

    def exchange(self, replies: list[AgentReply], wait_s: float) -> AgentExchange:
        """Hand the replies to their calls; then the calls waiting and the agents finished
        (waiting up to ``wait_s`` for the first)."""
        for reply in replies:
            with self._lock:
                fut = self._waiting.pop((reply.session, reply.ask), None)
            if fut is not None:
                self.loop.call_soon_threadsafe(_settle, fut, reply)
        with self._ready:
            self._expire()
            if not self._asks and not self._ends and wait_s > 0:
                self._ready.wait_for(lambda: bool(self._asks or self._ends), timeout=wait_s)
                self._expire()
            asks, self._asks = self._asks, []
            ends, self._ends = self._ends, []
        return AgentExchange(asks=asks, ends=ends)

    def close(self, sessions: list[int]) -> int:
        """Forget sessions: their agents' calls still out fail, their late ends are dropped."""
        closed = 0
        with self._lock:
            for i in sessions:
                s = self.sessions.pop(i, None)
                if s is None:
                    continue
                s.closed = s.ended = True
                closed += 1
                for key in [k for k in self._waiting if k[0] == i]:
                    fut = self._waiting.pop(key)
                    self.loop.call_soon_threadsafe(_fail, fut, "the trajectory was closed")
        return closed

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _expire(self) -> None:  # under the lock
        now = time.monotonic()
        for s in self.sessions.values():
            if not s.ended and now > s.deadline + GRACE_S:
                message = f"the agent did not return within {self.timeout_s:g} s (agent_timeout_s)"
                self._end(s, None, {}, "timeout", message)

    def _end(
        self,
        s: AgentSession,
        reward: float | None,
        metrics: dict[str, float],
        fault: AgentFault | None,
        message: str = "",
    ) -> None:  # under the lock
        if s.ended:
            return
        s.ended = True
        rec = s.rec
        sampled = [0] * len(rec.sampled) if fault is not None else rec.sampled
        self._ends.append(
            AgentEnd(
                session=s.id,
                reward=0.0 if reward is None or fault is not None else reward,
                metrics=metrics,
                fault=fault,
                message=message,
                start=rec.start,
                ids=rec.ids,
                sampled=sampled,
                log_probs=rec.log_probs,
                versions=rec.versions,
                segments=rec.segments,
                turns=s.turns,
                tool_calls=rec.tool_calls,
                drift=rec.drift,
                finish=rec.finish or ("fault" if fault else ""),
            )
        )
        self._ready.notify_all()

    # -- the agent's thread ---------------------------------------------------------------------

    def _drive(self, s: AgentSession) -> None:
        fault: AgentFault | None = None
        message, reward = "", None
        metrics: dict[str, float] = {}
        try:
            out = asyncio.run(self._agent(s))
        except TimeoutError:
            fault = "timeout"
            message = f"the agent did not return within {self.timeout_s:g} s (agent_timeout_s)"
        except BaseException as exc:  # the user's code: counted, the run goes on
            fault, message = "raised", f"{type(exc).__name__}: {exc}"
            log.warning("agent of session %d raised %s", s.id, message)
        else:
            try:
                reward, metrics = _reward(out)
            except ValueError as exc:
                fault, message = "bad_return", str(exc)
        with self._lock:
            if fault is None and s.rec.calls == 0:
                fault, message = "no_call", "the agent returned without calling the model"
            self._end(s, reward, metrics, fault, message)

    async def _agent(self, s: AgentSession) -> Any:
        import openai  # the agents' own client; the env role needs it only in agent mode

        left = max(0.001, s.deadline - time.monotonic())
        # one TLS context for every client: building one per client (certifi's bundle) costs
        # ~25 ms, a whole second per 40 trajectories; the endpoint is plain HTTP anyway
        http = openai.DefaultAsyncHttpxClient(verify=self._tls, timeout=left)
        client = openai.AsyncOpenAI(
            base_url=self.url(s.id), api_key=self.key, max_retries=0, timeout=left, http_client=http
        )
        try:
            return await asyncio.wait_for(self.fn(client, dict(s.row)), left)
        finally:
            await client.close()

    # -- the endpoint (its own thread and loop) ---------------------------------------------------

    async def _listen(self) -> int:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{session}/v1/completions", self._completions)
        app.router.add_get("/s/{session}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # loopback only: the agents run in this process
        await web.SockSite(runner, sock).start()
        return int(sock.getsockname()[1])

    def _session(self, request: web.Request) -> AgentSession:
        if request.headers.get("Authorization", "") != f"Bearer {self.key}":
            raise _Refused(401, "the API key is not this run's", "invalid_api_key")
        try:
            s = self.sessions.get(int(request.match_info["session"]))
        except ValueError:
            s = None
        if s is None or s.ended:
            raise _Refused(404, "no such trajectory (it ended or never began)", "not_found")
        return s

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._session(request)
        except _Refused as exc:
            return exc.response()
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "hybridflow"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            s = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _Refused(400, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise _Refused(400, "the body must be a JSON object")
            _check(body, self.model_name, chat)
            if s.busy:
                raise _Refused(
                    400, "one model call at a time per trajectory (its turns are in order)"
                )
            s.busy = True
            try:
                found = await self._turn(s, body, chat)
            finally:
                s.busy = False
        except _Refused as exc:
            return exc.response()
        except BadRequest as exc:
            return _Refused(400, str(exc), exc.code, exc.param).response()
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await _stream(request, found, chat, usage)
        return web.json_response(found)

    async def _turn(self, s: AgentSession, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        r = self.renderer
        tools = body.get("tools") if chat else None
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list", "tools")
        if chat and body.get("tool_choice") not in (None, "auto", "none"):
            raise BadRequest("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
        if chat and body.get("tool_choice") == "none":
            tools = None
        if chat:
            text = r.chat(body.get("messages"), tools, s.rec.given)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be one string", "prompt")
            text = prompt
        rec = s.rec
        first = not rec.start
        new, drifted = r.extend(rec, text)
        new_text = r.decode(new) if new else ""
        context = rec.context + new
        stops = _stops(body.get("stop"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise BadRequest("max_tokens must be a positive integer", "max_tokens")
        tokens: list[int] = []
        log_probs: list[float] = []
        said, finish, version, part = "", "stop", 0, 0
        while True:  # a turn goes on after a stop token that closes no call
            reply = await self._ask(
                AgentAsk(
                    session=s.id,
                    ask=0,
                    prompt_ids=context + tokens,
                    turn=s.turns,
                    part=part,
                    max_tokens=None if limit is None else limit - len(tokens),
                    temperature=_number(body, "temperature"),
                    top_p=_number(body, "top_p"),
                    seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
                )
            )
            if reply.error is not None:
                raise BadRequest(reply.error, reply.param)
            tokens += reply.tokens
            log_probs += reply.log_probs
            said += reply.text
            finish, version = reply.finish or "stop", reply.version
            last = reply.tokens[-1] if reply.tokens else None
            more = (
                finish == "stop"
                and last in self.stop_ids
                and last != self.eos_id
                and not said.endswith(self.close_tag)
                and (limit is None or len(tokens) < limit)
            )
            if not more:
                break
            part += 1
        cut = _cut_at_stop(r, tokens, stops)
        if cut is not None:
            tokens, log_probs, finish = tokens[:cut], log_probs[:cut], "stop"
            said = r.decode(tokens, special=False)
        if not first and not drifted:
            rec.observe(new, new_text)
        rec.sample(tokens, log_probs, version, said)
        rec.calls += 1
        rec.finish = finish
        s.turns += 1
        name = f"call_{s.id}_{rec.calls}"
        content: str | None = said
        calls: list[dict[str, Any]] = []
        if chat and tools and cut is None:
            content, calls = r.tool_calls(said, name, tools)
            rec.tool_calls += len(calls)
        full = r.decode(tokens) if tokens else ""
        rec.given.append(Given(raw=said, full=full, call_ids=[c["id"] for c in calls]))
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        scores = list(zip(tokens, log_probs, strict=True)) if body.get("logprobs") else None
        choice = self._choice(chat, reason, content, calls, said, scores)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{s.id}-{rec.calls}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(context),
                "completion_tokens": len(tokens),
                "total_tokens": len(context) + len(tokens),
            },
        }

    def _choice(
        self,
        chat: bool,
        reason: str,
        content: str | None,
        calls: list[dict[str, Any]],
        said: str,
        scores: list[tuple[int, float]] | None,
    ) -> dict[str, Any]:
        """A response's one choice, in the chat or the completions shape; ``scores``: the
        sampled tokens with their log-probs, when the request asked for ``logprobs``."""
        r = self.renderer
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        lps = None
        if scores is not None:
            lps = [
                {
                    "token": r.decode([t]),
                    "logprob": lp,
                    "bytes": list(r.decode([t]).encode()),
                    "top_logprobs": [],
                }
                for t, lp in scores
            ]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice["message"] = message
            choice["logprobs"] = None if lps is None else {"content": lps}
        else:
            choice["text"] = said
            choice["logprobs"] = (
                None
                if lps is None
                else {
                    "tokens": [x["token"] for x in lps],
                    "token_logprobs": [x["logprob"] for x in lps],
                }
            )
        return choice

    async def _ask(self, ask: AgentAsk) -> AgentReply:
        fut: asyncio.Future[AgentReply] = asyncio.get_running_loop().create_future()
        with self._ready:
            self._next_ask += 1
            ask = ask.model_copy(update={"ask": self._next_ask})
            self._waiting[(ask.session, ask.ask)] = fut
            self._asks.append(ask)
            self._ready.notify_all()
        try:
            return await fut
        except _Closed as exc:
            raise _Refused(409, str(exc)) from None


class _Closed(RuntimeError):
    pass


class _Refused(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        error = {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


def _settle(fut: asyncio.Future[AgentReply], reply: AgentReply) -> None:
    if not fut.done():
        fut.set_result(reply)


def _fail(fut: asyncio.Future[AgentReply], why: str) -> None:
    if not fut.done():
        fut.set_exception(_Closed(why))


def _check(body: dict[str, Any], model: str, chat: bool) -> None:
    name = body.get("model")
    if name != model:
        raise _Refused(
            404, f"the model {name!r} does not exist here; this run serves {model!r}",
            "model_not_found", "model",
        )  # fmt: skip
    if body.get("n", 1) not in (1, None):
        raise _Refused(
            400, "n must be 1: the run samples a prompt n times by running its agent n times",
            "unsupported_parameter", "n",
        )  # fmt: skip
    if body.get("top_logprobs") not in (None, 0):
        raise _Refused(
            400, "top_logprobs is not supported (logprobs gives the sampled tokens' own)",
            "unsupported_parameter", "top_logprobs",
        )  # fmt: skip
    if not chat and (
        body.get("echo") or (isinstance(body.get("logprobs"), int) and body["logprobs"] > 1)
    ):
        raise _Refused(400, "echo and logprobs > 1 are not supported", "unsupported_parameter")
    for key, default in REFUSED.items():
        if key in body and body[key] not in (default, None):
            raise _Refused(
                400, f"{key} is not supported by this endpoint", "unsupported_parameter", key
            )
    if chat and "messages" not in body:
        raise _Refused(400, "messages is required", None, "messages")


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{key} must be a number", key)
    return float(value)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not all(isinstance(x, str) and x for x in found):
        raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
    if len(found) > 4:
        raise BadRequest("stop takes at most 4 sequences", "stop")
    return found


def _cut_at_stop(r: Renderer, tokens: list[int], stops: list[str]) -> int | None:
    """The fewest leading tokens whose text holds a stop sequence (the tokens after it are not
    part of the turn: never trained, never shown); None if none appears."""
    if not stops:
        return None
    text = r.decode(tokens, special=False)
    if not any(s in text for s in stops):
        return None
    for k in range(1, len(tokens) + 1):
        if any(s in r.decode(tokens[:k], special=False) for s in stops):
            return k
    return None


def _reward(out: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) of what an agent returned; ValueError if it is neither a finite number
    nor a dict with one under ``reward`` (other entries: finite numbers)."""
    metrics: dict[str, float] = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise ValueError(
                f"the agent returned a dict without 'reward' (keys: {sorted(out)[:8]})"
            )
        for key, value in out.items():
            if key != "reward":
                metrics[str(key)] = _finite(value, f"its {key!r}")
        out = out["reward"]
    return _finite(out, "its reward"), metrics


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the agent returned {value!r} as {what}: a finite number is needed")
    return float(value)


async def _stream(
    request: web.Request, found: dict[str, Any], chat: bool, usage: bool
) -> web.StreamResponse:
    """The finished turn as server-sent events, in OpenAI's chunk shapes (the turn is generated
    whole first: streaming here is the wire format, not token by token)."""
    out = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    choice = found["choices"][0]
    base = {k: found[k] for k in ("id", "created", "model")}
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunks: list[dict[str, Any]] = []
    if chat:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        chunks.append(
            {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        )
        chunks.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]})
    else:
        chunks.append(
            {
                "index": 0,
                "text": choice["text"],
                "logprobs": choice["logprobs"],
                "finish_reason": None,
            }
        )
        chunks.append({"index": 0, "text": "", "finish_reason": choice["finish_reason"]})
    events = [{**base, "object": kind, "choices": [c]} for c in chunks]
    if usage:  # stream_options.include_usage: a last chunk with the usage and no choices
        events.append({**base, "object": kind, "choices": [], "usage": found["usage"]})
    for event in events:
        await out.write(f"data: {json.dumps(event)}\n\n".encode())
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
