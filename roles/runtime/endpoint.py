"""Endpoints: role methods the controller may call, each with its transfer protocol.

A transfer protocol is a pair of plain functions (the paper's distribute + collect):

- ``distribute(args, kwargs, layout)`` returns, per rank, the ``(args, kwargs)`` that rank runs
  with, or ``None`` where the rank sits the call out;
- ``collect(results, layout)`` turns the per-rank results (``None`` where a rank did not run) into
  the one value the controller receives.

``@endpoint(DP_SPLIT)`` marks a method; the marker is an ordinary attribute on the function, the
method stays a normal method, so IDEs and type checkers see exactly what the class defines. A new
protocol is a new ``TransferProtocol(...)`` value with a new name in ``transport.protocol.Transfer``
(the vocabulary the controller's clients share), not a string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from reshard.layout import GenLayout, gen_place
from transport.batch import BatchError, TensorBatch
from transport.columns import REPLICA
from transport.protocol import Layout, Transfer

P = ParamSpec("P")
R = TypeVar("R")

Args = tuple[tuple[Any, ...], dict[str, Any]]
Distribute = Callable[[tuple[Any, ...], dict[str, Any], Layout], list[Args | None]]
Collect = Callable[[list[Any], Layout], Any]

_MARK = "__hybridflow_endpoint__"


@dataclass(frozen=True)
class TransferProtocol:
    name: Transfer
    distribute: Distribute
    collect: Collect


def _broadcast(args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout) -> list[Args | None]:
    return [(args, kwargs)] * layout.world_size


def _rank_zero_only(
    args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout
) -> list[Args | None]:
    return [(args, kwargs)] + [None] * (layout.world_size - 1)


def _first(results: list[Any], layout: Layout) -> Any:
    return results[0]


def split(batch: TensorBatch, count: int) -> list[TensorBatch]:
    """``count`` shards of ``batch`` in order: nearly equal, or, when it has a ``replica``
    column (session affinity: a trajectory's turns go where its KV is kept), row i to shard
    ``replica[i]``. That column must be sorted and name every shard at least once, so the shards'
    results concatenated are in the batch's order."""
    wanted = batch.non_tensors.get(REPLICA)
    if wanted is None:
        return batch.chunk(count)
    replicas = [int(r) for r in wanted]
    if replicas != sorted(replicas) or set(replicas) != set(range(count)):
        raise BatchError(
            f"a {REPLICA!r} column must be sorted and name each of the {count} replicas at "
            f"least once; got {sorted(set(replicas))}"
        )
    bounds = [replicas.index(k) for k in range(count)] + [len(replicas)]
    return [batch[bounds[k] : bounds[k + 1]] for k in range(count)]


def _by_dp(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: Layout,
    shards: Callable[[Any], list[Any]],
) -> list[Args | None]:
    """Each argument cut into one shard per dp rank by ``shards``; every rank gets its dp rank's
    shards (the tp/pp peers of a dp rank the same)."""
    arg_shards = [shards(a) for a in args]
    kwarg_shards = {k: shards(v) for k, v in kwargs.items()}
    per_rank: list[Args | None] = []
    for rank in range(layout.world_size):
        dp, _, _ = layout.coords(rank)
        per_rank.append(
            (tuple(s[dp] for s in arg_shards), {k: s[dp] for k, s in kwarg_shards.items()})
        )
    return per_rank


def _dp_scatter(args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout) -> list[Args | None]:
    """Split every TensorBatch argument into dp shards (``split``: nearly equal, in order, or
    by its ``replica`` column); other arguments go to every rank unchanged. The tp/pp peers of a
    dp rank get the same shard."""

    def shards(value: Any) -> list[Any]:
        if isinstance(value, TensorBatch):
            return split(value, layout.dp)
        return [value] * layout.dp

    return _by_dp(args, kwargs, layout, shards)


def _dp_gather(results: list[Any], layout: Layout) -> Any:
    """One result per dp group, from tp rank 0 on the last pp stage; TensorBatch results are
    concatenated in dp order, anything else comes back as a list indexed by dp rank."""
    picked = [results[layout.rank_of(dp, layout.pp - 1, 0)] for dp in range(layout.dp)]
    if picked and all(isinstance(r, TensorBatch) for r in picked):
        return TensorBatch.concat(picked)
    return picked


def _dp_gather_ragged(results: list[Any], layout: Layout) -> Any:
    """Like ``_dp_gather`` for batches whose ``[B, T, ...]`` columns differ in width between dp
    ranks (generated sequences): each is right-padded to the widest, with the value
    ``meta["pad_values"][column]`` (default 0)."""
    picked = [results[layout.rank_of(dp, layout.pp - 1, 0)] for dp in range(layout.dp)]
    return _pad_and_concat(picked)


def _pad_and_concat(picked: list[Any]) -> Any:
    if not picked or not all(isinstance(r, TensorBatch) for r in picked):
        return picked
    pad_values = picked[0].meta.get("pad_values", {})
    for name in picked[0].tensors:
        columns = [b.tensors[name] for b in picked]
        if columns[0].dim() < 2:
            continue
        width = max(c.shape[1] for c in columns)
        for batch, column in zip(picked, columns, strict=True):
            if column.shape[1] < width:
                fill = column.new_full(
                    (column.shape[0], width, *column.shape[2:]), pad_values.get(name, 0)
                )
                fill[:, : column.shape[1]] = column
                batch.tensors[name] = fill
    return TensorBatch.concat(picked)


def _replicas(layout: Layout) -> list[tuple[int, int, int]]:
    """Per rank: (generation replica, generation stage, generation tp index) under the
    HybridFlow grouping of the layout's generation tp/pp (the training layout when unset)."""
    gen = GenLayout(tp=layout.generation_tp, pp=layout.generation_pp)
    places = [gen_place(layout, gen, r, "hybridflow") for r in range(layout.world_size)]
    return [(p.replica, p.stage, p.tp) for p in places]


def _micro_dp_scatter(
    args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout
) -> list[Args | None]:
    """Split every TensorBatch argument over the generation replicas (d * d_g, in order); the
    ranks of one replica (its generation tp/pp group) get the same shard."""
    places = _replicas(layout)
    count = 1 + max(p[0] for p in places)

    def shards(value: Any) -> list[Any]:
        return split(value, count) if isinstance(value, TensorBatch) else [value] * count

    arg_shards = [shards(a) for a in args]
    kwarg_shards = {k: shards(v) for k, v in kwargs.items()}
    return [
        (tuple(s[rep] for s in arg_shards), {k: s[rep] for k, s in kwarg_shards.items()})
        for rep, _, _ in places
    ]


def _micro_dp_gather(results: list[Any], layout: Layout) -> Any:
    """Each generation replica's result from its tp rank 0 on its last stage, in replica
    order, ragged columns padded as ``_dp_gather_ragged`` does."""
    places = _replicas(layout)
    last = layout.generation_pp - 1
    chosen = {rep: r for r, (rep, stage, tp) in enumerate(places) if stage == last and tp == 0}
    picked = [results[chosen[rep]] for rep in sorted(chosen)]
    return _pad_and_concat(picked)


def _routed(args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout) -> list[Args | None]:
    """Every list argument whose items have a ``replica`` field split by it (item to dp rank
    ``replica``); other arguments go to every rank unchanged. The tp/pp peers of a dp rank get
    the same items."""

    def shards(value: Any) -> list[Any]:
        if not isinstance(value, list) or not all(hasattr(x, "replica") for x in value):
            return [value] * layout.dp
        if any(not 0 <= int(x.replica) < layout.dp for x in value):
            raise BatchError(
                f"an item names a replica outside the group's {layout.dp} dp ranks: "
                f"{sorted({int(x.replica) for x in value})}"
            )
        return [[x for x in value if int(x.replica) == dp] for dp in range(layout.dp)]

    return _by_dp(args, kwargs, layout, shards)


def _concat_lists(results: list[Any], layout: Layout) -> list[Any]:
    """The lists of each dp group's tp rank 0 on the last pp stage, concatenated in dp order."""
    return [x for dp in range(layout.dp) for x in results[layout.rank_of(dp, layout.pp - 1, 0)]]


ONE_TO_ALL = TransferProtocol(Transfer.ONE_TO_ALL, _broadcast, _first)
DP_SPLIT = TransferProtocol(Transfer.DP_SPLIT, _dp_scatter, _dp_gather)
RANK_ZERO = TransferProtocol(Transfer.RANK_ZERO, _rank_zero_only, _first)
#: dp-split in, rank 0's result out: for calls whose ranks already reduced their result over the
#: group (a training step's metrics), so the controller gets one value, not one per dp rank.
DP_REDUCED = TransferProtocol(Transfer.DP_REDUCED, _dp_scatter, _first)
#: dp-split in, rows concatenated out after right-padding ``[B, T]`` columns to a common width.
DP_RAGGED = TransferProtocol(Transfer.DP_RAGGED, _dp_scatter, _dp_gather_ragged)
#: the paper's 3D_ALL_MICRO_DP: like DP_RAGGED over the generation replicas (reshard/); the same
#: as DP_RAGGED when the group generates at its training layout.
MICRO_DP = TransferProtocol(Transfer.MICRO_DP, _micro_dp_scatter, _micro_dp_gather)
#: items of list arguments to the dp rank each names (``replica``), the ranks' lists joined
DP_ROUTED = TransferProtocol(Transfer.DP_ROUTED, _routed, _concat_lists)


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    protocol: TransferProtocol


def endpoint(
    protocol: TransferProtocol = ONE_TO_ALL,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Mark a role method as callable by the controller with the given transfer protocol."""

    def mark(fn: Callable[P, R]) -> Callable[P, R]:
        setattr(fn, _MARK, EndpointSpec(fn.__name__, protocol))
        return fn

    return mark


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    """Every endpoint a role class declares (inherited ones included)."""
    found: dict[str, EndpointSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            spec = getattr(value, _MARK, None)
            if isinstance(spec, EndpointSpec):
                found[name] = spec
    return found
