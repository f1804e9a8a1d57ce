"""Transfer plans: who gathers with whom, which pieces each rank contributes, bucket by bucket.

One plan shape serves all four schemes; they differ only in group membership and order:

==============  ======================================  ==========================================
scheme          gather group of a rank                  order
==============  ======================================  ==========================================
hybridflow      its micro-DP group (ranks sharing its   buckets of whole parameters; only pieces
                generation shard; hybridflow grouping)  some member lacks are sent
hybridflow-v    its training replica (TPxPP group;      buckets; every piece
                standard generation grouping)
naive           every rank (DeepSpeed-Chat's scheme)    buckets; every piece, split over holders
verl            every rank                              one parameter at a time, gathered in full,
                                                        then staged through a bucket
==============  ======================================  ==========================================

A piece held by several members of a group (a replicated parameter, or a tp shard replicated over
dp in naive/verl) is split among its holders so the group carries it once. With ``fsdp=True`` the
training pieces are additionally split over dp (FSDP-sharded training parameters), and the
HybridFlow micro-DP group then spans the dp replicas too.

Everything here is arithmetic on shapes: a 70B model on 128 ranks plans in seconds without a
tensor in sight (``hybridflow reshard-plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from reshard.layout import (
    SPLIT_DIM,
    Box,
    GenLayout,
    Grouping,
    LayoutError,
    Param,
    box_numel,
    check_pair,
    check_params,
    contains,
    gen_box,
    gen_place,
    intersect,
    train_box,
)
from transport.protocol import Layout

Scheme = Literal["hybridflow", "hybridflow-v", "naive", "verl"]
SCHEMES: tuple[Scheme, ...] = ("hybridflow", "hybridflow-v", "naive", "verl")
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Piece:
    """Part of one parameter that one group member puts into the gather."""

    param: int  # index into the plan's parameter list
    box: Box

    def nbytes(self, params: list[Param]) -> int:
        return box_numel(self.box) * params[self.param].itemsize


@dataclass
class GroupPlan:
    """One gather group: its members and, per bucket, every member's pieces in order."""

    members: list[int]
    buckets: list[list[list[Piece]]] = field(default_factory=list)  # [bucket][member] -> pieces

    def bucket_bytes(self, params: list[Param], bucket: int) -> list[int]:
        return [sum(p.nbytes(params) for p in pieces) for pieces in self.buckets[bucket]]


