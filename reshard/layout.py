"""Layouts: where each piece of each parameter lives in training and in generation.

A model is a list of ``Param``: full shape, how tensor parallel splits it (``column``: dim 0 split
over tp, e.g. q/k/v, gate/up, a vocab-parallel embedding; ``row``: dim 1, e.g. o/down;
``replicated``: whole on every tp rank, e.g. norms) and which pipeline stage holds it.

The training layout is p-t-d on N = p·t·d ranks in the standard grouping (``transport.protocol
.Layout``: tp fastest, then pp, then dp; a rank's coordinates are ``(dp, pp, tp)``). Parameters
are replicated across dp (the paper's case; FSDP sharding over dp is modelled by the planner, not
executed here).

The generation layout is p_g-t_g-d_g-d: each training replica (the p·t ranks of one dp index)
becomes d_g = p·t / (p_g·t_g) micro-DP replicas. Which rank holds which generation shard depends
on the grouping:

* ``hybridflow`` — the paper's: the ranks that share a generation shard form a micro-DP group
  (consecutive ranks when p = p_g), and generation TP/PP groups take ranks at regular intervals,
  so every rank's training shard lies inside its generation shard. 8 ranks, 1-4-2 → 1-2-2-2: TP
  groups [0,2] [1,3] [4,6] [5,7], micro-DP groups [0,1] [2,3] [4,5] [6,7].
* ``standard`` — generation TP/PP groups on consecutive ranks, like training; a rank's generation
  shard generally does not contain its training shard (HybridFlow-V, naive and verl-style use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Literal

from transport.protocol import Layout

Split = Literal["column", "row", "replicated"]
Grouping = Literal["hybridflow", "standard"]
#: A box: (start, stop) per dim of a parameter's full shape.
Box = tuple[tuple[int, int], ...]

SPLIT_DIM: dict[str, int | None] = {"column": 0, "row": 1, "replicated": None}


class LayoutError(ValueError):
    """Two layouts or a parameter set that cannot be resharded, with what to change."""


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    split: Split = "replicated"
    stage: int = 0
    itemsize: int = 4  # bytes per element

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def box(self, parts: int, index: int) -> Box:
        """The slice tensor parallel at size ``parts`` gives to tp rank ``index``."""
        full = tuple((0, s) for s in self.shape)
        dim = SPLIT_DIM[self.split]
        if dim is None or parts == 1:
            return full
        if dim >= len(self.shape) or self.shape[dim] % parts:
            raise LayoutError(
                f"{self.name}: {self.split}-split of shape {list(self.shape)} over {parts} "
                f"ranks needs dim {dim} divisible by {parts}"
            )
        size = self.shape[dim] // parts
        return tuple(
            (index * size, (index + 1) * size) if d == dim else f for d, f in enumerate(full)
        )


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def relative(box: Box, within: Box) -> Box:
    """``box`` in the coordinates of ``within`` (which must contain it)."""
    return tuple((a - w0, b - w0) for (a, b), (w0, _) in zip(box, within, strict=True))


@dataclass(frozen=True)
class GenLayout:
    """Generation tensor and pipeline sizes; the micro-DP size follows from the training layout."""

    tp: int = 1
    pp: int = 1

    def micro_dp(self, train: Layout) -> int:
        check_pair(train, self)
        return (train.pp * train.tp) // (self.pp * self.tp)


def check_pair(train: Layout, gen: GenLayout) -> None:
    if train.tp % gen.tp or train.pp % gen.pp:
        raise LayoutError(
            f"generation t_g={gen.tp}, p_g={gen.pp} must divide training t={train.tp}, "
            f"p={train.pp} (each generation shard is a union of training shards)"
        )


def parse_layout(text: str) -> tuple[int, ...]:
    """'1-4-2' → (1, 4, 2): the paper's p-t-d notation."""
    try:
        parts = tuple(int(x) for x in text.split("-"))
    except ValueError:
        parts = ()
    if not parts or any(x < 1 for x in parts):
        raise LayoutError(f"layout {text!r}: expected positive integers joined by '-', e.g. 1-4-2")
    return parts


