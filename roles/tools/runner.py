"""Workers that run an env group's actions, each under a deadline, and the box results wait in.

``Runner.start(work, late)`` queues one piece of work and returns a ``Future`` of its result. At
most ``workers`` pieces run at once, each on a thread of its own, started when a slot is free. A
piece that is still running ``timeout_s`` after it started is given up: its future gets
``late(seconds)`` at the deadline (a single deadline thread keeps the earliest one and wakes for
it), its slot goes to the next piece, and its thread is left to finish in the background, its
result dropped. Python cannot stop a thread, so a tool that never returns costs a thread, not a
slot (``Runner.abandoned`` counts them).

``Outbox`` holds finished results until ``take(wait_s)`` hands them over, waiting up to ``wait_s``
(on a condition, not by polling) when it is empty.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

IDLE_WAKE_S = 60.0  # the deadline thread's wait when no deadline is pending


@dataclass
class _Job(Generic[T]):
    work: Callable[[], T]
    late: Callable[[float], T]
    future: Future[T] = field(default_factory=Future)
    started: float = 0.0
    settled: bool = False
    given_up: bool = False  # settled at its deadline, its thread still running


class Runner:
    """Runs work on up to ``workers`` threads at once, each piece given up after ``timeout_s``."""

    def __init__(self, workers: int, timeout_s: float, name: str = "env") -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"workers={workers} must be >= 1 and timeout_s={timeout_s} > 0")
        self.workers, self.timeout_s, self.name = workers, timeout_s, name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the deadline thread waits on it
        self._queue: deque[_Job[object]] = deque()
        self._deadlines: list[tuple[float, int, _Job[object]]] = []
        self._order = itertools.count()
        self._running = 0
        self.abandoned = 0  # threads still running past their deadline
        self._watcher: threading.Thread | None = None

    @property
    def load(self) -> int:
        """Pieces running or waiting for a slot."""
        with self._lock:
            return self._running + len(self._queue)

    def start(self, work: Callable[[], T], late: Callable[[float], T]) -> Future[T]:
        """Queue ``work``; its future gets its result, or ``late(seconds)`` at its deadline."""
        job: _Job[T] = _Job(work, late)
        with self._lock:
            self._queue.append(job)  # type: ignore[arg-type]
            self._launch()
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch, name=f"{self.name}-deadlines", daemon=True
                )
                self._watcher.start()
        return job.future

    def _launch(self) -> None:
        """Start queued pieces while slots are free (lock held)."""
        while self._queue and self._running < self.workers:
            job = self._queue.popleft()
            self._running += 1
            job.started = time.monotonic()
            heapq.heappush(self._deadlines, (job.started + self.timeout_s, next(self._order), job))
            self._wake.notify()
            thread = threading.Thread(target=self._run, args=(job,), name=f"{self.name}-worker")
            thread.daemon = True  # an abandoned tool must not keep the process alive
            thread.start()

    def _run(self, job: _Job[object]) -> None:
        try:
            result = job.work()
        except BaseException as exc:  # the work's own bug: its future carries it to the caller
            if self._settle(job, late=False):
                job.future.set_exception(exc)
            return
        if self._settle(job, late=False):
            job.future.set_result(result)

    def _settle(self, job: _Job[object], late: bool) -> bool:
        """Mark ``job`` finished (``late``: given up at its deadline); False if it already was."""
        with self._lock:
            if job.settled:
                if job.given_up and not late:
                    self.abandoned -= 1  # a given-up thread finally returned
                return False
            job.settled, job.given_up = True, late
            self._running -= 1
            if late:
                self.abandoned += 1
            self._launch()
            return True

    def _watch(self) -> None:
        while True:
            due = self._next_due()
            for job in due:
                if self._settle(job, late=True):
                    try:
                        job.future.set_result(job.late(time.monotonic() - job.started))
                    except BaseException as exc:  # the fallback's own bug: report it
                        job.future.set_exception(exc)

    def _next_due(self) -> list[_Job[object]]:
        """Wait for the earliest deadline; the unsettled pieces whose deadline has passed."""
        with self._lock:
            while True:
                while self._deadlines and self._deadlines[0][2].settled:
                    heapq.heappop(self._deadlines)
                now = time.monotonic()
                due = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    due.append(heapq.heappop(self._deadlines)[2])
                due = [job for job in due if not job.settled]
                if due:
                    return due
                wait = self._deadlines[0][0] - now if self._deadlines else IDLE_WAKE_S
                self._wake.wait(timeout=wait)


class Outbox(Generic[T]):
    """Finished results, handed over in the order they finished."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._items: list[T] = []

    def put(self, item: T) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()

    def take(self, wait_s: float) -> list[T]:
        """Everything finished so far; when nothing is, wait up to ``wait_s`` for the first."""
        with self._ready:
            if not self._items and wait_s > 0:
                self._ready.wait_for(lambda: bool(self._items), timeout=wait_s)
            items, self._items = self._items, []
            return items
