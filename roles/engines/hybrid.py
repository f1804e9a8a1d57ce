"""The actor's 3D-HybridEngine: generation at the group's generation layout (``gen_tp``), with
weights resharded from the training engine's for each ``generate`` and freed after.

Training runs at tp = t (the FSDP engine's DTensor plan: q/k/v/gate/up split by rows, o/down by
columns, the rest whole). Generation runs at t_g dividing t: each training replica becomes
d_g = t/t_g micro-DP replicas, formed by the paper's grouping (``reshard/layout.py``), so a rank's
training shard lies inside its generation shard. Per ``weights()`` block:

1. ``reshard.transfer.Transfer`` all-gathers, within each micro-DP group, the training pieces the
   others lack; each rank's own training tensors are re-pointed into their place in the new
   generation shard (no copy kept twice);
2. the generation shard is bound into a skeleton of the model whose row-parallel projections
   all-reduce over the generation tp group (``RowParallel``) — the native engine runs it as is;
3. at the end of the block the skeleton lets go of the shard, the training tensors get storage of
   their own again and what was gathered is freed.

The training weights are never changed (the tests check them bitwise). Needs ``dp_mode:
replicate`` (or dp = 1): FSDP-sharded training weights are planned by ``reshard/plan.py`` but not
executed here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.layout import GenLayout, gen_groups, params_from_layout
from reshard.plan import make_plan
from reshard.transfer import Transfer, gather_group, release
from roles.engines.training.interface import TrainingEngine
from transport.device import in_host_memory
from transport.protocol import Layout


class HybridError(ValueError):
    """A layout the hybrid engine cannot run, with what to change."""


class RowParallel(torch.nn.Module):
    """A linear layer whose input features are split over a tp group: the local product, then
    a sum over the group (the bias, if any, added once after)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.group is not None:
            dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a parameter: a DTensor's local shard object itself (not a view
    of it), so ``set_`` on it re-points the storage the module computes with."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        local: torch.Tensor = param._local_tensor
        return local
    return param


class HybridEngine:
    def __init__(self, engine: TrainingEngine, layout: Layout, bucket_bytes: int) -> None:
        if layout.pp != 1 or layout.generation_pp != 1:
            raise HybridError("the hybrid engine runs pp = 1 (pipeline stages come with Megatron)")
        module = _module(engine)
        if layout.dp > 1 and engine.cfg.dp_mode == "fsdp":
            raise HybridError(
                f"gen_tp={layout.generation_tp} with dp={layout.dp} needs the actor's dp_mode: "
                "replicate (FSDP-sharded training weights are not resharded yet)"
            )
        self.engine, self.rank = engine, dist.get_rank()
        self.gen = GenLayout(tp=layout.generation_tp)
        params = params_from_layout({n: p.as_dict() for n, p in engine.param_layout().items()})
        self.plan = make_plan(params, layout, self.gen, "hybridflow", bucket_bytes=bucket_bytes)
        self.group = gather_group(self.plan)
        tp_groups = gen_groups(layout, self.gen, "hybridflow")["tp"]
        tp_group = dist.new_subgroups_by_enumeration(tp_groups)[0] if self.gen.tp > 1 else None
        self.skeleton = _skeleton(module.config, tp_group)
        self.last: dict[str, float] = {}

    @contextmanager
    def weights(self) -> Iterator[torch.nn.Module]:
        """The model at the generation layout for the duration of the block."""
        module = _module(self.engine)
        train = {n: local_tensor(p) for n, p in module.named_parameters()}
        dtype = next(iter(train.values())).dtype
        start = time.perf_counter()
        gen = Transfer(self.plan, self.rank, self.group, dtype).run(train, reuse=True)
        self.last = {
            "reshard_s": time.perf_counter() - start,
            "reshard_recv_bytes": float(self.plan.recv_bytes(self.rank)),
        }
        _bind(self.skeleton, gen)
        try:
            yield self.skeleton
        finally:
            _unbind(self.skeleton, gen)
            release(train, gen)


def _module(engine: TrainingEngine) -> torch.nn.Module:
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise HybridError(f"{type(engine).__name__} exposes no module to reshard")
    return module


def _skeleton(config: Any, tp_group: dist.ProcessGroup | None) -> torch.nn.Module:
    """The model's module tree with no weights (meta), real rotary tables, and row-parallel
    projections that all-reduce over ``tp_group``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = getattr(model, str(model.base_model_prefix))
    base.rotary_emb = type(base.rotary_emb)(config=config)
    for layer in base.layers:
        layer.self_attn.o_proj = RowParallel(tp_group)
        layer.mlp.down_proj = RowParallel(tp_group)
    model.eval()
    return model


def _bind(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
            tensor, requires_grad=False
        )
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def _unbind(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        placeholder = torch.empty(tensor.shape, device="meta", dtype=tensor.dtype)
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
            placeholder, requires_grad=False
        )


@contextmanager
def optimizer_offloaded(optimizer: torch.optim.Optimizer | None) -> Iterator[int]:
    """The optimizer's state moved to host memory for the block (e.g. while generating) and its
    own storage freed; restored bitwise after. Yields the bytes moved. On a GPU this frees
    device memory for the generation shard and KV cache; on CPU the host copy lives in the same
    memory, so it only exercises the mechanism (freeing and restoring storage)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    tensor = local_tensor(value)
                    host = torch.empty(
                        tensor.shape,
                        dtype=tensor.dtype,
                        pin_memory=not in_host_memory(tensor),
                    )
                    host.copy_(tensor)
                    tensor.untyped_storage().resize_(0)
                    saved.append((tensor, host))
    try:
        yield sum(host.numel() * host.element_size() for _, host in saved)
    finally:
        for tensor, host in saved:
            tensor.untyped_storage().resize_(host.numel() * host.element_size())
            tensor.copy_(host)
