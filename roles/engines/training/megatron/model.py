"""A Hugging Face Llama config as megatron-core's ``GPTModel`` chunks on one rank.

* ``init_parallel(layout, vpp, ...)`` sets up megatron-core's parallel state on the group's
  process group, with the group's rank order (tp fastest, then pp, then dp: megatron's order
  ``tp-pp-dp``) and the group's collective timeout. That state is global to the process: roles
  colocated in one group share it, so a second role of the same layout reuses it and one of
  another layout is refused.
* ``build_chunks(config, shape, ...)`` makes this rank's model chunks (one per virtual pipeline
  stage) with the local layer spec (no Transformer Engine): RMSNorm, SwiGLU (``linear_fc1`` =
  [gate; up]), RoPE with the config's theta, grouped-query attention, no biases, no dropout,
  fp32 parameters created on the CPU. The last chunk of the last stage ends in the LM head (its
  logits gathered over tp) or, for a ``token`` engine, in ``ValueHead``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from roles.engines.training.megatron.convert import Place, Shape
from transport.protocol import Layout

# what the converter and this builder know how to map
_ARCHITECTURES = frozenset({"llama", "mistral"})


class ModelError(ValueError):
    """A model or layout megatron-core cannot build here, with what to change."""


@dataclass(frozen=True)
class ParallelSizes:
    tp: int
    pp: int
    vpp: int
    world: int


def check_config(config: Any) -> float:
    """Refuse what ``GPTModel`` would compute differently from the HF model; return the RoPE
    theta."""
    kind = getattr(config, "model_type", None)
    if kind not in _ARCHITECTURES:
        raise ModelError(
            f"the megatron engine builds Llama-family models ({sorted(_ARCHITECTURES)}); "
            f"got model_type={kind!r}; use backend: fsdp for it"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ModelError(f"{flag}=True is not mapped to megatron; use backend: fsdp")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelError(f"hidden_act={config.hidden_act!r}: the megatron engine builds SwiGLU")
    if getattr(config, "sliding_window", None):
        raise ModelError("sliding-window attention is not mapped to megatron; use backend: fsdp")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or "default"
    if kind != "default":
        raise ModelError(f"rope_type={kind!r} is not mapped to megatron; use backend: fsdp")
    theta: Any = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    return float(theta)


def init_parallel(layout: Layout, vpp: int, timeout: datetime.timedelta) -> ParallelSizes:
    """megatron-core's parallel state for ``layout`` (once per process; a second call with the
    same sizes is a no-op, with other sizes a ``ModelError``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    wanted = ParallelSizes(layout.tp, layout.pp, vpp, layout.world_size)
    if ps.model_parallel_is_initialized():
        found = ParallelSizes(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            torch.distributed.get_world_size(),
        )
        if found != wanted:
            raise ModelError(
                f"megatron-core's parallel state is global to a process and already set to "
                f"tp={found.tp} pp={found.pp} vpp={found.vpp} by a colocated role; this role "
                f"asks for tp={wanted.tp} pp={wanted.pp} vpp={wanted.vpp}: give the roles of "
                "one group the same layout (and vpp), or place this role in its own group"
            )
        return found
    if vpp > 1 and layout.pp == 1:
        raise ModelError(f"vpp={vpp} needs pipeline stages to interleave; set pp > 1 or vpp: 1")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=timeout.total_seconds() / 60,
        order="tp-cp-ep-pp-dp",
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(0)
    return wanted


def check_rank_order(layout: Layout, rank: int) -> None:
    """megatron's groups must be the layout's (a mismatch would silently pair wrong ranks)."""
    from megatron.core import parallel_state as ps

    dp, pp, tp = layout.coords(rank)
    found = (
        ps.get_data_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
    )
    if found != (dp, pp, tp):
        raise ModelError(
            f"rank {rank}: megatron placed it at {found}, the layout at {(dp, pp, tp)}"
        )


def transformer_config(shape: Shape, sizes: ParallelSizes, eps: float) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp if sizes.vpp > 1 else None,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        # initialised (then overwritten by the HF weights): megatron sets the tensor-parallel
        # attributes of a weight (which the gradient norm reads) only while initialising it
        perform_initialization=True,
        # no fused kernels (CUDA-only) and no gradient-accumulation fusion (needs apex)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # rows and lengths change from micro-batch to micro-batch: stages exchange shapes first.
        # Not under the interleaved schedule: at pp = 2 it sends both ways to the one peer in
        # the same batch of shape messages, which then cross (the engine pads to one shape)
        variable_seq_lengths=sizes.vpp == 1,
        moe_token_dispatcher_type="alltoall",  # no experts; the default refuses variable lengths
        batch_p2p_comm=False,  # batched p2p ends in torch.cuda.synchronize()
        # the schedule neither divides the loss by the micro-batch count nor DDP by dp: the
        # engine's losses are already normalised by the global counts
        calculate_per_token_loss=True,
    )


class ValueHead(torch.nn.Module):
    """One scalar per position (HF's token-classification ``score``: weight ``[1, H]`` and a
    bias), in the place of ``GPTModel.output_layer`` and called the way it calls that."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight, self.bias), None


def build_chunks(
    config: Any, shape: Shape, sizes: ParallelSizes, place: Place
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks (randomly initialised weights: load them next)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    theta = check_config(config)
    place.check(shape)
    mconfig = transformer_config(shape, sizes, float(config.rms_norm_eps))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    chunks: list[torch.nn.Module] = []
    with torch.random.fork_rng(devices=[]):  # random init must not move the CPU stream
        for chunk in range(sizes.vpp):
            chunks.append(_chunk(config, shape, mconfig, spec, theta, chunk, sizes.vpp))
    return chunks


def _chunk(
    config: Any, shape: Shape, mconfig: Any, spec: Any, theta: float, chunk: int, vpp: int
) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    stage = chunk if vpp > 1 else None
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
    model = GPTModel(
        mconfig,
        spec,
        vocab_size=shape.vocab,
        max_sequence_length=int(config.max_position_embeddings),
        pre_process=first,
        post_process=last,
        parallel_output=False,  # the loss functions take whole-vocabulary logits
        share_embeddings_and_output_weights=shape.tied,
        position_embedding_type="rope",
        rotary_base=theta,
        vp_stage=stage,
    )
    if last and shape.head == "token":
        model.output_layer = ValueHead(shape.hidden)
    model.eval()  # no dropout anywhere: ranks and recomputations must agree
    return model
