"""Settings of the training calls: the policy loss (``update_policy``), the value loss
(``update_critic``) and the optimizer with its schedule (``configure_optim``).

The controller builds them from the experiment config; the roles compute with them
(``roles/modeling/losses.py`` holds the loss functions, ``roles/engines/training/`` the
optimizers). They travel as structs (``transport/structs.py``): validated when built, and again
when a rank receives them, with errors that name the field.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from transport.imports import import_path

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["k1", "abs", "k2", "k3", "mse", "low_var_kl"]
#: the policy-gradient term (docs/algorithms.md has each formula and its source)
PolicyKind = Literal["ppo", "gspo", "gspo-token", "cispo", "importance_sampling", "dro"]
#: kinds whose objective is a mean over responses: their default ``agg`` is seq-mean-token-mean
SEQUENCE_KINDS = ("gspo", "gspo-token")


#: how a ``forward_backward`` call's loss is normalised: by its own batch ("mean"), or not at
#: all ("sum": calls on parts add up to one call on the whole, as Tinker's losses do)
Reduction = Literal["mean", "sum"]


class PolicyLossConfig(BaseModel):
    """The policy loss of an update: its kind (PPO, GSPO, CISPO or your own function), clip
    ranges, how token losses are averaged (``agg``), KL and entropy terms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: PolicyKind = Field(
        "ppo",
        description="the policy-gradient term: ppo (token-level clipped ratio), gspo / "
        "gspo-token (the sequence's geometric-mean ratio, clipped per sequence; Zheng et al. "
        "2025), cispo (the clipped ratio as a stop-gradient weight on log pi; MiniMax-M1), "
        "importance_sampling (-A * pi / pi_old, no clipping: the REINFORCE gradient for "
        "samples from another policy, as Tinker's loss of that name), dro (-A log pi plus a "
        "quadratic penalty 0.5 beta (log pi - log pi_old)^2 in place of clipping; Richemond et al. 2024, "
        "as Tinker's loss of that name, beta: dro_beta)",
    )
    custom: str | None = Field(
        None,
        description="a policy-gradient term of your own, as package.module:function (replaces "
        "kind; roles/modeling/losses.py says what it takes and returns)",
    )
    clip_ratio_low: float = Field(0.2, description="ratio floor is 1 - clip_ratio_low")
    dro_beta: float = Field(
        0.05, ge=0, description="kind dro: the weight beta of its quadratic penalty"
    )
    clip_ratio_high: float | None = Field(
        None, description="ratio ceiling is 1 + clip_ratio_high; null: same as clip_ratio_low"
    )
    dual_clip: float | None = Field(
        3.0, description="cap on a negative-advantage token's loss, in units of -A; null: off"
    )
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus")
    kl_coef: float = Field(0.0, description="weight of KL-to-reference; needs ref_log_probs")
    kl_type: KLKind = Field("k3", description="KL estimator, see kl_penalty")
    agg: AggMode = Field(
        "token-mean",
        description="how per-token terms become one number; unset with kind gspo / gspo-token: "
        "seq-mean-token-mean (the mean over responses, as the GSPO paper and verl)",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="truncated importance sampling: weight each token's policy loss by "
        "min(pi_old / pi_rollout, tis_cap), pi_rollout being the generator's own log-probs "
        "(rollout_log_probs), as verl and slime do for vLLM rollouts; null: off",
    )
    decoupled: bool = Field(
        False,
        description="AReaL's decoupled PPO: clip pi / pi_prox (pi_prox = the recomputed pi_old) "
        "and weight each token by the behaviour weight pi_prox / pi_behav (pi_behav = the "
        "generator's log-probs), capped at tis_cap when that is set, uncapped otherwise",
    )

    @field_validator("custom")
    @classmethod
    def _custom_imports(cls, path: str | None) -> str | None:
        """Resolved when the config is made (the ranks import it again): a typo fails here,
        before a mesh's first call, not in the ranks after a stage ran."""
        if path is not None:
            import_path(path, "policy loss", "function", callable)
        return path

    @model_validator(mode="before")
    @classmethod
    def _kind_default_agg(cls, data: Any) -> Any:
        """GSPO's objective is a mean over responses of a sequence-level term: its own default
        aggregation is ``seq-mean-token-mean``, not the token mean that weights long responses
        more. An ``agg`` given explicitly wins."""
        if isinstance(data, dict) and "agg" not in data and data.get("kind") in SEQUENCE_KINDS:
            return {**data, "agg": "seq-mean-token-mean"}
        return data

    @field_validator("clip_ratio_low", "clip_ratio_high", "kl_coef")
    @classmethod
    def _non_negative(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"{info.field_name}={value} must be >= 0")
        return value

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        if value is not None and value <= 1:
            raise ValueError(f"dual_clip={value} must be > 1 (or null to disable)")
        return value

    @property
    def clip_high(self) -> float:
        return self.clip_ratio_low if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def behaviour_cap(self) -> float | None:
        """Cap of the per-token behaviour weight pi_old / pi_rollout; None: no weight at all.

        Truncated IS (``tis_cap``) and decoupled PPO (``decoupled``) are one formula: with
        r = pi / pi_prox and w = pi_prox / pi_behav (no gradient),

            loss_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))

        where pi_prox is the trainer's recomputed pi_old. Decoupled PPO (Fu et al. 2025, AReaL)
        is that objective with w uncapped (cap = inf) unless ``tis_cap`` bounds it; TIS is it
        with w capped. So ``decoupled`` only names the uncapped case, on the same code path.
        """
        if self.tis_cap is not None:
            return self.tis_cap
        return math.inf if self.decoupled else None


class ValueLossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clip: float | None = Field(0.5, description="max move of a value from its old one; null: off")
    agg: AggMode = Field("token-mean", description="how per-token terms become one number")

    @field_validator("clip")
    @classmethod
    def _clip_non_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"clip={value} must be >= 0 (or null to disable)")
        return value


class AdamStep(BaseModel):
    """One optimizer step's own AdamW settings (Tinker's ``AdamParams``, sent with each step):
    they take the place of the optimizer's and schedule's for that step; the moments and the
    step count carry on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(ge=0, description="this step's learning rate")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(None, gt=0, description="max global gradient norm; None: off")

    @model_validator(mode="after")
    def _betas_below_one(self) -> AdamStep:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas {self.betas}: each must be in [0, 1)")
        return self


class OptimConfig(BaseModel):
    """AdamW with linear warm-up, then a constant, linear or cosine schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
