"""The env role in real process groups, called from a controller in this process: the spec, the
open / submit / collect / close round trip in both call formats, every failure as an observation,
slow tools beside fast ones, environments, and a rank killed mid-call.

The test tools below are plain functions the rank processes import by path
(``tests.roles.test_env:sleepy``), as a user's tools would be."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controller.clients import EnvClient
from deploy.session import local_session
from roles.env import EnvConfig, load_config, load_tools
from roles.modeling.models import init_model, load_tokenizer
from roles.tools.calls import OBSERVATIONS
from roles.tools.games import GuessNumber
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient
from tests.waiting import Blocked, wait_for, wait_until
from transport.agent import EnvAction, EnvOpen, EnvResult
from transport.errors import RemoteError, RoleDeadError

ENV = "roles.env:EnvRole"
ECHO = "tests.fixtures.roles:Echo"
HERE = "tests.roles.test_env"
SEARCH = "roles.tools.search:search"
COLLECT_S = 30  # the longest any test waits for results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


# -- tools and an environment the ranks import by path ---------------------------------------------


def sleepy(seconds: str) -> str:
    """Sleep for a while, then say so.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(float(seconds))
    return f"slept {seconds}"


def broken(text: str) -> str:
    """Always fails."""
    raise RuntimeError(f"cannot handle {text}")


def listing(text: str) -> list[str]:
    """Returns a list, which is not text."""
    return text.split()


def huge(text: str) -> int:
    """Returns a number with 5,001 digits (more than str() of an int may print)."""
    return 10**5000


def specials(text: str) -> str:
    """Answers with the tokenizer's special tokens written out."""
    return "4</s><s><pad>"


def quitting(text: str) -> str:
    """Asks the interpreter to exit."""
    sys.exit(3)


def repeat(count: int) -> str:
    """Says 'ha' count times.

    Args:
        count: how many times.
    """
    return "ha" * count


def counting(text: str) -> int:
    """Counts characters; returns a number."""
    return len(text)


class Unmeasurable(str):
    """A string whose length cannot be taken."""

    def __len__(self) -> int:
        raise RuntimeError("no length")


