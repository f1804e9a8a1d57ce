"""Waiting in tests for something that can be observed, never for a guessed number of seconds.

``wait_for(predicate, timeout, what)`` polls until the predicate holds and returns its value; on
timeout it fails saying what was awaited (and, with ``proc``, fails at once, with its exit code,
when the process that should produce the event exits first). ``cpu_seconds`` reads a process's
CPU time, the observable of a rank that is computing; ``waits`` counts the times a process's main
thread blocked (a rank serving calls); ``Blocked`` sees a thread that waits.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.05  # how often a predicate is asked: cheap ones (a file, /proc), so often


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    proc: subprocess.Popen[Any] | None = None,
    detail: Callable[[], object] | None = None,
) -> T:
    """The first truthy value of ``predicate()``, asked every ``POLL_S`` for ``timeout`` seconds.

    Raises AssertionError naming ``what`` when it never comes, or when ``proc`` (the process
    expected to make it happen) exits first; ``detail()`` is added to the message (a log, say)."""
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            _fail(f"{what}: never happened; the process exited with {proc.returncode}", detail)
        if time.monotonic() > deadline:
            _fail(f"{what}: not within {timeout:g} s", detail)
        time.sleep(POLL_S)


async def wait_until(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    """``wait_for`` for async tests: the event loop runs between the checks."""
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(POLL_S)


def _fail(message: str, detail: Callable[[], object] | None) -> None:
    if detail is not None:
        message += f"\n{detail()}"
    raise AssertionError(message)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int, tid: int | None) -> list[str]:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(") ", 1)[1].split()  # from field 3 (state) on


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User plus system CPU time so far of process ``pid`` (all its threads), or of its thread
    ``tid`` (its main thread: ``tid=pid``), from /proc."""
    fields = _stat(pid, tid)
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15


def waits(pid: int) -> int:
    """How many times the main thread of process ``pid`` has blocked so far (its voluntary
    context switches): a rank serving calls blocks a few times per call, waiting for messages;
    starting up, it mostly computes (imports)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


class Blocked:
    """A predicate: thread ``tid`` of process ``pid`` is blocked — sleeping, and it has used no CPU
    time for ``quiet_s`` (one reading of /proc per call; a computing thread gains a clock tick
    every 10 ms, so a thread whose CPU time stands still that long is waiting, not working)."""

    def __init__(self, pid: int, tid: int, quiet_s: float = 0.3) -> None:
        self.pid, self.tid, self.quiet_s = pid, tid, quiet_s
        self.cpu, self.since = -1.0, time.monotonic()

    def __call__(self) -> bool:
        fields = _stat(self.pid, self.tid)
        cpu = (int(fields[11]) + int(fields[12])) * _TICK_S
        now = time.monotonic()
        if fields[0] not in ("S", "D") or cpu != self.cpu:
            self.cpu, self.since = cpu, now
            return False
        return now - self.since >= self.quiet_s
