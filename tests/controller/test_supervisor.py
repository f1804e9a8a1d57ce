"""Supervision at the controller: a dead group with a restart policy is started again by its
launcher, calls its death failed (or that came meanwhile) are re-issued on the new ranks, a group
that keeps dying stops at its policy with the setting named, and no rank outlives the session.
Real processes (the local launcher), real kills (SIGKILL); fixture roles."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from controller.placement import GroupSpec, RestartPolicy
from controller.server import Controller
from deploy.processes import descendants, rank_title
from deploy.session import local_session, remote_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.waiting import wait_until
from transport.errors import RoleDeadError

FAULTY = "tests.fixtures.roles:Faulty"
FAST = RestartPolicy(max=2, window_s=600, backoff_s=[0.0])


def supervised(spec: GroupSpec, policy: RestartPolicy | None = FAST, stateful: bool = False):
    return spec.model_copy(update={"restart": policy, "stateful": stateful})


async def pid(controller: Controller, role: str) -> int:
    """Rank 0's pid, asked of the role (so the call waits for a restart under way)."""
    found: int = await controller.call(role, "pid", [], {})
    return found


def test_policy_counts_restarts_in_its_window_and_backs_off_in_order() -> None:
    policy = RestartPolicy(max=3, window_s=10, backoff_s=[1, 5])
    assert [policy.backoff(n) for n in range(4)] == [1, 5, 5, 5]
    with pytest.raises(ValueError, match="backoff_s"):
        RestartPolicy(backoff_s=[-1.0])
    with pytest.raises(ValueError):
        RestartPolicy(backoff_s=[])


@pytest.mark.timeout(120)
def test_a_killed_stateless_group_is_restarted_and_the_call_in_flight_re_issued() -> None:
    async def main() -> None:
        spec = supervised(group("g", 2, faulty=FAULTY))
        async with local_session([spec], TEST_TIMEOUTS) as controller:
            assert controller.supervisor is not None
            await pid(controller, "faulty")
            before = _ranks("g")
            assert len(before) == 2
            slow = asyncio.ensure_future(controller.call("faulty", "sleep", [3.0], {}))
            await wait_until(lambda: controller.groups["g"].pending, 10, "the call in flight")
            os.kill(before[1], signal.SIGKILL)  # rank 1: the launcher ends rank 0 too
            assert await slow >= 3.0  # slept its 3 s on the new incarnation
            after = _ranks("g")
            assert len(after) == 2 and not set(after) & set(before)
            assert controller.groups["g"].incarnation == 1
            kinds = [(e["event"], e["group"]) for e in controller.supervisor.events]
            assert kinds == [("fault", "g"), ("restart", "g")]
            assert controller.supervisor.events[0]["rank"] == 1
            assert "SIGKILL" in controller.supervisor.events[0]["cause"]
        for gone in before + after:  # nothing outlives the session, old or new
            with pytest.raises(ProcessLookupError):
                os.kill(gone, 0)

    run(main)


@pytest.mark.timeout(120)
def test_a_group_that_keeps_dying_stops_at_its_policy_naming_the_setting() -> None:
    async def main() -> None:
        policy = RestartPolicy(max=1, window_s=600, backoff_s=[0.0])
        spec = supervised(group("g", 1, faulty=FAULTY), policy)
        async with local_session([spec], TEST_TIMEOUTS) as controller:
            first = await pid(controller, "faulty")
            os.kill(first, signal.SIGKILL)
            second = await pid(controller, "faulty")  # waits for the restart
            os.kill(second, signal.SIGKILL)
            with pytest.raises(RoleDeadError) as info:
                await pid(controller, "faulty")
            said = str(info.value)
            assert "SIGKILL" in said and "placement.g.restart.max=1" in said, said
            assert controller.groups["g"].incarnation == 1  # no second restart

    run(main)


@pytest.mark.timeout(120)
def test_without_a_policy_a_death_fails_the_call_as_before() -> None:
    async def main() -> None:
        spec = supervised(group("g", 1, faulty=FAULTY), None)
        async with local_session([spec], TEST_TIMEOUTS) as controller:
            rank0 = await pid(controller, "faulty")
            os.kill(rank0, signal.SIGKILL)
            with pytest.raises(RoleDeadError, match="restart allows none"):
                await pid(controller, "faulty")

    run(main)


