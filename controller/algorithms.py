"""RL algorithms as short async programs over the roles.

One training step of each algorithm is one coroutine over a batch the rollout pipeline
(``controller/rollouts.py``) already generated: score it, estimate advantages on the whole batch,
learn. Generating, syncing weights to the generator and counting policy versions are the
pipeline's; a step neither generates nor hands weights on. Calls to roles in different groups
overlap (``asyncio.gather``); colocated roles queue on their shared ranks in call order, so the
same program runs under any placement.

    ppo_step        critic + GAE (Ouyang et al. 2022; the paper's Figure 4)
    remax_step      no critic; the reward of a greedy sample per prompt is the baseline (Li et
                    al. 2023); the pipeline generates it with the batch, on the same weights
    safe_rlhf_step  PPO with a cost model, a cost critic and a Lagrange multiplier (Dai et al. 2023)
    group_step      critic-free estimators over n samples per prompt: GRPO, RLOO, REINFORCE++,
                    REINFORCE++-baseline (DAPO: GRPO with the pipeline's dynamic sampling)
    distill_step    on-policy distillation: a teacher role's reverse KL per sampled token

Their settings are ``AlgorithmConfig`` (``controller/algorithm_config.py``).
``docs/algorithms.md`` shows the first three side by side. Advantage estimators are in
``controller/advantages.py``; scores come through ``controller/scoring.py``; losses run inside the
roles (``roles/modeling/losses.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from controller import advantages as adv
from controller.agent import SAMPLE_BUDGET
from controller.algorithm_config import AlgorithmConfig
from controller.clients import (
    ActorClient,
    CriticClient,
    EngineClient,
    EnvClient,
    ReferenceClient,
    RewardClient,
    RoleClient,
    RolloutClient,
)
from controller.scoring import refused_rows, scores, stashed
from controller.server import Controller
from transport.batch import TensorBatch
from transport.columns import TOKENS
from transport.protocol import PEAK_MEMORY

C = TypeVar("C", bound=RoleClient)
R = TypeVar("R")


class BaseModelClient(ReferenceClient):
    """The reference of a LoRA run: the actor's own group, asked with its adapters switched off
    (``Actor.compute_ref_log_prob``), so no second copy of the model is loaded. A program takes
    it wherever it takes a ``ReferenceClient``; trainers do not configure or checkpoint it (it is
    the actor)."""

    async def compute_log_prob(
        self,
        batch: TensorBatch,
        temperature: float = 1.0,
        entropy: bool = False,
        *,
        timeout: float | None = None,
    ) -> TensorBatch:
        actor = ActorClient(self.controller, self.role)
        return await actor.compute_ref_log_prob(batch, temperature, entropy, timeout=timeout)


@dataclass
class Roles:
    """The role clients a step talks to; a role the algorithm does not use may be None. A reward
    or cost role may be a rule function or a model: steps only ask it for scores."""

    actor: ActorClient
    reward: RewardClient
    rollout: RolloutClient | None = None
    reference: ReferenceClient | None = None
    teacher: ReferenceClient | None = None  # on-policy distillation (algorithm distill)
    critic: CriticClient | None = None
    cost: RewardClient | None = None
    cost_critic: CriticClient | None = None
    env: EnvClient | None = None  # tools or an environment, for multi-turn rollouts

    @classmethod
    def placed(cls, controller: Controller, reference_in_actor: bool = False) -> Roles:
        """Clients for the roles the controller's placement names, by their names in an
        experiment (``actor``, ``reward``, ``rollout``, ...); absent optional roles are None.
        ``reference_in_actor``: a LoRA run without a reference role, whose reference is the
        actor with its adapters off (``BaseModelClient``)."""

        def optional(kind: type[C], name: str) -> C | None:
            return kind(controller, name) if name in controller.role_group else None

        return cls(
            actor=ActorClient(controller, "actor"),
            reward=RewardClient(controller, "reward"),
            rollout=optional(RolloutClient, "rollout"),
            reference=optional(ReferenceClient, "reference")
            or (BaseModelClient(controller, "actor") if reference_in_actor else None),
            teacher=optional(ReferenceClient, "teacher"),
            critic=optional(CriticClient, "critic"),
            cost=optional(RewardClient, "cost"),
            cost_critic=optional(CriticClient, "cost_critic"),
            env=optional(EnvClient, "env"),
        )

    @property
    def generator(self) -> ActorClient | RolloutClient:
        return self.rollout or self.actor

    def engines(self) -> dict[str, EngineClient]:
        """The model-holding roles a trainer configures, re-bases and checkpoints, by name."""
        found = {
            "actor": self.actor,
            # the base-model reference of a LoRA run is the actor: configured and saved once
            "reference": None if isinstance(self.reference, BaseModelClient) else self.reference,
            "critic": self.critic,
            "cost_critic": self.cost_critic,
        }
        return {name: client for name, client in found.items() if client is not None}


@dataclass
class State:
    """What the controller carries from step to step within an RL stage (and checkpoints): each
    RL stage starts its own from its ``AlgorithmConfig`` (``State.initial``)."""

    kl: adv.FixedKL | adv.AdaptiveKL
    lagrange: float = 0.0  # Safe-RLHF's lambda
    timings: dict[str, float] = field(default_factory=dict)
    # stage (or "<call>@<role>") -> (first start, last end), perf_counter seconds: the step's
    # timeline
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def initial(cls, cfg: AlgorithmConfig) -> State:
        """The state a stage of ``cfg`` starts from: its KL controller, its Lagrange multiplier."""
        return cls(kl=cfg.kl.controller(), lagrange=cfg.safe.lambda_init if cfg.safe else 0.0)

    def timer(self) -> Timer:
        return Timer(self.timings, self.spans)

    def state_dict(self) -> dict[str, Any]:
        return {"kl": self.kl.state_dict(), "lagrange": self.lagrange}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.kl.load_state_dict(saved["kl"])
        self.lagrange = float(saved["lagrange"])


class Timer:
    """Wall time of each stage of a step: ``async with timer("gen"): ...``; with ``spans``,
    also when each stage first started and last ended (the step's timeline).

    ``timer.lane(call, role)`` times one role's calls instead: a span ``<call>@<role>`` only (no
    timing), so that the timeline has a lane for every role a step keeps busy, not only the
    actor's stages, and each group's idle share counts the work of all its roles
    (``deploy/live.py``). Calls of one name in a step make one span, the first start to the last
    end (the mini-batches of an update, the gaps between them included)."""

    def __init__(
        self, into: dict[str, float], spans: dict[str, tuple[float, float]] | None = None
    ) -> None:
        self.into, self.spans = into, spans

    def __call__(self, name: str) -> _Span:
        return _Span(self.into, name, self.spans)

    def lane(self, call: str, role: str) -> _Span:
        return _Span(None, f"{call}@{role}", self.spans)


class _Span:
    def __init__(
        self, into: dict[str, float] | None, name: str, spans: dict[str, tuple[float, float]] | None
    ) -> None:
        self.into, self.name, self.spans = into, name, spans

    async def __aenter__(self) -> None:
        self.start = time.perf_counter()

    async def __aexit__(self, *exc: object) -> None:
        end = time.perf_counter()
        if self.into is not None:
            self.into[self.name] = self.into.get(self.name, 0.0) + end - self.start
        if self.spans is not None:
            first = self.spans.get(self.name, (self.start, end))[0]
            self.spans[self.name] = (first, end)


def need(client: C | None, name: str) -> C:
    if client is None:
        raise ValueError(f"this algorithm needs a {name!r} role; define and place one")
    return client


# -- the pieces every step is made of -----------------------------------------------------------


async def on(timer: Timer | None, role: RoleClient, call: str, pending: Awaitable[R]) -> R:
    """``await pending``, a call to ``role``, as a span of the step's timeline when timed."""
    if timer is None:
        return await pending
    async with timer.lane(call, role.role):
        return await pending


