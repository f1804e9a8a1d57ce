"""Point-to-point plans: which slices each rank of a training group sends to which rank of a
separate group (a rollout group, or a reference/critic group initialised from the actor).

The source holds parameters in its training layout (``transport.protocol.Layout`` dp/tp/pp;
tp-split per ``Param.split``, replicated across dp). Each destination rank needs, per parameter,
the piece its own layout gives it: ``Param.box(dst.tp, j)`` on its pipeline stage. A plan lists
``Move``\\ s — ``(src, dst, param, src_box, dst_box)`` with the boxes relative to the source's
held piece and the destination's needed piece — such that every destination piece is covered
exactly once and each source rank sends only what some destination needs.

Who sends: a piece several source ranks hold alike comes, for destination rank ``r``, from the
holders in source replica ``r % src.dp`` (so the ranks of the destination spread over the
source's data-parallel replicas), and among them (a replicated parameter's tp ranks) from holder
``(r + param_index) % holders``, which spreads replicated parameters over the tp ranks.

FSDP-sharded sources: ``src_dp_dims`` gives, per parameter, the dim the source additionally
splits over dp (``torch.chunk`` of its tp piece, as FSDP2 shards); each dp rank then holds a
distinct piece and a destination gathers its box from all of them — no all-gather on the source.

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
    src_dp_dims: list[int | None]  # per parameter, the dim the source shards over dp (FSDP)
    moves: list[Move] = field(default_factory=list)

    def held_box(self, param: int, rank: int) -> Box | None:
        """What source rank ``rank`` holds of ``param`` (None: another stage's, or an empty
        FSDP shard)."""
        p = self.params[param]
        dp, pp, tp = self.src.coords(rank)
        if p.stage != pp:
            return None
        box, dim = p.box(self.src.tp, tp), self.src_dp_dims[param]
        return box if dim is None else chunk_box(box, dim, self.src.dp, dp)

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


def chunk_box(box: Box, dim: int, parts: int, index: int) -> Box | None:
    """Part ``index`` of ``box`` cut along ``dim`` as ``torch.chunk`` cuts (ceil-sized parts;
    trailing ones may be short or empty)."""
    lo, hi = box[dim]
    size = -(-(hi - lo) // parts)
    start, stop = lo + index * size, min(hi, lo + (index + 1) * size)
    if start >= stop:
        return None
    return tuple((start, stop) if d == dim else e for d, e in enumerate(box))


def make_p2p_plan(
    params: Sequence[Param],
    src: Layout,
    dst: Layout,
    dst_splits: Mapping[str, Split] | None = None,
    src_dp_dims: Sequence[int | None] | None = None,
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
    dims: list[int | None] = [None] * len(theirs) if src_dp_dims is None else list(src_dp_dims)
    plan = P2PPlan(list(params), src, dst, theirs, dims)
    for index in range(len(plan.params)):
        holders: dict[Box, list[int]] = {}  # each distinct held box, by the ranks holding it
        for rank in range(src.world_size):
            box = plan.held_box(index, rank)
            if box is not None:
                holders.setdefault(box, []).append(rank)
        for rank in range(dst.world_size):
            plan.moves.extend(_moves_for(plan, rank, index, holders))
    plan.moves.sort(key=lambda m: (m.dst, m.param))
    return plan


def _moves_for(plan: P2PPlan, dst: int, param: int, holders: dict[Box, list[int]]) -> list[Move]:
    need = plan.need_box(param, dst)
    if need is None:
        return []
    replica = dst % plan.src.dp
    moves, covered = [], 0
    for box, ranks in sorted(holders.items()):
        overlap = intersect(box, need)
        if overlap is None:
            continue
        near = [r for r in ranks if plan.src.coords(r)[0] == replica] or ranks
        src = near[(dst + param) % len(near)]
        moves.append(Move(src, dst, param, relative(overlap, box), relative(overlap, need)))
        covered += box_numel(overlap)
    if covered != box_numel(need):
        raise LayoutError(
            f"{plan.params[param].name}: the source's pieces cover {covered} of the "
            f"{box_numel(need)} elements destination rank {dst} needs (overlapping or missing)"
        )
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


def dp_dims_from_wire(specs: Sequence[dict[str, Any]]) -> list[int | None]:
    """Per parameter, the dim a source shards over dp (``dp_dim``; absent or None: whole)."""
    found: list[int | None] = []
    for spec in specs:
        dim = spec.get("dp_dim")
        if dim is not None and (type(dim) is not int or not 0 <= dim < len(spec["shape"])):
            raise LayoutError(f"{spec.get('name')}: dp_dim {dim!r} is not a dim of its shape")
        found.append(dim)
    return found


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
