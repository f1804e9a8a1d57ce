"""Typed configuration of a training engine: the model it trains, its optimizer and schedule.

Roles receive these as plain dicts from the placement (``RoleSpec.config``) and validate them
here, on every rank, before any weight is loaded — a bad value fails the group's build call with
the field's name, not a stack trace from deep inside torch. ``OptimConfig`` is also what the
controller sends ``configure_optim`` at the start of a training stage, so it lives in
``transport/training.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from roles.engines.generation.sessions import DEFAULT_SESSION_CACHE_MB
from roles.modeling.lora import LoraSettings
from roles.runtime.device import Precision
from transport.training import OptimConfig

__all__ = ["EngineConfig", "OptimConfig"]  # OptimConfig: transport/training.py (configure_optim)


class EngineConfig(BaseModel):
    """What a training engine loads and how it computes."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="path of a Hugging Face model directory")
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp",
        description="training engine: fsdp (FSDP2 + DTensor tp, the default) or megatron "
        "(megatron-core tp x pp x dp; the [megatron] extra)",
    )
    dtype: Precision = Field(
        "auto",
        description="bf16: autocast the forward/backward, keep fp32 master weights; auto: bf16 "
        "where the hardware multiplies bf16 natively, else fp32 (roles/runtime/device.py)",
    )
    micro_batch_size: int = Field(8, ge=1, description="rows per forward/backward on one rank")
    attention: Literal["auto", "sdpa", "eager"] = Field(
        "auto",
        description="attention kernel of the training forward: sdpa (torch's fused kernel), "
        "eager (plain matmuls + softmax); auto: eager for bf16 on CPU up to "
        "EAGER_MAX_WIDTH tokens a row, where torch's CPU flash kernel is the slower "
        "(python -m bench.attention), sdpa otherwise",
    )
    logits_at: Literal["response", "all"] = Field(
        "response",
        description="where a pass computes the vocabulary projection and softmax: response "
        "(from the position before a batch's earliest response token; the prompt's positions "
        "are never scored, and their log-probs read 0) or all",
    )
    share_prompts: bool = Field(
        True,
        description="rows that start with the same prompt (a GRPO group) are packed with the "
        "prompt computed once and no padding, for log-probs and updates alike; the numbers are "
        "the same (roles/modeling/shared_prompt.py). fsdp backend, lm head, logits_at: response",
    )
    dp_mode: Literal["fsdp", "replicate"] = Field(
        "fsdp",
        description="fsdp: shard weights, gradients and optimizer state over dp (FSDP2); "
        "replicate: every dp rank holds the whole model and gradients are all-reduced once "
        "per step - less traffic for models that fit on one device",
    )
    seed: int = 0
    offload_optimizer: bool = Field(
        False,
        description="while the actor generates: optimizer state in host memory, restored after",
    )
    reshard_bucket_mb: float = Field(
        64, gt=0, description="bucket of the training->generation reshard (placement gen_tp)"
    )
    generator: Literal["native", "hf", "vllm"] = Field(
        "native",
        description="generation engine of the actor's colocated generate (vllm: the [vllm] "
        "extra; generates at gen_tp = tp or 1)",
    )
    session_cache_mb: float = Field(
        DEFAULT_SESSION_CACHE_MB,
        ge=0,
        description="generator native: KV caches of multi-turn trajectories kept between their turns "
        "(per rank, MiB; the least recently used are dropped beyond it, then re-prefilled; 0: off)",
    )
    vpp: int = Field(
        1, ge=1, description="megatron: virtual pipeline stages per rank (interleaved schedule)"
    )
    distributed_optimizer: bool = Field(
        False, description="megatron: shard optimizer state over dp (megatron-core's optimizer)"
    )
    optim: OptimConfig | None = Field(
        default_factory=OptimConfig, description="null for frozen weights (reference, reward)"
    )
    lora: LoraSettings | None = Field(
        None,
        description="train low-rank adapters instead of the weights (PEFT's LoRA layers; fsdp "
        "backend, tp 1): the base stays frozen, the optimizer holds only the adapters, weight "
        "syncs carry only them, and an actor's reference is itself with adapters off",
    )
