"""The pieces step programs are made of: the roles' clients (``Roles``), the state a stage
carries (``State``), and the calls and estimates every built-in program (``controller/
algorithms.py``) and a user's own (``algorithm.program``) is written with. ``hybridflow.steps``
re-exports the public ones; the built-in programs import nothing else (a test checks).

    async def my_step(roles, batch, cfg, state, step) -> dict:
        old, (score, extras) = await asyncio.gather(
            old_log_probs(roles, batch, cfg), rewarded(roles, batch, cfg)
        )
        ...  # advantages
        metrics = await learn(roles, with_columns(batch, ...), cfg, state, step)
        return summarize(batch, score, None, **extras, **metrics)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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
        """Who samples: the rollout group when one is placed, else the actor."""
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
        """Spans of the step's timeline: ``async with state.timer()("update"): ...``."""
        return Timer(self.timings, self.spans)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the KL controller and the Lagrange multiplier."""
        return {"kl": self.kl.state_dict(), "lagrange": self.lagrange}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Back to what ``state_dict`` returned."""
        self.kl.load_state_dict(saved["kl"])
        self.lagrange = float(saved["lagrange"])


class Timer:
    """Wall time of each stage of a step: ``async with timer("gen"): ...``; with ``spans``,
    also when each stage first started and last ended (the step's timeline).

    ``timer.lane(call, role)`` times one role's calls instead: a span ``<call>@<role>`` only (no
    timing), so that the timeline has a lane for every role a step keeps busy, not only the
    actor's stages, and each group's idle share counts the work of all its roles
    (``deploy/reports/live.py``). Calls of one name in a step make one span, the first start to
    the last end (the mini-batches of an update, the gaps between them included)."""

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
    """``client``, or a ValueError saying the algorithm needs role ``name`` placed."""
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
    """Per-token log-probs ``[B, T]`` of ``batch``'s tokens under ``role`` at ``temperature``
    (None when ``role`` is None: a step asks for a reference it may not have)."""
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
    """Per-token values ``[B, T]`` from a critic (None when ``role`` is None)."""
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
    """``[B]`` the prompt each row answers (its ``uid``): the groups of GRPO and RLOO."""
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
    """A step's record: the reward's mean and spread, response lengths and the share cut at
    their limit, the KL (when given), the generator's log-prob gap, and ``extra``."""
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
    """A copy of ``batch`` with these tensor columns added or replaced (None: left out)."""
    kept = {k: v for k, v in columns.items() if v is not None}
    return TensorBatch({**batch.tensors, **kept}, dict(batch.non_tensors), dict(batch.meta))


class Step(Protocol):
    """A step program, ``async def step(roles, batch, cfg, state, step) -> dict``: one RL step
    over the generated ``batch``; what it returns is the step's record."""

    def __call__(
        self, roles: Roles, batch: TensorBatch, cfg: AlgorithmConfig, state: State, step: int, /
    ) -> Awaitable[dict[str, Any]]: ...


def group_stats(solved: torch.Tensor, group: torch.Tensor) -> dict[str, float]:
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
