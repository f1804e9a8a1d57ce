"""The controller's socket limits, one behaviour each: a stranger over its allowance is cut off,
calls past a full queue wait in order, a group's frame over the cap fails naming the setting,
and the summary of rate-limited refusals comes when its window ends, not with the next one."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
import zmq

from controller.hello import Strangers, Verdict
from controller.server import Controller
from deploy.launchers.local import LocalLauncher
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.controller.flood_measure import start_stranger
from tests.controller.hostile_peer import hello
from tests.fixtures.clients import EchoClient
from tests.waiting import wait_until
from transport.codec import decode
from transport.errors import RoleDeadError
from transport.protocol import MsgType
from transport.security import HandshakeLog

ECHO = "tests.fixtures.roles:Echo"


def test_a_stranger_is_read_within_its_allowance_then_cut_off() -> None:
    s = Strangers(allowance=3, recut_after=4)
    assert [s.judge(b"a", False) for _ in range(5)] == [
        Verdict.READ,
        Verdict.READ,
        Verdict.READ,
        Verdict.CUT,
        Verdict.DROP,
    ]
    # more than a cut connection can have had queued: it sends on another one, cut that too
    assert [s.judge(b"a", False) for _ in range(5)] == [Verdict.DROP] * 3 + [
        Verdict.RECUT,
        Verdict.DROP,
    ]
    assert s.judge(b"b", True) == Verdict.CUT  # bigger than a hello: at once
    s.retry(b"b")  # its connection was not known: try again on its next message
    assert [s.judge(b"b", False) for _ in range(2)] == [Verdict.RECUT, Verdict.DROP]
    s.judge(b"c", False)
    s.forget(b"c")  # it registered
    assert s.judge(b"c", False) == Verdict.READ and s.first(b"c")


def test_strangers_remembered_are_bounded() -> None:
    s = Strangers(allowance=1, recut_after=10, remember=100)
    for i in range(10_000):
        s.judge(i.to_bytes(4, "big"), False)
    assert len(s._sent) == 100


def test_a_stranger_that_keeps_sending_hears_its_allowance_of_refusals_then_is_cut(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[list[MsgType], list[str], int]:
        controller = Controller([group("g", 1, echo=ECHO)], TEST_TIMEOUTS)
        address = controller.bind(f"ipc://{tmp_path}/c")
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.RECONNECT_IVL, -1)  # once cut, it stays away
        monitor = stranger.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        stranger.connect(address)
        try:
            for _ in range(50):
                stranger.send(hello(roles=["linear"]))
            await wait_until(lambda: monitor.poll(0), 10, "the controller cuts the stranger")
            heard = []
            while stranger.poll(0):
                heard.append(decode(stranger.recv_multipart(copy=False)).type)
            return heard, controller.rejected, controller.rejections.total
        finally:
            ctx.destroy(linger=0)
            await controller.shutdown()

    heard, rejected, total = run(main)
    allowance = TEST_TIMEOUTS.stranger_messages
    # refusals still queued when the connection is cut are dropped with it
    assert set(heard) <= {MsgType.REFUSE} and len(heard) <= allowance
    assert sum("bad token" in r for r in rejected) == allowance
    assert "its connection is cut" in rejected[allowance]
    assert total <= 50  # the rest were dropped unread, or never arrived


def test_a_stranger_that_names_itself_is_cut_again_each_time_it_comes_back(
    tmp_path: Path,
) -> None:
    """Its identity is the same on every connection, so its messages after the first cut look
    like what the cut connection had queued: past what a queue can hold, it is cut again."""
    timeouts = TEST_TIMEOUTS.model_copy(update={"controller_queue": 16})

    async def main() -> int:
        controller = Controller([group("g", 1, echo=ECHO)], timeouts)
        controller.bind(f"ipc://{tmp_path}/c")
        try:
            stranger = await start_stranger(controller, "named-hellos", 30)
            try:
                await wait_until(
                    lambda: controller._sockets[0][1].cuts >= 3, 20, "three cuts of the stranger"
                )
            finally:
                stranger.kill()
                await stranger.communicate()
            return controller.rejections.total
        finally:
            await controller.shutdown()

    assert run(main) > 3 * TEST_TIMEOUTS.stranger_messages


def test_calls_past_a_full_queue_wait_in_the_groups_backlog_in_order() -> None:
    timeouts = TEST_TIMEOUTS.model_copy(update={"controller_queue": 2})

    async def main() -> tuple[int, list[int]]:
        async with local_session([group("g", 1, echo=ECHO)], timeouts) as c:
            echo = EchoClient(c, "echo")
            calls = [asyncio.ensure_future(echo.echo(i)) for i in range(300)]
            await asyncio.sleep(0)  # one turn of the loop: each call runs up to its send
            waiting = len(c.groups["g"].backlog)
            return waiting, list(await asyncio.gather(*calls))

    waiting, answers = run(main)
    assert waiting > 0  # ZeroMQ took 2 (and what its I/O thread moved on); the rest waited
    assert answers == list(range(300))


def test_a_groups_frame_over_the_cap_fails_naming_the_setting(tmp_path: Path) -> None:
    """A group on another host sends tensors as frames: one over controller_frame_bytes makes
    ZeroMQ drop its connection, and the error says which setting to raise."""
    timeouts = TEST_TIMEOUTS.model_copy(update={"controller_frame_bytes": 1 << 20})

    async def main() -> RoleDeadError:
        placement = [group("g", 1, echo=ECHO)]
        controller = Controller(placement, timeouts)
        address = controller.bind(f"ipc://{tmp_path}/c")
        launcher = LocalLauncher(
            address, controller.token, tmp_path, tmp_path, timeouts, lambda g, r, c, _: None
        )
        launcher.start_group(placement[0], {"HYBRIDFLOW_HOST_ID": "elsewhere"})
        try:
            await controller.wait_ready()
            echo = EchoClient(controller, "echo")
            assert (await echo.echo(torch.ones(1000))).sum() == 1000  # 4 kB: one frame
            with pytest.raises(RoleDeadError) as info:
                await echo.echo(torch.ones(1 << 19))  # 2 MiB back: over the cap
            return info.value
        finally:
            await controller.shutdown()
            await launcher.stop()

    error = run(main)
    assert "timeouts.controller_frame_bytes=1048576" in str(error)


def test_the_refusal_summary_comes_when_its_window_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        controller = Controller([group("g", 1, echo=ECHO)], TEST_TIMEOUTS)
        controller.rejections.window_s = 0.5
        controller.bind(f"ipc://{tmp_path}/c")
        sock, watch = controller._sockets[0]
        try:
            for i in range(controller.rejections.burst + 7):  # 7 over the burst: counted
                controller._handle(sock, watch, zmq.Frame(b"\x00%d" % i), [hello(roles=["linear"])])
            # no later refusal comes: the controller's timer must say what was counted
            await wait_until(
                lambda: any("rejected 7 more" in r.getMessage() for r in caplog.records),
                10,
                "the summary of the 7 refusals counted but not logged",
            )
        finally:
            await controller.shutdown()

    with caplog.at_level(logging.WARNING, logger="hybridflow.controller"):
        run(main)


def test_the_handshake_summary_comes_on_flush_without_a_later_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    handshakes = HandshakeLog(logging.getLogger("test.handshakes"), 5, 10.0, lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.handshakes"):
        for _ in range(12):
            handshakes.refused("127.0.0.1:1", "no CURVE key (a plain client)")
        handshakes.flush()  # the window is still open: nothing yet
        assert len(caplog.records) == 5
        now[0] = 11.0
        handshakes.flush()
    assert caplog.records[-1].getMessage() == "... and 7 more refused handshakes"
