"""Fixtures for the shared-memory tests: a private segment prefix, an arena, a reader."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from transport.shm import SHM_DIR, ShmArena, ShmReader

MIB = 1 << 20


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = "hft" + uuid.uuid4().hex[:10]
    yield prefix
    for entry in os.scandir(SHM_DIR):  # leave nothing behind even if a test fails
        if entry.name.startswith(prefix + "-"):
            os.unlink(entry.path)


@pytest.fixture
def arena(shm_prefix: str) -> Iterator[ShmArena]:
    a = ShmArena(prefix=shm_prefix, max_bytes=64 * MIB, min_segment_bytes=MIB)
    yield a
    a.close()


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    r = ShmReader()
    yield r
    r.close()
