"""What a Tinker client's calls do, on the mesh: each training client (``create_model``) is a
LoRA actor on one base model in a mesh of its own, started from an experiment this module
writes; its calls run in the order the client numbered them (``seq_id``), through the public
``Mesh`` primitives (``forward_backward``, ``optim_step``, ``save_state``, ``load_state``,
``log_probs``, ``sample``), never around them. Results are futures the client polls.

Several training clients at once are several meshes (``max_models``: refused beyond it), each
with its own adapters and optimizer state. A sampling client samples from its training client's
mesh, with the weights that client had when the sampler was made: once the training client has
stepped again, the sampler is refused (``Refused`` names it) rather than sampled on other
weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller.datum import Datum
from deploy.clusters import cluster_plan
from deploy.experiment import check as check_experiment
from deploy.experiment import load
from deploy.mesh import Mesh, mesh
from deploy.tinker import wire
from deploy.tinker.wire import Refused
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig
from transport.training import AdamStep, OptimConfig

log = logging.getLogger(__name__)

#: how long ``retrieve_future`` holds a poll open before it answers "try again" (the SDK
#: re-polls at once and gives up on one poll after 45 s)
POLL_S = 20.0
#: LoRA's scale numerator (the update is scaled by alpha / rank), as the experiment default
LORA_ALPHA = 32
#: the modules LoRA adapts, by Tinker's switches
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
#: a sample's length when the client gives none
MAX_TOKENS = 128


@dataclass
class Served:
    """A base model this server trains: its name for clients and its folder."""

    name: str
    path: Path


@dataclass
class Result:
    """A finished call: JSON, or protobuf bytes (forward/backward and sampling outputs)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


class UnknownFuture(Refused):
    """A future id this server never gave."""


class Futures:
    """Calls running or done, by request id: the client polls each until it has its result."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Result]] = {}

    def start(self, work: Awaitable[Result]) -> str:
        request_id = uuid.uuid4().hex
        self._tasks[request_id] = asyncio.ensure_future(work)
        return request_id

    async def wait(self, request_id: str, timeout_s: float) -> Result | None:
        """The result once done (None: still running after ``timeout_s``); the call's error
        raised as it was."""
        task = self._tasks.get(request_id)
        if task is None:
            raise UnknownFuture(f"request_id {request_id!r}: no such future on this server", 404)
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:
            return None
        return task.result()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


@dataclass
class Model:
    """A training client: its mesh (started in the background), its calls' order, its
    checkpoints by name (the policy version each holds)."""

    model_id: str
    session_id: str
    base: Served
    rank: int
    folder: Path
    mesh: Mesh | None = None
    #: its session finished (or went quiet): the mesh is stopped, its checkpoints stay
    closed: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)
    failed: BaseException | None = None
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    #: the next ``seq_id`` to run, and the futures of those received (a retry is the same)
    next_seq: int = 1
    received: dict[int, str] = field(default_factory=dict)
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    #: mesh calls one at a time (sampling beside training would interleave their calls)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sampler_weights: dict[str, int] = field(default_factory=dict)
    start: asyncio.Task[None] | None = None
    #: ``asample`` requests waiting, by sampling setting, and the task that samples them
    draws: dict[str, tuple[SamplingConfig, tuple[str, ...], list[Draw]]] = field(
        default_factory=dict
    )
    drawing: asyncio.Task[None] | None = None

    async def ready(self) -> Mesh:
        if self.closed:
            raise Refused(f"model {self.model_id}: its session has finished; it is closed")
        await self.started.wait()
        if self.mesh is None:
            raise Refused(f"model {self.model_id}: its mesh did not start ({self.failed})", 500)
        return self.mesh

    async def in_order(self, seq_id: int, work: Callable[[], Awaitable[Result]]) -> Result:
        """``work`` once every call numbered before ``seq_id`` has run (a failed one too)."""
        async with self.turn:
            await self.turn.wait_for(lambda: self.next_seq >= seq_id)
        try:
            return await work()
        finally:
            async with self.turn:
                self.next_seq = max(self.next_seq, seq_id + 1)
                self.turn.notify_all()


@dataclass
class Draw:
    """An ``asample`` request waiting for its model's next batch."""

    sampler: Sampler
    prompt: list[int]
    seed: int
    prompt_logprobs: bool
    future: asyncio.Future[Result]