async def log_probs(
    role: ReferenceClient | None,
    batch: TensorBatch,
    temperature: float,
    timer: Timer | None = None,
) -> Any:
    if role is None:
        return None
    asked = role.compute_log_prob(batch.select(TOKENS, []), temperature=temperature)
    out = await on(timer, role, "compute_log_prob", asked)
    return out["log_probs"]


async def old_log_probs(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, timer: Timer | None = None
) -> torch.Tensor:
    """pi_old: recomputed by the actor, or the generator's own (``old_log_probs: rollout``)."""
    if cfg.old_log_probs == "rollout":
        return batch.tensors["log_probs"]
    found: torch.Tensor = await log_probs(roles.actor, batch, cfg.temperature, timer)
    return found


async def values(role: CriticClient | None, batch: TensorBatch, timer: Timer | None = None) -> Any:
    if role is None:
        return None
    out = await on(timer, role, "compute_values", role.compute_values(batch.select(TOKENS, [])))
    return out["values"]


async def scored(
    role: RewardClient, batch: TensorBatch, timer: Timer | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``scores`` of ``batch`` from ``role``; timed only when the role is asked now (a streamed
    batch was scored while it generated: ``controller/streaming.py``)."""
    if stashed(batch, role.role) is not None:
        return await scores(role, batch)
    return await on(timer, role, "compute_reward", scores(role, batch))


async def rewarded(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, timer: Timer | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward role's ``scores``, plus the overlong penalty when ``cfg.overlong`` is set
    (``reward/overlong_penalty``: its batch mean). Every score a step compares goes through
    here (ReMax's greedy baseline too), so all carry the same shaping."""
    score, extras = await scored(roles.reward, batch, timer)
    penalty = overlong(batch, cfg)
    if penalty is not None:
        score = score + penalty
        extras["reward/overlong_penalty"] = float(penalty.mean())
    return score, extras


def overlong(batch: TensorBatch, cfg: AlgorithmConfig) -> torch.Tensor | None:
    """[B] DAPO's soft overlong penalty of each row (None when ``cfg.overlong`` is off). The
    limit is ``max_new_tokens``, or for a multi-turn row its trajectory's budget of sampled
    tokens (``SAMPLE_BUDGET``: ``max_total_tokens`` less its prompt and observations), since
    ``max_new_tokens`` limits each turn, not the trajectory."""
    if cfg.overlong is None:
        return None
    lengths = batch.tensors["response_mask"].sum(-1)
    budget = batch.tensors.get(SAMPLE_BUDGET)
    limit = cfg.max_new_tokens if budget is None else budget
    return adv.overlong_penalty(lengths, limit, cfg.overlong.cache, cfg.overlong.factor)


def reference(roles: Roles, cfg: AlgorithmConfig) -> ReferenceClient | None:
    """The reference a step asks for log-probs: only when its KL reads them (``kl.coef`` > 0),
    so a stage without KL runs no reference pass (a LoRA actor's adapters-off one included)."""
    return roles.reference if cfg.kl.coef else None


def kl_of(old: torch.Tensor, ref: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """Per-token k1 estimate log pi_old - log pi_ref on response tokens (None without ref)."""
    return None if ref is None else (old - ref) * mask


def group_ids(batch: TensorBatch) -> torch.Tensor:
    return torch.tensor([int(u) for u in batch.non_tensors["uid"]], dtype=torch.long)


async def learn(
    roles: Roles,
    batch: TensorBatch,
    cfg: AlgorithmConfig,
    state: State,
    step: int,
    critics: tuple[tuple[CriticClient, str, str], ...] = (),
) -> dict[str, float]:
    """``ppo_epochs`` passes of ``mini_batches`` optimizer steps each, actor and critics together.
    ``critics``: (client, values column, returns column) — each critic trains on its own pair."""
    refused = refused_rows(batch)
    if refused is not None:  # a row without a finite score teaches nothing
        zeroed = batch.tensors["advantages"].masked_fill(refused[:, None], 0.0)
        batch = with_columns(batch, advantages=zeroed)
    actor_columns = [*TOKENS, "old_log_probs", "advantages"]
    if cfg.kl.mode == "loss" and cfg.kl.coef:
        actor_columns.append("ref_log_probs")
    if cfg.behaviour_weighted:  # the behaviour policy: the generator's log-probs
        batch = with_columns(batch, rollout_log_probs=batch.tensors["log_probs"])
        actor_columns.append("rollout_log_probs")
    sums: dict[str, float] = {}
    peaks: dict[str, float] = {}
    updates = 0
    t = state.timer()
    generator = torch.Generator().manual_seed(step)
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for mini in batch.index(order).chunk(cfg.mini_batches):
            policy = roles.actor.update_policy(
                mini.select(actor_columns, []),
                loss=cfg.policy_loss(state.kl.value),
                temperature=cfg.temperature,
            )
            calls = [on(t, roles.actor, "update_policy", policy)]
            for critic, values_key, returns_key in critics:
                part = TensorBatch.from_dict(
                    {
                        **{k: mini.tensors[k] for k in TOKENS},
                        "values": mini.tensors[values_key],
                        "returns": mini.tensors[returns_key],
                    }
                )
                calls.append(
                    on(t, critic, "update_critic", critic.update_critic(part, loss=cfg.value_loss))
                )
            results = await asyncio.gather(*calls)
            names = ["actor"] + [c.role for c, _, _ in critics]
            for name, result in zip(names, results, strict=True):
                for key, value in result.items():
                    if key == PEAK_MEMORY:  # a peak is the largest over the updates
                        peaks[f"{name}/{key}"] = max(peaks.get(f"{name}/{key}", 0.0), value)
                    else:
                        sums[f"{name}/{key}"] = sums.get(f"{name}/{key}", 0.0) + float(value)
            updates += 1
    found = {k: v / updates for k, v in sums.items()} | peaks
    cap = cfg.loss.tis_cap
    if cfg.behaviour_weighted:
        found.update(behaviour_weights(batch, math.inf if cap is None else float(cap)))
    return found


def behaviour_weights(batch: TensorBatch, cap: float) -> dict[str, float]:
    """Stats of the per-token weight min(pi_old / pi_behav, cap) the loss applies (TIS,
    decoupled PPO): mean, max (before the cap) and the fraction of tokens capped."""
    mask = batch.tensors["response_mask"].bool()
    log_ratio = batch.tensors["old_log_probs"] - batch.tensors["log_probs"]
    weight = log_ratio[mask].clamp(max=20.0).exp()
    if weight.numel() == 0:
        return {}
    return {
        "is/weight_mean": float(weight.clamp(max=cap).mean()),
        "is/weight_max": float(weight.max()),
        "is/capped_frac": float((weight >= cap).float().mean()),
    }


def summarize(
    batch: TensorBatch, score: torch.Tensor, kl: torch.Tensor | None, **extra: float
) -> dict[str, float]:
    mask = batch.tensors["response_mask"].float()
    lengths = mask.sum(-1)
    found = {
        "reward/mean": float(score.mean()),
        "reward/std": float(score.std()) if len(score) > 1 else 0.0,
        "response/length": float(lengths.mean()),
        "response/tokens": float(lengths.sum()),
        "response/clipped": float(
            sum(f == "length" for f in batch.non_tensors.get("finish", [])) / max(len(batch), 1)
        ),
    }
    if kl is not None:
        found["kl"] = float((kl.sum(-1)).mean())
    if "log_probs" in batch.tensors and "old_log_probs" in batch.tensors:
        found.update(logprob_gap(batch.tensors["log_probs"], batch.tensors["old_log_probs"], mask))
    found.update(extra)
    return found


def logprob_gap(generated: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|generator's log-prob - pi_old's| per response token: what the engines' kernels and
    precision disagree by (a vLLM rollout against the trainer's ``compute_log_prob``), plus the
    policy's lag when the samples came from older weights (``overlap``); 0 with
    ``old_log_probs: rollout``."""
    gaps = (generated - old)[mask.bool()].abs()
    if gaps.numel() == 0:
        return {}
    return {
        "rollout/logprob_gap_max": float(gaps.max()),
        "rollout/logprob_gap_mean": float(gaps.mean()),
    }


def with_columns(batch: TensorBatch, **columns: torch.Tensor | None) -> TensorBatch:
    kept = {k: v for k, v in columns.items() if v is not None}
    return TensorBatch({**batch.tensors, **kept}, dict(batch.non_tensors), dict(batch.meta))


Step = Callable[[Roles, TensorBatch, AlgorithmConfig, State, int], Awaitable[dict[str, Any]]]


# -- the algorithms -----------------------------------------------------------------------------


async def ppo_step(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int
) -> dict[str, Any]:
    """PPO with a critic and GAE: the paper's Figure 4 program. ``batch``: the generated samples."""
    t = state.timer()
    mask = batch.tensors["response_mask"]
    async with t("prepare"):  # the four calls overlap when the roles live in different groups
        old, ref, value, (score, extras) = await asyncio.gather(
            old_log_probs(roles, batch, cfg, t),
            log_probs(reference(roles, cfg), batch, cfg.temperature, t),
            values(roles.critic, batch, t),
            rewarded(roles, batch, cfg, t),
        )
    kl = kl_of(old, ref, mask)
    reward_kl = state.kl.value if cfg.kl.mode == "reward" else 0.0
    rewards = adv.token_rewards(score, mask, kl, reward_kl if kl is not None else 0.0)
    advantages, returns = adv.gae(rewards, value, mask, cfg.gamma, cfg.lam, cfg.whiten)
    batch = with_columns(
        batch,
        old_log_probs=old,
        ref_log_probs=ref,
        values=value,
        advantages=advantages,
        returns=returns,
    )
    async with t("update"):
        critics = ((need(roles.critic, "critic"), "values", "returns"),)
        metrics = await learn(roles, batch, cfg, state, step, critics)
    if kl is not None:
        state.kl.update(cfg.kl.measure(kl, mask), len(batch))
    return summarize(batch, score, kl, kl_coef=state.kl.value, **extras, **metrics)


async def remax_step(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int
) -> dict[str, Any]:
    """ReMax: PPO's program without a critic; the greedy response's reward is the baseline. The
    batch brings it as its ``remax_baseline`` column: the rollout pipeline generates the greedy
    responses right after the samples, on the same weights (``controller/rollouts.py``)."""
    t = state.timer()
    mask = batch.tensors["response_mask"]
    baseline = batch.tensors["remax_baseline"].float()
    async with t("prepare"):
        old, ref, (score, extras) = await asyncio.gather(
            old_log_probs(roles, batch, cfg, t),
            log_probs(reference(roles, cfg), batch, cfg.temperature, t),
            rewarded(roles, batch, cfg, t),
        )
    kl = kl_of(old, ref, mask)
    advantages = adv.remax(score, baseline, mask)
    batch = with_columns(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages)
    async with t("update"):
        metrics = await learn(roles, batch, cfg, state, step)
    base_mean = float(baseline[torch.tensor(first_rows(batch))].mean())
    return summarize(batch, score, kl, baseline=base_mean, **extras, **metrics)


async def safe_rlhf_step(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int
) -> dict[str, Any]:
    """Safe-RLHF: PPO for reward and for cost, advantages mixed by the Lagrange multiplier."""
    assert cfg.safe is not None
    t = state.timer()
    mask = batch.tensors["response_mask"]
    async with t("prepare"):
        old, ref, value, cost_value, (score, extras), (cost, _) = await asyncio.gather(
            old_log_probs(roles, batch, cfg, t),
            log_probs(reference(roles, cfg), batch, cfg.temperature, t),
            values(roles.critic, batch, t),
            values(roles.cost_critic, batch, t),
            rewarded(roles, batch, cfg, t),
            scored(need(roles.cost, "cost"), batch, t),
        )
    kl = kl_of(old, ref, mask)
    reward_kl = state.kl.value if (cfg.kl.mode == "reward" and kl is not None) else 0.0
    rewards = adv.token_rewards(score, mask, kl, reward_kl)
    r_adv, r_ret = adv.gae(rewards, value, mask, cfg.gamma, cfg.lam, cfg.whiten)
    cost_rewards = adv.token_rewards(cost, mask)
    c_adv, c_ret = adv.gae(cost_rewards, cost_value, mask, cfg.gamma, cfg.lam, cfg.whiten)
    lam = state.lagrange
    advantages = (r_adv - lam * c_adv) / (1.0 + lam)
    batch = with_columns(
        batch,
        old_log_probs=old,
        ref_log_probs=ref,
        values=value,
        returns=r_ret,
        cost_values=cost_value,
        cost_returns=c_ret,
        advantages=advantages,
    )
    critics = (
        (need(roles.critic, "critic"), "values", "returns"),
        (need(roles.cost_critic, "cost_critic"), "cost_values", "cost_returns"),
    )
    async with t("update"):
        metrics = await learn(roles, batch, cfg, state, step, critics)
    # Gradient ascent on lambda for the constraint E[cost] <= threshold (lambda >= 0).
    episode_cost = float(cost.mean())
    lam = max(0.0, lam + cfg.safe.lambda_lr * (episode_cost - cfg.safe.cost_threshold))
    state.lagrange = min(lam, cfg.safe.lambda_max) if cfg.safe.lambda_max else lam
    if kl is not None:
        state.kl.update(cfg.kl.measure(kl, mask), len(batch))
    return summarize(
        batch, score, kl, cost=episode_cost, **{"lambda": state.lagrange}, **extras, **metrics
    )


async def group_step(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int
) -> dict[str, Any]:
    """Critic-free: GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline differ only in the
    estimator over the n samples of each prompt (or the whole batch)."""
    t = state.timer()
    mask = batch.tensors["response_mask"]
    async with t("prepare"):
        old, ref, (score, extras) = await asyncio.gather(
            old_log_probs(roles, batch, cfg, t),
            log_probs(reference(roles, cfg), batch, cfg.temperature, t),
            rewarded(roles, batch, cfg, t),
        )
    kl = kl_of(old, ref, mask)
    coef = state.kl.value if (cfg.kl.mode == "reward" and kl is not None) else 0.0
    group = group_ids(batch)
    if cfg.name == "reinforce_pp":
        rewards = adv.token_rewards(score, mask, kl, coef)
        advantages, _ = adv.reinforce_pp(rewards, mask, cfg.gamma)
    elif cfg.name == "reinforce_pp_baseline":
        advantages = adv.reinforce_pp_baseline(score, group, mask, kl, coef)
    else:  # a sequence-level KL penalty in the score, as RLOO does
        shaped = score - coef * kl.sum(-1) if (kl is not None and coef) else score
        if cfg.name == "grpo":
            advantages = adv.grpo(shaped, group, mask, cfg.norm_std)
        else:
            advantages = adv.rloo(shaped, group, mask)
    batch = with_columns(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages)
    async with t("update"):
        metrics = await learn(roles, batch, cfg, state, step)
    if kl is not None:
        state.kl.update(cfg.kl.measure(kl, mask), len(batch))
        metrics["kl_coef"] = state.kl.value
    solved = score.view(-1).gt(0.5).float()
    return summarize(batch, score, kl, **extras, **metrics, **_group_stats(solved, group))


async def distill_step(
    roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int
) -> dict[str, Any]:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the student
    samples, the teacher role scores the sampled tokens, and each token's advantage is the
    negative per-token reverse KL, -coef x (log pi_student - log pi_teacher), no discounting; the
    update is the configured policy loss. The reward role's scores are reported, not trained on."""
    t = state.timer()
    mask = batch.tensors["response_mask"]
    async with t("prepare"):
        old, teacher, ref, (score, extras) = await asyncio.gather(
            old_log_probs(roles, batch, cfg, t),
            log_probs(need(roles.teacher, "teacher"), batch, cfg.temperature, t),
            log_probs(reference(roles, cfg), batch, cfg.temperature, t),
            rewarded(roles, batch, cfg, t),
        )
    reverse_kl = adv.reverse_kl(old, teacher, mask)
    advantages = -cfg.distill_coef * reverse_kl
    kl = kl_of(old, ref, mask)
    if kl is not None and cfg.kl.mode == "reward":  # a per-token penalty like the teacher's
        advantages = advantages - state.kl.value * kl
    batch = with_columns(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages)
    async with t("update"):
        metrics = await learn(roles, batch, cfg, state, step)
    if kl is not None:
        state.kl.update(cfg.kl.measure(kl, mask), len(batch))
        metrics["kl_coef"] = state.kl.value
    metrics["distill/reverse_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1))
    return summarize(batch, score, kl, **extras, **metrics)


def _group_stats(solved: torch.Tensor, group: torch.Tensor) -> dict[str, float]:
    """Fractions of prompts whose samples all scored alike (no learning signal there)."""
    _, index = torch.unique(group, return_inverse=True)
    k = int(index.max()) + 1 if index.numel() else 0
    hits = torch.zeros(k).index_add_(0, index, solved)
    size = torch.zeros(k).index_add_(0, index, torch.ones_like(solved))
    return {
        "groups/all_solved": float((hits == size).float().mean()) if k else 0.0,
        "groups/none_solved": float((hits == 0).float().mean()) if k else 0.0,
    }


def first_rows(batch: TensorBatch) -> list[int]:
    """The first row of each prompt (by ``uid``), in order of appearance."""
    seen: dict[Any, int] = {}
    for i, uid in enumerate(batch.non_tensors["uid"]):
        seen.setdefault(uid, i)
    return list(seen.values())


def step_program(cfg: AlgorithmConfig) -> Step:
    """The step coroutine of a stage: ``cfg.program`` (imported by path, from the experiment's
    folder as reward functions are) or the built-in of ``cfg.name``; ValueError saying what is
    wrong with a path."""
    if cfg.program is None:
        return STEPS[cfg.name]
    module_name, sep, attr = cfg.program.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"program {cfg.program!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import {module_name!r} for program {cfg.program!r}: {exc}"
        ) from exc
    found = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(found):
        raise ValueError(
            f"{module_name} has no async function {attr!r} (program {cfg.program!r}); a step "
            "program is async def step(roles, batch, cfg, state, step) -> dict"
        )
    program: Step = found
    return program


STEPS: dict[str, Step] = {
    "ppo": ppo_step,
    "remax": remax_step,
    "safe_rlhf": safe_rlhf_step,
    "grpo": group_step,
    "rloo": group_step,
    "reinforce_pp": group_step,
    "reinforce_pp_baseline": group_step,
    "distill": distill_step,
}
