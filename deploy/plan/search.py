"""The paper's mapping algorithm (§6, Algorithm 1) over ``deploy/plan/cost.py``'s model.

1. Every set partition of the models into colocated groups (Bell(k): 15 for PPO's four).
2. Per group, the fewest devices on which some strategy fits memory.
3. Every allocation of the N devices to the groups with at least that many each (the
   compositions of N: C(N-1, k-1) when every minimum is 1).
4. Per group and device count the best strategy: ``(p, t)`` with t up to the devices per node
   and dividing every model's heads, p dividing every model's layers (p > 1 only when pipeline
   parallel is allowed), d = n / (p t), and the actor's generation tp dividing t. The best is the
   fitting one with the least summed stage time; it is cached per (group, device count), so an
   allocation costs only lookups.
   ``allows`` (``deploy/plan/rules.py``) leaves out what the experiment's engines cannot run.
5. The plan's step time: per stage the slowest group, summed over stages; plans ranked by it.
   Equal times (to 9 significant digits) rank the plan with fewer groups first, then by its
   groups in the experiment's role order (roles, devices, p, t, d, gen tp), so the winner is
   the same on every run and for every ``top``.

Difference from the paper: one ``(p, t)`` per group rather than per model, because a placement
group runs all its roles at one tp and pp here (``controller/placement.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from deploy.plan.cost import GroupCost, Strategy, Workload, group_cost, step_cost
from deploy.plan.profiles import DeviceProfile


class PlanError(ValueError):
    """No plan fits; the message says which limit to raise."""


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split ``items`` into non-empty groups (order of groups and within a group
    as in ``items``)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [(first,), *partition]
        for i, group in enumerate(partition):
            yield [*partition[:i], (first, *group), *partition[i + 1 :]]


def allocations(total: int, minimums: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every way to give ``total`` devices to groups, each at least its minimum."""
    if not minimums:
        if total == 0:
            yield ()
        return
    if len(minimums) == 1:
        if total >= minimums[0]:
            yield (total,)
        return
    rest_min = sum(minimums[1:])
    for first in range(minimums[0], total - rest_min + 1):
        for tail in allocations(total - first, minimums[1:]):
            yield (first, *tail)


@dataclass(frozen=True)
class Plan:
    groups: tuple[tuple[str, ...], ...]
    costs: tuple[GroupCost, ...]
    stages: dict[str, float]

    @property
    def total(self) -> float:
        return self.stages["total"]


#: whether the experiment can run a group at a strategy (``deploy/plan/rules.py``)
Allows = Callable[[tuple[str, ...], Strategy], bool]
#: a plan's place in the ranking: rounded step time, groups, then the groups themselves
RankKey = tuple[float, int, tuple[tuple[Any, ...], ...]]


def tie(seconds: float) -> float:
    """``seconds`` to 9 significant digits: times that differ only in the last bits of their
    float sums (the same work added up in another order) tie."""
    return float(f"{seconds:.9g}")


class Planner:
    def __init__(
        self,
        wl: Workload,
        devices: int,
        per_node: int,
        profile: DeviceProfile,
        allow_pp: bool = False,
        allows: Allows | None = None,
    ) -> None:
        self.wl, self.devices, self.per_node, self.profile = wl, devices, per_node, profile
        self.allow_pp, self.allows = allow_pp, allows
        self.best = lru_cache(maxsize=None)(self._best)

    def strategies(self, roles: tuple[str, ...], n: int) -> Iterator[Strategy]:
        models = [self.wl.models[r] for r in roles if r in self.wl.models]
        for t in range(1, min(n, self.per_node) + 1):
            if n % t or any(
                m.dims.heads % t or (m.dims.kv_heads % t and t % m.dims.kv_heads) for m in models
            ):
                continue
            for p in range(1, n // t + 1):
                if (n // t) % p or (p > 1 and not self.allow_pp):
                    continue
                if any(m.dims.layers % p for m in models):
                    continue
                gen = (
                    [g for g in range(1, t + 1) if t % g == 0]
                    if self.wl.generator in roles
                    else [t]
                )
                for g in gen:
                    s = Strategy(p=p, t=t, d=n // (p * t), gen_t=g)
                    if self.allows is None or self.allows(roles, s):
                        yield s

    def _best(self, roles: tuple[str, ...], n: int) -> GroupCost | None:
        found: GroupCost | None = None
        for s in self.strategies(roles, n):
            cost = group_cost(list(roles), self.wl, s, self.per_node, self.profile)
            if cost.fits and (found is None or cost.total < found.total):
                found = cost
        return found

    def minimum(self, roles: tuple[str, ...]) -> int | None:
        for n in range(1, self.devices + 1):
            if self.best(roles, n) is not None:
                return n
        return None

    def plans(self, top: int = 10) -> list[Plan]:
        """The ``top`` plans by step time, best first (ties: ``rank_key``)."""
        if top < 1:
            raise PlanError(f"--top {top}: show at least 1 plan")
        models = list(self.wl.models)
        order = {r: i for i, r in enumerate(models)}
        kept: list[tuple[RankKey, Plan]] = []
        for partition in set_partitions(models):
            groups = tuple(sorted((tuple(g) for g in partition), key=lambda g: order[g[0]]))
            minimums = [self.minimum(g) for g in groups]
            if any(m is None for m in minimums):
                continue
            for alloc in allocations(self.devices, [m for m in minimums if m is not None]):
                costs = [self.best(g, n) for g, n in zip(groups, alloc, strict=True)]
                if any(c is None for c in costs):
                    continue
                fitted = tuple(c for c in costs if c is not None)
                stages = step_cost(list(fitted))
                if len(kept) == top and tie(stages["total"]) > kept[-1][0][0]:
                    continue
                plan = Plan(groups, fitted, stages)
                bisect.insort(kept, (self.rank_key(plan, order), plan), key=lambda e: e[0])
                del kept[top:]
        if not kept:
            raise PlanError(
                f"no placement of {', '.join(models)} fits {self.devices} devices of "
                f"{self.profile.mem_bytes / 1e9:.0f} GB: raise --gpus or --gpu-mem, or plan smaller "
                "models"
            )
        return [plan for _, plan in kept]

    @staticmethod
    def rank_key(plan: Plan, order: dict[str, int]) -> RankKey:
        """Step time, then fewer groups, then the groups in the experiment's role order."""
        layout = tuple(
            (tuple(order[r] for r in g), s.p * s.t * s.d, s.p, s.t, s.d, s.gen_t)
            for g, s in zip(plan.groups, (c.strategy for c in plan.costs), strict=True)
        )
        return (tie(plan.total), len(plan.groups), layout)
