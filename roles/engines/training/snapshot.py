"""In-memory snapshots of a training engine's state: a rollback loses one step, at a copy's cost.

Supervision (``controller/supervisor.py``) rolls every stateful group back when one of them dies.
A checkpoint (``save``) serializes: ~4 s for a 135M-parameter actor (1.7 GB of weights and AdamW
moments), as long as a step. A snapshot copies the same tensors into files in shared memory that
this process mapped at its first snapshot — a plain ``copy_``, ~0.1 s — and those files outlive
the rank (not the machine): a restarted rank maps them again and copies back.

One rank's snapshots live under ``FOLDER/rank{r}/`` (the controller makes ``FOLDER``, on
``/dev/shm``, and removes it), in two slots::

    slot0/  slot1/
        manifest.json   the controller's step, the write order, the engine's description, and
                        per tensor its file, shape, dtype and numel; written last (tmp + rename)
        extras.pt       the small things, through ``torch.save``: RNG, schedule, engine step,
                        the state's non-tensor leaves (AdamW's param_groups)
        NAME.bin        one tensor (this rank's local shard) raw, mapped by ``torch.from_file``

A snapshot goes into the slot that does not hold the newest complete one, and removes that
slot's manifest before it writes: a rank killed mid-copy leaves a slot without a manifest, which
is never read, and the other slot (the previous step) whole. Restoring a slot makes it the newest,
so the next snapshot does not overwrite the state just restored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from roles.engines.training.common import EngineError

MANIFEST = "manifest.json"
EXTRAS = "extras.pt"
SLOTS = 2


def flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level, keys joined by dots (``optim.state.<parameter>.exp_avg``);
    anything but a dict is a leaf (a tensor, AdamW's param_groups list, a number)."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        inner = flatten(value, name + ".") if isinstance(value, dict) else {name: value}
        for leaf, item in inner.items():
            if leaf in flat:
                raise EngineError(f"two entries of the engine state flatten to {leaf!r}")
            flat[leaf] = item
    return flat


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor of the state (a DTensor's local shard), without autograd."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def fill(
    state: dict[str, Any], tensors: Mapping[str, torch.Tensor], leaves: Mapping[str, Any]
) -> None:
    """Copy a snapshot into a freshly built state of the same engine, in place, as ``dcp.load``
    does: tensors into the local shards they came from, every other leaf replaced."""
    own = flatten(state)
    differ = set(own) ^ (set(tensors) | set(leaves))
    if differ:
        raise EngineError(
            f"the snapshot does not fit this engine's state: {len(differ)} names differ, "
            f"e.g. {sorted(differ)[:3]}"
        )
    _fill(state, "", tensors, leaves)


def _fill(
    state: dict[str, Any],
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    leaves: Mapping[str, Any],
) -> None:
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _fill(value, name + ".", tensors, leaves)
        elif isinstance(value, torch.Tensor) and value.numel() > 0:
            piece, saved = local(value), tensors.get(name)
            if saved is None or saved.shape != piece.shape or saved.dtype != piece.dtype:
                found = "no tensor" if saved is None else f"{saved.dtype} {list(saved.shape)}"
                raise EngineError(
                    f"snapshot tensor {name!r} is {found}, this engine's is "
                    f"{piece.dtype} {list(piece.shape)}"
                )
            with torch.no_grad():
                piece.copy_(saved)
        elif not isinstance(value, torch.Tensor):  # an empty tensor has nothing to copy
            state[key] = leaves[name]


class RankSnapshots:
    """One rank's two slots under ``folder/rank{rank}/`` and the tensors this process has
    mapped of them, kept between snapshots so that a later one is a plain copy."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self.root = folder / f"rank{rank}"
        self.mapped: list[dict[str, torch.Tensor]] = [{} for _ in range(SLOTS)]

    def write(
        self, step: int, state: Mapping[str, Any], extras: dict[str, Any], engine: dict[str, Any]
    ) -> int:
        """``state`` (nested dicts of tensors and small leaves) and ``extras`` as the snapshot of
        ``step``, into the slot not holding the newest complete one; returns the bytes written."""
        manifests = self._manifests()
        slot = _slot_to_write(manifests)
        path = self._slot_dir(slot)
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)  # the slot is incomplete until the last line
        entries: dict[str, dict[str, Any]] = {}
        leaves: dict[str, Any] = {}
        written = 0
        for name, value in flatten(state).items():
            if not isinstance(value, torch.Tensor):
                leaves[name] = value
                continue
            piece = local(value)
            if piece.numel() == 0:  # nothing to map
                leaves[name] = piece.cpu()
                continue
            self._mapped(slot, name, piece.numel(), piece.dtype).view(piece.shape).copy_(piece)
            entries[name] = {
                "file": _file_name(name),
                "shape": list(piece.shape),
                "dtype": str(piece.dtype).removeprefix("torch."),
                "numel": piece.numel(),
            }
            written += piece.numel() * piece.element_size()
        self._drop_others(slot, entries)
        torch.save({**extras, "leaves": leaves}, path / EXTRAS)
        written += (path / EXTRAS).stat().st_size
        order = 1 + max((m["order"] for m in manifests if m is not None), default=0)
        manifest = {"step": step, "order": order, "engine": engine, "tensors": entries}
        _write_json(path / MANIFEST, manifest)
        return written

    def read(
        self, step: int, engine: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The snapshot of ``step`` — its tensors by flat name (mapped, in their shapes) and
        its extras (``leaves``: the other leaves) — from the newest complete slot holding it.
        That slot becomes the newest: the next snapshot goes into the other one."""
        manifests = self._manifests()
        found = [i for i, m in enumerate(manifests) if m is not None and m["step"] == step]
        if not found:
            steps = sorted(m["step"] for m in manifests if m is not None)
            raise FileNotFoundError(
                f"no complete snapshot of step {step} for rank {self.rank} in {self.folder} "
                f"(complete snapshots there: steps {steps})"
            )
        slot = max(found, key=lambda i: manifests[i]["order"])  # type: ignore[index]
        manifest = manifests[slot]
        assert manifest is not None
        if manifest["engine"] != engine:
            raise EngineError(
                f"the snapshot in {self._slot_dir(slot)} was taken by an engine of "
                f"{manifest['engine']}, not {engine}"
            )
        tensors = {name: self._open(slot, name, e) for name, e in manifest["tensors"].items()}
        extras = torch.load(self._slot_dir(slot) / EXTRAS, weights_only=True)
        newest = max(m["order"] for m in manifests if m is not None)
        if manifest["order"] != newest:
            _write_json(self._slot_dir(slot) / MANIFEST, {**manifest, "order": newest + 1})
        return tensors, extras

    # -- files ---------------------------------------------------------------------------------

    def _slot_dir(self, slot: int) -> Path:
        return self.root / f"slot{slot}"

    def _manifests(self) -> list[dict[str, Any] | None]:
        found: list[dict[str, Any] | None] = []
        for slot in range(SLOTS):
            try:
                found.append(json.loads((self._slot_dir(slot) / MANIFEST).read_text()))
            except FileNotFoundError:
                found.append(None)
        return found

    def _mapped(self, slot: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The flat tensor mapped onto ``name``'s file in ``slot``: the one mapped before when
        it still fits, else the file (re)made at exactly this size and mapped."""
        have = self.mapped[slot].get(name)
        if have is not None and have.numel() == numel and have.dtype == dtype:
            return have
        file = self._slot_dir(slot) / _file_name(name)
        size = numel * dtype.itemsize
        if file.exists() and file.stat().st_size != size:
            file.unlink()  # from_file would map a prefix of a longer file, grow a shorter one
        if not file.exists():
            _allocate(file, size)
        mapped = torch.from_file(str(file), shared=True, size=numel, dtype=dtype)
        self.mapped[slot][name] = mapped
        return mapped

    def _open(self, slot: int, name: str, entry: dict[str, Any]) -> torch.Tensor:
        """A tensor of a complete slot, mapped (again, in a restarted process) and checked."""
        dtype = getattr(torch, entry["dtype"])
        numel, shape = int(entry["numel"]), tuple(entry["shape"])
        file = self._slot_dir(slot) / entry["file"]
        size = file.stat().st_size if file.exists() else None
        if size != numel * dtype.itemsize:
            raise FileNotFoundError(
                f"snapshot file {file} is {'missing' if size is None else f'{size} bytes'}, "
                f"its manifest says {numel} x {dtype}"
            )
        return self._mapped(slot, name, numel, dtype).view(shape)

    def _drop_others(self, slot: int, entries: Mapping[str, dict[str, Any]]) -> None:
        """Remove the files of ``slot`` no tensor of this snapshot uses (another engine state
        written there before), so that shared memory holds two snapshots, no more."""
        for name in set(self.mapped[slot]) - set(entries):
            del self.mapped[slot][name]
        files = {e["file"] for e in entries.values()}
        for file in self._slot_dir(slot).glob("*.bin"):
            if file.name not in files:
                file.unlink()


def _slot_to_write(manifests: list[dict[str, Any] | None]) -> int:
    """The slot without a complete snapshot, else the one holding the older."""
    empty = [i for i, m in enumerate(manifests) if m is None]
    if empty:
        return empty[0]
    return min(range(SLOTS), key=lambda i: manifests[i]["order"])  # type: ignore[index]


def _allocate(file: Path, size: int) -> None:
    """A new file of ``size`` bytes with its pages allocated in one call: on tmpfs, twice as
    fast as allocating them one page fault at a time through the first copy."""
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _file_name(name: str) -> str:
    return name.replace(os.sep, "_") + ".bin"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as ``path``, atomically: a reader sees the old file or the whole new one."""
    aside = path.with_name(path.name + ".tmp")
    aside.write_text(json.dumps(data))
    os.replace(aside, path)
