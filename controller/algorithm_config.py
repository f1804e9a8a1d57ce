"""An RL stage's algorithm settings (``stages[i].algorithm`` of an experiment): which program
runs a step (``name``), sampling, the estimator's and the loss's settings, KL, the rollout
pipeline's options (staleness, streaming, partial rollout, dynamic sampling) and reward shaping.
The programs themselves are in ``controller/algorithms.py``."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from controller import advantages as adv
from controller.streaming import PartialRollout
from transport.sampling import SamplingConfig
from transport.training import PolicyLossConfig, ValueLossConfig

Name = Literal[
    "ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "safe_rlhf", "distill"
]
GROUPED = ("grpo", "rloo", "reinforce_pp_baseline")  # need n >= 2 samples per prompt
WITH_CRITIC = ("ppo", "safe_rlhf")


class KLConfig(BaseModel):
    """KL to the reference policy: a per-token penalty in the reward (k1 = log pi - log ref;
    fixed, or adaptive when ``target`` is set) or a term of the policy loss (``kl_type``)."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(0.0, ge=0, description="0: no KL and no reference role needed")
    mode: Literal["reward", "loss"] = "reward"
    kl_type: Literal["k1", "abs", "k2", "k3", "mse", "low_var_kl"] = Field(
        "low_var_kl", description="estimator of the loss term (mode: loss)"
    )
    target: float | None = Field(None, gt=0, description="adaptive controller's target KL")
    target_unit: Literal["sequence", "token"] | None = Field(
        None,
        description="what target measures: 'sequence' (KL summed over each response) or "
        "'token' (mean per response token, verl's kl_ctrl.target_kl); required with target",
    )
    horizon: int = Field(10000, ge=1, description="adaptive controller's horizon, in samples")

    @model_validator(mode="after")
    def _unit_with_target(self) -> KLConfig:
        if self.target is not None and self.target_unit is None:
            raise ValueError(
                f"kl.target={self.target} needs kl.target_unit: 'sequence' (the KL summed over "
                "each response) or 'token' (its mean per response token, as verl's target_kl; "
                "a target copied from verl is 'token'); they differ by the response length"
            )
        return self

    def measure(self, kl: torch.Tensor, mask: torch.Tensor) -> float:
        """The batch's KL in the target's unit (``advantages.kl_measure``)."""
        return adv.kl_measure(kl, mask, self.target_unit or "sequence")

    def controller(self) -> adv.FixedKL | adv.AdaptiveKL:
        if self.target is not None:
            return adv.AdaptiveKL(self.coef, self.target, self.horizon)
        return adv.FixedKL(self.coef)


class SafeConfig(BaseModel):
    """Safe-RLHF's Lagrangian: maximise reward subject to E[cost] <= ``cost_threshold``."""

    model_config = ConfigDict(extra="forbid")

    cost_threshold: float = 0.0
    lambda_init: float = Field(1.0, ge=0)
    lambda_lr: float = Field(0.05, gt=0, description="step of lambda per unit of cost excess")
    lambda_max: float | None = Field(None, gt=0)
    ptx_coef: float = Field(0.0, ge=0, description="weight of a pretraining (SFT) loss step")


class DynamicSampling(BaseModel):
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose samples all scored alike give
    GRPO no gradient; they are dropped and more prompts are drawn until the step has
    ``prompts_per_step`` informative groups or ``max_rounds`` extra rounds were drawn."""

    model_config = ConfigDict(extra="forbid")

    max_rounds: int = Field(
        3,
        ge=0,
        description="extra generation rounds a step may draw (each prompts_per_step prompts); at "
        "the cap the step trains on the informative groups it has",
    )


class OverlongShaping(BaseModel):
    """DAPO's soft overlong punishment (controller/advantages.py: overlong_penalty)."""

    model_config = ConfigDict(extra="forbid")

    cache: int = Field(
        ge=1,
        description="L_cache: responses longer than max_new_tokens - cache tokens lose up to "
        "factor points, linearly, reaching -factor at max_new_tokens",
    )
    factor: float = Field(1.0, gt=0, description="the penalty at the limit")


