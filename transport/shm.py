"""Shared-memory side channel for large tensors between processes on one host.

The sender (:class:`ShmArena`) copies a tensor's raw bytes once into a reused, pre-faulted segment
``/dev/shm/<prefix>-<pid>-<n>`` and returns a small descriptor (``str``/``int`` values only) that
the caller ships in its own message. The receiver (:class:`ShmReader`) maps the segment (mapping
cached by name) and returns a zero-copy 1-D ``uint8`` tensor over it.

Segment layout: one page of header, then the data (page aligned, so any dtype view is aligned).

* bytes ``[0, 64)``: one flag per reader; the sender sets ``1`` in :meth:`ShmArena.put`, reader
  ``j`` clears byte ``j`` once the storage of its tensor is freed. A segment is free when all are 0.
* bytes ``[64, 72)``: generation (``<Q``) of the current contents, checked against the descriptor.
* byte ``72``: ``1`` once the sender retires (unlinks) the segment; readers then drop their mapping.

Every byte has a single writer at any time (the sender writes flags only while they are all 0,
reader ``j`` writes only byte ``j`` and only while it is 1), so no cross-process atomics are used.
This relies on x86's ordered stores and byte-granular writes, on the GIL inside a process, and on
the message transport (a syscall) ordering the sender's writes before the receiver's reads.

Lifetime: a received tensor pins its segment until every view of it is gone; clone or copy out
data that is kept for long. A descriptor never passed to :meth:`ShmReader.get` keeps its segment
busy forever: use :meth:`ShmReader.release` to discard one, or :meth:`ShmArena.release_reader` when
a receiver died. Segments of a killed sender are removed with :func:`sweep`. Linux only.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import struct
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from transport.device import in_host_memory

SHM_DIR = "/dev/shm"
MAX_READERS = 64
DATA_OFFSET = mmap.PAGESIZE
_GEN_OFFSET = 64
_RETIRED_OFFSET = 72
_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)
_NAME_RE = re.compile(r"[A-Za-z0-9_.]+-\d+-\d+")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.]+")


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


@dataclass(eq=False)
class _Segment:
    name: str
    capacity: int
    mm: mmap.mmap
    flags: npt.NDArray[np.uint8] = field(init=False)
    data: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.flags = np.frombuffer(self.mm, np.uint8, MAX_READERS, 0)
        arr = np.frombuffer(self.mm, np.uint8, self.capacity, DATA_OFFSET)
        self.data = torch.from_numpy(arr)

    @property
    def size(self) -> int:
        return DATA_OFFSET + self.capacity

    def busy(self) -> bool:
        return bool(self.flags.any())

    def retire(self) -> None:
        """Mark retired for readers, then drop the views and unmap (the caller unlinks)."""
        self.mm[_RETIRED_OFFSET] = 1
        del self.flags, self.data
        self.mm.close()


class ShmArena:
    """Sender side: a pool of named shared-memory segments owned by this process."""

    _prefixes_in_use: ClassVar[set[str]] = set()  # two arenas must not share names

    def __init__(
        self, prefix: str = "hf", max_bytes: int = 4 << 30, min_segment_bytes: int = 1 << 20
    ) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"shm prefix must match [A-Za-z0-9_.]+, got {prefix!r}")
        if prefix in ShmArena._prefixes_in_use:
            raise ValueError(f"an open ShmArena in this process already uses prefix {prefix!r}")
        ShmArena._prefixes_in_use.add(prefix)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.min_segment_bytes = max(1, min_segment_bytes)
        self._pid = os.getpid()
        self._segments: dict[str, _Segment] = {}
        self._counter = 0
        self._gen = int.from_bytes(os.urandom(6), "little") << 8  # differs across incarnations
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    @property
    def total_bytes(self) -> int:
        """Bytes of /dev/shm held by this arena (headers included)."""
        return sum(s.size for s in self._segments.values())

    def put(self, data: torch.Tensor, readers: int = 1) -> dict[str, Any] | None:
        """Copy ``data``'s bytes into a free segment; return its descriptor, or None if full."""
        if not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers must be in [1, {MAX_READERS}], got {readers}")
        if not in_host_memory(data) or not data.is_contiguous():
            raise ValueError("ShmArena.put needs a contiguous CPU tensor")
        return self.put_parts([data], readers)

    def put_parts(self, parts: Sequence[torch.Tensor], readers: int = 1) -> dict[str, Any] | None:
        """Like ``put`` for several CPU tensors, back to back in one segment, each copied once
        (the reshard module's buckets). A part that is not contiguous is copied in its own
        dtype, so the bytes before it must be a multiple of its itemsize."""
        if not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers must be in [1, {MAX_READERS}], got {readers}")
        if not all(in_host_memory(p) for p in parts):
            raise ValueError("ShmArena.put_parts needs CPU tensors")
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                raise RuntimeError("ShmArena is closed or was inherited through fork")
            seg = self._find_free(nbytes) or self._create(nbytes)
            if seg is None:
                return None
            offset = 0
            for part in parts:
                n = part.numel() * part.element_size()
                into = seg.data[offset : offset + n]
                if part.is_contiguous():
                    into.copy_(part.detach().reshape(-1).view(torch.uint8))
                else:
                    into.view(part.dtype).view(part.shape).copy_(part.detach())
                offset += n
            self._gen += 1
            struct.pack_into("<Q", seg.mm, _GEN_OFFSET, self._gen)
            seg.flags[:readers] = 1
            return {"name": seg.name, "nbytes": nbytes, "gen": self._gen, "readers": readers}

    def release_reader(self, reader_index: int) -> int:
        """Clear ``reader_index``'s flag everywhere (only once that reader is known dead)."""
        if not 0 <= reader_index < MAX_READERS:
            raise ValueError(f"reader_index must be in [0, {MAX_READERS}), got {reader_index}")
        with self._lock:
            held = [s for s in self._segments.values() if s.flags[reader_index]]
            for s in held:
                s.flags[reader_index] = 0
            return len(held)

    def close(self) -> None:
        """Unlink and unmap every segment. Idempotent; a forked child only unmaps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for seg in list(self._segments.values()):
                self._drop(seg, unlink=os.getpid() == self._pid)
            ShmArena._prefixes_in_use.discard(self.prefix)
        atexit.unregister(self.close)

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _find_free(self, nbytes: int) -> _Segment | None:
        limit = max(4 * nbytes, self.min_segment_bytes)
        fits = [
            s for s in self._segments.values() if nbytes <= s.capacity <= limit and not s.busy()
        ]
        return min(fits, key=lambda s: s.capacity, default=None)

    def _create(self, nbytes: int) -> _Segment | None:
        capacity = max(self.min_segment_bytes, 1 << max(nbytes - 1, 0).bit_length())
        size = DATA_OFFSET + capacity
        if size > self.max_bytes:
            return None
        # Make room by retiring free segments of the wrong size, largest first.
        idle = sorted((s for s in self._segments.values() if not s.busy()), key=lambda s: -s.size)
        if self.total_bytes - sum(s.size for s in idle) + size > self.max_bytes:
            return None
        while self.total_bytes + size > self.max_bytes:
            self._drop(idle.pop(0), unlink=True)
        name = f"{self.prefix}-{self._pid}-{self._counter}"
        self._counter += 1
        path = os.path.join(SHM_DIR, name)
        if os.path.exists(path):  # left by a dead process that had our pid
            _retire_file(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # ENOSPC here rather than SIGBUS on first write
            seg = _Segment(name, capacity, _map(fd, size, populate=False))
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        seg.data.zero_()  # pre-fault (write faults): later puts copy into mapped, writable pages
        self._segments[name] = seg
        return seg

    def _drop(self, seg: _Segment, unlink: bool) -> None:
        del self._segments[seg.name]
        if unlink:
            seg.retire()
            try:
                os.unlink(os.path.join(SHM_DIR, seg.name))
            except FileNotFoundError:
                pass
        else:
            del seg.flags, seg.data
            seg.mm.close()


def _release(mm: mmap.mmap, index: int, claims: dict[tuple[str, int], int], key: Any) -> None:
    """Finalizer of a received array: hand the segment back for this reader."""
    try:
        mm[index] = 0
    except ValueError:  # mapping already closed
        pass
    claims.pop(key, None)


class ShmReader:
    """Receiver side: attaches to other processes' segments."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._claims: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def get(self, desc: dict[str, Any], reader_index: int = 0) -> torch.Tensor:
        """Zero-copy 1-D uint8 view of the descriptor's bytes; released when its storage dies."""
        name, nbytes, gen = self._check(desc, reader_index)
        with self._lock:
            self._prune_retired()
            mm = self._attach(name)
            if nbytes > len(mm) - DATA_OFFSET:
                raise ValueError(f"descriptor needs {nbytes} bytes; segment {name} is smaller")
            if struct.unpack_from("<Q", mm, _GEN_OFFSET)[0] != gen:
                raise ValueError(f"stale descriptor for {name}: generation {gen} was replaced")
            key = (name, reader_index)
            if key in self._claims or not mm[reader_index]:
                raise ValueError(f"{name} was already received or released by {reader_index}")
            self._claims[key] = gen
            arr = np.frombuffer(mm, np.uint8, nbytes, DATA_OFFSET)
            weakref.finalize(arr, _release, mm, reader_index, self._claims, key)
            return torch.from_numpy(arr)

    def release(self, desc: dict[str, Any], reader_index: int = 0) -> None:
        """Give a descriptor's segment back without reading it (e.g. a dropped message)."""
        self.get(desc, reader_index)  # the unreferenced view is freed, and released, at once

    def close(self) -> None:
        """Unmap cached segments; mappings still viewed by live tensors go when those die."""
        with self._lock:
            for mm in self._maps.values():
                try:
                    mm.close()
                except BufferError:
                    pass
            self._maps.clear()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _check(desc: dict[str, Any], reader_index: int) -> tuple[str, int, int]:
        try:
            name, nbytes, gen, readers = desc["name"], desc["nbytes"], desc["gen"], desc["readers"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed shm descriptor {desc!r}") from e
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"bad shm segment name {name!r}")
        if not all(type(v) is int for v in (nbytes, gen, readers, reader_index)) or nbytes < 0:
            raise ValueError(f"malformed shm descriptor {desc!r}")
        if not 0 <= reader_index < readers <= MAX_READERS:
            raise ValueError(f"reader_index {reader_index} not in [0, {readers})")
        return name, nbytes, gen

    def _attach(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is not None:
            return mm
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(f"shared-memory segment {name} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET:
                raise ValueError(f"{name} is not a shm segment ({size} bytes)")
            mm = self._maps[name] = _map(fd, size, populate=True)
        finally:
            os.close(fd)
        return mm

    def _prune_retired(self) -> None:
        for name, mm in list(self._maps.items()):
            if mm[_RETIRED_OFFSET]:
                del self._maps[name]
                try:
                    mm.close()
                except BufferError:  # live views keep it; the finalizers hold the last refs
                    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # a zombie left its segments behind for good


def sweep(pid: int, prefix: str = "hf") -> int:
    """Unlink segments left by dead process ``pid``; return how many. ValueError if it lives."""
    if _pid_alive(pid):
        raise ValueError(f"process {pid} is alive; its shm segments are in use")
    pattern = re.compile(re.escape(f"{prefix}-{pid}-") + r"\d+")
    names = [e.path for e in os.scandir(SHM_DIR) if pattern.fullmatch(e.name)]
    return sum(_retire_file(path) for path in names)


def sweep_dead(prefix_pattern: str = r"hf[crw]\d*") -> int:
    """Unlink every segment whose owner (the pid in its name) is dead, for prefixes matching
    ``prefix_pattern``: what ``kill -9`` left behind. Returns how many."""
    pattern = re.compile(f"(?:{prefix_pattern})-(\\d+)-\\d+")
    removed = 0
    for entry in os.scandir(SHM_DIR):
        match = pattern.fullmatch(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            removed += _retire_file(entry.path)
    return removed


def _retire_file(path: str) -> bool:
    """Set a segment's retired flag (readers drop cached mappings), then unlink it."""
    try:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size >= DATA_OFFSET:
                f.seek(_RETIRED_OFFSET)
                f.write(b"\x01")
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


if __name__ == "__main__":
    import time

    torch.set_num_threads(1)

    def _rate(nbytes: int, fn: Any, reps: int) -> float:
        fn()  # warm up (creates and pre-faults the segment)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    with ShmArena(prefix="hfbench", max_bytes=2 << 30) as arena, ShmReader() as reader:
        for mib in (16, 256):
            n = mib << 20
            src = torch.randint(0, 1 << 40, (n // 8,), dtype=torch.int64)
            dst = torch.zeros_like(src)

            def memcpy(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                dst.copy_(src)

            def total(dst: torch.Tensor = dst) -> None:
                dst.sum()

            def shm(src: torch.Tensor = src) -> None:
                desc = arena.put(src)
                if desc is None:
                    raise RuntimeError("the benchmark arena is full; raise its max_bytes")
                reader.get(desc).view(torch.int64).sum()

            reps = max(4, (4 << 30) // n)
            base, add, got = (_rate(n, f, reps) for f in (memcpy, total, shm))
            print(
                f"{mib:4d} MiB  memcpy {base:5.1f} GB/s  int64 sum {add:5.1f} GB/s  "
                f"put+get+sum {got:5.1f} GB/s  ratio to memcpy {got / base:.2f}"
            )
