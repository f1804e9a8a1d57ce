"""A rank's error as the caller reads it (``transport/errors.py``): one line naming the role, the
rank and the exception, then the frame that raised it; the remote traceback an attribute away."""

from __future__ import annotations

import traceback

from transport.errors import RemoteError, innermost_frame, remote_error


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


def test_a_ranks_error_comes_back_as_the_class_of_its_kind() -> None:
    """``except hf.RemoteEngineError`` (and the others) without matching message text; a
    rank's BatchError is caught where the controller's own check is (``except BatchError``)."""
    import hybridflow as hf

    kinds = {
        "EngineError": hf.RemoteEngineError,
        "GenerationError": hf.RemoteGenerationError,
        "BatchError": hf.RemoteBatchError,
        "RewardError": hf.RemoteRewardError,
        "ZeroDivisionError": hf.RemoteError,
    }
    for name, cls in kinds.items():
        err = remote_error("actor", 1, name, "no", "")
        assert type(err) is cls and isinstance(err, hf.RemoteError), name
        assert (err.role, err.rank, err.exc_type) == ("actor", 1, name)
    assert isinstance(remote_error("a", 0, "BatchError", "x", ""), hf.BatchError)