@dataclass
class Plan:
    scheme: Scheme
    train: Layout
    gen: GenLayout
    params: list[Param]
    groups: list[GroupPlan]
    group_of: list[int]  # rank -> index into groups
    grouping: Grouping
    fsdp: bool
    bucket_bytes: int
    # Memos (speed only: a 70B model on 128 ranks repeats the same few shapes thousands of
    # times). Boxes are keyed by a parameter's shape, split and stage, never its name; bucket
    # sizes are filled on first use, once make_plan has built the groups.
    _boxes: dict[tuple[object, ...], Box | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _sizes: dict[int, list[list[int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _shard: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def gen_box(self, param: int, rank: int) -> Box | None:
        p = self.params[param]
        key = ("gen", p.shape, p.split, p.stage, rank)
        if key not in self._boxes:
            self._boxes[key] = gen_box(p, self.train, self.gen, rank, self.grouping)
        return self._boxes[key]

    def held_box(self, param: int, rank: int) -> Box | None:
        p = self.params[param]
        key = ("held", p.shape, p.split, p.stage, rank)
        if key not in self._boxes:
            self._boxes[key] = held(p, self.train, rank, self.fsdp)
        return self._boxes[key]

    def member_bytes(self, group: int) -> list[list[int]]:
        """Per bucket of group ``group``, each member's bytes (``GroupPlan.bucket_bytes``)."""
        if group not in self._sizes:
            plan = self.groups[group]
            self._sizes[group] = [
                plan.bucket_bytes(self.params, b) for b in range(len(plan.buckets))
            ]
        return self._sizes[group]

    def recv_bytes(self, rank: int) -> int:
        """What reaches ``rank`` from the others of its group (the real pieces, no padding)."""
        group = self.group_of[rank]
        me = self.groups[group].members.index(rank)
        return sum(sum(sizes) - sizes[me] for sizes in self.member_bytes(group))

    def send_bytes(self, rank: int) -> int:
        """What ``rank`` contributes to its group's gathers (each other member receives it)."""
        group = self.group_of[rank]
        me = self.groups[group].members.index(rank)
        return sum(sizes[me] for sizes in self.member_bytes(group))

    def gen_bytes(self, rank: int) -> int:
        """Size of the rank's generation shard."""
        if rank not in self._shard:
            sizes = [self.gen_box(i, rank) for i in range(len(self.params))]
            self._shard[rank] = sum(
                box_numel(b) * p.itemsize for b, p in zip(sizes, self.params, strict=True) if b
            )
        return self._shard[rank]

    def reused_bytes(self, rank: int) -> int:
        """Training bytes that stay in place as part of the generation shard (HybridFlow only:
        the rank's training shard lies inside its generation shard)."""
        if self.scheme != "hybridflow":
            return 0
        total = 0
        for i, p in enumerate(self.params):
            g, h = self.gen_box(i, rank), self.held_box(i, rank)
            if g is not None and h is not None and contains(g, h):
                total += box_numel(h) * p.itemsize
        return total

    def peak_bytes(self, rank: int) -> int:
        """Modelled peak extra memory while transferring: the generation shard (less what is
        reused in place) plus the largest gather buffer (verl: plus its staging bucket)."""
        group = self.groups[self.group_of[rank]]
        widest = max((max(sizes) for sizes in self.member_bytes(self.group_of[rank])), default=0)
        gather = widest * len(group.members)  # the gathered buffer (the own part packs in place)
        staging = min(self.bucket_bytes, self.gen_bytes(rank)) if self.scheme == "verl" else 0
        return self.gen_bytes(rank) - self.reused_bytes(rank) + gather + staging

    def summary(self) -> dict[str, object]:
        ranks = range(self.train.world_size)
        model = sum(p.nbytes for p in self.params)
        return {
            "scheme": self.scheme,
            "train": f"{self.train.pp}-{self.train.tp}-{self.train.dp}",
            "gen": f"{self.gen.pp}-{self.gen.tp}-{self.gen.micro_dp(self.train)}",
            "fsdp": self.fsdp,
            "model_bytes": model,
            "groups": [g.members for g in self.groups],
            "recv_bytes_max": max(self.recv_bytes(r) for r in ranks),
            "send_bytes_max": max(self.send_bytes(r) for r in ranks),
            "gen_bytes_max": max(self.gen_bytes(r) for r in ranks),
            "peak_extra_bytes_max": max(self.peak_bytes(r) for r in ranks),
            "buckets_max": max(len(g.buckets) for g in self.groups),
        }


def held(param: Param, train: Layout, rank: int, fsdp: bool) -> Box | None:
    """What ``rank`` holds of ``param`` in training; under FSDP its dp share of the tp box."""
    box = train_box(param, train, rank)
    if box is None or not fsdp:
        return box
    dp, _, _ = train.coords(rank)
    return split_box(box, train.dp, dp, param)


def split_box(box: Box, parts: int, index: int, param: Param) -> Box | None:
    """Part ``index`` of ``parts`` of a box: cut along the parameter's tp dim when it divides,
    else along the first dim that divides; if none does, part 0 takes it all."""
    if parts == 1:
        return box
    preferred = SPLIT_DIM[param.split]
    dims = ([preferred] if preferred is not None else []) + list(range(len(box)))
    for d in dims:
        lo, hi = box[d]
        if (hi - lo) % parts == 0 and hi > lo:
            size = (hi - lo) // parts
            return tuple(
                (lo + index * size, lo + (index + 1) * size) if k == d else e
                for k, e in enumerate(box)
            )
    return box if index == 0 else None


def gather_groups(train: Layout, gen: GenLayout, scheme: Scheme, fsdp: bool) -> list[list[int]]:
    world = list(range(train.world_size))
    if scheme in ("naive", "verl"):
        return [world]
    if scheme == "hybridflow-v":
        if fsdp:
            return [world]
        block = train.pp * train.tp
        return [world[i : i + block] for i in range(0, len(world), block)]
    # hybridflow: the ranks sharing a generation shard (within a replica; across replicas too
    # when FSDP shards the training weights over dp)
    found: dict[tuple[int, ...], list[int]] = {}
    for rank in world:
        place = gen_place(train, gen, rank, "hybridflow")
        key = (
            (place.stage, place.tp)
            if fsdp
            else (rank // (train.pp * train.tp), place.stage, place.tp)
        )
        found.setdefault(key, []).append(rank)
    return sorted(found.values())


def make_plan(
    params: list[Param],
    train: Layout,
    gen: GenLayout,
    scheme: Scheme = "hybridflow",
    *,
    fsdp: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Plan:
    if scheme not in SCHEMES:
        raise LayoutError(f"scheme {scheme!r}: pick one of {', '.join(SCHEMES)}")
    if bucket_bytes < 1:
        raise LayoutError(f"bucket_bytes={bucket_bytes} must be positive")
    check_pair(train, gen)
    check_params(params, train, gen)
    grouping: Grouping = "hybridflow" if scheme == "hybridflow" else "standard"
    plan = Plan(
        scheme, train, gen, params, [], [0] * train.world_size, grouping, fsdp, bucket_bytes
    )
    for index, members in enumerate(gather_groups(train, gen, scheme, fsdp)):
        group = GroupPlan(members)
        memo: dict[tuple[object, ...], list[list[Box]]] = {}
        pieces = [_contributions(plan, members, i, memo) for i in range(len(params))]
        group.buckets = _buckets(pieces, params, bucket_bytes, per_param=scheme == "verl")
        plan.groups.append(group)
        for rank in members:
            plan.group_of[rank] = index
    return plan


def _contributions(
    plan: Plan, members: list[int], param: int, memo: dict[tuple[object, ...], list[list[Box]]]
) -> list[list[Piece]]:
    """Each member's pieces of one parameter (the boxes depend only on the parameter's shape,
    split and stage, so parameters alike share one computation through ``memo``)."""
    p = plan.params[param]
    key = (p.shape, p.split, p.stage)
    if key not in memo:
        memo[key] = _contribution_boxes(plan, members, param)
    return [[Piece(param, box) for box in boxes] for boxes in memo[key]]


def _contribution_boxes(plan: Plan, members: list[int], param: int) -> list[list[Box]]:
    """Each member's boxes of one parameter: every distinct training box held in the group,
    split among its holders; HybridFlow skips boxes no member lacks."""
    holders: dict[Box, list[int]] = {}
    for m, rank in enumerate(members):
        box = plan.held_box(param, rank)
        if box is not None:
            holders.setdefault(box, []).append(m)
    out: list[list[Box]] = [[] for _ in members]
    for box, who in sorted(holders.items()):
        if plan.scheme == "hybridflow" and not _lacked(plan, members, param, box):
            continue
        for k, m in enumerate(who):
            part = split_box(box, len(who), k, plan.params[param])
            if part is not None:
                out[m].append(part)
    return out


def _lacked(plan: Plan, members: list[int], param: int, box: Box) -> bool:
    """Whether some member needs part of ``box`` for its generation shard and does not hold it."""
    for rank in members:
        need = plan.gen_box(param, rank)
        have = plan.held_box(param, rank)
        if need is None:
            continue
        overlap = intersect(need, box)
        if overlap is not None and not (have is not None and contains(have, overlap)):
            return True
    return False


def _buckets(
    pieces: list[list[list[Piece]]], params: list[Param], limit: int, per_param: bool
) -> list[list[list[Piece]]]:
    """Consecutive parameters into buckets of at most ``limit`` gathered bytes (at least one
    parameter each); ``per_param``: one parameter per bucket."""
    members = len(pieces[0]) if pieces else 0
    buckets: list[list[list[Piece]]] = []
    current: list[list[Piece]] = [[] for _ in range(members)]
    size = 0
    for per_member in pieces:
        added = sum(p.nbytes(params) for ps in per_member for p in ps)
        if added == 0:
            continue
        if any(current) and (per_param or size + added > limit):
            buckets.append(current)
            current, size = [[] for _ in range(members)], 0
        for m, ps in enumerate(per_member):
            current[m].extend(ps)
        size += added
    if any(current):
        buckets.append(current)
    return buckets


def table_bytes(scheme: Scheme, train: Layout, gen: GenLayout, model_bytes: int) -> float:
    """The paper's per-rank communication volume (Table 2) for tp/pp-sharded, dp-replicated
    training weights; verl-style moves what naive moves."""
    t, p, d = train.tp, train.pp, train.dp
    if scheme == "hybridflow":
        return (t * p - gen.tp * gen.pp) / (gen.tp * gen.pp * t * p) * model_bytes
    if scheme == "hybridflow-v":
        return (t * p - 1) / (t * p) * model_bytes
    return (t * p * d - 1) / (t * p * d) * model_bytes
