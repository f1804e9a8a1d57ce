"""The Tinker REST API (``/api/v1/...``) over HTTP, as the ``tinker`` SDK calls it: aiohttp routes
that check the key, validate each request with the SDK's own request types, and hand it to the
``Service``. Work is answered with a future id; ``retrieve_future`` holds a poll open until the
result is ready (or ``POLL_S`` passed: "try again").

Errors: a request that is refused or malformed gets its status (400, 401, 404, 409, 429) and a
JSON body naming what (the SDK raises ``BadRequestError``, ``AuthenticationError``,
``NotFoundError``, ...); a call that fails after it was accepted is the future's error
(``RequestFailedError`` in the client), with the category ``user`` when the request was at fault.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pydantic
from aiohttp import web
from tinker import types

from deploy.tinker import wire
from deploy.tinker.service import POLL_S, Result, Service, UnknownFuture
from deploy.tinker.wire import Refused
from transport.errors import RemoteBatchError, RemoteError
from transport.training import AdamStep

log = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"
M = TypeVar("M", bound=pydantic.BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str) -> web.Response:
    """A refusal the SDK shows: a JSON body that is never empty (an empty 400 is read as a
    proxy's and retried)."""
    return web.json_response({"error": message, "detail": message}, status=status)


def make_app(service: Service, api_key: str) -> web.Application:
    """The routes, behind the key check (``X-API-Key``)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("X-API-Key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            return error(401, "a missing or wrong API key (the X-API-Key header)")
        try:
            return await handler(request)
        except Refused as exc:
            return error(exc.status, str(exc))
        except web.HTTPException:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error(500, f"{request.method} {request.path} failed on the server (its log)")

    app = web.Application(middlewares=[guard], client_max_size=256 * 2**20)
    api = Routes(service)
    for method, path, handler in api.table():
        app.router.add_route(method, f"/api/v1/{path}", handler)
    app.router.add_route("*", "/{tail:.*}", api.unknown)
    return app


class Routes:
    """One handler per endpoint the SDK calls."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def table(self) -> list[tuple[str, str, Handler]]:
        return [
            ("POST", "client/config", self.config),
            ("POST", "client/dynamic_config", self.config),
            ("POST", "create_session", self.create_session),
            ("POST", "session_heartbeat", self.heartbeat),
            ("POST", "telemetry", self.telemetry),
            ("POST", "sessions/{session_id}/finish", self.finish),
            ("GET", "get_server_capabilities", self.capabilities),
            ("POST", "create_model", self.create_model),
            ("POST", "get_info", self.get_info),
            ("POST", "forward_backward", self.forward_backward),
            ("POST", "optim_step", self.optim_step),
            ("POST", "save_weights", self.save_weights),
            ("POST", "load_weights", self.load_weights),
            ("POST", "save_weights_for_sampler", self.save_for_sampler),
            ("POST", "create_sampling_session", self.create_sampler),
            ("GET", "samplers/{sampler_id}", self.get_sampler),
            ("POST", "asample", self.sample),
            ("POST", "retrieve_future", self.retrieve),
            ("GET", "training_runs/{run_id}", self.training_run),
        ]

    # -- sessions ---------------------------------------------------------------------------

    async def config(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def create_session(self, request: web.Request) -> web.Response:
        await parse(request, types.CreateSessionRequest)
        return web.json_response({"session_id": self.service.create_session()})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await parse(request, types.SessionHeartbeatRequest)
        self.service.heartbeat(body.session_id)
        return web.json_response({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        await request.read()  # accepted and dropped
        return web.json_response({"status": "accepted"})

    async def finish(self, request: web.Request) -> web.Response:
        await request.read()
        await self.service.finish(request.match_info["session_id"])
        return web.json_response({})

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response({"supported_models": self.service.capabilities()})

    async def training_run(self, request: web.Request) -> web.Response:
        return error(404, f"training run {request.match_info['run_id']!r}: not listed here")

    async def unknown(self, request: web.Request) -> web.Response:
        return error(404, f"{request.method} {request.path} is not served by hybridflow serve")

    # -- training clients -------------------------------------------------------------------

    async def create_model(self, request: web.Request) -> web.Response:
        body = await parse(request, types.CreateModelRequest)
        if body.lora_config is None:
            raise Refused("create_model: lora_config is missing; this server trains LoRA only")
        if getattr(body.optimizer_config, "type", "adamw") != "adamw":
            raise Refused(
                f"create_model.optimizer_config: {body.optimizer_config.type!r}; only adamw"
            )
        model = self.service.create_model(
            body.session_id, body.model_seq_id, body.base_model, body.lora_config.model_dump()
        )
        request_id = self.service.futures.start(self.service.created(model))
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    async def get_info(self, request: web.Request) -> web.Response:
        body = await parse(request, types.GetInfoRequest)
        model = self.service.model(body.model_id, "get_info")
        await model.ready()
        return web.json_response(self.service.info(model))

    async def forward_backward(self, request: web.Request) -> web.Response:
        message = wire.forward_backward_request(await request.read())
        model = self.service.model(message.model_id, "forward_backward")

        async def work() -> Result:  # a refused datum fails the future, in its turn
            return await self.service.forward_backward(model, wire.batch_of(message))

        request_id = self.service.submit(model, message.seq_id, lambda: user_faults(work()))
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await parse(request, types.OptimStepRequest)
        model = self.service.model(body.model_id, "optim_step")
        params = body.optim_params

        async def work() -> Result:  # refused in its turn, as forward_backward
            if not isinstance(params, types.AdamParams):
                raise Refused(f"optim_step: {type(params).__name__}; only AdamParams is served")
            try:
                adam = AdamStep(
                    lr=params.learning_rate,
                    betas=(params.beta1, params.beta2),
                    eps=params.eps,
                    weight_decay=params.weight_decay,
                    grad_clip=params.grad_clip_norm or None,
                )
            except pydantic.ValidationError as exc:
                raise Refused(f"optim_step.adam_params: {short(exc)}") from None
            return await self.service.optim_step(model, adam)

        request_id = self.service.submit(model, body.seq_id, lambda: user_faults(work()))
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    async def save_weights(self, request: web.Request) -> web.Response:
        body = await parse(request, types.SaveWeightsRequest)
        model = self.service.model(body.model_id, "save_weights")
        name = body.path or ""
        request_id = self.service.submit(
            model, body.seq_id, lambda: user_faults(self.service.save_state(model, name))
        )
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await parse(request, types.LoadWeightsRequest)
        if body.model_id is None:  # a new training client from a saved state
            if body.session_id is None or body.model_seq_id is None:
                raise Refused("load_weights: give model_id, or session_id and model_seq_id")
            source_id, _, _ = wire.parse_path(body.path, "load_weights.path")
            source = self.service.model(source_id, "load_weights.path")
            lora = {"rank": source.rank, **source_lora(source)}
            model = self.service.create_model(
                body.session_id, body.model_seq_id, source.base.name, lora
            )
            seq: int | None = None
        else:
            model = self.service.model(body.model_id, "load_weights")
            seq = body.seq_id
        path, optimizer = body.path, body.optimizer
        request_id = self.service.submit(
            model, seq, lambda: user_faults(self.service.load_state(model, path, optimizer))
        )
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = await parse(request, types.SaveWeightsForSamplerRequest)
        model = self.service.model(body.model_id, "save_weights_for_sampler")
        session = model.model_id.split(":")[0]
        request_id = self.service.submit(
            model,
            body.seq_id,
            lambda: user_faults(self.service.save_for_sampler(model, body.path, session)),
        )
        return web.json_response({"request_id": request_id, "model_id": model.model_id})

    # -- sampling clients -------------------------------------------------------------------

    async def create_sampler(self, request: web.Request) -> web.Response:
        body = await parse(request, types.CreateSamplingSessionRequest)
        self.service.heartbeat(body.session_id)
        sampler_id = self.service.create_sampler(body.session_id, body.model_path, body.base_model)
        return web.json_response({"sampling_session_id": sampler_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sampler = self.service.sampler(request.match_info["sampler_id"])
        return web.json_response(
            {
                "sampler_id": sampler.sampler_id,
                "base_model": sampler.model.base.name,
                "model_path": sampler.path,
            }
        )

    async def sample(self, request: web.Request) -> web.Response:
        body = await parse(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise Refused("asample: sampling_session_id is missing (make a sampling client)")
        sampler = self.service.sampler(body.sampling_session_id)
        unserved = {
            "topk_prompt_logprobs": body.topk_prompt_logprobs,
            "topk_sample_logprobs": body.topk_sample_logprobs,
            "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
            "target_prompt_logprobs": body.target_prompt_logprobs is not None,
            "prompt_logprobs_last_n": body.prompt_logprobs_last_n is not None,
        }
        asked = [name for name, value in unserved.items() if value]
        if asked:
            raise Refused(f"asample: {', '.join(asked)} is not served here")
        if body.num_samples < 1:
            raise Refused(f"asample.num_samples: {body.num_samples}; give at least 1")
        prompt = wire.tokens_of(
            [chunk_proto(c, i) for i, c in enumerate(body.prompt.chunks)], "asample.prompt"
        )
        params = body.sampling_params.model_dump(exclude_none=True)
        work = self.service.sample(
            sampler, prompt, body.num_samples, params, bool(body.prompt_logprobs)
        )
        request_id = self.service.futures.start(user_faults(work))
        ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
        return web.json_response({"request_id": request_id, "sample_sequence_ids": ids})

    # -- futures ----------------------------------------------------------------------------

    async def retrieve(self, request: web.Request) -> web.Response:
        body = await parse(request, types.FutureRetrieveRequest)
        try:
            result = await self.service.futures.wait(body.request_id, POLL_S)
        except UnknownFuture:
            raise
        except Refused as exc:
            return web.json_response({"error": str(exc), "category": "user"})
        except RemoteBatchError as exc:
            return web.json_response({"error": str(exc), "category": "user"})
        except RemoteError as exc:
            return web.json_response({"error": str(exc), "category": "server"})
        except Exception as exc:
            log.exception("request %s failed", body.request_id)
            return web.json_response(
                {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
            )
        if result is None:
            return web.json_response({"type": "try_again", "request_id": body.request_id})
        if result.proto is not None:
            return web.Response(body=result.proto, content_type=PROTOBUF)
        return web.json_response(result.json)


async def user_faults(work: Awaitable[Result]) -> Result:
    """``work``; a ``ValueError`` raised in this process (a row the mesh's checks refused) is
    the request's fault, as a ``Refused``."""
    try:
        return await work
    except ValueError as exc:
        raise Refused(str(exc)) from exc


async def parse(request: web.Request, model: type[M]) -> M:
    """The JSON body as the SDK's request type, or ``Refused`` naming the field."""
    try:
        raw = await request.json()
    except json.JSONDecodeError:
        raise Refused(f"{request.path}: the body is not JSON") from None
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise Refused(f"{request.path}: {short(exc)}") from None


def short(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )


def chunk_proto(chunk: Any, i: int) -> Any:
    """A JSON prompt chunk as the protobuf one ``wire.tokens_of`` reads."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    kind = getattr(chunk, "type", None)
    if kind != "encoded_text":
        raise Refused(f"asample.prompt.chunks[{i}]: a chunk of kind {kind!r}; only encoded_text")
    tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
    return pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens))


def source_lora(model: Any) -> dict[str, Any]:
    """The LoRA switches a training client was made with (read back from its experiment)."""
    import yaml

    exp = yaml.safe_load((model.folder / "experiment.yaml").read_text())
    targets = exp["roles"]["actor"]["lora"]["target_modules"]
    return {
        "seed": exp["trainer"]["seed"],
        "train_attn": "q_proj" in targets,
        "train_mlp": "gate_proj" in targets,
        "train_unembed": False,
    }
