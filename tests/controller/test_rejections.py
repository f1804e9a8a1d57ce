"""The rejection record: clipped reasons, the newest few kept, warnings rate-limited."""

from __future__ import annotations

import logging

import pytest

from controller.rejections import REASON_CHARS, SHORT_CHARS, Rejections, clip, short


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_short_never_builds_a_long_value() -> None:
    for value in ["v" * 60_000_000, b"v" * 60_000_000, list(range(10**6)), {"k": "v" * 10**6}]:
        assert len(short(value)) <= SHORT_CHARS + 20


def test_clip_says_how_long_the_text_was() -> None:
    assert clip("abc", 5) == "abc"
    assert clip("abcdef", 3) == "abc... (6 chars)"


def test_reasons_are_clipped_and_only_the_newest_kept() -> None:
    r = Rejections(logging.getLogger("test.rejections"), keep=10)
    for i in range(1000):
        r.add(f"reason {i} " + "x" * 10_000)
    assert r.total == 1000
    assert len(r.reasons) == 10
    assert r.reasons[-1].startswith("reason 999 ")
    assert all(len(reason) <= REASON_CHARS + 20 for reason in r.reasons)


def test_warnings_are_rate_limited_then_summed_up(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    r = Rejections(logging.getLogger("test.rejections"), burst=5, window_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        for _ in range(10_000):
            r.add("bad hello")
        assert len(caplog.records) == 6  # 5 reasons, then one line saying the rest are counted
        assert "counting the rest" in caplog.records[-1].getMessage()
        clock.now = 11.0
        r.add("bad hello")
    messages = [rec.getMessage() for rec in caplog.records]
    assert "rejected 9995 more messages" in messages[-2]
    assert messages[-1] == "rejected bad hello"
