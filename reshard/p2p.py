"""Point-to-point plans: which slices each rank of a training group sends to which rank of a
separate group (a rollout group, or a reference/critic group initialised from the actor).

The source holds parameters in its training layout (``transport.protocol.Layout`` dp/tp/pp;
tp-split per ``Param.split``, replicated across dp). Each destination rank needs, per parameter,
the piece its own layout gives it: ``Param.box(dst.tp, j)`` on its pipeline stage. A plan lists
``Move``\\ s — ``(src, dst, param, src_box, dst_box)`` with the boxes relative to the source's
held piece and the destination's needed piece — such that every destination piece is covered
exactly once and each source rank sends only what some destination needs.

Who sends: destination rank ``r`` takes everything from source replica ``r % src.dp`` (so the
ranks of the destination spread over the source's data-parallel replicas), and a piece that
several tp ranks of that replica hold (a replicated parameter) comes from tp rank
``(r + param_index) % holders``, which spreads replicated parameters over the tp ranks.

The destination may split a parameter differently from the source (a tp = 1 source holds every
parameter whole): ``dst_splits`` gives the destination's split by name (absent: replicated);
without it both sides split alike.

Pipeline stages: a parameter's ``stage`` is its training stage; the destination's ``pp`` must
divide the source's (each destination stage is a union of training stages).

Pure arithmetic on shapes; ``reshard/remote.py`` executes a plan bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from reshard.layout import Box, LayoutError, Param, Split, box_numel, intersect, relative
from transport.protocol import Layout

TP_DIM_SPLIT: dict[int | None, Split] = {0: "column", 1: "row", None: "replicated"}


@dataclass(frozen=True)
class Move:
    """One slice of one parameter from a source rank to a destination rank."""

    src: int
    dst: int
    param: int  # index into the plan's parameter list
    src_box: Box  # relative to what ``src`` holds of the parameter
    dst_box: Box  # relative to what ``dst`` needs of the parameter

    def nbytes(self, params: Sequence[Param]) -> int:
        return box_numel(self.src_box) * params[self.param].itemsize


@dataclass
class P2PPlan:
    params: list[Param]  # as the source splits them
    src: Layout
    dst: Layout
    dst_params: list[Param]  # the same parameters as the destination splits them
    moves: list[Move] = field(default_factory=list)

    def held_box(self, param: int, rank: int) -> Box | None:
        """What source rank ``rank`` holds of ``param`` (None: another stage's)."""
        p = self.params[param]
        _, pp, tp = self.src.coords(rank)
        return p.box(self.src.tp, tp) if p.stage == pp else None

    def need_box(self, param: int, rank: int) -> Box | None:
        """What destination rank ``rank`` needs of ``param`` (None: another stage's)."""
        p = self.dst_params[param]
        _, pp, tp = self.dst.coords(rank)
        per_stage = self.src.pp // self.dst.pp
        return p.box(self.dst.tp, tp) if p.stage // per_stage == pp else None

    def sends(self, src: int) -> list[Move]:
        return [m for m in self.moves if m.src == src]

    def receives(self, dst: int) -> list[Move]:
        return [m for m in self.moves if m.dst == dst]

    def pairs(self) -> dict[tuple[int, int], list[Move]]:
        """(src, dst) → its moves, in parameter order."""
        found: dict[tuple[int, int], list[Move]] = {}
        for m in self.moves:
            found.setdefault((m.src, m.dst), []).append(m)
        return found

    def bytes_between(self, src: int, dst: int) -> int:
        return sum(m.nbytes(self.params) for m in self.moves if (m.src, m.dst) == (src, dst))

    def send_bytes(self, src: int) -> int:
        return sum(m.nbytes(self.params) for m in self.sends(src))

    def recv_bytes(self, dst: int) -> int:
        return sum(m.nbytes(self.params) for m in self.receives(dst))


def make_p2p_plan(
    params: Sequence[Param],
    src: Layout,
    dst: Layout,
    dst_splits: Mapping[str, Split] | None = None,
) -> P2PPlan:
    """The moves that give every rank of ``dst`` its pieces from the ranks of ``src``."""
    if src.pp % dst.pp:
        raise LayoutError(
            f"destination pp={dst.pp} must divide source pp={src.pp} (each destination stage "
            "is a union of source stages)"
        )
    theirs = list(params)
    if dst_splits is not None:
        theirs = [replace(p, split=dst_splits.get(p.name, "replicated")) for p in params]
    for p, q in zip(params, theirs, strict=True):
        if not 0 <= p.stage < src.pp:
            raise LayoutError(f"{p.name}: stage {p.stage} outside source pp={src.pp}")
        p.box(src.tp, 0)  # raises when a split does not divide
        q.box(dst.tp, 0)
    plan = P2PPlan(list(params), src, dst, theirs)
    for rank in range(dst.world_size):
        for index in range(len(plan.params)):
            plan.moves.extend(_moves_for(plan, rank, index))
    return plan


def _moves_for(plan: P2PPlan, dst: int, param: int) -> list[Move]:
    need = plan.need_box(param, dst)
    if need is None:
        return []
    replica = dst % plan.src.dp
    holders: dict[Box, list[int]] = {}  # each distinct held box, by the replica's ranks holding it
    for pp in range(plan.src.pp):
        for tp in range(plan.src.tp):
            rank = plan.src.rank_of(replica, pp, tp)
            box = plan.held_box(param, rank)
            if box is not None:
                holders.setdefault(box, []).append(rank)
    moves = []
    for box, ranks in sorted(holders.items()):
        overlap = intersect(box, need)
        if overlap is None:
            continue
        src = ranks[(dst + param) % len(ranks)]
        moves.append(Move(src, dst, param, relative(overlap, box), relative(overlap, need)))
    return moves


def pair_buckets(moves: Sequence[Move], params: Sequence[Param], limit: int) -> list[list[Move]]:
    """Consecutive moves of one (src, dst) pair in buckets of at most ``limit`` bytes (a move
    larger than ``limit`` travels alone)."""
    if limit < 1:
        raise LayoutError(f"bucket_bytes={limit} must be positive")
    buckets: list[list[Move]] = []
    size = 0
    for move in moves:
        n = move.nbytes(params)
        if not buckets or size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(move)
        size += n
    return buckets


def params_from_wire(specs: Sequence[dict[str, Any]], itemsize: int) -> list[Param]:
    """Parameters from ``[{"name", "shape", "tp_dim"}]`` (what a training engine reports): the
    tp dim 0 is a column split, 1 a row split, none replicated."""
    found = []
    for spec in specs:
        tp_dim = spec.get("tp_dim")
        if tp_dim not in TP_DIM_SPLIT:
            raise LayoutError(f"{spec.get('name')}: tp_dim {tp_dim!r} is not 0, 1 or None")
        shape = tuple(int(s) for s in spec["shape"])
        stage = int(spec.get("stage", 0))
        found.append(Param(str(spec["name"]), shape, TP_DIM_SPLIT[tp_dim], stage, itemsize))
    return found