@dataclass
class Sampler:
    """A sampling client: the training client it samples from and the policy version it was
    made at."""

    sampler_id: str
    model: Model
    version: int
    path: str | None


class Service:
    """Sessions, training and sampling clients, and their futures, for one server."""

    def __init__(
        self,
        bases: list[Served],
        run_dir: Path,
        nproc: int = 1,
        max_models: int = 2,
        overrides: tuple[str, ...] = (),
        clusters: Path | None = None,
    ) -> None:
        self.bases = {b.name: b for b in bases}
        self.clusters = clusters  # a cluster spec: where each client's group starts
        self.run_dir = run_dir
        self.nproc = nproc
        self.max_models = max_models
        self.overrides = overrides
        self.futures = Futures()
        self.sessions: dict[str, float] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._seeds = itertools.count(1)

    # -- the run folder's record of training clients (read by --resume) ----------------------

    @property
    def registry(self) -> Path:
        return self.run_dir / "models.json"

    def record(self) -> None:
        """Every training client made here, with its checkpoints: written aside, renamed."""
        entries = [
            {
                "model_id": m.model_id,
                "session_id": m.session_id,
                "base": m.base.name,
                "rank": m.rank,
                "folder": str(m.folder),
                "sampler_weights": m.sampler_weights,
            }
            for m in self.models.values()
        ]
        aside = self.registry.with_suffix(".json.tmp")
        aside.write_text(json.dumps(entries, indent=1))
        aside.replace(self.registry)

    def resume(self) -> int:
        """The training clients of an earlier server on this run folder, closed: their saved
        states and sampler weights load into new clients as before. How many."""
        if not self.registry.is_file():
            raise Refused(f"--resume: {self.registry} does not exist (no server ran there)")
        for entry in json.loads(self.registry.read_text()):
            base = self.bases.get(entry["base"])
            if base is None:
                log.warning(
                    "--resume: model %s was trained from %s, which this server does not serve: "
                    "its checkpoints are left out",
                    entry["model_id"],
                    entry["base"],
                )
                continue
            model = Model(
                entry["model_id"], entry["session_id"], base, entry["rank"], Path(entry["folder"])
            )
            model.closed = True
            model.sampler_weights = dict(entry["sampler_weights"])
            model.started.set()
            self.models[model.model_id] = model
        return len(self.models)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = uuid.uuid4().hex[:12]
        self.sessions[session_id] = time.monotonic()
        return session_id

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise Refused(f"session_id {session_id!r}: no such session (or it finished)", 404)
        self.sessions[session_id] = time.monotonic()

    async def finish(self, session_id: str) -> None:
        """A session's end: its training clients' meshes stop (their checkpoints stay)."""
        self.sessions.pop(session_id, None)
        for model in list(self.models.values()):
            if model.session_id == session_id and not model.closed:
                await self.close_model(model)

    async def sweep(self, idle_s: float) -> None:
        """Finish the sessions whose client stopped its heartbeats ``idle_s`` ago (it died)."""
        now = time.monotonic()
        for session_id, seen in list(self.sessions.items()):
            if now - seen > idle_s:
                log.warning("session %s sent no heartbeat for %g s: finished", session_id, idle_s)
                await self.finish(session_id)

    async def close_model(self, model: Model) -> None:
        model.closed = True
        if model.start is not None and not model.start.done():
            model.start.cancel()
            with contextlib.suppress(BaseException):
                await model.start
        async with model.lock:  # a call on its mesh finishes first
            await model.stack.aclose()
        model.mesh = None

    def capabilities(self) -> list[dict[str, Any]]:
        return [
            {"model_name": b.name, "trainable": True, "sampleable": True}
            for b in self.bases.values()
        ]

    # -- training clients -------------------------------------------------------------------

    def base(self, name: str, where: str) -> Served:
        """A served base model by its name, or by its folder (a client that loads the
        tokenizer from the same folder names the model by its path)."""
        found = self.bases.get(name)
        if found is None and Path(name).is_absolute():
            found = next((b for b in self.bases.values() if b.path == Path(name).resolve()), None)
        if found is None:
            raise Refused(
                f"{where}: base model {name!r} is not served here; it serves "
                f"{', '.join(sorted(self.bases))}"
            )
        return found

    def create_model(
        self, session_id: str, model_seq_id: int, base: str, lora: dict[str, Any]
    ) -> Model:
        """A training client: its mesh starts in the background (the future of ``create_model``
        or ``load_weights`` waits for it)."""
        self.heartbeat(session_id)
        served = self.base(base, "create_model")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            return self.models[model_id]
        self.room("create_model")
        if not lora.get("train_attn", True) and not lora.get("train_mlp", True):
            raise Refused(
                "lora_config: train_attn and train_mlp are both off; the unembedding alone "
                "(train_unembed) is not adapted here"
            )
        if lora.get("train_unembed", True):  # the SDK's default: accepted, said in the log
            log.warning(
                "model %s_%d: train_unembed is accepted but the unembedding is not adapted "
                "(LoRA on attention and MLP only)",
                session_id,
                model_seq_id,
            )
        return self.start_model(model_id, session_id, served, lora)

    def room(self, where: str) -> None:
        """Refuse a model beyond ``--max-models`` (training clients and base samplers)."""
        running = sum(1 for m in self.models.values() if m.failed is None and not m.closed)
        if running >= self.max_models:
            raise Refused(
                f"{where}: this server runs at most {self.max_models} models at once "
                "(hybridflow serve --max-models); close a session (ServiceClient.close) first"
            )

    def start_model(
        self, model_id: str, session_id: str, served: Served, lora: dict[str, Any]
    ) -> Model:
        """A model's mesh, started in the background (``Model.ready`` waits for it)."""
        folder = self.run_dir / "models" / safe(model_id)
        model = Model(model_id, session_id, served, int(lora["rank"]), folder)
        self.models[model_id] = model
        model.folder.mkdir(parents=True, exist_ok=True)
        self.record()
        experiment = model.folder / "experiment.yaml"
        experiment.write_text(yaml.safe_dump(self.experiment(served, lora), sort_keys=False))

        async def start() -> None:
            try:
                model.mesh = await model.stack.enter_async_context(
                    mesh(
                        experiment,
                        *self.overrides,
                        run_dir=model.folder / "run",
                        clusters=self.clusters,
                    )
                )
            except BaseException as exc:
                model.failed = exc
                log.error("model %s: its mesh did not start: %s", model_id, exc)
                raise
            finally:
                model.started.set()

        model.start = asyncio.ensure_future(start())
        return model

    def check(self) -> None:
        """Refuse before serving what no client's mesh could start with: the ``--set``
        overrides and the cluster spec, checked on the experiment of a client of the first base
        model (ExperimentError naming the setting)."""
        served = next(iter(self.bases.values()))
        probe = self.run_dir / "experiment-check.yaml"
        probe.write_text(yaml.safe_dump(self.experiment(served, {"rank": 8}), sort_keys=False))
        try:
            exp = load(probe, self.overrides)
            check_experiment(exp, run=False)
            if self.clusters is not None:
                cluster_plan(self.clusters, exp)
        finally:
            probe.unlink()

    def experiment(self, served: Served, lora: dict[str, Any]) -> dict[str, Any]:
        """The experiment a training client's mesh runs: the base model, a LoRA actor, the
        placement; ``--set`` overrides come on top."""
        targets = (ATTENTION if lora.get("train_attn", True) else []) + (
            MLP if lora.get("train_mlp", True) else []
        )
        seed = lora.get("seed")
        return {
            "name": "tinker",
            "models": {"base": {"path": str(served.path)}},
            "roles": {
                "actor": {
                    "model": "base",
                    "lora": {
                        "rank": int(lora["rank"]),
                        "alpha": LORA_ALPHA,
                        "target_modules": targets,
                    },
                    # Tinker's optimizer is whatever each step says (AdamStep): no clipping,
                    # no schedule of its own
                    "optim": {"lr": 1e-4, "grad_clip": None},
                },
                # the mesh places a reward role; Tinker's clients score on their side
                "reward": {"function": "roles.rules:last_number_reward"},
            },
            "placement": {"main": {"roles": ["actor", "reward"], "nproc": self.nproc}},
            "trainer": {"seed": 0 if seed is None else int(seed)},
        }

    def model(self, model_id: str, where: str) -> Model:
        found = self.models.get(model_id)
        if found is None:
            raise Refused(f"{where}: model_id {model_id!r}: no such training client", 404)
        return found

    def submit(
        self, model: Model, seq_id: int | None, work: Callable[[], Awaitable[Result]]
    ) -> str:
        """A training client's call as a future, run in ``seq_id`` order; a retried call (the
        same ``seq_id``) is the same future."""
        if seq_id is None:
            return self.futures.start(work())
        if seq_id in model.received:
            return model.received[seq_id]
        request_id = self.futures.start(model.in_order(seq_id, work))
        model.received[seq_id] = request_id
        return request_id

    async def created(self, model: Model) -> Result:
        await model.ready()
        return Result({"model_id": model.model_id, "type": "create_model"})

    def info(self, model: Model) -> dict[str, Any]:
        return {
            "model_id": model.model_id,
            "model_data": {
                "arch": "llama",
                "model_name": model.base.name,
                "tokenizer_id": str(model.base.path),
            },
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": model.base.name,
            "type": "get_info",
        }

    async def forward_backward(self, model: Model, batch: wire.Batch) -> Result:
        m = await model.ready()
        async with model.lock:
            # the log-probs Tinker returns are those the loss saw, from the same forward
            found: dict[str, float] | None = None
            if batch.forward_only:
                logprobs = await m.log_probs(batch.rows)
            else:
                found, logprobs = await m.forward_backward_log_probs(
                    batch.rows, batch.loss, reduction="sum"
                )
            per_row = [
                logprobs[i, 1 : 1 + len(row.response)].tolist() for i, row in enumerate(batch.rows)
            ]
            metrics = {"loss:sum": self.loss_sum(batch, per_row, found)}
        return Result(proto=wire.forward_output(per_row, metrics))

    @staticmethod
    def loss_sum(
        batch: wire.Batch, logprobs: list[list[float]], found: dict[str, float] | None = None
    ) -> float:
        """The batch's summed loss: as the mesh reports it after a backward, else computed
        from the log-probs the same way (``wire.summed_loss``)."""
        if found is not None:
            return float(found["loss"])
        return wire.summed_loss(batch, logprobs)

    async def optim_step(self, model: Model, adam: AdamStep) -> Result:
        m = await model.ready()
        async with model.lock:
            found = await m.optim_step(adam)
        metrics = {f"{k}:mean": float(v) for k, v in found.items() if math.isfinite(float(v))}
        return Result({"metrics": metrics, "type": "optim_step"})

    async def save_state(self, model: Model, name: str) -> Result:
        m = await model.ready()
        wire.check_name(name, "save_weights.path")
        async with model.lock:
            await m.save_state(f"weights-{name}")
        return Result({"path": wire.tinker_path(model.model_id, "weights", name)})

    async def load_state(self, model: Model, path: str, optimizer: bool) -> Result:
        """A saved training state into ``model``: weights, and with ``optimizer`` its moments
        and schedule (else a fresh optimizer)."""
        source_id, kind, name = wire.parse_path(path, "load_weights.path")
        if kind != "weights":
            raise Refused(f"load_weights.path: {path!r} is sampler weights; load a saved state")
        source = self.model(source_id, "load_weights.path")
        folder = source.folder / "run" / "state" / f"weights-{name}"
        if not folder.is_dir():
            raise Refused(f"load_weights.path: {path!r}: no such checkpoint", 404)
        m = await model.ready()
        local = f"weights-{name}" if source is model else f"from-{safe(source_id)}-{name}"
        if source is not model:  # the checkpoint format is per run folder: a copy of its own
            target = model.folder / "run" / "state" / local
            if not target.exists():
                await asyncio.to_thread(shutil.copytree, folder, target)
        async with model.lock:
            await m.load_state(local)
            if not optimizer:
                await m.configure_optim(OptimConfig(lr=1e-4, grad_clip=None))
        return Result({"path": path, "model_id": model.model_id, "type": "load_weights"})

    async def save_for_sampler(
        self, model: Model, name: str | None, session_id: str | None
    ) -> Result:
        m = await model.ready()
        if name is None:  # save_weights_and_get_sampling_client: a sampler of these weights
            sampler_id = f"{session_id or 'sampler'}:sample:{uuid.uuid4().hex[:8]}"
            self.samplers[sampler_id] = Sampler(sampler_id, model, m.version, None)
            return Result({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
        wire.check_name(name, "save_weights_for_sampler.path")
        async with model.lock:
            await m.save_state(f"sampler-{name}")
        model.sampler_weights[name] = m.version
        self.record()
        path = wire.tinker_path(model.model_id, "sampler_weights", name)
        return Result({"path": path, "type": "save_weights_for_sampler"})

    # -- sampling clients -------------------------------------------------------------------

    def create_sampler(self, session_id: str, model_path: str | None, base: str | None) -> str:
        if model_path is None:  # the base model alone: a fresh adapter is the base, bitwise
            if base is None:
                raise Refused("create_sampling_session: neither model_path nor base_model")
            served = self.base(base, "create_sampling_session.base_model")
            model_id = f"{session_id}:base:{safe(served.name)}"
            model = self.models.get(model_id)
            if model is None or model.closed or model.failed is not None:
                self.room("create_sampling_session")
                model = self.start_model(model_id, session_id, served, {"rank": 1})
            sampler_id = f"{session_id}:sample:{uuid.uuid4().hex[:8]}"
            self.samplers[sampler_id] = Sampler(sampler_id, model, 0, None)
            return sampler_id
        model_id, kind, name = wire.parse_path(model_path, "create_sampling_session.model_path")
        model = self.model(model_id, "create_sampling_session.model_path")
        versions = model.sampler_weights if kind == "sampler_weights" else {}
        if name not in versions:
            raise Refused(f"create_sampling_session.model_path: {model_path!r}: not saved", 404)
        sampler_id = f"{session_id}:sample:{uuid.uuid4().hex[:8]}"
        self.samplers[sampler_id] = Sampler(sampler_id, model, versions[name], model_path)
        return sampler_id

    def sampler(self, sampler_id: str) -> Sampler:
        found = self.samplers.get(sampler_id)
        if found is None:
            raise Refused(f"sampling_session_id {sampler_id!r}: no such sampler", 404)
        return found

    async def sample(
        self,
        sampler: Sampler,
        prompt: list[int],
        n: int,
        params: dict[str, Any],
        prompt_logprobs: bool,
    ) -> Result:
        """``n`` samples of ``prompt``. Requests that arrive while the model's mesh is busy wait
        together and go to it as one batch (one ``sample`` call per sampling setting): the
        cookbook's groups, sent at once, are sampled at once. Each request draws from its own
        seed, so batching does not change what it gets."""
        model = sampler.model
        await model.ready()
        if not prompt:
            raise Refused("asample.prompt: no tokens")
        config, stops, seed = self.sampling(params, n)
        draw = Draw(
            sampler, prompt, seed, prompt_logprobs, asyncio.get_running_loop().create_future()
        )
        key = json.dumps([config.model_dump(mode="json"), stops])  # the setting's batch
        model.draws.setdefault(key, (config, stops, []))[2].append(draw)
        if model.drawing is None or model.drawing.done():
            model.drawing = asyncio.ensure_future(self.draw(model))
        return await draw.future

    async def draw(self, model: Model) -> None:
        """Sample what waits, batch by batch, until nothing does."""
        try:
            m = await model.ready()
            async with model.lock:
                while model.draws:
                    groups, model.draws = model.draws, {}
                    for config, stops, draws in groups.values():
                        await self.draw_batch(m, config, list(stops), draws)
        except BaseException as exc:
            for _, _, draws in model.draws.values():
                for d in draws:
                    if not d.future.done():
                        d.future.set_exception(exc)
            model.draws = {}
            raise

    async def draw_batch(
        self, m: Mesh, config: SamplingConfig, stops: list[str], draws: list[Draw]
    ) -> None:
        live = []
        for d in draws:
            if m.version != d.sampler.version:
                d.future.set_exception(
                    Refused(
                        f"sampler {d.sampler.sampler_id}: it holds the weights of policy version "
                        f"{d.sampler.version}, and its training client has stepped to "
                        f"{m.version} since; make a new sampling client "
                        "(save_weights_and_get_sampling_client)",
                        409,
                    )
                )
            else:
                live.append(d)
        if not live:
            return
        try:
            batch = TensorBatch.from_dict(
                non_tensors={
                    "prompt_ids": [d.prompt for d in live],
                    "prompt": [""] * len(live),
                    "uid": list(range(len(live))),
                    "seed": [d.seed for d in live],
                }
            )
            found = await m.sample(batch, config)
            sequences = self.sequences(m, found, config, stops)
            wanted = [i for i, d in enumerate(live) if d.prompt_logprobs]
            prompt_lps: dict[int, list[float]] = {}
            if wanted:
                rows = [
                    Datum(live[i].prompt[:1], live[i].prompt[1:] or live[i].prompt) for i in wanted
                ]
                taken = await m.log_probs(rows, temperature=1.0)
                for j, i in enumerate(wanted):
                    prompt_lps[i] = [math.nan, *taken[j, 1 : len(live[i].prompt)].tolist()]
        except BaseException as exc:
            for d in live:
                if not d.future.done():
                    d.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        mine: dict[int, list[wire.Sampled]] = {}
        for request, sequence in zip(found.non_tensors["request"], sequences, strict=True):
            mine.setdefault(int(request), []).append(sequence)
        for i, d in enumerate(live):
            if not d.future.done():
                d.future.set_result(Result(proto=wire.sample_output(mine[i], prompt_lps.get(i))))

    def sampling(
        self, params: dict[str, Any], n: int
    ) -> tuple[SamplingConfig, tuple[str, ...], int]:
        """Tinker's ``SamplingParams`` as the mesh's, the stop strings (cut after sampling) and
        the request's seed (the server's next one when it gives none)."""
        stop = params.get("stop")
        stop_ids: list[int] | None = None
        texts: tuple[str, ...] = ()
        if stop == []:  # Tinker: not even EOS ends it
            raise Refused("sampling_params.stop: [] (no stop at all, not even EOS) is not served")
        if isinstance(stop, str):
            texts = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
            stop_ids = [int(s) for s in stop]  # these alone end a sample
        elif isinstance(stop, list):
            texts = tuple(str(s) for s in stop)
        top_k = int(params.get("top_k", -1))
        seed = params.get("seed")
        try:
            config = SamplingConfig(
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=0 if top_k < 0 else top_k,
                max_new_tokens=int(params.get("max_tokens") or MAX_TOKENS),
                n=n,
                stop_token_ids=stop_ids,
            )
        except ValueError as exc:
            raise Refused(f"sampling_params: {exc}") from None
        return config, texts, next(self._seeds) if seed is None else int(seed)

    def sequences(
        self, m: Mesh, batch: TensorBatch, config: SamplingConfig, stop_texts: list[str]
    ) -> list[wire.Sampled]:
        ids = batch.tensor("input_ids")
        mask = batch.tensor("response_mask").bool()
        logprobs = batch.tensor("log_probs")
        stops = set(config.stop_token_ids or [m.tokenizer.eos_token_id])
        found = []
        for i in range(len(ids)):
            tokens = ids[i][mask[i]].tolist()
            lps = logprobs[i][mask[i]].tolist()
            stopped = bool(tokens) and tokens[-1] in stops
            if stop_texts:
                cut = cut_at(m.tokenizer, tokens, stop_texts)
                if cut is not None:
                    tokens, lps, stopped = tokens[:cut], lps[:cut], True
            found.append(wire.Sampled(tokens, lps, stopped))
        return found

    # -- the end ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every model's mesh (its groups) and every call still running."""
        await self.futures.close()
        for model in self.models.values():
            await self.close_model(model)


def cut_at(tokenizer: Any, tokens: list[int], stops: list[str]) -> int | None:
    """The fewest tokens whose text holds a stop string (None: none does)."""
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None


def safe(model_id: str) -> str:
    return model_id.replace(":", "-").replace("/", "-")


__all__ = ["Futures", "Model", "Refused", "Result", "Sampler", "Served", "Service"]
