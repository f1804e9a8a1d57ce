"""Built-in rule rewards: exact answers, final numbers, the environment's own reward."""

from __future__ import annotations

import pytest

from roles.rules import arithmetic_reward


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("82", 1.0),
        (" 82\n", 1.0),
        ("82 because 37+45=82", 1.0),
        ("82\nmore text", 1.0),
        ("82</s>", 0.0),  # special tokens are the caller's to strip
        ("83", 0.0),
        ("820", 0.0),
        ("8 2", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("the answer is 82", 0.0),
    ],
)
def test_arithmetic_reward_compares_the_first_token(response: str, reward: float) -> None:
    assert arithmetic_reward("37+45=", response, {"answer": "82"}) == reward


def test_arithmetic_reward_accepts_numeric_answers() -> None:
    assert arithmetic_reward("37+45=", "82", {"answer": 82}) == 1.0
    assert arithmetic_reward("37+45=", "82", {"answer": 82.0}) == 1.0
    assert arithmetic_reward("37+45=", "82", {"answer": " 82 "}) == 1.0


def test_arithmetic_reward_without_answer_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="metadata\\['answer'\\]"):
        arithmetic_reward("37+45=", "82", {})


def test_last_number_reward_reads_the_final_number() -> None:
    from roles.rules import last_number_reward

    assert last_number_reward("", "7 + 6 = 13", {"answer": "13"}) == 1.0
    assert last_number_reward("", "13, or maybe 14", {"answer": 13}) == 0.0
    assert last_number_reward("", "no idea", {"answer": "13"}) == 0.0
    assert last_number_reward("", "it is -3", {"answer": -3.0}) == 1.0
    with pytest.raises(ValueError, match="answer"):
        last_number_reward("", "1", {})


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("5535", 1.0),  # the final turn after "123*45=[calculator 123*45] = 5535\n"
        (" 5535\n", 1.0),
        ("5534", 0.0),  # a direct guess one off
        ("55350", 0.0),
        ("[calculator 123*45]", 0.0),  # out of turns on a call: no answer
        ("= 5535", 0.0),
        ("", 0.0),
    ],
)
def test_tool_arithmetic_reward_scores_the_final_answer(response: str, reward: float) -> None:
    from roles.rules import needed_columns, tool_arithmetic_reward

    assert tool_arithmetic_reward("123*45=", response, {"answer": "5535"}) == reward
    assert needed_columns(tool_arithmetic_reward) == ("answer",)


def test_tool_arithmetic_reward_without_answer_names_itself() -> None:
    from roles.rules import tool_arithmetic_reward

    with pytest.raises(ValueError, match="tool_arithmetic_reward needs metadata\\['answer'\\]"):
        tool_arithmetic_reward("123*45=", "5535", {})


@pytest.mark.parametrize(
    ("env_reward", "score"),
    [
        (1.0, 1.0),  # GuessNumber: the right guess
        (0.0, 0.0),  # lost, or cut short by max_turns
        (2, 2.0),  # an environment that pays on several steps: their sum, as the rollout wrote it
        (-0.5, -0.5),
    ],
)
def test_env_reward_is_the_environments_sum_whatever_the_text(
    env_reward: float, score: float
) -> None:
    from roles.rules import env_reward as rule
    from roles.rules import needed_columns

    row = {"env_reward": env_reward, "secret": 11, "turns": 3}
    assert rule("Game: ", "[11]", row) == score
    assert rule("Game: ", "no number at all", row) == score  # the text is the game's to judge
    # the rollout makes the column, so the data is not asked for it at load
    assert needed_columns(rule) == ()


def test_env_reward_without_a_multi_turn_rollout_says_to_set_trainer_agent() -> None:
    from roles.rules import env_reward

    with pytest.raises(ValueError, match="env_reward comes from a multi-turn rollout: set "):
        env_reward("Game: ", "[8]", {"secret": 11})
    with pytest.raises(ValueError, match=r"metadata\['env_reward'\] is None \(a NoneType\)"):
        env_reward("Game: ", "[8]", {"env_reward": None})
    with pytest.raises(ValueError, match="is True"):
        env_reward("Game: ", "[8]", {"env_reward": True})
