"""The actor's 3D-HybridEngine: generation at the group's generation layout (``gen_tp``), with
weights resharded from the training engine's for each ``generate`` and freed after.

Training runs at tp = t and pp = p (the fsdp engine's DTensor plan, or megatron-core's layers:
each engine hands its pieces in Hugging Face names, ``TrainingEngine.held_pieces``). Generation
runs at t_g dividing t and one pipeline stage: each training replica becomes d_g = p·t/t_g
micro-DP replicas, formed by the paper's grouping (``reshard/layout.py``), so a rank's training
shard lies inside its generation shard. Per ``weights()`` block:

1. ``reshard.transfer.Transfer`` all-gathers, within each micro-DP group, the training pieces the
   others lack (under pp: the other stages' layers); where the engine's pieces are its own
   tensors (``held_in_place``) they are re-pointed into their place in the new generation shard
   (no copy kept twice);
2. the generation shard is bound into a skeleton of the model whose row-parallel projections
   all-reduce over the generation tp group (``RowParallel``), and whose embedding and head, when
   the engine splits them over the vocabulary (megatron), look up and gather over it too — the
   native engine runs it as is;
3. at the end of the block the skeleton lets go of the shard, the training tensors get storage of
   their own again and what was gathered is freed.

The training weights are never changed (the tests check them bitwise). Needs weights whole over
dp (fsdp's ``dp_mode: replicate``, or dp = 1; megatron's DDP): FSDP-sharded training weights are
planned by ``reshard/plan.py`` but not executed here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.layout import GenLayout, gen_groups, gen_place, params_from_layout
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
        if layout.generation_pp != 1:
            raise HybridError(
                f"the hybrid engine generates on one pipeline stage; got gen_pp="
                f"{layout.generation_pp} (pp={layout.pp}): set the placement's gen_pp: 1"
            )
        layout_of = engine.param_layout()
        if layout.dp > 1 and any(p.dp_dim is not None for p in layout_of.values()):
            raise HybridError(
                f"gen_tp={layout.generation_tp} with dp={layout.dp} needs weights whole over dp "
                "(the fsdp engine's dp_mode: replicate): FSDP-sharded training weights are not "
                "resharded yet"
            )
        self.engine, self.rank = engine, dist.get_rank()
        self.gen = GenLayout(tp=layout.generation_tp)
        params = params_from_layout({n: p.as_dict() for n, p in layout_of.items()})
        self.plan = make_plan(params, layout, self.gen, "hybridflow", bucket_bytes=bucket_bytes)
        self.group = gather_group(self.plan)
        tp_groups = gen_groups(layout, self.gen, "hybridflow")["tp"]
        tp_group = dist.new_subgroups_by_enumeration(tp_groups)[0] if self.gen.tp > 1 else None
        place = gen_place(layout, self.gen, self.rank, "hybridflow")
        vocab_split = {
            p.name for p in params if p.split == "column" and p.name in _VOCAB and self.gen.tp > 1
        }
        self.skeleton = _skeleton(engine.model_config, tp_group, vocab_split, place.tp)
        self.last: dict[str, float] = {}

    @contextmanager
    def weights(self) -> Iterator[torch.nn.Module]:
        """The model at the generation layout for the duration of the block."""
        train = self.engine.held_pieces()
        dtype = next(iter(train.values())).dtype
        start = time.perf_counter()
        reuse = self.engine.held_in_place
        with torch.no_grad():
            device = next(iter(train.values())).device  # where the training pieces are
            gen = Transfer(self.plan, self.rank, self.group, dtype, device).run(train, reuse=reuse)
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


#: the HF names of the embedding and the LM head (megatron splits them over the vocabulary)
_VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows (the vocabulary) are split over a tp group: each rank looks up
    the ids in its range, zero elsewhere, and the group sums (exact: one term is non-zero)."""

    def __init__(self, group: dist.ProcessGroup | None, index: int) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.register_parameter("weight", None)

    weight: torch.Tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.index * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.clamp(0, rows - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredHead(torch.nn.Module):
    """An LM head whose rows (the vocabulary) are split over a tp group: each rank's logits,
    gathered over the group in vocabulary order."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.register_parameter("weight", None)

    weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _skeleton(
    config: Any, tp_group: dist.ProcessGroup | None, vocab_split: set[str], tp_index: int
) -> torch.nn.Module:
    """The model's module tree with no weights (meta), real rotary tables, row-parallel
    projections that all-reduce over ``tp_group``, and a vocabulary-parallel embedding and head
    for the names in ``vocab_split``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = getattr(model, str(model.base_model_prefix))
    base.rotary_emb = type(base.rotary_emb)(config=config)
    for layer in base.layers:
        layer.self_attn.o_proj = RowParallel(tp_group)
        layer.mlp.down_proj = RowParallel(tp_group)
    if "model.embed_tokens.weight" in vocab_split:
        base.embed_tokens = VocabParallelEmbedding(tp_group, tp_index)
        if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" in vocab_split:
            model.lm_head = GatheredHead(tp_group)
    model.eval()
    return model


def _bind(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
            tensor, requires_grad=False
        )
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        model.lm_head.weight = model.get_input_embeddings().weight


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
        for _, state in optimizer.state.items():  # a dict, or megatron's ProxyDict
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
