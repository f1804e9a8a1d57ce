"""The ``megatron`` training engine: megatron-core's GPTModel, pipeline schedules, DDP and optimizer.

Each rank of the group holds its tensor-parallel shard of the layers of its pipeline stage (one
``GPTModel`` chunk per virtual stage, ``model.py``), loaded from the Hugging Face folder through
``convert.py``. Every pass goes through megatron-core's ``get_forward_backward_func`` (no
pipelining, 1F1B, or interleaved 1F1B with ``vpp``), with micro-batches of ``micro_batch_size``
rows; the loss and read functions are the project's own and get whole-vocabulary logits (the
output layer gathers them over tp) in the caller's columns (``rows.py``). Gradients are reduced by
megatron-core's ``DistributedDataParallel`` and applied by its optimizer (AdamW; the distributed
optimizer, sharding its state over dp, with ``distributed_optimizer: true``).

Exactness, as in the fsdp engine (the tests compare the two):

* losses are normalised by global counts; megatron's own scalings are switched off
  (``calculate_per_token_loss``: the schedule does not divide by the number of micro-batches and
  DDP sums over dp instead of averaging; the token count it would divide by is ignored);
* TP/PP peers run the same micro-batches; dp ranks may run different numbers (DDP reduces once,
  after the last); under the interleaved schedule the count is padded to a multiple of pp with
  masked-out copies;
* the gradient norm sums squares in fp64 over the gradients megatron-core itself counts once
  (no tp duplicate, no second copy of a tied embedding), one all-reduce, then scales them down to
  ``grad_clip`` like ``clip_grad_norm_``.

Results live on the last pipeline stage; the engine broadcasts them (metrics, ``infer`` results)
to the whole pipeline group, so any rank's answer is the group's.

On CPU ranks (gloo) ``cuda_shim.py`` makes megatron-core's CUDA assumptions hold.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roles.base import RoleContext
from roles.engines.training.common import (
    EngineError,
    checkpoint_aside,
    global_counts,
    load_module,
    open_checkpoint,
    rank_file,
    skipped_step,
    sum_over_dp,
    write_hf_folder,
)
from roles.engines.training.config import EngineConfig, OptimConfig
from roles.engines.training.interface import Head, LossFn, ParamLayout, Read, TrainingEngine
from roles.engines.training.megatron import cuda_shim
from roles.engines.training.megatron.convert import (
    ConvertError,
    Place,
    Shape,
    fuse,
    gather_pieces,
    hf_names,
    hf_stage,
    hf_tp_dim,
    rank_pieces,
    unfuse,
)
from roles.engines.training.megatron.model import (
    ModelError,
    build_chunks,
    check_config,
    check_rank_order,
    init_parallel,
)
from roles.engines.training.megatron.rows import RowError, Rows, causal_mask, left_align, restore
from roles.runtime.device import group_dtype
from transport.batch import TensorBatch
from transport.device import HOST, DeviceKind

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> datetime.timedelta:
    """The collective timeout the role group was started with (megatron's groups get it too)."""
    if group is None:
        return DEFAULT_TIMEOUT
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT
    return timeout if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT


class MegatronEngine(TrainingEngine):
    # q/k/v and gate/up are fused here: HF pieces are views or copies of the weights, and the
    # actor generates through reshard into an HF skeleton
    held_in_place = False
    generates_in_place = False

    def __init__(self, cfg: EngineConfig, ctx: RoleContext, head: Head = "lm") -> None:
        if cfg.lora is not None:
            raise EngineError(
                "lora: the megatron engine has no LoRA (megatron-core 0.16 has no adapter layers "
                "of its own); use backend: fsdp"
            )
        self.cfg, self.head, self.step = cfg, head, 0
        self.layout, self.rank = ctx.layout, ctx.rank
        self.device = ctx.device
        self.host = ctx.device.kind == DeviceKind.CPU
        if self.host:
            cuda_shim.apply()
        self.precision = group_dtype(cfg.dtype, ctx.device, ctx.process_group)
        _, pp, tp = ctx.layout.coords(ctx.rank)
        self.place = Place(tp, pp, ctx.layout.tp, ctx.layout.pp, cfg.vpp)
        hf = load_module(cfg, head)  # the fsdp engine's model, seeded alike (a fresh head)
        self.model_config = hf.config
        self.shape = Shape.of(hf.config, head)
        timeout = group_timeout(ctx.process_group, ctx.device.device)
        try:
            check_config(hf.config)  # before any collective: every rank fails alike
            self.place.check(self.shape)
            with self._megatron():
                self.sizes = init_parallel(ctx.layout, cfg.vpp, timeout)
                check_rank_order(ctx.layout, ctx.rank)
                self.models = build_chunks(hf.config, self.shape, self.sizes, self.place)
            pieces = rank_pieces(dict(hf.state_dict()), self.shape, self.place)
        except (ModelError, ConvertError) as exc:
            raise EngineError(str(exc)) from exc
        self._load_pieces(pieces)
        del hf
        self.chunks: list[Any] = list(self.models)  # DDP-wrapped once trainable
        self.module: torch.nn.Module = torch.nn.ModuleList(self.chunks)
        self.optimizer: Any = None
        self.schedule_step = 0
        if cfg.optim is not None:
            self.configure_optim(cfg.optim)
        else:
            for model in self.models:
                model.requires_grad_(False)

    # -- megatron-core's state -------------------------------------------------------------------

    def _megatron(self) -> AbstractContextManager[None]:
        """The context of every megatron-core call (CPU ranks: CUDA device arguments → CPU)."""
        return cuda_shim.redirected() if self.host else nullcontext()

    @staticmethod
    def _groups() -> Any:
        from megatron.core import parallel_state as ps

        return ps

    def _last_stage(self) -> bool:
        return self.place.pp == self.place.pp_size - 1

    def _dp_group(self) -> dist.ProcessGroup | None:
        return self._groups().get_data_parallel_group() if self.layout.dp > 1 else None

    def configure_optim(self, optim: OptimConfig) -> None:
        """megatron-core's DDP around the chunks (once) and a fresh optimizer (fresh moments,
        the schedule's position from step 0)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = self.cfg.model_copy(update={"optim": optim})
        config: Any = self.models[0].config
        with self._megatron():
            if not isinstance(self.chunks[0], DistributedDataParallel):
                for model in self.models:
                    model.requires_grad_(True)
                ddp = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=self.cfg.distributed_optimizer,
                )
                self.chunks = [
                    DistributedDataParallel(config, ddp, model, disable_bucketing=i > 0)
                    for i, model in enumerate(self.models)
                ]
                self.module = torch.nn.ModuleList(self.chunks)
                syncs = [chunk.no_sync for chunk in self.chunks]
                config.no_sync_func = syncs if len(syncs) > 1 else syncs[0]
                # losses are normalised already: reduce over dp, never divide by a token count
                config.finalize_model_grads_func = partial(_finalize, finalize_model_grads)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=optim.lr,
                    weight_decay=optim.weight_decay,
                    adam_beta1=optim.betas[0],
                    adam_beta2=optim.betas[1],
                    adam_eps=optim.eps,
                    clip_grad=0.0,  # the engine clips (its global-norm definition)
                    use_distributed_optimizer=self.cfg.distributed_optimizer,
                ),
                self.chunks,
                config_overrides={},  # weight decay on every parameter, as torch's AdamW
                use_gloo_process_groups=False,
            )
        self.schedule_step = 0  # the schedule starts over with the optimizer (``step`` goes on)

    # -- passes ----------------------------------------------------------------------------------

    def _micro_batches(self, batch: TensorBatch) -> list[Rows]:
        """This rank's micro-batches as the model takes them. Every dp rank learns whether any
        got no rows or rows it cannot run before one of them enters the schedule alone."""
        size = self.cfg.micro_batch_size
        # the interleaved schedule takes one shape for every micro-batch (model.py)
        mask = batch.tensor("attention_mask")
        width = int(mask.sum(-1).max()) if self.cfg.vpp > 1 and len(batch) else 0
        rows: list[Rows] = []
        problem = ""
        try:
            for i in range(0, len(batch), size):
                rows.append(left_align(batch[i : i + size], width, size if width else 0))
        except RowError as exc:
            problem = str(exc)
        stats = torch.tensor(
            [-len(batch), int(bool(problem))], dtype=torch.int64, device=self.device.device
        )
        group = self._dp_group()
        if group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        if int(stats[0]) == 0:
            raise EngineError(
                f"a data-parallel rank got no rows (dp={self.layout.dp}); give every call at "
                "least dp rows (TensorBatch.pad_to_divisor pads a batch)"
            )
        if int(stats[1]):
            raise EngineError(problem or "another data-parallel rank's rows cannot run here")
        if self.cfg.vpp > 1:  # the interleaved schedule runs whole groups of pp micro-batches
            pp = self.place.pp_size
            missing = max(pp - len(rows), -len(rows) % pp)
            rows += [Rows(rows[0].micro, rows[0].input_ids, rows[0].offsets, False)] * missing
        return rows

    def _run(
        self,
        rows: list[Rows],
        last: Callable[[torch.Tensor, Rows], Any],
        forward_only: bool,
    ) -> list[Any]:
        """One pass of megatron-core's schedule over ``rows``; ``last(output, rows)`` runs on the
        last stage for each micro-batch with the model's output in the caller's columns and
        returns a loss triple (training) or anything (``forward_only``); returns those."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[Rows], model: torch.nn.Module) -> tuple[Any, Any]:
            micro = next(data)
            ids = micro.input_ids
            output = model(ids, None, causal_mask(ids.shape[1], ids.device))
            if not getattr(getattr(model, "module", model), "post_process", True):
                # under bf16 autocast a stage ends in bf16; the next one receives fp32
                output = output.to(torch.float32)

            def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> Any:
                with torch.autocast(self.device.type, enabled=False):  # losses in fp32
                    return last(restore(output, micro), micro)

            return output, loss_func

        chunks = len(self.chunks)
        data: Any = [iter(rows) for _ in range(chunks)] if chunks > 1 else iter(rows)
        schedule = get_forward_backward_func()
        # the backward runs in the autocast context too: megatron's linear layers compute theirs
        # by hand (custom autograd functions whose autocast decorators are CUDA's only), and a
        # bf16 gradient meets the fp32 weight there
        with self._megatron(), self.autocast():
            return list(
                schedule(
                    forward_step_func=forward_step,
                    data_iterator=data,
                    model=self.chunks if chunks > 1 else self.chunks[0],
                    num_microbatches=len(rows),
                    seq_length=max(r.input_ids.shape[1] for r in rows),
                    micro_batch_size=max(r.input_ids.shape[0] for r in rows),
                    forward_only=forward_only,
                    collect_non_loss_data=forward_only,
                )
            )

    def _model_output(self, output: torch.Tensor) -> torch.Tensor:
        return output.squeeze(-1) if self.head == "token" else output

    def infer(self, batch: TensorBatch, read: Read) -> torch.Tensor:
        def last(output: torch.Tensor, rows: Rows) -> torch.Tensor:
            return read(self._model_output(output), rows.micro)

        rows = self._micro_batches(self._on_device(batch))
        with torch.no_grad():
            found = self._run(rows, last, forward_only=True)
        parts = [part for part, micro in zip(found, rows, strict=False) if micro.real]
        result = torch.cat(parts) if self._last_stage() else None
        return self._from_last_stage(result).to(HOST)  # callers mix it with the wire's batches

    def _on_device(self, batch: TensorBatch) -> TensorBatch:
        """A batch from the wire (host memory) on this rank's device; as is on the host."""
        return batch if self.host else batch.to(self.device.device, non_blocking=True)

    def train_step(
        self, batch: TensorBatch, loss_fn: LossFn, count_key: str = "response_mask"
    ) -> dict[str, float]:
        if self.optimizer is None:
            raise EngineError("this engine's weights are frozen (optim: null); it cannot train")
        batch = self._on_device(batch)
        tokens, seqs = global_counts(batch.tensor(count_key), self._dp_group(), self.device.device)
        rows = self._micro_batches(batch)
        totals: dict[str, torch.Tensor] = {}

        def last(output: torch.Tensor, micro: Rows) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss, metrics = loss_fn(self._model_output(output), micro.micro, tokens, seqs)
            if micro.real:
                for name, value in {"loss": loss, **metrics}.items():
                    totals[name] = totals.get(name, 0.0) + value.detach().double()
            else:
                loss = loss * 0.0
            return loss, torch.ones((), dtype=torch.int), {}

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(rows, last, forward_only=False)
        lr = self._set_lr()
        with self._megatron():
            self.optimizer.prepare_grads()
            grad_norm = self._clip_gradients()
            # a non-finite norm (the same on every rank) cannot be clipped: skip the step, the
            # weights, moments and schedule as they were (as fsdp.py does)
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                self.optimizer.step_with_ready_grads()
        if skipped:
            skipped_step(self.step, grad_norm)
        else:
            self.schedule_step += 1
        self.step += 1
        shared = self._metrics_from_last_stage(totals)
        result = self.sum_over_dp(shared)
        result.update(grad_norm=grad_norm, lr=lr, tokens=tokens, seqs=seqs, skipped=float(skipped))
        return result

    def _set_lr(self) -> float:
        optim = self.cfg.optim
        assert optim is not None and self.optimizer is not None  # train_step checked
        lr = optim.lr * optim.lr_factor(self.schedule_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _clip_gradients(self) -> float:
        """Global L2 norm over the gradients megatron-core counts once, in fp64 with one
        all-reduce over the ranks that hold different ones; scaled to ``grad_clip`` above it."""
        square = torch.zeros((), dtype=torch.float64, device=self.device.device)
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for optimizer in optimizers:
            for grad in optimizer.get_main_grads_for_grad_norm():
                square += torch.linalg.vector_norm(grad).double() ** 2
        group = optimizers[0].get_grad_stats_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(square, group=group)
        norm = float(square.sqrt())
        clip = self.cfg.optim.grad_clip if self.cfg.optim else None
        if clip is not None and math.isfinite(norm):
            coef = min(1.0, clip / (norm + 1e-6))
            for optimizer in optimizers:
                for param in optimizer.get_parameters():
                    if param.grad is not None:
                        param.grad.mul_(coef)
        return norm

    def sum_over_dp(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return sum_over_dp(values, self._dp_group(), self.device.device)

    def _from_last_stage(self, result: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``result`` on every rank of the pipeline group."""
        if self.place.pp_size == 1:
            assert result is not None
            return result
        ps = self._groups()
        group, src = (
            ps.get_pipeline_model_parallel_group(),
            ps.get_pipeline_model_parallel_last_rank(),
        )
        meta = [None if result is None else (tuple(result.shape), result.dtype)]
        dist.broadcast_object_list(meta, src=src, group=group)
        shape, dtype = meta[0]  # type: ignore[misc]
        out = (
            result.contiguous()
            if result is not None
            else torch.empty(shape, dtype=dtype, device=self.device.device)
        )
        dist.broadcast(out, src=src, group=group)
        return out

    def _metrics_from_last_stage(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.place.pp_size == 1:
            return totals
        ps = self._groups()
        group, src = (
            ps.get_pipeline_model_parallel_group(),
            ps.get_pipeline_model_parallel_last_rank(),
        )
        box = [{k: float(v) for k, v in totals.items()} if self._last_stage() else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in (box[0] or {}).items()}

    @contextmanager
    def full_weights(self) -> Iterator[torch.nn.Module]:
        """The chunks as they are: DDP keeps whole weights on every dp rank (the distributed
        optimizer shards only its own state). Not a module generation engines run: the actor
        generates through reshard (``generates_in_place`` is False)."""
        yield self.module

    def autocast(self) -> AbstractContextManager[Any]:
        if self.precision.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # -- weights ---------------------------------------------------------------------------------

    def held_pieces(self) -> dict[str, torch.Tensor]:
        """This rank's HF pieces: each parameter of its stage cut to its tp shard (views of the
        weights where the layouts agree, copies of q/k/v otherwise); a tied model's last stage
        leaves out its copy of the embedding (stage 0 holds the parameter)."""
        chunks = [{n: p.detach() for n, p in m.named_parameters()} for m in self.models]
        pieces = unfuse(chunks, self.shape, self.place)
        pp, vpp = self.place.pp_size, self.place.vpp
        return {
            n: t for n, t in pieces.items() if hf_stage(self.shape, pp, vpp, n) == self.place.pp
        }

    def _load_pieces(self, pieces: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for model, state in zip(self.models, fuse(pieces, self.shape, self.place), strict=True):
                own = dict(model.named_parameters())
                if set(own) != set(state):
                    raise EngineError(
                        f"megatron chunk weights differ: {sorted(set(own) ^ set(state))}"
                    )
                for name, tensor in state.items():
                    own[name].copy_(tensor)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight whole in HF names on rank 0 (empty elsewhere); a collective. A tied
        output embedding is left out, as ``save_pretrained`` does."""
        dp = self.layout.coords(self.rank)[0]
        mine = {k: v.clone() for k, v in self.held_pieces().items()} if dp == 0 else {}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return gather_pieces([mine], self.shape, self.place.tp_size)
        found: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, found, dst=0)
        if self.rank != 0:
            return {}
        assert found is not None
        return gather_pieces(found, self.shape, self.place.tp_size)

    def load_full_state(self, state: dict[str, torch.Tensor], strict: bool = True) -> int:
        """Whole HF weights (every rank passes the same) into this rank's shards; ``strict=False``
        takes the names both models share. Returns how many tensors were taken."""
        own = set(hf_names(self.shape))
        picked = {k: v for k, v in state.items() if k in own}
        missing = own - set(picked)
        if not picked or (strict and (missing or len(picked) != len(state))):
            raise EngineError(
                f"weights do not fit this model: {len(picked)} of {len(state)} names match, "
                f"{len(missing)} of its own are missing (e.g. {sorted(missing)[:3]})"
            )
        try:
            chunks = [{n: p.detach() for n, p in m.named_parameters()} for m in self.models]
            held = unfuse(chunks, self.shape, self.place)
            pieces = rank_pieces(picked, self.shape, self.place, held=held)
        except ConvertError as exc:
            raise EngineError(str(exc)) from exc
        self._load_pieces(pieces)
        return len(picked)

    def param_layout(self) -> dict[str, ParamLayout]:
        """Per HF name: full shape, the dim tp splits (0, 1 or None), no dp split (DDP keeps
        whole weights on every dp rank), and the pipeline stage that holds it."""
        full = _hf_shapes(self.shape)
        tp = self.place.tp_size
        return {
            name: ParamLayout(
                full[name],
                hf_tp_dim(name) if tp > 1 else None,
                None,
                hf_stage(self.shape, self.place.pp_size, self.place.vpp, name),
            )
            for name in hf_names(self.shape)
        }

    # -- checkpoints -----------------------------------------------------------------------------

    def _describe(self) -> dict[str, Any]:
        return {
            "backend": "megatron",
            "dp": self.layout.dp,
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "vpp": self.cfg.vpp,
            "distributed_optimizer": self.cfg.distributed_optimizer,
            "head": self.head,
        }

    def _optimizers(self) -> list[Any]:
        if self.optimizer is None:
            return []
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def save(self, path: str | Path) -> None:
        """Each rank's shards, optimizer state, step and RNG (the CPU's, the CUDA stand-in's and
        megatron's tracker's) in ``rank{r}.pt``, written aside and renamed into place."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with checkpoint_aside(path, self.rank, self._barrier, self._describe()) as aside:
            state = {
                "weights": [{n: p.detach() for n, p in m.named_parameters()} for m in self.models],
                "optim": [o.optimizer.state_dict() for o in self._optimizers()],
                "step": self.step,
                "schedule_step": self.schedule_step,
                "rng": torch.get_rng_state(),
                "stand_in": cuda_shim.STAND_IN.get_state(),
                "tracker": get_cuda_rng_tracker().get_states(),
            }
            torch.save(state, rank_file(aside, self.rank))

    def load(self, path: str | Path) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        folder = open_checkpoint(path, self.rank, self._describe())
        state = torch.load(rank_file(folder, self.rank), weights_only=True)
        with torch.no_grad():
            for model, weights in zip(self.models, state["weights"], strict=True):
                own = dict(model.named_parameters())
                for name, tensor in weights.items():
                    own[name].copy_(tensor)
        optimizers = self._optimizers()
        if len(optimizers) != len(state["optim"]):
            raise EngineError(f"checkpoint {folder} holds no optimizer state for this engine")
        for optimizer, saved_state in zip(optimizers, state["optim"], strict=True):
            optimizer.optimizer.load_state_dict(saved_state)
        self.step = int(state["step"])
        self.schedule_step = int(state["schedule_step"])
        torch.set_rng_state(state["rng"])
        cuda_shim.STAND_IN.set_state(state["stand_in"])
        get_cuda_rng_tracker().set_states(state["tracker"])

    def export(self, path: str | Path) -> None:
        """The full weights as a plain Hugging Face folder (safetensors + config + tokenizer),
        gathered to rank 0 and written aside, then renamed into place."""
        full = self.full_state()
        if self.rank == 0:
            write_hf_folder(path, full, self.model_config, self.cfg.model)
        self._barrier()

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _finalize(finalize: Callable[..., None], model: Any, num_tokens: Any, **kwargs: Any) -> None:
    finalize(model, None, **kwargs)


def _hf_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.groups * shape.head_dim
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (shape.ffn, h),
        "mlp.up_proj.weight": (shape.ffn, h),
        "mlp.down_proj.weight": (h, shape.ffn),
    }
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        out.update({f"model.layers.{i}.{leaf}": dims for leaf, dims in layer.items()})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab, h)
    out["score.weight"] = (1, h)
    out["score.bias"] = (1,)
    return out
