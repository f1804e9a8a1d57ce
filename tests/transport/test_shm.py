"""Tests for transport.shm: shared-memory arena (sender) and reader (receiver)."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import os
import re
import struct
from multiprocessing.connection import Connection

import pytest
import torch

from transport.shm import (
    DATA_OFFSET,
    MAX_READERS,
    SHM_DIR,
    ShmArena,
    ShmReader,
    sweep,
    sweep_dead,
)

MIB = 1 << 20
WAIT_S = 60.0


def _path(desc: dict[str, object]) -> str:
    return os.path.join(SHM_DIR, str(desc["name"]))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _recv(conn: Connection) -> object:
    assert conn.poll(WAIT_S), "timed out waiting for the other process"
    return conn.recv()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(3 * MIB // 4, dtype=torch.float32).reshape(3, -1),
        torch.randint(-(1 << 60), 1 << 60, (200_000,), dtype=torch.int64),
        torch.rand(1000) > 0.5,
        torch.tensor(3.5, dtype=torch.float64),
        torch.empty(0, dtype=torch.int32),
    ],
)
def test_round_trip(arena: ShmArena, reader: ShmReader, tensor: torch.Tensor) -> None:
    desc = arena.put(tensor)
    assert desc is not None
    assert set(desc) == {"name", "nbytes", "gen", "readers"}
    assert all(type(v) in (str, int) for v in desc.values())
    assert desc["nbytes"] == tensor.numel() * tensor.element_size()
    got = reader.get(desc)
    assert got.dtype == torch.uint8 and got.shape == (desc["nbytes"],)
    assert torch.equal(got.view(tensor.dtype).reshape(tensor.shape), tensor)


def test_view_is_zero_copy(arena: ShmArena, reader: ShmReader) -> None:
    desc = arena.put(torch.zeros(MIB, dtype=torch.uint8))
    assert desc is not None
    got = reader.get(desc)
    assert got.data_ptr() % 64 == 0
    fd = os.open(_path(desc), os.O_RDWR)  # write through a different mapping of the segment
    try:
        os.pwrite(fd, b"\x07\x08", DATA_OFFSET + 1000)
    finally:
        os.close(fd)
    assert got[1000].item() == 7 and got[1001].item() == 8
    again = arena.put(torch.ones(10, dtype=torch.uint8))  # the sender does not touch a busy one
    assert again is not None and again["name"] != desc["name"]
    assert got[1000].item() == 7


def test_reuse_only_after_release(arena: ShmArena, reader: ShmReader) -> None:
    d1 = arena.put(torch.full((MIB,), 1, dtype=torch.uint8))
    assert d1 is not None
    held = reader.get(d1)
    view = held[10:20]  # a derived view keeps the segment as busy as the original
    del held
    gc.collect()
    d2 = arena.put(torch.full((MIB,), 2, dtype=torch.uint8))
    assert d2 is not None and d2["name"] != d1["name"]
    assert bool((view == 1).all())
    del view
    gc.collect()
    d3 = arena.put(torch.full((MIB,), 3, dtype=torch.uint8))
    assert d3 is not None and d3["name"] == d1["name"] and d3["gen"] != d1["gen"]
    assert bool((reader.get(d3) == 3).all())
    with pytest.raises(ValueError, match="stale"):
        reader.get(d1)


def test_size_classes(arena: ShmArena, reader: ShmReader) -> None:
    big = arena.put(torch.zeros(8 * MIB, dtype=torch.uint8))
    assert big is not None
    reader.release(big)
    small = arena.put(torch.zeros(MIB, dtype=torch.uint8))  # 8 MiB is > 4x: not reused
    assert small is not None and small["name"] != big["name"]
    reader.release(small)
    tiny = arena.put(torch.zeros(100, dtype=torch.uint8))  # min-size segments serve tiny puts
    assert tiny is not None and tiny["name"] == small["name"]


def test_two_readers_must_both_release(arena: ShmArena, reader: ShmReader) -> None:
    desc = arena.put(torch.arange(MIB // 8, dtype=torch.int64), readers=2)
    assert desc is not None
    r1 = ShmReader()
    a, b = reader.get(desc, 0), r1.get(desc, 1)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="already received"):
        reader.get(desc, 0)
    del a
    gc.collect()
    other = arena.put(torch.zeros(MIB, dtype=torch.uint8))
    assert other is not None and other["name"] != desc["name"]
    del b
    gc.collect()
    again = arena.put(torch.zeros(MIB, dtype=torch.uint8))
    assert again is not None and again["name"] == desc["name"]
    r1.close()


def test_release_reader_frees_a_dead_readers_segments(arena: ShmArena, reader: ShmReader) -> None:
    desc = arena.put(torch.zeros(MIB, dtype=torch.uint8), readers=2)
    assert desc is not None
    reader.release(desc, 0)
    assert arena.release_reader(1) == 1
    again = arena.put(torch.zeros(MIB, dtype=torch.uint8))
    assert again is not None and again["name"] == desc["name"]


def _child_reader(conn: Connection) -> None:
    reader = ShmReader()
    while True:
        desc = conn.recv()
        if desc is None:
            break
        view = reader.get(desc)
        digest = _digest(view)
        del view
        conn.send(digest)
    reader.close()
    conn.close()


def test_second_process_reads_and_releases(arena: ShmArena) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_reader, args=(child,), daemon=True)
    proc.start()
    try:
        names = set()
        for i in range(4):
            data = torch.randint(0, 256, (3 * MIB + i,), dtype=torch.uint8)
            desc = arena.put(data)
            assert desc is not None
            names.add(desc["name"])
            parent.send(desc)
            assert _recv(parent) == _digest(data)
        assert len(names) == 1  # each release let the next put reuse the segment
        parent.send(None)
        proc.join(WAIT_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(WAIT_S)


def test_max_bytes(shm_prefix: str, reader: ShmReader) -> None:
    with ShmArena(prefix=shm_prefix, max_bytes=2 * MIB + 2 * DATA_OFFSET) as arena:
        assert arena.put(torch.zeros(4 * MIB, dtype=torch.uint8)) is None
        d1 = arena.put(torch.zeros(MIB, dtype=torch.uint8))
        d2 = arena.put(torch.zeros(MIB, dtype=torch.uint8))
        assert d1 is not None and d2 is not None
        assert arena.put(torch.zeros(10, dtype=torch.uint8)) is None
        assert arena.total_bytes <= arena.max_bytes
        reader.release(d1)
        assert arena.put(torch.zeros(10, dtype=torch.uint8)) is not None


def test_free_segments_are_retired_to_make_room(shm_prefix: str, reader: ShmReader) -> None:
    with ShmArena(prefix=shm_prefix, max_bytes=5 * MIB + DATA_OFFSET) as arena:
        small = arena.put(torch.ones(MIB, dtype=torch.uint8))
        assert small is not None
        assert int(reader.get(small).sum()) == MIB  # the reader now caches that mapping
        big = arena.put(torch.ones(4 * MIB, dtype=torch.uint8))  # both would not fit
        assert big is not None
        assert not os.path.exists(_path(small))
        assert int(reader.get(big).sum()) == 4 * MIB
        assert small["name"] not in reader._maps  # dropped on seeing the retired flag


def test_close_removes_files(shm_prefix: str, reader: ShmReader) -> None:
    arena = ShmArena(prefix=shm_prefix)
    descs = [arena.put(torch.zeros(n * MIB, dtype=torch.uint8)) for n in (1, 2, 3)]
    paths = [_path(d) for d in descs if d is not None]
    assert len(paths) == 3 and all(os.path.exists(p) for p in paths)
    assert descs[0] is not None
    view = reader.get(descs[0])
    arena.close()
    arena.close()
    assert not any(os.path.exists(p) for p in paths)
    assert int(view.sum()) == 0  # a reader's live view stays valid after the unlink
    with pytest.raises(RuntimeError):
        arena.put(torch.zeros(1))


def _child_leaks(conn: Connection, prefix: str) -> None:
    arena = ShmArena(prefix=prefix)
    names = [arena.put(torch.zeros(MIB, dtype=torch.uint8), readers=1) for _ in range(2)]
    conn.send([d["name"] for d in names if d is not None])
    conn.close()
    os._exit(0)  # no atexit: the segments are left behind


def test_sweep_dead_process(shm_prefix: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_leaks, args=(child, shm_prefix))
    proc.start()
    names = _recv(parent)
    proc.join(WAIT_S)
    assert proc.exitcode == 0 and proc.pid is not None
    assert isinstance(names, list) and len(names) == 2
    assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert sweep(proc.pid, prefix=shm_prefix) == 2
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert sweep(proc.pid, prefix=shm_prefix) == 0
    with pytest.raises(ValueError, match="alive"):
        sweep(os.getpid(), prefix=shm_prefix)


def test_bad_descriptors(arena: ShmArena, reader: ShmReader, shm_prefix: str) -> None:
    desc = arena.put(torch.zeros(MIB, dtype=torch.uint8), readers=2)
    assert desc is not None
    bad: list[dict[str, object]] = [
        {},
        {**desc, "name": f"{shm_prefix}-{os.getpid()}-999"},
        {**desc, "name": "../etc/passwd"},
        {**desc, "name": 5},
        {**desc, "nbytes": 3 * MIB},
        {**desc, "nbytes": -1},
        {**desc, "gen": desc["gen"] + 1},
        {**desc, "readers": MAX_READERS + 1},
    ]
    for d in bad:
        with pytest.raises(ValueError):
            reader.get(d)
    with pytest.raises(ValueError, match="reader_index"):
        reader.get(desc, reader_index=2)
    with pytest.raises(ValueError, match="does not exist"):
        reader.get(bad[1])
    reader.release(desc, 0)
    with pytest.raises(ValueError, match="already received or released"):
        reader.get(desc, 0)
    assert torch.equal(reader.get(desc, 1), torch.zeros(MIB, dtype=torch.uint8))


def test_leftover_of_an_earlier_process_with_our_pid(shm_prefix: str, reader: ShmReader) -> None:
    path = os.path.join(SHM_DIR, f"{shm_prefix}-{os.getpid()}-0")
    header = bytearray(DATA_OFFSET)
    header[0] = 1
    struct.pack_into("<Q", header, 64, 5)
    with open(path, "wb") as f:
        f.write(bytes(header) + b"\x09" * MIB)
    old = {"name": os.path.basename(path), "nbytes": 10, "gen": 5, "readers": 1}
    assert reader.get(old).tolist() == [9] * 10  # the reader now caches the old mapping
    with ShmArena(prefix=shm_prefix) as arena:
        desc = arena.put(torch.full((20,), 4, dtype=torch.uint8))
        assert desc is not None and desc["name"] == old["name"]
        assert reader.get(desc).tolist() == [4] * 20
        with pytest.raises(ValueError, match="already uses prefix"):
            ShmArena(prefix=shm_prefix)
    ShmArena(prefix=shm_prefix).close()  # the prefix is free again after close


def test_bad_puts(arena: ShmArena) -> None:
    with pytest.raises(ValueError):
        arena.put(torch.zeros(4), readers=MAX_READERS + 1)
    with pytest.raises(ValueError):
        arena.put(torch.zeros(4), readers=0)
    with pytest.raises(ValueError):
        arena.put(torch.zeros(4, 4).t())
    with pytest.raises(ValueError):
        ShmArena(prefix="a/b")
    with pytest.raises(ValueError):
        arena.release_reader(MAX_READERS)


def test_sweep_dead_removes_what_a_killed_process_left(shm_prefix: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_leaks, args=(child, shm_prefix))  # exits like kill -9
    proc.start()
    names = _recv(parent)
    proc.join(WAIT_S)
    assert isinstance(names, list) and len(names) == 2
    assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    with ShmArena(prefix=shm_prefix + "live") as live:  # a live owner's segment stays
        kept = live.put(torch.zeros(MIB, dtype=torch.uint8), readers=1)
        assert kept is not None
        assert sweep_dead(re.escape(shm_prefix) + "(?:live)?") == 2
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        assert os.path.exists(os.path.join(SHM_DIR, kept["name"]))