@dataclass(frozen=True)
class GenPlace:
    """Where a rank sits in the generation layout."""

    replica: int  # generation replica index, 0 .. d·d_g - 1
    stage: int  # generation pipeline stage s_g
    tp: int  # generation tensor-parallel index j_g


def gen_place(train: Layout, gen: GenLayout, rank: int, grouping: Grouping) -> GenPlace:
    d_g = gen.micro_dp(train)
    dp, pp, tp = train.coords(rank)
    if grouping == "hybridflow":
        ps, ts = train.pp // gen.pp, train.tp // gen.tp  # training stages/shards per gen one
        micro = (pp % ps) * ts + tp % ts
        return GenPlace(dp * d_g + micro, pp // ps, tp // ts)
    local = pp * train.tp + tp  # position inside the training replica
    return GenPlace(
        dp * d_g + local // (gen.tp * gen.pp), (local // gen.tp) % gen.pp, local % gen.tp
    )


def gen_groups(train: Layout, gen: GenLayout, grouping: Grouping) -> dict[str, list[list[int]]]:
    """The generation process groups: ``tp`` (one generation engine's shards, per stage),
    ``pp`` and ``micro_dp`` (the ranks holding the same generation shard)."""
    places = [gen_place(train, gen, r, grouping) for r in range(train.world_size)]

    def by(key: str) -> list[list[int]]:
        found: dict[tuple[int, ...], list[int]] = {}
        for rank, p in enumerate(places):
            if key == "tp":
                k: tuple[int, ...] = (p.replica, p.stage)
            elif key == "pp":
                k = (p.replica, p.tp)
            else:  # same shard, same training replica
                k = (rank // (train.pp * train.tp), p.stage, p.tp)
            found.setdefault(k, []).append(rank)
        return sorted(found.values())

    return {"tp": by("tp"), "pp": by("pp"), "micro_dp": by("micro_dp")}


def train_box(param: Param, train: Layout, rank: int) -> Box | None:
    """The piece of ``param`` rank ``rank`` holds in training (None: another stage's)."""
    _, pp, tp = train.coords(rank)
    return param.box(train.tp, tp) if param.stage == pp else None


def gen_box(
    param: Param, train: Layout, gen: GenLayout, rank: int, grouping: Grouping
) -> Box | None:
    """The piece of ``param`` rank ``rank`` holds while generating (None: another stage's)."""
    place = gen_place(train, gen, rank, grouping)
    if param.stage // (train.pp // gen.pp) != place.stage:
        return None
    return param.box(gen.tp, place.tp)


def check_params(params: list[Param], train: Layout, gen: GenLayout) -> None:
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise LayoutError("parameter names repeat")
    for p in params:
        if not 0 <= p.stage < train.pp:
            raise LayoutError(f"{p.name}: stage {p.stage} outside pp={train.pp}")
        for parts in {train.tp, gen.tp}:
            p.box(parts, 0)  # raises when the split does not divide


def all_ranks(train: Layout) -> list[int]:
    return list(range(train.world_size))


def replica_ranks(train: Layout, dp: int) -> list[int]:
    return [train.rank_of(dp, s, t) for s, t in product(range(train.pp), range(train.tp))]


def params_from_layout(layout: dict[str, dict[str, object]], itemsize: int = 4) -> list[Param]:
    """Parameters as a training engine reports them (``EngineRole.param_layout``: per name its
    full ``shape`` and the ``tp_dim`` tensor parallel splits, 0, 1 or None)."""
    kinds: dict[object, Split] = {0: "column", 1: "row", None: "replicated"}
    out = []
    for name, entry in layout.items():
        tp_dim = entry.get("tp_dim")
        if tp_dim not in kinds:
            raise LayoutError(f"{name}: tp_dim={tp_dim!r}; reshard handles 0, 1 or None")
        shape = entry.get("shape")
        if not isinstance(shape, list | tuple) or not all(isinstance(s, int) for s in shape):
            raise LayoutError(f"{name}: shape {shape!r} is not a list of ints")
        stage = entry.get("pp_stage", 0)
        if not isinstance(stage, int):
            raise LayoutError(f"{name}: pp_stage {stage!r} is not an int")
        out.append(Param(name, tuple(shape), kinds[tp_dim], stage, itemsize))
    return out
