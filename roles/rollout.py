"""The rollout role: a process group that generates, with weights it receives from the actor.

``generate(prompts, sampling, min_version)`` is dp-split (each dp rank serves its share of the
prompts; tp ranks of one dp rank run one tensor-parallel engine together) and refuses to run on
weights older than ``min_version``. New weights arrive rank to rank from the actor's group
(``WeightSink``: ``open_receive`` + ``receive_weights``, ``roles/weight_sync.py``), each rank
taking only its tp slice; ``load_weights(state, version)`` still takes a full state dict through
the controller (the baseline the reshard benchmark compares against). Every generation reports the
version it used.

Config: ``{"model": PATH, "engine": "native" | "hf" | "vllm" | "sglang", "dtype": "auto" | "fp32" |
"bf16"}``. With ``engine: vllm`` (``roles/engines/generation/vllm.py``) vLLM holds the weights:
the group's ranks are vLLM's ranks (tp = the group's tp), and every rank takes whole tensors from
a sync (vLLM's loaders cut their tp slices); the role keeps only a weightless copy of the model for
the parameter names and shapes. ``engine: sglang`` (``roles/engines/generation/sglang.py``, never
run: no SGLang build installs on this project's machines) works the same way at tp = 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM

from roles.base import Role, RoleContext
from roles.engines.generation.interface import GenerationEngine, GenerationError, ServingEngine
from roles.engines.generation.iteration import DecodeLoop, Job, TurnLoop
from roles.engines.generation.native import NativeEngine
from roles.engines.generation.serve import EngineName, make_engine, prompt_ids, serve
from roles.engines.generation.sessions import DEFAULT_SESSION_CACHE_MB, SessionCache
from roles.engines.generation.vllm import DEFAULT_KV_CACHE_MB, VLLMEngine, VLLMTurnLoop
from roles.modeling.lora import LoraSettings, attach, is_adapter
from roles.modeling.models import load_causal_lm, load_config, load_tokenizer
from roles.modeling.text import pad_rows
from roles.runtime.device import Precision, group_dtype, peak_memory_bytes, reset_peak_memory
from roles.runtime.endpoint import DP_RAGGED, DP_ROUTED, DP_SPLIT, ONE_TO_ALL, RANK_ZERO, endpoint
from roles.weight_sync import WeightSink, local_piece
from transport.batch import TensorBatch
from transport.device import HOST
from transport.protocol import PEAK_MEMORY, Layout
from transport.sampling import SamplingConfig
from transport.turns import TurnRequest, TurnResult


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model folder the weights start from")
    engine: EngineName = "native"
    dtype: Precision = Field(
        "auto", description="weights' dtype while generating (auto: roles/runtime/device.py)"
    )
    lora: LoraSettings | None = Field(
        None,
        description="the actor's LoRA settings (set by hybridflow run for a LoRA actor): the "
        "same adapters over the base from the model folder; weight syncs carry only them",
    )
    kv_cache_mb: float = Field(
        DEFAULT_KV_CACHE_MB,
        gt=0,
        description="engine vllm: KV cache per rank, MiB (VLLM_CPU_KVCACHE_SPACE, GiB, overrides)",
    )
    kv_block_tokens: int | None = Field(
        None,
        gt=0,
        description="engine vllm: tokens per KV block, the unit its prefix cache reuses (null: "
        "vLLM's default, 128 on CPU; multi-turn rollouts of short turns reuse more with 32)",
    )
    session_cache_mb: float = Field(
        DEFAULT_SESSION_CACHE_MB,
        ge=0,
        description="native engine: KV caches of multi-turn trajectories kept between their turns "
        "(per rank, MiB; the least recently used are dropped beyond it, then re-prefilled; 0: off)",
    )


def vllm_engine(
    model_dir: str,
    tokenizer: Any,
    dtype: torch.dtype,
    tp: int,
    kv_cache_mb: float,
    block_tokens: int | None = None,
) -> GenerationEngine:
    """A vLLM engine over the weights of ``model_dir`` (it loads its own copy)."""
    from roles.engines.generation.vllm import VLLMEngine

    config = load_config(model_dir)
    return VLLMEngine(
        model_dir,
        tp=tp,
        kv_cache_mb=kv_cache_mb,
        block_size=block_tokens,
        dtype=dtype,
        eos_token_id=tokenizer.eos_token_id,
        context=int(config.max_position_embeddings),
    )


class StaleWeightsError(RuntimeError):
    """The rollout holds an older weight version than the controller asked to generate with."""


class Rollout(WeightSink, Role):
    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx)
        self.cfg = RolloutConfig.model_validate(config)
        self.dtype = group_dtype(self.cfg.dtype, ctx.device, ctx.process_group)
        self.tokenizer = load_tokenizer(self.cfg.model)
        self.serving = self.cfg.engine in ("vllm", "sglang")  # the engine holds the weights
        self.engine: GenerationEngine
        if self.serving:
            self._build_serving()
        else:
            self._build_module_engine()
        self.version = 0
        self.sessions = SessionCache(int(self.cfg.session_cache_mb * 2**20))
        self.loop: TurnLoop | None = None  # iteration-level serving, from the first exchange

    def _build_serving(self) -> None:
        config = load_config(self.cfg.model)
        with torch.device("meta"):  # names and shapes only: the engine holds the weights
            self.model = AutoModelForCausalLM.from_config(config)
        common = {
            "dtype": self.dtype.torch_dtype,
            "eos_token_id": self.tokenizer.eos_token_id,
            "context": int(config.max_position_embeddings),
        }
        if self.cfg.engine == "sglang":
            from roles.engines.generation.sglang import SGLangEngine

            if self.ctx.layout.tp != 1:
                raise ValueError("engine 'sglang' runs one engine per rank (tp = 1)")
            gpu = self.ctx.device.device.index or 0
            self.engine = SGLangEngine(self.cfg.model, gpu=gpu, **common)
            return
        self.engine = vllm_engine(
            self.cfg.model,
            self.tokenizer,
            self.dtype.torch_dtype,
            self.ctx.layout.tp,
            self.cfg.kv_cache_mb,
            self.cfg.kv_block_tokens,
        )

    def _build_module_engine(self) -> None:
        model = load_causal_lm(self.cfg.model, dtype=self.dtype.torch_dtype)
        if self.cfg.lora is not None:
            if self.cfg.engine not in ("native", "hf") or self.ctx.layout.tp > 1:
                raise ValueError(
                    f"lora: a rollout group runs adapters with engine native or hf at tp=1 "
                    f"(got engine={self.cfg.engine!r}, tp={self.ctx.layout.tp})"
                )
            attach(model, self.cfg.lora)  # B = 0 until the first sync: the base model
            model.requires_grad_(False)
        # (a no-op on the host)
        self.model = model.to(self.ctx.device.device).eval()  # type: ignore[arg-type]
        layout = self.ctx.layout
        if layout.tp > 1:
            if self.cfg.engine != "native":
                raise ValueError(
                    f"engine={self.cfg.engine!r} runs at tp=1 only; use 'native' or 'vllm'"
                )
            from torch.distributed.device_mesh import init_device_mesh

            from roles.engines.training.common import tensor_parallel

            mesh = init_device_mesh(
                self.ctx.device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp")
            )
            tensor_parallel(self.model, mesh["tp"])
        self.engine = make_engine(self.cfg.engine, self.model, self.tokenizer)

    @endpoint(DP_RAGGED)
    def generate(
        self, batch: TensorBatch, sampling: SamplingConfig | None = None, min_version: int = 0
    ) -> TensorBatch:
        """Samples for the prompts of ``batch`` (see ``roles/engines/generation/serve.py``), on
        weights of version ``min_version`` or newer."""
        if self.version < min_version:
            raise StaleWeightsError(
                f"{self.ctx.role} rank {self.ctx.rank} holds weight version {self.version}, "
                f"older than the version {min_version} asked for (did the last weight sync fail?)"
            )
        reset_peak_memory(self.ctx.device)
        with self._engine():
            out = serve(self.engine, self.tokenizer, batch, sampling, self.version, self.sessions)
        out.meta[PEAK_MEMORY] = peak_memory_bytes(self.ctx.device)
        return out

    @endpoint(DP_ROUTED)
    def exchange(
        self,
        channel: str,
        requests: list[TurnRequest],
        sampling: SamplingConfig | None = None,
        wait_s: float = 0.0,
        min_version: int = 0,
    ) -> list[TurnResult]:
        """Iteration-level serving (``roles/engines/generation/iteration.py``; native or vLLM
        engine at tp = 1): ``requests`` join the running decode batch; returns ``channel``'s turns that
        finished, waiting up to ``wait_s`` for the first while any are out."""
        if self.version < min_version:
            raise StaleWeightsError(
                f"{self.ctx.role} rank {self.ctx.rank} holds weight version {self.version}, "
                f"older than the version {min_version} asked for (did the last weight sync fail?)"
            )
        loop = self._decode_loop()
        settings = SamplingConfig.model_validate(sampling if sampling is not None else {})
        jobs = [
            Job(
                id=r.id,
                channel=channel,
                prompt=list(r.prompt_ids),
                max_new=r.max_new,
                seed=r.seed,
                sampling=settings,
                version=self.version,
                session=r.session,
            )
            for r in requests
        ]
        if jobs:
            loop.submit(jobs)
        return [
            TurnResult(
                id=j.id,
                tokens=j.tokens,
                log_probs=j.log_probs,
                text=self.tokenizer.decode(j.tokens, skip_special_tokens=True),
                finish="stop" if j.finish == "stop" else "length",
                version=j.version,
                reused=j.reused,
                pad_id=int(self.tokenizer.pad_token_id or 0),
            )
            for j in loop.take(channel, wait_s)
        ]

    def _decode_loop(self) -> TurnLoop:
        if self.loop is None:
            if self.ctx.layout.tp != 1 or not isinstance(self.engine, NativeEngine | VLLMEngine):
                raise GenerationError(
                    f"iteration-level serving runs on engines 'native' and 'vllm' at tp = 1 "
                    f"(this group: engine {self.cfg.engine!r}, tp {self.ctx.layout.tp}); use "
                    "agent serving 'continuous'"
                )
            if isinstance(self.engine, VLLMEngine):  # vLLM's scheduler admits each turn
                self.loop = VLLMTurnLoop(self.engine)
            else:
                self.loop = DecodeLoop(self.engine, self.sessions)
        return self.loop

    def _engine(self) -> Any:
        """Held around any other use of the engine while the decode loop may run."""
        return self.loop.lock if self.loop is not None else nullcontext()

    @contextmanager
    def _weights_change(self) -> Iterator[None]:
        """Around a weight change: refused while the decode loop has turns out (they were
        admitted at the old version: pushes wait for them, ``controller/streaming.py``)."""
        if self.loop is None:
            yield
            return
        with self.loop.lock:
            busy = self.loop.busy
            if busy:
                raise GenerationError(
                    f"{self.ctx.role} rank {self.ctx.rank}: new weights arrived while {busy} "
                    "turns are out in the decode loop (push weights through the WeightGate)"
                )
            self.loop.release()
            yield

    @endpoint(ONE_TO_ALL)
    def drop_sessions(self, keys: list[str]) -> int:
        """Forget the kept KV of these trajectories (they ended); how many this rank held."""
        with self._engine():
            return self.sessions.drop(keys)

    @endpoint(DP_SPLIT)
    @torch.no_grad()
    def prompt_logits(self, batch: TensorBatch) -> TensorBatch:
        """``logits`` ``[B, V]`` (float32) of the next token after each prompt: what the first
        generated token is drawn from (a check that tp ranks agree with one rank)."""
        if self.serving:
            raise ValueError(
                f"prompt_logits reads the model's own logits; engine {self.cfg.engine!r} has none"
            )
        prompts = prompt_ids(batch, self.tokenizer)
        rows = pad_rows(prompts, [[0] * len(p) for p in prompts], self.tokenizer.pad_token_id)
        device = self.ctx.device.device
        ids, mask = rows.tensor("input_ids").to(device), rows.tensor("attention_mask").to(device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        last = mask.sum(-1) - 1
        picked = logits[torch.arange(len(ids), device=device), last]
        return TensorBatch.from_dict({"logits": picked.to(HOST)})

    @endpoint(ONE_TO_ALL)
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Replace every weight with ``state`` (full tensors, names as the actor's export);
        tp ranks keep their slice. Returns the new version."""
        with self._weights_change():
            if isinstance(self.engine, ServingEngine):
                self.engine.load_weights(self._in_model_order(state))
            else:
                load_full_state(self.model, state)
            self.version = version
        return version

    @endpoint(ONE_TO_ALL)
    def weight_version(self) -> int:
        return self.version

    # -- weights rank to rank (roles/weight_sync.py) ------------------------------------------

    def sink_layout(self) -> Layout:
        return self.ctx.layout

    def sink_names(self) -> set[str]:
        names = {name for name, _ in self.model.named_parameters()}
        if self.cfg.lora is not None:  # the base is the model folder's and never changes
            return {name for name in names if is_adapter(name)}
        return names

    def sink_splits(self) -> dict[str, int]:
        from torch.distributed.tensor import DTensor

        from roles.engines.training.common import split_dim

        found = {}
        for name, param in self.model.named_parameters():
            if isinstance(param, DTensor):
                dims = [d for d in map(split_dim, param.placements) if d is not None]
                if dims:
                    found[name] = dims[0]
        return found

    def check_staged(self, staged: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        if self.serving and set(staged) != set(params):
            lacking = sorted(set(params) - set(staged))
            raise ValueError(
                f"engine {self.cfg.engine!r} reloads whole layers and cannot take part of the "
                f"weights (missing {lacking[:3]}, {len(lacking)} in all); sync with strict=True"
            )
        for name, got in staged.items():
            piece = local_piece(params[name])
            if piece.shape != got.shape:
                raise ValueError(
                    f"{name}: received shape {list(got.shape)} for this rank's piece of shape "
                    f"{list(piece.shape)}"
                )

    def adopt(self, staged: dict[str, torch.Tensor], strict: bool, version: int) -> None:
        """Each staged slice becomes this rank's piece: a whole parameter in the generation
        dtype and device is taken over as it is, anything else copied (cast) into place."""
        from torch.distributed.tensor import DTensor

        if isinstance(self.engine, ServingEngine):
            self.engine.load_weights(self._in_model_order(staged))
            self.version = version
            return
        params = dict(self.model.named_parameters())
        with self._weights_change(), torch.no_grad():
            for name, got in staged.items():
                param = params[name]
                same = got.dtype == param.dtype and got.device == param.device
                if isinstance(param, DTensor) or not same:
                    local_piece(param).copy_(got)
                else:
                    param.data = got
        self.version = version

    def _in_model_order(self, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Named tensors in the model's parameter order: vLLM processes a layer once all its
        tensors are in, so layer by layer keeps one layer's tensors buffered at a time."""
        return [(n, tensors[n]) for n, _ in self.model.named_parameters() if n in tensors]

    @endpoint(RANK_ZERO)
    def precision(self) -> dict[str, str]:
        """The dtype the weights generate in (``dtype: auto`` resolved) and why."""
        return {"dtype": self.dtype.dtype, "reason": self.dtype.reason}


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a model whose parameters may be tp-split DTensors."""
    from torch.distributed.tensor import DTensor

    from roles.engines.training.common import split_dim

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state) - _tied(model))
    if missing:
        raise KeyError(f"the new weights lack {missing[:5]} ({len(missing)} in all)")
    with torch.no_grad():
        for name, param in params.items():
            full = state.get(name)
            if full is None:
                continue  # tied to the input embeddings
            if isinstance(param, DTensor):
                local, where = full, param.device_mesh.get_coordinate()
                assert where is not None, "this rank holds no part of the parameter"
                for mesh_dim, placement in enumerate(param.placements):
                    dim = split_dim(placement)
                    if dim is not None:
                        local = local.chunk(param.device_mesh.size(mesh_dim), dim)[where[mesh_dim]]
                param.to_local().copy_(local)
            else:
                param.copy_(full)


def _tied(model: torch.nn.Module) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
