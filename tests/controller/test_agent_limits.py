"""A turn's token limit holds across the continuations of one turn (``controller/agent.py``
``_one``): a stop token that closes no call continues the turn, within what is left of it.

The generator is scripted (what is under test is the turn's bookkeeping; real generation runs in
``tests/controller/test_agent.py``): every call samples up to three tokens and stops on ``>``."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.agent import AgentConfig, Trajectory, _one
from transport.agent import EnvResult, EnvSpec
from transport.sampling import SamplingConfig

GT, EOS = 7, 2  # ids of ">" and end of sequence


class Angles:
    """A generator that answers every turn with up to 3 tokens "ab>", stopping on ">"."""

    def __init__(self) -> None:
        self.asked: list[int] = []  # max_new of each call

    async def turn(
        self, key: int, ids: list[int], seed: int, max_new: int
    ) -> tuple[list[int], list[float], str, str, int]:
        self.asked.append(max_new)
        tokens = [5, 6, GT][:max_new] if max_new < 3 else [5, 6, GT]
        text = "ab>"[: len(tokens)]
        finish = "stop" if tokens[-1] == GT else "length"
        return tokens, [-0.5] * len(tokens), text, finish, 0

    def leave(self) -> None:
        pass


class NoDesk:
    async def act(self, action: Any) -> Any:
        raise AssertionError("a turn that closed no call reached the env")


class Observer:
    """Every ">" closes a call; the observation is ``size`` tokens."""

    def __init__(self, size: int = 1) -> None:
        self.size = size

    async def act(self, action: Any) -> EnvResult:
        ids = [9] * self.size
        return EnvResult(session=action.session, observation_ids=ids, observation="!")


def run_turn(
    max_new: int, max_total: int = 512, close: str = "</call>", desk: Any = None
) -> tuple[Trajectory, Angles]:
    spec = EnvSpec(eos_token_id=EOS, call_stop_token_ids=[GT], call_close=close, format="bracket")
    cfg = AgentConfig(max_turns=2, max_total_tokens=max_total)
    t = Trajectory(request=0, sample=0, seed=1, session=0, start=[1, 3])
    server = Angles()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new, n=1)
    asyncio.run(_one(t, server, desk or NoDesk(), spec, cfg, sampling))
    return t, server


def test_a_turn_of_repeated_stops_samples_at_most_max_new_tokens() -> None:
    t, server = run_turn(max_new=8)
    assert sum(t.sampled) == 8  # 3 + 3 + 2, not a fresh 8 per continuation
    assert server.asked == [8, 5, 2]
    assert t.turns == 1 and t.finish == "length"
    assert t.texts == ["ab>ab>ab"]  # the whole turn, cut at its limit, is kept
    assert t.segments == [("sampled", "ab>ab>ab")]


def test_a_turn_that_ends_exactly_at_its_limit_on_a_stop_is_cut_there() -> None:
    t, server = run_turn(max_new=6)
    assert sum(t.sampled) == 6 and server.asked == [6, 3]
    assert t.finish == "length" and t.texts == ["ab>ab>"]


def test_the_trajectory_limit_still_bounds_a_turn() -> None:
    t, server = run_turn(max_new=32, max_total=2 + 7)  # 2 start tokens: 7 left to sample
    assert sum(t.sampled) == 7 and server.asked == [7, 4, 1]
    assert t.finish == "length" and t.texts == ["ab>ab>a"]


def test_each_turn_has_its_own_limit() -> None:
    t, server = run_turn(max_new=8, close=">", desk=Observer())
    assert server.asked == [8, 8]  # the second turn starts afresh
    assert t.turns == 2 and t.finish == "turns" and t.texts == ["ab>", "ab>"]


def test_an_observation_is_cut_at_what_is_left_of_the_trajectory() -> None:
    t, server = run_turn(max_new=8, max_total=15, close=">", desk=Observer(size=4000))
    assert t.length == 15 and t.ids == [5, 6, GT] + [9] * 10  # 2 start + 3 sampled + 10
    assert t.finish == "length" and server.asked == [8]
