"""Role classes and reward functions named by import path: each mistake gets its own message."""

from __future__ import annotations

import pytest

from roles.base import load_class
from roles.reward import RewardError, load_function
from roles.testing import Echo, failing_reward


def test_good_paths_resolve() -> None:
    assert load_class("roles.testing:Echo") is Echo
    assert load_function("roles.testing:failing_reward") is failing_reward


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("roles.testing", "role class 'roles.testing' must look like package.module:Class"),
        ("nowhere.at_all:Echo", "cannot import 'nowhere.at_all' for role class"),
        ("roles.testing:failing_reward", "roles.testing has no Class 'failing_reward'"),
    ],
)
def test_bad_role_class(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_class(path)


def test_bad_reward_function_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match=r"roles\.testing has no function 'nothing'"):
        load_function("roles.testing:nothing")
