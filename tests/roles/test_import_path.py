"""Role classes and reward functions named by import path: each mistake gets its own message."""

from __future__ import annotations

import pytest

from roles.reward import RewardError, load_function
from roles.runtime.host import load_class
from tests.fixtures.roles import Echo, failing_reward


def test_good_paths_resolve() -> None:
    assert load_class("tests.fixtures.roles:Echo") is Echo
    assert load_function("tests.fixtures.roles:failing_reward") is failing_reward


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "tests.fixtures.roles",
            "role class 'tests.fixtures.roles' must look like package.module:Class",
        ),
        ("nowhere.at_all:Echo", "cannot import 'nowhere.at_all' for role class"),
        (
            "tests.fixtures.roles:failing_reward",
            "tests.fixtures.roles has no Class 'failing_reward'",
        ),
    ],
)
def test_bad_role_class(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_class(path)


def test_bad_reward_function_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match=r"tests\.fixtures\.roles has no function 'nothing'"):
        load_function("tests.fixtures.roles:nothing")