class AlgorithmConfig(BaseModel):
    """What one RL step does. The policy loss (``loss``) and value loss (``value_loss``) travel
    to the roles as they are (``transport/training.py``; computed in ``roles/modeling/losses.py``)."""

    model_config = ConfigDict(extra="forbid")

    name: Name = "grpo"
    program: str | None = Field(
        None,
        description="a step program of your own, as package.module:function (an async function "
        "taking roles, batch, cfg, state, step and returning metrics; docs/api.md), run instead "
        "of name's; name still says which roles and samples the stage needs",
    )
    prompts_per_step: int = Field(16, ge=1)
    n: int = Field(8, ge=1, description="samples per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(32, ge=1)
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten: bool = Field(True, description="whiten GAE advantages over the batch")
    norm_std: bool = Field(True, description="GRPO: divide by the group's std")
    kl: KLConfig = Field(default_factory=KLConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    value_loss: ValueLossConfig = Field(default_factory=ValueLossConfig)
    old_log_probs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="rollout: take pi_old from the generator's own log-probs (saves a forward "
        "pass; exact for fp32 on-policy, the behaviour policy when off-policy)",
    )
    max_staleness: int = Field(
        0,
        description="k: batches for steps n+1..n+k are generated while step n trains, on "
        "weights at most k RL steps old; 0: on-policy (generate, train, sync). Overlaps only "
        "with a rollout group apart from the actor; the colocated actor alternates on its ranks "
        "(same samples, no overlap)",
    )
    overlap: bool = Field(
        False,
        description="alias of max_staleness: 1 (generate the next batch while training on this "
        "one); refused together with another max_staleness",
    )
    stream_chunks: int = Field(
        1,
        ge=1,
        description="sub-batches a step's prompts are generated in, each scored while the next "
        "generates (controller/streaming.py)",
    )
    partial_rollout: PartialRollout | None = Field(
        None, description="generate chunk_tokens per call; weight updates may land in between"
    )
    safe: SafeConfig | None = None
    distill_coef: float = Field(
        1.0,
        gt=0,
        description="distill: the advantage of a sampled token is -distill_coef x (log pi_student "
        "- log pi_teacher), the per-token reverse KL to the teacher role",
    )
    dynamic_sampling: DynamicSampling | None = Field(
        None,
        description="DAPO: drop prompt groups whose rewards are all equal and draw more prompts "
        "(grpo, rloo, reinforce_pp_baseline); null: off",
    )
    overlong: OverlongShaping | None = Field(
        None, description="DAPO: soft penalty on responses near max_new_tokens; null: off"
    )

    @model_validator(mode="after")
    def _staleness(self) -> AlgorithmConfig:
        if self.max_staleness < 0:
            raise ValueError(
                f"max_staleness={self.max_staleness} must be >= 0 (0: on-policy; k: batches "
                "generated on weights up to k RL steps old)"
            )
        if self.overlap:
            if self.max_staleness not in (0, 1):
                raise ValueError(
                    f"overlap: true means max_staleness: 1, but max_staleness={self.max_staleness}"
                    " is set too; drop overlap and keep max_staleness"
                )
            self.max_staleness = 1
        return self

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.name in GROUPED and self.n < 2:
            raise ValueError(
                f"algorithm {self.name!r} compares samples of the same prompt: set n >= 2 "
                f"(got n={self.n})"
            )
        if self.dynamic_sampling is not None and self.name not in GROUPED:
            raise ValueError(
                f"dynamic_sampling drops groups of samples of one prompt that scored alike; "
                f"algorithm {self.name!r} has no such groups (use one of {list(GROUPED)})"
            )
        if self.overlong is not None and self.overlong.cache > self.max_new_tokens:
            raise ValueError(
                f"overlong.cache={self.overlong.cache} must be at most max_new_tokens="
                f"{self.max_new_tokens} (the penalty starts cache tokens before the limit)"
            )
        if self.name == "safe_rlhf" and self.safe is None:
            self.safe = SafeConfig()
        if self.name == "remax" and self.kl.coef and self.kl.mode == "reward":
            raise ValueError(
                "remax compares with a greedy sample that has no KL term; use kl.mode: loss"
            )
        if self.kl.target is not None and self.kl.mode == "loss":
            raise ValueError("kl.target (the adaptive controller) only applies to kl.mode: reward")
        if self.behaviour_weighted and self.old_log_probs == "rollout":
            raise ValueError(
                "loss.tis_cap / loss.decoupled reweight the recomputed pi_old toward the "
                "generator's log-probs; with old_log_probs: rollout they are the same (use "
                "old_log_probs: recompute)"
            )
        return self

    @property
    def behaviour_weighted(self) -> bool:
        """The loss weights tokens by pi_old / pi_behav (``tis_cap`` or ``decoupled``)."""
        return self.loss.tis_cap is not None or self.loss.decoupled

    @property
    def greedy_baseline(self) -> bool:
        """Each batch comes with the reward of a greedy response per prompt (ReMax)."""
        return self.name == "remax"

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.n

    def sampling(self, seed: int, greedy: bool = False) -> SamplingConfig:
        if greedy:
            return SamplingConfig(temperature=0.0, n=1, max_new_tokens=self.max_new_tokens)
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            n=self.n,
            seed=seed,
        )

    def policy_loss(self, kl_coef: float) -> PolicyLossConfig:
        if self.kl.mode == "loss" and self.kl.coef:
            return self.loss.model_copy(update={"kl_coef": kl_coef, "kl_type": self.kl.kl_type})
        return self.loss

    def needed_roles(self) -> set[str]:
        needed = {"actor", "reward"}
        if self.name in WITH_CRITIC:
            needed.add("critic")
        if self.name == "safe_rlhf":
            needed |= {"cost", "cost_critic"}
        if self.name == "distill":
            needed.add("teacher")
        if self.kl.coef:
            needed.add("reference")
        return needed
