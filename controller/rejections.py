"""The controller's record of refused messages: bounded, rate-limited, never a peer's value at length.

Anyone who reaches the controller's socket can make it refuse messages as fast as they can send
them, and choose what the refusal would quote. So a reason quotes a peer's values through
``short`` (a few dozen characters, however long the value), is cut to ``REASON_CHARS``, only the
newest ``KEEP`` reasons are kept, and at most ``LOG_BURST`` warnings are logged per
``LOG_WINDOW_S``; the others are counted and summed up in one line when the window ends (the
controller's timer calls ``flush``, so the line comes even when no later refusal does). Before
this, a 60 MB ``version`` string became a 60 MB log line that blocked the event loop for a minute,
and a fuzz run left 19,995 reasons in memory. Messages dropped unread (from a stranger whose
connection was cut) are only counted (``dropped``): a flood costs a counter, not a reason each.
"""

from __future__ import annotations

import logging
import reprlib
import time
from collections.abc import Callable
from typing import Any

KEEP = 256
REASON_CHARS = 400
LOG_BURST = 20
LOG_WINDOW_S = 10.0
SHORT_CHARS = 60


class _ShortRepr(reprlib.Repr):
    def repr_bytes(self, x: bytes, level: int) -> str:  # reprlib would repr it all, then cut
        return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_repr = _ShortRepr()
_repr.maxstring = _repr.maxother = _repr.maxlong = SHORT_CHARS
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 6
_repr.maxlevel = 2


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def short(value: Any) -> str:
    """A peer's value for a message: its repr, cut before it is built where reprlib can (a
    60 MB string costs 60 characters) and after where it cannot."""
    return clip(_repr.repr(value), SHORT_CHARS)


class Rejections:
    """Reasons for refused messages, newest last; ``total`` counts every one ever refused."""

    def __init__(
        self,
        log: logging.Logger,
        keep: int = KEEP,
        burst: int = LOG_BURST,
        window_s: float = LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.keep = keep
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self.reasons: list[str] = []
        self.total = 0
        self._window_start = clock()
        self._logged = 0
        self._unlogged = 0

    def add(self, reason: str, exc: BaseException | None = None) -> str:
        """Record one refusal; returns the reason as kept (clipped). ``exc``: an unexpected
        error behind it, logged with its traceback (within the same rate limit)."""
        reason = clip(reason, REASON_CHARS)
        self.reasons.append(reason)
        if len(self.reasons) > self.keep:
            del self.reasons[: len(self.reasons) - self.keep]
        self._log(reason, exc)
        self.total += 1
        return reason

    def dropped(self, count: int = 1) -> None:
        """Count messages dropped unread: in ``total`` and in the window's summary line."""
        self.total += count
        self._unlogged += count

    def due(self) -> float:
        """Seconds until the current window ends (when ``flush`` has something to say)."""
        return max(0.0, self._window_start + self.window_s - self.clock())

    def flush(self) -> None:
        """Close the window if it has ended: log the summary of what was counted in it."""
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._close_window(now)

    def _log(self, reason: str, exc: BaseException | None) -> None:
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._close_window(now)
        if self._logged < self.burst:
            self._logged += 1
            self.log.warning("rejected %s", reason, exc_info=exc)
            return
        if self._unlogged == 0:
            self.log.warning(
                "rejecting more than %d messages within %.0f s: counting the rest, not logging "
                "each (controller.rejected keeps the newest %d)",
                self.burst,
                self.window_s,
                self.keep,
            )
        self._unlogged += 1

    def _close_window(self, now: float) -> None:
        if self._unlogged:
            self.log.warning(
                "rejected %d more messages in the last %.0f s (%d in all since start)",
                self._unlogged,
                now - self._window_start,
                self.total,
            )
        self._window_start, self._logged, self._unlogged = now, 0, 0