@pytest.mark.timeout(120)
def test_a_kill_during_the_restart_itself_is_survived() -> None:
    """The new incarnation is killed as soon as it exists, before it joined (held in its role's
    construction: a forked rank registers in milliseconds): the recovery tries again, within the
    same policy."""

    async def main() -> None:
        policy = RestartPolicy(max=3, window_s=600, backoff_s=[0.0])
        hold = Path(tempfile.mkdtemp()) / "hold"  # while it exists, a new rank never joins
        spec = supervised(group("g", 1, faulty=(FAULTY, {"hold": str(hold)})), policy)
        async with local_session([spec], TEST_TIMEOUTS) as controller:
            first = await pid(controller, "faulty")
            hold.touch()
            os.kill(first, signal.SIGKILL)

            def newborn() -> int | None:
                for child in descendants(os.getpid()):
                    if child != first and (rank_title(child) or ("",))[0] == "g":
                        return child
                return None

            second = await wait_until(newborn, 30, "the restarted rank's process")
            os.kill(second, signal.SIGKILL)
            hold.unlink()  # the next incarnation may join
            third = await pid(controller, "faulty")
            assert third not in (first, second)
            restarts = [e for e in controller.supervisor.events if e["event"] == "restart"]
            assert len(restarts) == 1 and restarts[0]["tries"] == 2

    run(main)


def _ranks(name: str) -> list[int]:
    """The pids of group ``name``'s ranks (started by this process), in rank order."""
    found = {}
    for pid in descendants(os.getpid()):
        title = rank_title(pid)
        if title is not None and title[0] == name:
            found[title[1]] = pid
    return [found[r] for r in sorted(found)]


def _by_hand(address: str, token: str, tmp: Path, name: str) -> subprocess.Popen[bytes]:
    """``hybridflow role faulty --connect ADDRESS --group g``, as an operator starts it."""
    sockets = tmp / f"{name}-sockets"
    sockets.mkdir()
    argv = ["role", "faulty", "--connect", address, "--group", "g", "--nproc", "1"]
    argv += ["--socket-dir", str(sockets), "--run-dir", str(tmp / name)]
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", *argv],
        env={**os.environ, "HYBRIDFLOW_TOKEN": token},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.mark.timeout(180)
def test_a_group_started_by_hand_is_re_adopted_when_it_says_hello_again(tmp_path: Path) -> None:
    """No launcher: the controller waits for a group of the same name and token (a process
    manager or the operator starts it again); one with a wrong token is refused meanwhile."""

    async def real() -> None:
        policy = RestartPolicy(max=3, window_s=600, backoff_s=[0.0], rejoin_s=60)
        spec = supervised(group("g", 1, faulty=FAULTY), policy)
        procs: list[subprocess.Popen[bytes]] = []

        def announce(address: str, token: str) -> None:
            procs.append(_by_hand(address, token, tmp_path, "first"))
            told.update(address=address, token=token)

        told: dict[str, str] = {}
        try:
            async with remote_session([spec], "tcp://127.0.0.1:0", TEST_TIMEOUTS, announce) as ctl:
                first = await pid(ctl, "faulty")
                os.kill(first, signal.SIGKILL)  # the rank; its `hybridflow role` then ends
                asking = asyncio.ensure_future(pid(ctl, "faulty"))  # waits for the group
                await wait_until(lambda: ctl.groups["g"].dead is None, 30, "the group forgotten")
                intruder = _by_hand(told["address"], "wrong" * 8, tmp_path, "intruder")
                procs.append(intruder)
                await wait_until(lambda: intruder.poll() is not None, 60, "the refusal")
                assert any("bad token" in r for r in ctl.rejected), ctl.rejected
                assert not asking.done()
                procs.append(_by_hand(told["address"], told["token"], tmp_path, "second"))
                second = await asking
                assert second != first and second == await pid(ctl, "faulty")
                assert ctl.groups["g"].incarnation == 1
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    run(real)


def test_a_group_leaving_on_the_shutdown_is_no_death(caplog: pytest.LogCaptureFixture) -> None:
    """A group that exits on SHUTDOWN loses its connection; the loss a socket reports waits a
    grace period for the launcher's exit status (``declare_dead``), which may end after the
    shutdown began. A normal end of a run was reported as ``group 'tools' is dead: rank 0 (the
    coordinator) lost its connection``: neither the loss nor its grace's end is a death now."""

    async def main() -> Controller:
        async with local_session(
            [group("g", 1, echo="tests.fixtures.roles:Echo")], TEST_TIMEOUTS
        ) as c:
            pass
        cause = "(the coordinator) lost its connection: it exited"
        c._settle_later("g", c.groups["g"].incarnation, 0, cause)  # the grace ends late
        c.declare_dead("g", 0, cause, True)
        return c

    with caplog.at_level("ERROR", logger="hybridflow"):
        controller = run(main)
    assert controller.groups["g"].dead is None
    assert not [r for r in caplog.records if "is dead" in r.getMessage()]
