"""The ``fsdp`` training engine: FSDP2 for data parallel, DTensor tensor parallel, dp x tp mesh.

The group's ranks form a device mesh ``(dp, tp)`` in the same row-major order as the role layout
(rank = dp_rank · tp + tp_rank). Each decoder layer's attention and MLP projections are split over
``tp`` by ``TP_PLAN`` (``common.py``: q/k/v and gate/up column-wise, o and down row-wise, so each
layer needs two all-reduces); embeddings, norms and heads stay whole on the tp ranks. Then every
layer and the root are ``fully_shard``-ed over ``dp``. Gloo runs all of it on CPU; NCCL would on GPU.

Exactness matters more than anything here (the tests compare 1, dp = 2 and tp = 2 runs):

* losses are normalised by global counts (``roles/modeling/losses.py``) and multiplied by ``dp`` because
  FSDP averages gradients over its ranks;
* every dp rank runs the same number of micro-batches — a rank with fewer rows runs a masked-out
  copy of its first row, since a forward pass is a sequence of collectives;
* the gradient norm for clipping is summed over the local shards with one all-reduce, each
  parameter's local square counted once however many ranks replicate it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from roles.base import RoleContext
from roles.engines.training.common import (
    EngineError,
    checkpoint_aside,
    decoder_layers,
    global_counts,
    load_module,
    open_checkpoint,
    rank_file,
    skipped_step,
    split_dim,
    sum_over_dp,
    tensor_parallel,
    write_hf_folder,
)
from roles.engines.training.config import EngineConfig, OptimConfig
from roles.engines.training.interface import Head, LossFn, ParamLayout, Read, TrainingEngine
from roles.engines.training.snapshot import RankSnapshots, fill
from roles.modeling.logprob import logits_kept
from roles.modeling.lora import (
    adapter_dropout,
    adapter_folder,
    adapter_values,
    adapters_disabled,
    adapters_set_to,
    attach,
    injected_names,
    is_adapter,
    merged_state,
    write_adapter_folder,
)
from roles.modeling.shared_prompt import PromptPack, pack_shared_prompts
from roles.modeling.text import block_causal_mask, segment_positions
from roles.runtime.device import attention_kernel, group_dtype, rng_state, set_rng_state
from transport.batch import TensorBatch
from transport.device import HOST, DeviceKind
from transport.training import AdamStep


class FSDPEngine(TrainingEngine):
    def __init__(self, cfg: EngineConfig, ctx: RoleContext, head: Head = "lm") -> None:
        layout = ctx.layout
        if layout.pp != 1:
            raise EngineError(f"the fsdp engine has no pipeline parallel; got pp={layout.pp}")
        self.cfg, self.head, self.step = cfg, head, 0
        self.device = ctx.device  # mesh and autocast device type come from the device seam
        self.precision = group_dtype(cfg.dtype, ctx.device, ctx.process_group)
        self.dp, self.tp, self.world = layout.dp, layout.tp, layout.world_size
        # on the rank's device before it is split or an optimizer sees it (a no-op on the host)
        self.module = load_module(cfg, head).to(self.device.device)
        self.model_config = self.module.config
        if cfg.lora is not None:
            self._attach_lora()
        self.mesh: DeviceMesh | None = None
        if self.world > 1:
            self.mesh = init_device_mesh(
                self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp")
            )
            self._parallelize(self.mesh)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._snapshots: RankSnapshots | None = None  # the shared-memory files mapped so far
        self.accumulated = 0  # forward_backward calls whose gradients wait for optim_step
        # LoRA: the adapters the reference computes with (rebase_reference); None: adapters off
        self._reference: dict[str, torch.Tensor] | None = None
        if cfg.optim is not None:
            self.configure_optim(cfg.optim)
        else:
            self.module.requires_grad_(False)

    def configure_optim(self, optim: OptimConfig) -> None:
        """A fresh AdamW and schedule (e.g. when an RL stage follows an SFT stage); the weights
        stay, the optimizer moments and the schedule's position start over."""
        self.cfg = self.cfg.model_copy(update={"optim": optim})
        self.module.zero_grad(set_to_none=True)  # gradients of the old optimizer's steps go
        self.accumulated = 0
        if self.cfg.lora is None:
            self.module.requires_grad_(True)
        else:  # the adapters (and a critic's new head): the base stays frozen
            for name, param in self.module.named_parameters():
                param.requires_grad_(self._trained(name))
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Plain tensors (one rank, replicate mode): the fused kernel, ~3x faster than the loop.
        # DTensors of different meshes (tp-split and tp-whole) need the per-tensor loop.
        plain = not any(isinstance(p, DTensor) for p in params)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=plain or None,
            foreach=None if plain else False,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, optim.lr_factor)

    # -- LoRA (roles/modeling/lora.py) ---------------------------------------------------------

    def _attach_lora(self) -> None:
        """PEFT's LoRA layers into the model before it is sharded, seeded alike on every rank
        (A is random, B zero: the model is the base model until the first step)."""
        if self.tp > 1:
            raise EngineError(
                f"lora: adapters train at tp=1 (got tp={self.tp}); the tensor-parallel plan "
                "does not split LoRA layers yet - use dp ranks instead"
            )
        torch.manual_seed(self.cfg.seed)
        attach(self.module, self.cfg.lora)  # type: ignore[arg-type]
        for name, param in self.module.named_parameters():
            param.requires_grad_(self._trained(name))

    def _trained(self, name: str) -> bool:
        """Whether a parameter trains in a LoRA run: the adapters, and a token head (a critic's
        or reward model's new value head has no base to keep)."""
        return is_adapter(name) or (self.head == "token" and name.startswith("score."))

    def synced_names(self) -> set[str] | None:
        if self.cfg.lora is None:
            return None
        return {name for name, _ in self.module.named_parameters() if is_adapter(name)}

    @contextmanager
    def reference_weights(self) -> Iterator[torch.nn.Module]:
        if self.cfg.lora is None:
            raise EngineError("this engine has no lora adapters to switch off")
        if self._reference is None:
            with adapters_disabled(self.module) as module:
                yield module
            return
        with adapters_set_to(self.module, self._reference):
            yield self.module

    def rebase_reference(self) -> None:
        if self.cfg.lora is None:
            raise EngineError("this engine has no lora adapters to re-base a reference on")
        self._reference = adapter_values(self.module)

    # -- parallelism ---------------------------------------------------------------------------

    def _parallelize(self, mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.tp > 1:
            tensor_parallel(self.module, mesh["tp"])
        if self.dp > 1 and self.cfg.dp_mode == "fsdp":
            for layer in decoder_layers(self.module):
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(self.module, mesh=mesh["dp"])

    def _dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.mesh is not None and self.dp > 1 else None

    # -- micro-batches -------------------------------------------------------------------------

    def _micro_batches(self, batch: TensorBatch) -> Iterator[tuple[TensorBatch, bool]]:
        """This rank's micro-batches, padded with masked-out copies of the first one up to the
        largest count on any dp rank; yields (micro-batch, is_real)."""
        size = self.cfg.micro_batch_size
        local = [batch[i : i + size] for i in range(0, len(batch), size)]
        stats = torch.tensor(
            [len(local), -len(batch)], dtype=torch.int64, device=self.device.device
        )
        group = self._dp_group()
        if group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        if int(stats[1]) == 0:
            raise EngineError(
                f"a data-parallel rank got no rows (dp={self.dp}); give every call at least "
                f"dp rows (TensorBatch.pad_to_divisor pads a batch)"
            )
        yield from ((micro, True) for micro in local)
        for _ in range(int(stats[0]) - len(local)):
            yield local[0], False

    def _forward(self, micro: TensorBatch) -> torch.Tensor:
        ids, mask = micro.tensor("input_ids"), micro.tensor("attention_mask")
        segments = micro.tensors.get("segment_ids")
        if segments is not None:  # packed rows: positions restart, no attention across sequences
            attention: torch.Tensor | None = block_causal_mask(segments)
            positions = segment_positions(segments)
        else:
            attention = None if bool(mask.all()) else mask
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        # packed rows keep the fused kernel: their 4-d block mask is built for sdpa
        choice = "sdpa" if segments is not None else self.cfg.attention
        kernel = attention_kernel(choice, self.device, self.precision.dtype, int(ids.shape[1]))
        self.model_config._attn_implementation = kernel  # read by every layer at each forward
        # logits only where they are read: from the position before the first response token
        # (a critic's values and a batch without a response mask: everywhere)
        response = micro.tensors.get("response_mask")
        keep = 0
        if self.head == "lm" and self.cfg.logits_at == "response" and response is not None:
            keep = logits_kept(response)
        if keep and response is not None and segments is None and self.cfg.share_prompts:
            pack = pack_shared_prompts(ids, mask, response, keep)
            if pack is not None:
                return self._forward_packed(pack)
        kept = {"logits_to_keep": keep} if keep else {}
        with self.autocast():
            out = self.module(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=False,
                **kept,
            )
        logits = out.logits
        return logits.squeeze(-1) if self.head == "token" else logits

    def _forward_packed(self, pack: PromptPack) -> torch.Tensor:
        """The forward over a micro-batch's rows with each group's prompt once; logits in the
        rows' own layout (``roles/modeling/shared_prompt.py``)."""
        width = int(pack.input_ids.shape[1])
        kernel = attention_kernel(self.cfg.attention, self.device, self.precision.dtype, width)
        self.model_config._attn_implementation = kernel
        with self.autocast():
            out = self.module(
                input_ids=pack.input_ids,
                attention_mask=pack.attention_mask(kernel, torch.float32),
                position_ids=pack.positions,
                use_cache=False,
                logits_to_keep=pack.columns,
            )
        return pack.gather(out.logits)

    @contextmanager
    def full_weights(self) -> Iterator[torch.nn.Module]:
        """The model with whole (dp-unsharded) weights for the duration of the block: FSDP
        all-gathers every layer and frees the copies after; replicate mode and one rank hold
        them already. Tensor-parallel splits stay (the native generation engine runs tp)."""
        from torch.distributed.fsdp import FSDPModule

        sharded = self.dp > 1 and self.cfg.dp_mode == "fsdp"
        modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)] if sharded else []
        for module in modules:
            module.unshard()
        try:
            yield self.module
        finally:
            for module in modules:
                module.reshard()

    def autocast(self) -> AbstractContextManager[Any]:
        if self.precision.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # -- the interface -------------------------------------------------------------------------

    def _on_device(self, batch: TensorBatch) -> TensorBatch:
        """A batch from the wire (host memory) on this rank's device; as is on the host."""
        if self.device.kind == DeviceKind.CPU:
            return batch
        return batch.to(self.device.device, non_blocking=True)

    def infer(self, batch: TensorBatch, read: Read) -> torch.Tensor:
        """``read``'s result per row, in host memory (callers mix it with the wire's batches)."""
        batch = self._on_device(batch)
        width = _width(batch)
        parts = []
        with torch.no_grad():
            for micro, real in self._micro_batches(batch):
                micro = trim(micro)
                result = read(self._forward(micro), micro)
                if real:
                    parts.append(_pad_to(result, width))
        return torch.cat(parts).to(HOST)

    def train_step(
        self, batch: TensorBatch, loss_fn: LossFn, count_key: str = "response_mask"
    ) -> dict[str, float]:
        if self.accumulated:  # they would be dropped (or stepped twice) without a word
            raise EngineError(
                f"train_step: the gradients of {self.accumulated} forward_backward call(s) are "
                "pending; take them with optim_step first (a whole step uses its own batch only)"
            )
        result = self.forward_backward(batch, loss_fn, count_key)
        result.update(self.optim_step())
        return result

    def forward_backward(
        self, batch: TensorBatch, loss_fn: LossFn, count_key: str = "response_mask"
    ) -> dict[str, float]:
        if self.optimizer is None or self.scheduler is None:
            raise EngineError("this engine's weights are frozen (optim: null); it cannot train")
        batch = self._on_device(batch)
        tokens, seqs = global_counts(batch.tensor(count_key), self._dp_group(), self.device.device)
        micro_batches = list(self._micro_batches(batch))
        totals: dict[str, torch.Tensor] = {}
        sharded = self.dp > 1 and self.cfg.dp_mode == "fsdp"
        dropout = self.cfg.lora is not None and self.cfg.lora.dropout > 0
        try:
            with adapter_dropout(self.module) if dropout else nullcontext():
                self._accumulate(micro_batches, loss_fn, tokens, seqs, totals, sharded)
        except BaseException as exc:
            # the micro-batches before the failing one added their gradients, which nothing
            # tells from earlier calls': all are dropped, or the next step would take them
            if self.accumulated:
                exc.add_note(
                    f"the gradients of {self.accumulated} forward_backward call(s) before it "
                    "were dropped too (they cannot be told from its own); run them again"
                )
            self.discard_gradients()
            if sharded:
                self._drop_unsynced_gradients()
            raise
        self.accumulated += 1
        result = self.sum_over_dp(totals)
        result.update(tokens=tokens, seqs=seqs)
        return result

    def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        if self.optimizer is None or self.scheduler is None:
            raise EngineError("this engine's weights are frozen (optim: null); it cannot train")
        if not self.accumulated:
            raise EngineError("optim_step: no gradients since the last step; call forward_backward")
        if self.dp > 1 and self.cfg.dp_mode != "fsdp":
            self._all_reduce_gradients()
        if adam is not None:  # this step's own settings; the schedule sets lr again after it
            for group in self.optimizer.param_groups:
                group.update(
                    lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay
                )
        grad_norm = self._clip_gradients(adam.grad_clip if adam is not None else "config")
        lr = self.optimizer.param_groups[0]["lr"]
        # a non-finite norm (every rank sees the same one) cannot be clipped: stepping on it
        # would make the weights NaN, so the step is skipped (weights, moments and schedule as
        # they were) and reported, as Megatron and DeepSpeed skip an overflowed step
        skipped = not math.isfinite(grad_norm)
        if skipped:
            skipped_step(self.step, grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
        # the gradients are spent: freed now, not at the next step, so generation in between
        # (the colocated actor) has their memory
        self.discard_gradients()
        self.step += 1
        return {"grad_norm": grad_norm, "lr": float(lr), "skipped": float(skipped)}

    def discard_gradients(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0

    def _drop_unsynced_gradients(self) -> None:
        """FSDP holds the gradients of the micro-batches run without gradient sync on its
        unsharded parameters until the last one's backward reduce-scatters them, out of
        ``zero_grad``'s reach: a call that failed before that leaves them for the next one's
        reduce-scatter. FSDP2 has no public call that drops them; this reads its state."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if not isinstance(module, FSDPModule):
                continue
            module.set_requires_gradient_sync(True, recurse=False)
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None

    def _accumulate(
        self,
        micro_batches: list[tuple[TensorBatch, bool]],
        loss_fn: LossFn,
        tokens: float,
        seqs: float,
        totals: dict[str, torch.Tensor],
        sharded: bool,
    ) -> None:
        """Forward and backward of every micro-batch, gradients summed in place."""
        for i, (micro, real) in enumerate(micro_batches):
            if sharded:  # reduce-scatter gradients once, after the last micro-batch
                self.module.set_requires_gradient_sync(i == len(micro_batches) - 1)  # type: ignore[operator]
            micro = trim(micro)
            loss, metrics = loss_fn(self._forward(micro), micro, tokens, seqs)
            # FSDP averages gradients over dp, the replicate all-reduce sums them
            (loss * ((self.dp if sharded else 1.0) if real else 0.0)).backward()
            if real:
                for name, value in {"loss": loss, **metrics}.items():
                    totals[name] = totals.get(name, 0.0) + value.detach().float()

    def sum_over_dp(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return sum_over_dp(values, self._dp_group(), self.device.device)

    def _all_reduce_gradients(self, bucket: int = 1 << 24) -> None:
        """Replicate mode: sum each rank's gradients over dp, in flat buckets of ``bucket``
        elements (one collective per bucket instead of one per parameter)."""
        grads = [
            _local_and_copies(p.grad, 1)[0] for p in self.module.parameters() if p.grad is not None
        ]
        group = self._dp_group()
        start = 0
        while start < len(grads):
            stop, size = start, 0
            while stop < len(grads) and (stop == start or size + grads[stop].numel() <= bucket):
                size += grads[stop].numel()
                stop += 1
            flat = torch.cat([g.reshape(-1) for g in grads[start:stop]])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads[start:stop]:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            start = stop

    def _clip_gradients(self, clip: float | Literal["config"] | None = "config") -> float:
        """Global L2 norm of the gradients (per-tensor norms summed in fp64, one all-reduce);
        scale them down to ``clip`` (by default the optimizer config's ``grad_clip``; None: not
        at all) when above it, as ``clip_grad_norm_`` does."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64, device=self.device.device)
        for grad in grads:
            local, copies = _local_and_copies(grad, self.world)
            square += torch.linalg.vector_norm(local).double() ** 2 / copies
        if self.world > 1:
            dist.all_reduce(square)
        norm = float(square.sqrt())
        if clip == "config":
            clip = self.cfg.optim.grad_clip if self.cfg.optim else None
        if clip is not None and math.isfinite(norm):
            coef = min(1.0, clip / (norm + 1e-6))
            for grad in grads:
                _local_and_copies(grad, self.world)[0].mul_(coef)
        return norm

    # -- state ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """A sharded checkpoint of model, optimizer, schedule and each rank's RNG, written aside
        and renamed into place (a crash leaves the previous checkpoint intact)."""
        import torch.distributed.checkpoint as dcp

        rank = dist.get_rank() if dist.is_initialized() else 0
        with checkpoint_aside(path, rank, self._barrier, self._describe()) as aside:
            state, extra = self._state_and_extra()
            dcp.save(state, checkpoint_id=str(aside))
            torch.save(extra, rank_file(aside, rank))

    def load(self, path: str | Path) -> None:
        import torch.distributed.checkpoint as dcp

        rank = dist.get_rank() if dist.is_initialized() else 0
        folder = open_checkpoint(path, rank, self._describe())
        self.discard_gradients()  # gradients of the weights it replaces must not step these
        state = self._state()
        dcp.load(state, checkpoint_id=str(folder))
        self._set_state(state)
        self._take_extra(torch.load(rank_file(folder, rank), weights_only=True))

    def snapshot(self, folder: Path, step: int) -> int:
        """What ``save`` holds, copied into this rank's slot of shared-memory files under
        ``folder`` (``snapshot.py``); returns the bytes written. No collective."""
        state, extra = self._state_and_extra()
        return self._snapshots_in(folder).write(step, state, extra, self._describe())

    def restore_snapshot(self, folder: Path, step: int) -> int:
        """The snapshot of ``step`` back into this engine (a restarted one too), as ``load``
        restores a checkpoint; returns the engine's step."""
        tensors, extra = self._snapshots_in(folder).read(step, self._describe())
        self.discard_gradients()  # as ``load``: what was accumulated belongs to other weights
        state = self._state()
        fill(state, tensors, extra.pop("leaves"))
        self._set_state(state)
        self._take_extra(extra)
        return self.step

    def _set_state(self, state: dict[str, Any]) -> None:
        """A state of ``_state``'s shape (filled from a checkpoint or snapshot) into the module
        and optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.module,
            [self.optimizer] if self.optimizer else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=self._state_options(),
        )

    def _snapshots_in(self, folder: Path) -> RankSnapshots:
        """This rank's snapshots under ``folder``, with the files mapped so far (kept)."""
        folder = Path(folder)
        if self._snapshots is None or self._snapshots.folder != folder:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._snapshots = RankSnapshots(folder, rank)
        return self._snapshots

    def _state_and_extra(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state ``save`` and ``snapshot`` write (``_state``), and this rank's extras: RNG,
        step, schedule, whether the optimizer was fresh."""
        # Before the first step AdamW has no state; to give one, torch's get_state_dict runs a
        # zero-lr step, which would make the next real step AdamW's second (other bias
        # corrections): taking a checkpoint must not change training, so that state is dropped
        # from the optimizer (the tensors returned keep it)
        fresh = self.optimizer is not None and not self.optimizer.state
        state = self._state()
        if fresh and self.optimizer is not None:
            self.optimizer.state.clear()
        extra = {
            "rng": rng_state(self.device),
            "step": self.step,
            "scheduler": self._sched_state(),
            "fresh": fresh,
            "reference_adapters": self._reference,
        }
        return state, extra

    def _take_extra(self, extra: dict[str, Any]) -> None:
        """The extras of ``_state_and_extra`` back, after the state itself was set."""
        if extra.get("fresh") and self.optimizer is not None:
            self.optimizer.state.clear()  # saved before the first step (see _state_and_extra)
        set_rng_state(self.device, extra["rng"])
        self.step = int(extra["step"])
        self._reference = extra.get("reference_adapters")
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = [self.optimizer] if self.optimizer else []
        model_state, optim_state = get_state_dict(
            self.module, optimizers, options=self._state_options()
        )
        return (
            {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}
        )

    def _state_options(self) -> Any:
        """With LoRA a checkpoint holds what trains (the adapters, their optimizer state): the
        frozen base is the model folder's, loaded at build."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.cfg.lora is not None
        # (loading: not strict, since the frozen names are absent; engine.json already names
        # the lora settings a checkpoint was written with, and a mismatch is refused)
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _sched_state(self) -> dict[str, Any] | None:
        return self.scheduler.state_dict() if self.scheduler else None

    def _describe(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "dp": self.dp,
            "tp": self.tp,
            "dp_mode": self.cfg.dp_mode,
            "head": self.head,
        }
        if self.cfg.lora is not None:  # a LoRA checkpoint holds adapters only
            found["lora"] = self.cfg.lora.model_dump(mode="json")
        return found

    def export(self, path: str | Path) -> None:
        """The full weights as a plain Hugging Face folder (safetensors + config + tokenizer),
        gathered to rank 0 and written aside, then renamed into place. With LoRA the folder
        holds the merged weights, and a PEFT adapter folder is written beside it
        (``NAME-adapter``, ``roles/modeling/lora.py``)."""
        raw = self._gathered()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            write_hf_folder(path, self._plain(raw), self.model_config, self.cfg.model)
            if self.cfg.lora is not None:
                write_adapter_folder(adapter_folder(path), raw, self.cfg.lora, self.cfg.model)
        self._barrier()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight whole, on rank 0 (an empty dict elsewhere); a collective. A tied output
        embedding is left out, as ``save_pretrained`` does; LoRA adapters are merged in (plain
        Hugging Face names)."""
        return self._plain(self._gathered())

    def _plain(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.cfg.lora is None or not full:
            return full
        return merged_state(full, self.cfg.lora.scaling)

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Every tensor of the module whole on rank 0, in its own names (adapters apart)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # gathered into host memory: rank 0 must not hold a second whole copy on its device
        offload = self.world > 1 or self.device.kind != DeviceKind.CPU
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        full = get_model_state_dict(self.module, options=options)
        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        if getattr(self.model_config, "tie_word_embeddings", False):
            full.pop("lm_head.weight", None)
        return {k: v.detach().contiguous() for k, v in full.items()}  # type: ignore[union-attr]

    def load_full_state(self, state: dict[str, torch.Tensor], strict: bool = True) -> int:
        """Whole weights (every rank passes the same ``state``, e.g. the actor's ``full_state``)
        into this engine's layout. ``strict=False`` takes the names both models share (an LM's
        backbone into a critic) and ignores the rest; returns how many tensors were loaded."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        own = set(self.module.state_dict())
        if self.cfg.lora is not None:  # plain names onto the wrapped layers' base weights
            state = injected_names(state, own)
        picked: dict[str, Any] = {k: v for k, v in state.items() if k in own}
        tied = getattr(self.model_config, "tie_word_embeddings", False)
        missing = own - set(picked) - ({"lm_head.weight"} if tied else set())
        if self.cfg.lora is not None:  # base weights alone leave the adapters as they are
            missing = {n for n in missing if not is_adapter(n)}
        if not picked or (strict and (missing or len(picked) != len(state))):
            raise EngineError(
                f"weights do not fit this model: {len(picked)} of {len(state)} names match, "
                f"{len(missing)} of its own are missing (e.g. {sorted(missing)[:3]})"
            )
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.module, picked, options=options)
        return len(picked)

    def param_layout(self) -> dict[str, ParamLayout]:
        layout = {}
        for name, param in self.module.named_parameters():
            dims: dict[str, int | None] = {"dp": None, "tp": None}
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                for mesh_dim, placement in zip(names, param.placements, strict=True):
                    dims[mesh_dim] = split_dim(placement)
            layout[name] = ParamLayout(tuple(param.shape), dims["tp"], dims["dp"])
        return layout

    def held_pieces(self) -> dict[str, torch.Tensor]:
        """Each parameter's local tensor itself (a DTensor's local shard object, so reshard's
        ``Tensor.set_`` re-points the storage the module computes with)."""
        out = {}
        for name, param in self.module.named_parameters():
            local = param._local_tensor if isinstance(param, DTensor) else param
            out[name] = local
        return out

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _local_and_copies(grad: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """The rank-local part of a gradient and how many ranks hold that same part."""
    if isinstance(grad, DTensor):
        shards = math.prod(
            grad.device_mesh.size(i)
            for i, p in enumerate(grad.placements)
            if split_dim(p) is not None
        )
        return grad.to_local(), world // shards
    return grad, world


def _width(batch: TensorBatch) -> int:
    return batch.tensor("input_ids").shape[1]


def trim(micro: TensorBatch) -> TensorBatch:
    """Drop columns past the last real token of any row (right padding costs nothing)."""
    mask = micro.tensor("attention_mask")
    width = mask.shape[1]
    used = int(mask.any(0).nonzero().max()) + 1 if bool(mask.any()) else 1
    if used == width:
        return micro
    tensors = {
        k: v[:, :used] if v.dim() >= 2 and v.shape[1] == width else v
        for k, v in micro.tensors.items()
    }
    return TensorBatch(tensors, dict(micro.non_tensors), dict(micro.meta))


def _pad_to(result: torch.Tensor, width: int) -> torch.Tensor:
    if result.dim() < 2 or result.shape[1] == width:
        return result
    return F.pad(result, [0, 0] * (result.dim() - 2) + [0, width - result.shape[1]])
