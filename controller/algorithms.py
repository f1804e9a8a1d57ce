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

They are written with the public pieces of ``hybridflow.steps`` alone (``controller/steps.py``,
``hybridflow.advantages``), as a user's own program is; ``tests/test_import_graph.py`` fails when
this file imports anything else of the framework. Their settings are ``AlgorithmConfig``
(``controller/algorithm_config.py``).
``docs/algorithms.md`` shows the first three side by side. Advantage estimators are in
``controller/advantages.py``; scores come through ``controller/scoring.py``; losses run inside the
roles (``roles/modeling/losses.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any

import torch

from controller import advantages as adv
from controller.algorithm_config import AlgorithmConfig
from controller.steps import (
    Roles,
    State,
    Step,
    first_rows,
    group_ids,
    group_stats,
    kl_of,
    learn,
    log_probs,
    need,
    old_log_probs,
    reference,
    rewarded,
    scored,
    summarize,
    values,
    with_columns,
)
from transport.batch import TensorBatch

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
    return summarize(batch, score, kl, **extras, **metrics, **group_stats(solved, group))


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
