"""CURVE on the controller's TCP socket: listed client keys get in, anyone else never registers;
and a coordinator never joins a controller whose key is not the one it pins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller.server import Controller
from deploy.launchers.local import LocalLauncher
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient
from tests.waiting import wait_for, wait_until
from transport.channel import bind_router, connect_dealer, send_within
from transport.codec import encode
from transport.errors import RegistrationError
from transport.protocol import Message, MsgType
from transport.security import CurveClient, CurveServer, make_keypair


def test_curve_admits_listed_keys_and_refuses_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server_secret = make_keypair(tmp_path / "server", "controller")
    server_public = tmp_path / "server" / "controller.key"
    good_public, good_secret = make_keypair(tmp_path / "clients", "good")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "good.key").write_bytes(good_public.read_bytes())
    _, bad_secret = make_keypair(tmp_path / "strangers", "bad")  # valid key, not listed
    timeouts = TEST_TIMEOUTS.model_copy(update={"connect_s": 4})

    async def main() -> None:
        placement = [
            group("good", 1, echo="tests.fixtures.roles:Echo"),
            group("bad", 1, other="tests.fixtures.roles:Echo"),
        ]
        controller = Controller(placement, timeouts)
        address = controller.bind("tcp://127.0.0.1:0", CurveServer(server_secret, allowed))
        exits: list[tuple[str, int, int]] = []
        launchers = []
        for name, secret in (("good", good_secret), ("bad", bad_secret)):
            monkeypatch.setenv("HYBRIDFLOW_CURVE_SECRET", str(secret))
            monkeypatch.setenv("HYBRIDFLOW_CURVE_SERVER_KEY", str(server_public))
            launcher = LocalLauncher(
                address,
                controller.token,
                tmp_path / name,
                tmp_path,
                timeouts,
                lambda g, r, c, _: exits.append((g, r, c)),
            )
            launcher.start([next(g for g in placement if g.name == name)])
            launchers.append(launcher)
        try:
            async with asyncio.timeout(30):
                await controller.groups["good"].ready.wait()
            assert (await EchoClient(controller, "echo").where())["ranks"] == [0]
            # the stranger's coordinator gives up on its own: no WELCOME ever comes
            await wait_until(lambda: exits, 30, "the stranger's coordinator exiting")
            assert exits[0][0] == "bad" and exits[0][2] != 0
            with pytest.raises(RegistrationError, match=r"groups \['bad'\] did not register"):
                await controller.wait_ready(0.1)
            log = (tmp_path / "bad" / "logs" / "bad-0.log").read_text()
            assert "no answer from the controller" in log
        finally:
            await controller.shutdown()
            for launcher in launchers:
                await launcher.stop()

    run(main)


def test_tcp_leaving_the_host_requires_curve() -> None:
    import zmq

    with pytest.raises(ValueError, match="needs CURVE keys"):
        bind_router(zmq.Context.instance(), "tcp://0.0.0.0:0", TEST_TIMEOUTS)


def test_a_coordinator_does_not_join_a_controller_with_another_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's key is accepted, but the controller is not the one whose public key the
    coordinator pins (an impostor listening at the address): the handshake fails on the
    coordinator's side and it never says hello."""
    _, impostor_secret = make_keypair(tmp_path / "impostor", "controller")
    make_keypair(tmp_path / "real", "controller")
    public, secret = make_keypair(tmp_path / "clients", "main")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "main.key").write_bytes(public.read_bytes())
    timeouts = TEST_TIMEOUTS.model_copy(update={"connect_s": 3})

    async def main() -> None:
        placement = [group("main", 1, echo="tests.fixtures.roles:Echo")]
        controller = Controller(placement, timeouts)
        address = controller.bind("tcp://127.0.0.1:0", CurveServer(impostor_secret, allowed))
        monkeypatch.setenv("HYBRIDFLOW_CURVE_SECRET", str(secret))
        monkeypatch.setenv("HYBRIDFLOW_CURVE_SERVER_KEY", str(tmp_path / "real" / "controller.key"))
        exits: list[int] = []
        launcher = LocalLauncher(
            address,
            controller.token,
            tmp_path,
            tmp_path,
            timeouts,
            lambda g, r, c, _: exits.append(c),
        )
        launcher.start([placement[0]])
        try:
            await wait_until(lambda: exits, 30, "the coordinator giving up on the impostor")
            assert exits[0] != 0 and not controller.groups["main"].ready.is_set()
            assert controller.rejected == []  # no hello ever reached the impostor
            log = (tmp_path / "logs" / "main-0.log").read_text()
            assert "no answer from the controller" in log
        finally:
            await controller.shutdown()
            await launcher.stop()

    run(main)


def test_a_refused_client_s_hello_is_not_a_send_that_blocks_for_ever(tmp_path: Path) -> None:
    """ZeroMQ drops a connection whose CURVE handshake the server refused, and a DEALER with no
    connection blocks a send for ever: a coordinator whose key is refused hung in its hello
    (when it sent after the refusal) instead of giving up after connect_s."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    _, server_secret = make_keypair(tmp_path / "server", "controller")
    (tmp_path / "allowed").mkdir()
    _, stranger = make_keypair(tmp_path / "strangers", "bad")
    ctx = zmq.Context()
    server = CurveServer(server_secret, tmp_path / "allowed")
    auth = server.start_authenticator(ctx)
    router, address = bind_router(ctx, "tcp://127.0.0.1:0", TEST_TIMEOUTS, server)
    client = CurveClient(stranger, tmp_path / "server" / "controller.key")
    dealer = connect_dealer(ctx, address, b"bad", TEST_TIMEOUTS, client)
    monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        assert monitor.poll(10_000), "no handshake failure within 10 s"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH

        def refuses_a_send() -> bool:  # no connection left: a blocking send would wait for ever
            try:
                dealer.send(b"probe", zmq.NOBLOCK)  # lands in the connection being dropped
            except zmq.Again:
                return True
            return False

        wait_for(refuses_a_send, 10, "the dealer dropping its refused connection")
        hello = encode(Message(MsgType.HELLO, 0, {}))
        assert send_within(dealer, hello, 0.3) is False
        assert router.poll(100) == 0  # and nothing reached the controller
    finally:
        for sock in (monitor, dealer, router):
            sock.close(0)
        auth.stop()
        ctx.term()
