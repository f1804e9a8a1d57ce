"""``TensorBatch``: the unit of data that flows between the controller and its worker groups.

A batch holds three kinds of data:

* ``tensors`` -- named ``torch.Tensor`` columns that all share dim 0, the batch size;
* ``non_tensors`` -- named per-row Python values (prompts, ids, reward metadata), one list
  entry per row;
* ``meta`` -- free-form values that describe the whole batch (temperature, step number).

The controller builds a batch, ``chunk``s it across the ranks of a role group, and ``concat``s the
replies back into one. ``pad_to_divisor``/``unpad`` make a batch divisible by the group size first.
Row slicing (``split``, ``chunk``, slices, int indices, ``unpad``) returns views of the original
tensors, so nothing is copied until a worker writes to the wire or gathers rows by index.

Code that reads a batch it received (a role on a rank, the controller on a reply) takes columns
with ``tensor(name)``, ``non_tensor(name)`` and ``require_tensors(*names)``: a missing column or one
of the wrong kind raises ``BatchError`` naming the column and what the batch has, so bad input from
the wire is an error the caller can read, not an assert.

The class deliberately has no ``__eq__``: use ``equals`` for an exact column-by-column comparison.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch

#: Anything that selects rows: an int (one row, dims kept), a slice, a 1-D integer tensor or list
#: of ints, or a 1-D bool mask tensor as long as the batch.
RowIndex = int | slice | torch.Tensor | Sequence[int]


class BatchError(ValueError):
    """A batch lacks a column its reader needs, or holds it as the other kind (tensor or not)."""


def _same(a: Any, b: Any) -> bool:
    """Exact equality that also works for tensors and numpy arrays (no ambiguous truth values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        same_kind = a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        return same_kind and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _check_same_keys(what: str, first: Mapping[str, Any], other: Mapping[str, Any], i: int) -> None:
    missing, extra = sorted(set(first) - set(other)), sorted(set(other) - set(first))
    if missing or extra:
        raise ValueError(
            f"concat: batch {i} {what} keys differ from batch 0: missing {missing}, extra {extra}"
        )


@dataclass(eq=False, repr=False)
class TensorBatch:
    """Named tensor and per-row columns sharing one batch size, plus batch-wide ``meta``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        size: int | None = None
        first = ""
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor column {name!r} is a {type(t).__name__}, not a Tensor")
            if t.ndim < 1:
                raise ValueError(f"tensor column {name!r} is 0-d; columns need a batch dim")
            size, first = self._check_size(name, t.shape[0], size, first)
        for name, col in self.non_tensors.items():
            if not isinstance(col, list):
                raise TypeError(f"non-tensor column {name!r} is a {type(col).__name__}, not a list")
            if name in self.tensors:
                raise ValueError(f"column {name!r} is both a tensor and a non-tensor column")
            size, first = self._check_size(name, len(col), size, first)

    @staticmethod
    def _check_size(name: str, n: int, size: int | None, first: str) -> tuple[int, str]:
        if size is not None and n != size:
            raise ValueError(
                f"column {name!r} has {n} rows but column {first!r} has {size}; "
                "all columns must share the batch size"
            )
        return (n, name) if size is None else (size, first)

    # ------------------------------------------------------------------ construction / access
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> TensorBatch:
        """Build a batch; non-tensor columns may be any sequence (stored as lists)."""
        cols: dict[str, list[Any]] = {}
        for name, col in (non_tensors or {}).items():
            if isinstance(col, str | bytes):
                raise TypeError(f"non-tensor column {name!r} is a {type(col).__name__}, not rows")
            cols[name] = list(col)
        return cls(dict(tensors or {}), cols, dict(meta or {}))

    @property
    def batch_size(self) -> int:
        """Rows in the batch; 0 for a batch with no columns (even when it has ``meta``)."""
        for t in self.tensors.values():
            return int(t.shape[0])
        for col in self.non_tensors.values():
            return len(col)
        return 0

    def __len__(self) -> int:
        return self.batch_size

    def _has_columns(self) -> bool:
        return bool(self.tensors) or bool(self.non_tensors)

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for k, t in self.tensors.items()
        )
        return (
            f"TensorBatch(batch_size={self.batch_size}, tensors={{{cols}}}, "
            f"non_tensors={list(self.non_tensors)}, meta={list(self.meta)})"
        )

    @overload
    def __getitem__(self, item: str) -> torch.Tensor | list[Any]: ...
    @overload
    def __getitem__(self, item: RowIndex) -> TensorBatch: ...
    def __getitem__(self, item: str | RowIndex) -> torch.Tensor | list[Any] | TensorBatch:
        if isinstance(item, str):
            if item in self.tensors:
                return self.tensors[item]
            if item in self.non_tensors:
                return self.non_tensors[item]
            raise KeyError(f"no column named {item!r}")
        return self.index(item)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor column ``name``; a ``BatchError`` if it is missing or a non-tensor column."""
        found = self.tensors.get(name)
        if found is None:
            raise self._absent(name, "tensor")
        return found

    def non_tensor(self, name: str) -> list[Any]:
        """The non-tensor (per-row list) column ``name``; a ``BatchError`` if it is missing or
        a tensor column."""
        found = self.non_tensors.get(name)
        if found is None:
            raise self._absent(name, "non-tensor")
        return found

    def require_tensors(self, *names: str) -> None:
        """A ``BatchError`` listing every named tensor column the batch lacks (check before a
        collective, so that every rank fails alike instead of some waiting on the others)."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise BatchError(f"the batch lacks tensor column(s) {missing}; {self._inventory()}")

    def _absent(self, name: str, kind: str) -> BatchError:
        if name in self.tensors or name in self.non_tensors:
            other = "non-tensor" if kind == "tensor" else "tensor"
            return BatchError(f"column {name!r} must be a {kind} column; got a {other} column")
        return BatchError(f"the batch has no column {name!r}; {self._inventory()}")

    def _inventory(self) -> str:
        return (
            f"it has tensor columns {sorted(self.tensors)} "
            f"and non-tensor columns {sorted(self.non_tensors)}"
        )

    def select(
        self,
        tensor_keys: Sequence[str] | None = None,
        non_tensor_keys: Sequence[str] | None = None,
        meta_keys: Sequence[str] | None = None,
    ) -> TensorBatch:
        """Keep only the named columns of each kind (``None`` keeps all of that kind)."""

        def pick(kind: str, src: Mapping[str, Any], keys: Sequence[str] | None) -> dict[str, Any]:
            if keys is None:
                return dict(src)
            for k in keys:
                if k not in src:
                    raise KeyError(f"no {kind} key {k!r}")
            return {k: src[k] for k in keys}

        tensors = pick("tensor", self.tensors, tensor_keys)
        cols = pick("non-tensor", self.non_tensors, non_tensor_keys)
        return TensorBatch(
            tensors, {k: list(v) for k, v in cols.items()}, pick("meta", self.meta, meta_keys)
        )

    def union(self, other: TensorBatch) -> TensorBatch:
        """Merge the columns of both; a key in both must hold identical values.

        A batch with no columns (meta only) can be merged into a batch of any size.
        """
        if self._has_columns() and other._has_columns() and len(self) != len(other):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        merged: list[dict[str, Any]] = []
        for kind, mine, theirs in (
            ("tensor", self.tensors, other.tensors),
            ("non-tensor", self.non_tensors, other.non_tensors),
            ("meta", self.meta, other.meta),
        ):
            for k in mine.keys() & theirs.keys():
                if not _same(mine[k], theirs[k]):
                    raise ValueError(f"union: {kind} key {k!r} differs between the two batches")
            merged.append({**mine, **theirs})
        tensors, cols, meta = merged
        return TensorBatch(tensors, {k: list(v) for k, v in cols.items()}, meta)

    # ------------------------------------------------------------------ row selection
    def _rows(self, start: int, stop: int) -> TensorBatch:
        """Rows ``start:stop`` (already clamped); tensors are views."""
        return TensorBatch(
            {k: t[start:stop] for k, t in self.tensors.items()},
            {k: v[start:stop] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def _gather(self, idx: torch.Tensor) -> TensorBatch:
        """Rows at the 1-D integer positions ``idx`` (copies, as advanced indexing must)."""
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"row index out of range for batch of size {n}")
        positions = idx.tolist()
        return TensorBatch(
            {k: t[idx.to(t.device)] for k, t in self.tensors.items()},
            {k: [v[i] for i in positions] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def index(self, idx: RowIndex) -> TensorBatch:
        """Select rows; int, slice (positive step) and mask-free selections return views."""
        n = len(self)
        if isinstance(idx, bool):
            raise TypeError("a bool is not a row index; use a bool mask tensor")
        if isinstance(idx, int):
            if not -n <= idx < n:
                raise IndexError(f"row {idx} out of range for batch of size {n}")
            start = idx % n
            return self._rows(start, start + 1)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            if step == 1:
                return self._rows(start, max(start, stop))
            if step > 0:
                return TensorBatch(
                    {k: t[idx] for k, t in self.tensors.items()},
                    {k: v[idx] for k, v in self.non_tensors.items()},
                    dict(self.meta),
                )
            return self._gather(torch.arange(start, stop, step))
        t = torch.as_tensor(idx) if not isinstance(idx, torch.Tensor) else idx
        if t.ndim != 1:
            raise IndexError(f"row index tensor must be 1-D, got shape {list(t.shape)}")
        if t.dtype == torch.bool:
            if t.shape[0] != n:
                raise IndexError(f"bool mask has {t.shape[0]} entries, batch has {n} rows")
            return self._gather(t.nonzero().flatten())
        if t.numel() == 0:
            t = t.long()
        if t.is_floating_point() or t.is_complex():
            raise IndexError(f"row index tensor must be integer or bool, got {t.dtype}")
        return self._gather(t.long())

    def split(self, size: int) -> list[TensorBatch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter); views, [] if empty."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        n = len(self)
        return [self._rows(s, min(s + size, n)) for s in range(0, n, size)]

    def chunk(self, n: int) -> list[TensorBatch]:
        """``n`` views whose sizes differ by at most one, larger first (like ``tensor_split``)."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, got {n}")
        base, extra = divmod(len(self), n)
        parts, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            parts.append(self._rows(start, stop))
            start = stop
        return parts

    @staticmethod
    def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
        """Stack batches row-wise; all must have the same keys. Meta comes from the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        head = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            _check_same_keys("tensor", head.tensors, b.tensors, i)
            _check_same_keys("non-tensor", head.non_tensors, b.non_tensors, i)
        tensors = {}
        for k in head.tensors:
            try:
                tensors[k] = torch.cat([b.tensors[k] for b in batches])
            except RuntimeError as e:
                raise ValueError(f"concat: tensor column {k!r} cannot be concatenated: {e}") from e
        cols = {k: [x for b in batches for x in b.non_tensors[k]] for k in head.non_tensors}
        return TensorBatch(tensors, cols, dict(head.meta))

    def repeat(self, times: int, interleave: bool = True) -> TensorBatch:
        """Repeat each row ``times``: interleaved gives [a, a, b, b], otherwise [a, b, a, b]."""
        if times < 0:
            raise ValueError(f"repeat times must be >= 0, got {times}")
        if interleave:
            tensors = {k: t.repeat_interleave(times, dim=0) for k, t in self.tensors.items()}
            cols = {k: [x for x in v for _ in range(times)] for k, v in self.non_tensors.items()}
        else:
            tensors = {k: t.repeat(times, *[1] * (t.ndim - 1)) for k, t in self.tensors.items()}
            cols = {k: v * times for k, v in self.non_tensors.items()}
        return TensorBatch(tensors, cols, dict(self.meta))

    def pad_to_divisor(self, divisor: int) -> tuple[TensorBatch, int]:
        """Append rows, cycling from the start, until the size divides by ``divisor``.

        Returns ``(padded, pad_count)``; ``self`` itself when no padding is needed.
        """
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty batch: there are no rows to repeat")
        pad = -n % divisor
        if pad == 0:
            return self, 0
        filler = self._gather(torch.arange(pad) % n)
        return TensorBatch.concat([self, filler]), pad

    def unpad(self, pad_count: int) -> TensorBatch:
        """Drop the last ``pad_count`` rows (a view); inverse of ``pad_to_divisor``."""
        n = len(self)
        if not 0 <= pad_count <= n:
            raise ValueError(f"pad_count must be in [0, {n}], got {pad_count}")
        return self._rows(0, n - pad_count)

    # ------------------------------------------------------------------ misc
    def to(self, device: torch.device | str, non_blocking: bool = False) -> TensorBatch:
        """Move every tensor column to ``device``; non-tensors and meta are shallow-copied."""
        return TensorBatch(
            {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()},
            {k: list(v) for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def equals(self, other: TensorBatch) -> bool:
        """True if every column and meta entry match exactly (tensor dtype and shape included)."""
        pairs = (
            (self.tensors, other.tensors),
            (self.non_tensors, other.non_tensors),
            (self.meta, other.meta),
        )
        return all(a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a) for a, b in pairs)
