"""Typed configuration of a training engine: the model it trains, its optimizer and schedule.

Roles receive these as plain dicts from the placement (``RoleSpec.config``) and validate them
here, on every rank, before any weight is loaded — a bad value fails the group's build call with
the field's name, not a stack trace from deep inside torch.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from roles.runtime.device import Precision


class OptimConfig(BaseModel):
    """AdamW with linear warm-up, then a constant, linear or cosine schedule."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0")
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = Field(
        None, ge=1, description="optimizer steps the linear/cosine decay spans"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decay, as lr fraction")
    grad_clip: float | None = Field(1.0, gt=0, description="max global gradient norm; null: off")

    @model_validator(mode="after")
    def _decay_has_length(self) -> OptimConfig:
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(
                f"optim.schedule={self.schedule!r} needs optim.total_steps (the steps it decays "
                "over); set it or use schedule='constant'"
            )
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps} exceeds optim.total_steps="
                f"{self.total_steps}"
            )
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant" or self.total_steps is None:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.schedule == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


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
    vpp: int = Field(
        1, ge=1, description="megatron: virtual pipeline stages per rank (interleaved schedule)"
    )
    distributed_optimizer: bool = Field(
        False, description="megatron: shard optimizer state over dp (megatron-core's optimizer)"
    )
    optim: OptimConfig | None = Field(
        default_factory=OptimConfig, description="null for frozen weights (reference, reward)"
    )
