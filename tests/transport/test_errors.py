"""A rank's error as the caller reads it (``transport/errors.py``): one line naming the role, the
rank and the exception, then the frame that raised it; the remote traceback an attribute away."""

from __future__ import annotations

import traceback

from transport.errors import RemoteError, innermost_frame


def user_reward(text: str) -> float:
    return float(text) / 0  # the user's own line


def test_a_remote_error_names_the_users_frame_and_keeps_the_traceback_aside() -> None:
    try:
        user_reward("3")
    except ZeroDivisionError:
        remote = traceback.format_exc()
    err = RemoteError("reward", 2, "ZeroDivisionError", "float division by zero", remote)
    first, where, aside = str(err).splitlines()
    assert first == "reward rank 2 raised ZeroDivisionError: float division by zero"
    assert where.endswith("in user_reward: return float(text) / 0  # the user's own line")
    assert "test_errors.py:" in where and aside == "  (the remote traceback: .remote_traceback)"
    assert "Traceback (most recent call last)" in err.remote_traceback
    assert "Traceback" not in str(err)


def test_a_traceback_without_frames_adds_no_line() -> None:
    assert innermost_frame("ValueError: bad") == ""
    assert len(str(RemoteError("a", 0, "ValueError", "bad", "ValueError: bad")).splitlines()) == 2