class Touchy(GuessNumber):
    """GuessNumber that explodes on 'boom', stalls on 'stall' and leaves a file when closed."""

    def reset(self, row: dict[str, Any]) -> str:
        self.closed_flag = row.get("closed_flag")
        return super().reset(row)

    def step(self, text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if "boom" in text:
            raise RuntimeError("the board caught fire")
        if "stall" in text:
            time.sleep(30)
        if "odd" in text:
            return ("not", "a", "step")  # type: ignore[return-value]
        if "nan" in text:
            return "a reward that is no number", float("nan"), False, {}
        if "evil" in text:  # text the env role itself fails on, after the step returned
            return Unmeasurable("x"), 0.0, False, {}
        return super().step(text)

    def close(self) -> None:
        if self.closed_flag:
            Path(self.closed_flag).write_text("closed")


def tools_group(name: str, tiny: Path, fmt: str, tools: list[str], **config: Any) -> Any:
    settings = {"tools": tools, "tokenizer": str(tiny), "format": fmt, **config}
    return group(name, 1, **{name: (ENV, settings)})


async def results(env: EnvClient, count: int) -> dict[int, EnvResult]:
    """The next ``count`` results, by session (fails naming what is missing after COLLECT_S)."""
    found: dict[int, EnvResult] = {}
    deadline = time.monotonic() + COLLECT_S
    while len(found) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {sorted(found)} of {count} results within {COLLECT_S} s"
        for result in await env.collect(min(left, 5.0)):
            assert result.session not in found, f"two results for session {result.session}"
            found[result.session] = result
    return found


def action(session: int, text: str, turn: int = 0) -> EnvAction:
    return EnvAction(session=session, text=text, finish="stop", turn=turn)


def encoded(tiny: Path, text: str) -> list[int]:
    """``text`` as the env role encodes what a tool or environment wrote: special tokens
    spelled out are characters."""
    tokenizer = load_tokenizer(tiny)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids


# -- the round trip -------------------------------------------------------------------------------


def test_spec_and_a_calculator_round_trip_in_both_formats(tiny: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    calc = "roles.tools.calculator:calculator"
    (tmp_path / "Paris.txt").write_text("Paris is the capital of France.")
    (tmp_path / "Bread.txt").write_text("Bread is baked from flour.")

    async def main() -> None:
        docs = {"search_documents": str(tmp_path), "search_top_k": 1}
        placement = [
            tools_group("bracket", tiny, "bracket", [calc, f"{HERE}:counting", SEARCH], **docs),
            tools_group("hermes", tiny, "hermes", [calc]),
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            bracket, hermes = EnvClient(c, "bracket"), EnvClient(c, "hermes")
            spec = await bracket.spec()
            assert spec.eos_token_id == tokenizer.eos_token_id
            assert spec.call_stop_token_ids == [tokenizer.encode("]", add_special_tokens=False)[-1]]
            assert spec.call_close == "]" and spec.format == "bracket" and not spec.stateful
            names = [t["function"]["name"] for t in spec.tools]
            assert names == ["calculator", "counting", "search"]
            calculator = spec.tools[0]["function"]
            assert calculator["parameters"]["required"] == ["expression"]
            assert calculator["description"].startswith("Evaluate an arithmetic expression")
            h_spec = await hermes.spec()
            close_ids = tokenizer.encode("</tool_call>", add_special_tokens=False)
            assert h_spec.call_stop_token_ids == [close_ids[-1]]
            assert h_spec.call_close == "</tool_call>" and h_spec.format == "hermes"

            rows = [{"prompt": "12*34="}, {"prompt_ids": [1, 2, 3]}]
            opened = await bracket.open([EnvOpen(session=s, row=r) for s, r in enumerate(rows)])
            # the start: the prompt as the generation engines read it (<s> + its bytes)
            start = [tokenizer.bos_token_id, *encoded(tiny, "12*34=")]
            assert opened == [
                EnvResult(session=0, observation_ids=start),
                EnvResult(session=1, observation_ids=[1, 2, 3]),
            ]
            assert await bracket.submit([action(0, "12*34 is [calculator 12*34]")]) == 1
            assert await bracket.submit([action(1, "[counting four]", turn=2)]) == 1
            got = await results(bracket, 2)
            assert got[0].observation == " = 408\n"
            assert got[0].observation_ids == encoded(tiny, " = 408\n")
            assert (got[0].called, got[0].error, got[0].done, got[0].reward) == (
                "calculator",
                None,
                False,
                None,
            )
            assert got[0].latency_s > 0
            assert got[1].observation == " = 4\n"  # a number comes back as text
            await bracket.submit([action(0, "[search capital of France]", turn=1)])
            found = (await results(bracket, 1))[0]
            assert found.observation == " = [1] Paris\nParis is the capital of France.\n"

            await hermes.open([EnvOpen(session=5)])
            call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
            await hermes.submit([action(5, f"Let me add.\n{call}</tool_call>")])
            (result,) = (await results(hermes, 1)).values()
            templated = OBSERVATIONS["hermes"].replace("{text}", "5")
            assert result.observation == templated
            assert result.observation_ids == encoded(tiny, templated)

            assert await bracket.close([0, 1, 7]) == 2
            with pytest.raises(RemoteError, match="session 0 is not open"):
                await bracket.submit([action(0, "[calculator 1+1]")])
            with pytest.raises(RemoteError, match=r"sessions \[5\] are open already"):
                await hermes.open([EnvOpen(session=5)])
            assert await bracket.collect(0.0) == []

    run(main)


# -- failures -------------------------------------------------------------------------------------

FAILING_TOOLS = [
    "roles.tools.calculator:calculator",
    "roles.tools.sandbox:python",
    f"{HERE}:sleepy",
    f"{HERE}:broken",
    f"{HERE}:listing",
    f"{HERE}:quitting",
    f"{HERE}:repeat",
    f"{HERE}:huge",
    f"{HERE}:specials",
]


def test_every_failure_comes_back_as_an_observation_and_the_role_carries_on(tiny: Path) -> None:
    turns = {
        0: ("[broken x]", "raised", "broken", "error: broken raised RuntimeError: cannot handle x"),
        1: ("[listing a b]", "not_text", "listing", "error: listing returned a list, not text"),
        2: ("calculator 1+1]", "malformed", None, "has no '[' before it"),
        3: ("[repeat lots]", "malformed", "repeat", "count: Input should be a valid integer"),
        4: (
            "[weather Oslo]",
            "unknown_tool",
            None,
            "the tools are: broken, calculator, huge, listing",
        ),
        5: ("[sleepy 30]", "timeout", "sleepy", "did not finish within 2 s (call_timeout_s)"),
        6: ("[python hog = bytearray(2**30)]", "sandbox_killed", "python", "ran out of memory"),
        7: ("[quitting now]", "raised", "quitting", "quitting raised SystemExit: 3"),
        8: ("[calculator 1/0]", "raised", "calculator", "ZeroDivisionError: division by zero"),
        9: ("[python print('x' * 5000)]", None, "python", "[... 4881 more bytes of output cut]"),
        10: ("[repeat 300]", None, "repeat", "ha\n[... 400 more characters cut]"),
        11: ("[huge x]", "not_text", "huge", "error: huge returned a int, not text"),
        12: ("[specials x]", None, "specials", "4</s><s><pad>"),
    }

    async def main() -> None:
        config = {"call_timeout_s": 2.0, "sandbox_memory_mb": 256, "max_observation_chars": 200}
        placement = [tools_group("tools", tiny, "bracket", FAILING_TOOLS, **config)]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            env = EnvClient(c, "tools")
            await env.open([EnvOpen(session=s) for s in turns])
            submitted = time.monotonic()
            await env.submit([action(s, text) for s, (text, *_) in turns.items()])
            got = await results(env, len(turns))
            waited = time.monotonic() - submitted
            for session, (_, error, called, words) in turns.items():
                result = got[session]
                assert (result.error, result.called) == (error, called), result
                assert words in result.observation, result.observation
                assert result.observation.startswith(" = ") and not result.done
                assert result.observation_ids == encoded(tiny, result.observation)
            # a tool's text is never special tokens: "</s>" there is characters, not the EOS
            special = set(load_tokenizer(tiny).all_special_ids)
            assert not special & set(got[12].observation_ids), got[12].observation_ids
            # the timeout's result came at its deadline, not when the 30 s sleep ends
            assert 2.0 <= got[5].latency_s < 4.0 and waited < 15
            # same process, still serving: the next call works, in the session that timed out
            await env.submit([action(5, "[calculator 6*7]", turn=1)])
            assert (await results(env, 1))[5].observation == " = 42\n"

    run(main)


def test_a_slow_tool_does_not_hold_back_a_fast_one_submitted_after_it(tiny: Path) -> None:
    async def main() -> None:
        tools = [f"{HERE}:sleepy", "roles.tools.calculator:calculator"]
        placement = [tools_group("tools", tiny, "bracket", tools, workers=2)]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            env = EnvClient(c, "tools")
            await env.open([EnvOpen(session=0), EnvOpen(session=1)])
            await env.submit([action(0, "[sleepy 2]")])
            await env.submit([action(1, "[calculator 1+1]")])
            first = await env.collect(COLLECT_S)
            assert [(r.session, r.observation) for r in first] == [(1, " = 2\n")]
            later = await results(env, 1)
            assert later[0].observation == " = slept 2\n" and later[0].latency_s >= 2.0

    run(main)


# -- environments ---------------------------------------------------------------------------------


def test_environments_play_to_the_end_and_their_failures_end_the_trajectory(
    tiny: Path, tmp_path: Path
) -> None:
    flag = tmp_path / "closed"

    def game(name: str, cls: str, **more: Any) -> Any:
        settings = {
            "environment": cls,
            "environment_args": {"max_moves": 2},
            "tokenizer": str(tiny),
            "format": "bracket",
            "call_timeout_s": 2.0,
            **more,
        }
        return group(name, 1, **{name: (ENV, settings)})

    async def main() -> None:
        placement = [
            game("game", "roles.tools.games:GuessNumber", observation="\n{text}\n"),
            game("touchy", f"{HERE}:Touchy"),  # observations as the environment writes them
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            env = EnvClient(c, "game")
            assert (await env.spec()).stateful and (await env.spec()).tools == []
            rows = [{"secret": 42, "prompt": "Play."}, {"secret": 7}, {}]
            opened = await env.open([EnvOpen(session=s, row=r) for s, r in enumerate(rows)])
            first = "Guess my number from 1 to 100."
            assert [r.observation for r in opened[:2]] == [first, first]
            # the start: the prompt as the engines read it, then the first observation as it is
            prompt = [load_tokenizer(tiny).bos_token_id, *encoded(tiny, "Play.")]
            assert opened[0].observation_ids == prompt + encoded(tiny, first)
            assert opened[1].observation_ids == encoded(tiny, first)  # a row without a prompt
            assert (opened[2].error, opened[2].done) == ("env", True)
            assert "reset raised KeyError" in opened[2].observation

            await env.submit([action(0, "I guess 50"), action(1, "50")])
            got = await results(env, 2)
            assert got[0].observation == "\n50? Go lower.\n"
            assert got[0].observation_ids == encoded(tiny, got[0].observation)
            assert (got[0].reward, got[0].done) == (0.0, False)
            await env.submit([action(0, "42", turn=1), action(1, "9", turn=1)])
            got = await results(env, 2)
            assert (got[0].observation, got[0].reward, got[0].done) == (
                "\n42 is right.\n",
                1.0,
                True,
            )
            assert (got[1].reward, got[1].done) == (0.0, True)  # out of moves
            with pytest.raises(RemoteError, match="session 0 is done; open a new session"):
                await env.submit([action(0, "42", turn=2)])
            with pytest.raises(RemoteError, match="session 2 is done"):
                await env.submit([action(2, "1")])

            touchy = EnvClient(c, "touchy")
            row = {"secret": 5, "closed_flag": str(flag)}
            await touchy.open([EnvOpen(session=s, row=row) for s in range(5)])
            moves = ["boom", "stall", "odd", "nan", "evil"]
            await touchy.submit([action(s, move) for s, move in enumerate(moves)])
            got = await results(touchy, 5)
            # a reward that is not finite never reaches the trajectory: the step failed
            assert (got[3].error, got[3].done, got[3].reward) == ("env", True, None)
            assert "step's reward is nan, not a finite number" in got[3].observation
            # the env role failing on what the environment gave: its state is unknown, it ends
            assert (got[4].error, got[4].done) == ("env", True)
            assert (got[0].error, got[0].done) == ("env", True)
            fire = "error: the environment's step raised RuntimeError: the board caught fire"
            assert got[0].observation == fire
            assert got[0].observation_ids == encoded(tiny, fire)
            assert (got[1].error, got[1].done) == ("timeout", True)
            assert "step did not finish within 2 s (call_timeout_s)" in got[1].observation
            assert (got[2].error, got[2].done) == ("env", True)
            assert "step raised TypeError: step returned tuple, not (observation" in (
                got[2].observation
            )
            assert await touchy.close([0]) == 1
            await wait_until(flag.exists, 10, "the environment's close() called on close")

    run(main)


# -- the group's limits ---------------------------------------------------------------------------


def test_a_killed_env_rank_mid_call_is_named_to_the_controller(tiny: Path) -> None:
    async def main() -> int:
        settings = {"tools": [f"{HERE}:sleepy"], "tokenizer": str(tiny), "format": "bracket"}
        placement = [group("g", 1, env=(ENV, settings), echo=ECHO)]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            (pid,) = (await EchoClient(c, "echo").where())["pids"]
            env = EnvClient(c, "env")
            await env.open([EnvOpen(session=0)])
            await env.submit([action(0, "[sleepy 60]")])
            pending = asyncio.ensure_future(env.collect(50.0))
            # mid-call: the rank's main thread waits in collect for the first result
            blocked = Blocked(pid, pid)
            await wait_until(
                lambda: "futex" in _wchan(pid) and blocked(), 20, "the rank waiting in collect"
            )
            assert not pending.done()
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(RoleDeadError) as info:
                await pending
            assert time.monotonic() - killed < 5.0
            assert (info.value.role, info.value.rank) == ("env", 0)
            assert "SIGKILL" in str(info.value)
            return pid

    pid = run(main)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 5, "the env rank gone")


def _wchan(pid: int) -> str:
    with open(f"/proc/{pid}/task/{pid}/wchan") as f:
        return f.read()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or gone between open and read
        return True


def test_more_than_one_rank_is_refused_saying_why(tiny: Path) -> None:
    async def main() -> None:
        settings = {"tools": ["roles.tools.calculator:calculator"], "tokenizer": str(tiny)}
        async with local_session([group("env", 2, env=(ENV, settings))], TEST_TIMEOUTS):
            pass

    with pytest.raises(Exception, match="place it in a group of nproc 1 \\(this group has 2\\)"):
        run(main)


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({}, "tokenizer: Field required"),
        ({"tokenizer": "m"}, "needs one of 'tools' .* and has none of them"),
        ({"tokenizer": "m", "tools": ["a:b"], "environment": "c:D"}, "has tools and environment"),
        ({"tokenizer": "m", "environment": "c:D", "agent": "a:run"}, "has environment and agent"),
        ({"tokenizer": "m", "tools": ["a:b"], "format": "xml"}, "format: Input should be"),
        ({"tokenizer": "m", "tools": ["a:b"], "observation": "= {result}"}, "has no \\{text\\}"),
        ({"tokenizer": "m", "tools": ["a:b"], "workers": 0}, "workers: Input should be greater"),
        ({"tokenizer": "m", "tools": ["a:b"], "sandbox_timeout_s": 10}, "must be below call_t"),
        ({"tokenizer": "m", "tools": ["a:b"], "colour": 1}, "colour: Extra inputs"),
        ({"tokenizer": "m", "tools": [SEARCH]}, "the search tool needs search_documents"),
        ({"tokenizer": "m", "tools": ["a:b"], "search_documents": "d"}, "search is not among"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(config: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=f"bad env role config: .*{why}"):
        load_config(config)


def test_tools_are_checked_against_the_format() -> None:
    def cfg(tools: list[str], fmt: str = "bracket") -> EnvConfig:
        return EnvConfig.model_validate({"tools": tools, "tokenizer": "m", "format": fmt})

    assert list(load_tools(cfg([f"{HERE}:sleepy", f"{HERE}:repeat"]))) == ["sleepy", "repeat"]
    with pytest.raises(ValueError, match="share the name 'sleepy'"):
        load_tools(cfg([f"{HERE}:sleepy", f"{HERE}:sleepy"]))
    with pytest.raises(ValueError, match="has no function 'nowhere'"):
        load_tools(cfg([f"{HERE}:nowhere"]))
    with pytest.raises(ValueError, match=r"required parameters \['city', 'when'\]; the bracket"):
        load_tools(cfg([f"{HERE}:forecast"]))
    assert list(load_tools(cfg([f"{HERE}:forecast"], "hermes"))) == ["forecast"]


def forecast(city: str, when: str) -> str:
    """Two required parameters: more than the bracket format can pass."""
    return f"{city} {when}"


def test_sessions_idle_past_their_limit_are_closed_at_the_next_open(tiny: Path) -> None:
    """A controller that failed or died mid-rollout never closes its sessions: the env role
    closes those idle past ``session_idle_s`` when sessions are next opened (its clock is moved
    on here by ageing the sessions, not by waiting)."""
    from roles.base import RoleContext
    from roles.env import EnvRole
    from roles.runtime.device import HOST_DEVICE
    from transport.protocol import Layout

    ctx = RoleContext("env", "e", 0, 1, Layout(), None, HOST_DEVICE)
    env = EnvRole(
        ctx,
        tools=["roles.tools.calculator:calculator"],
        tokenizer=str(tiny),
        session_idle_s=60,
    )
    env.open([EnvOpen(session=i, row={"prompt": "1+1="}) for i in (1, 2, 3)])
    for i in (1, 2):
        env.sessions[i].touched -= 61
    env.open([EnvOpen(session=4, row={"prompt": "2+2="})])
    assert sorted(env.sessions) == [3, 4]
