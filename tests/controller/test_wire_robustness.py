"""Bad peers on the controller's socket are refused with a logged reason; real groups carry on."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import tempfile

import msgpack
import pytest
import zmq

from controller.server import Controller
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient
from tests.waiting import wait_until
from transport.codec import encode
from transport.errors import RegistrationError
from transport.protocol import PROTOCOL_VERSION, Message, MsgType

ECHO = "tests.fixtures.roles:Echo"


def test_garbage_wrong_version_unknown_type_and_oversized_are_rejected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    timeouts = TEST_TIMEOUTS.model_copy(update={"max_frame_bytes": 1 << 20})
    bad_messages = [
        [b"\xc1\xff garbage"],
        [msgpack.packb([PROTOCOL_VERSION + 1, int(MsgType.CALL), 1, {}])],
        [msgpack.packb([PROTOCOL_VERSION, 99, 1, {}])],
        [msgpack.packb([PROTOCOL_VERSION, int(MsgType.REPLY), 1, {"result": 1}]), b"x" * (2 << 20)],
        encode(Message(MsgType.REPLY, 5, {"result": 1})).frames,  # well-formed, but unregistered
    ]

    async def main() -> Controller:
        async with local_session([group("g", 2, echo=ECHO)], timeouts) as c:
            echo = EchoClient(c, "echo")
            ctx = zmq.Context.instance()
            intruders = []
            for frames in bad_messages:  # each from a peer of its own: an oversized message
                intruder = ctx.socket(zmq.DEALER)  # cuts its sender's connection, and the
                intruder.connect(c.addresses[0])  # controller's allowance counts per peer
                intruder.send_multipart(frames)
                intruders.append(intruder)
                # the real group keeps working between every bad message
                assert (await echo.where())["ranks"] == [0, 1]
                await wait_until(
                    lambda: len(c.rejected) >= len(intruders),
                    10,
                    f"the controller's refusal of bad message {len(intruders)}",
                )
            for intruder in intruders:
                intruder.close(linger=0)
            return c

    with caplog.at_level(logging.WARNING, logger="hybridflow.controller"):
        controller = run(main)
    reasons = controller.rejected
    assert len(reasons) == 5, reasons
    assert "not valid msgpack" in reasons[0]
    assert "protocol version" in reasons[1]
    assert "unknown message type 99" in reasons[2]
    assert "over the limit" in reasons[3]
    assert "has not registered" in reasons[4]
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 5


def _role_cli(address: str, names: str, token: str, *extra: str) -> subprocess.Popen[bytes]:
    run_dir = tempfile.mkdtemp(prefix="hf-role-test-")  # each group its own logs
    argv = ["role", names, "--connect", address, "--token", token, "--run-dir", run_dir, *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_group_started_by_hand_joins_and_wrong_groups_are_refused() -> None:
    """`hybridflow role NAMES --connect ADDR --nproc N` against a controller started alone.
    A wrong token and an unknown group are refused and the controller waits on for its own;
    its own group started at another size is refused and ends the wait at once, named."""

    async def main() -> tuple[list[str], list[bytes], str]:
        controller = Controller([group("workers", 2, echo=ECHO)], TEST_TIMEOUTS)
        address = controller.bind("ipc:///tmp/hf-by-hand-test")
        outputs = []
        try:
            wrong = [
                _role_cli(address, "echo", "not-the-token", "--nproc", "2"),
                _role_cli(address, "critic", controller.token, "--nproc", "2"),
            ]
            for proc in wrong:
                code = await asyncio.to_thread(proc.wait, 60)
                assert code != 0
                out = proc.stdout.read() if proc.stdout else b""
                outputs.append(b" ".join(out.split()))  # rich wraps long lines
            good = _role_cli(address, "echo", controller.token, "--nproc", "2")
            await controller.wait_ready(60)
            assert (await EchoClient(controller, "echo").where())["ranks"] == [0, 1]
        finally:
            await controller.shutdown()
        assert await asyncio.to_thread(good.wait, 30) == 0  # SHUTDOWN ends the group cleanly

        other = Controller([group("workers", 2, echo=ECHO)], TEST_TIMEOUTS)
        sized = _role_cli(other.bind("ipc:///tmp/hf-by-hand-test-2"), "echo", other.token)
        try:
            with pytest.raises(RegistrationError) as refused:
                await other.wait_ready(120)  # not its timeout: the refusal ends it
            assert await asyncio.to_thread(sized.wait, 60) != 0
        finally:
            await other.shutdown()
        out = sized.stdout.read() if sized.stdout else b""
        outputs.append(b" ".join(out.split()))
        return controller.rejected + other.rejected, outputs, str(refused.value)

    rejected, outputs, ended = run(main)
    assert len(rejected) == 3, rejected
    assert any("bad token" in r for r in rejected)
    assert any("unknown group" in r and "critic" in r for r in rejected)
    assert any("world size 1" in r and "nproc=2" in r for r in rejected)
    assert ended.startswith("group 'workers' was refused: world size 1 but the placement says")
    # the reason is printed on the group's side too
    assert any(b"bad token" in out for out in outputs)
    assert any(b"unknown group" in out for out in outputs)
    assert any(b"world size 1" in out for out in outputs)
