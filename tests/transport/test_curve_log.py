"""Issue 21, 2d: refused CURVE handshakes (no key, an unlisted key, a pinned key that is not the
controller's) are logged with the peer's address, at a bounded rate."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import zmq

from controller.server import Controller
from tests.conftest import TEST_TIMEOUTS, group, run
from transport.security import (
    UNKNOWN_PEER,
    CurveServer,
    HandshakeLog,
    HandshakeWatch,
    load_keypair,
    load_public,
    make_keypair,
)


def client(address: str, secret: Path | None, server_public: Path | None) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if secret is not None and server_public is not None:
        sock.curve_publickey, sock.curve_secretkey = load_keypair(secret)
        sock.curve_serverkey = load_public(server_public)
    sock.connect(address)
    sock.send(b"hello?", zmq.NOBLOCK)
    return sock


def test_each_kind_of_refused_handshake_is_logged_with_the_peer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, server_secret = make_keypair(tmp_path / "server", "controller")
    good_public, _ = make_keypair(tmp_path / "clients", "good")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "good.key").write_bytes(good_public.read_bytes())
    stranger_public, stranger_secret = make_keypair(tmp_path / "strangers", "bad")
    other_public, _ = make_keypair(tmp_path / "other", "controller")  # not this controller's
    _, good_secret = make_keypair(tmp_path / "clients2", "good2")
    (allowed / "good2.key").write_bytes((tmp_path / "clients2" / "good2.key").read_bytes())
    stranger_key = load_public(stranger_public).decode()
    server_public = tmp_path / "server" / "controller.key"

    async def refused_once(controller: Controller, sock: zmq.Socket[Any], *whys: str) -> str:
        try:
            for _ in range(1000):  # 10 s at most
                found = [
                    line for line in controller.handshakes.recent if any(w in line for w in whys)
                ]
                if found:
                    return found[0]
                await asyncio.sleep(0.01)
        finally:
            sock.close()
        raise AssertionError(f"no {whys} refusal in {list(controller.handshakes.recent)}")

    async def main() -> list[str]:
        controller = Controller([group("g", 1, echo="tests.fixtures.roles:Echo")], TEST_TIMEOUTS)
        address = controller.bind("tcp://127.0.0.1:0", CurveServer(server_secret, allowed))
        try:
            return [
                # a plain client: ZeroMQ sees the mechanism mismatch, or the client hanging up on it
                await refused_once(
                    controller, client(address, None, None), "no CURVE key", "hung up"
                ),
                await refused_once(
                    controller,
                    client(address, stranger_secret, server_public),
                    "not in the allowed",
                ),
                await refused_once(
                    controller, client(address, good_secret, other_public), "another controller"
                ),
            ]
        finally:
            await controller.shutdown()

    with caplog.at_level(logging.WARNING):
        no_key, unlisted, wrong_server = run(main)
    # the ZAP handler is given the peer's address and key: exact
    assert unlisted.startswith("refused a CURVE handshake from 127.0.0.1")
    assert stranger_key in unlisted
    # the monitor's: the address when the connection could still be read, always the endpoint
    for line in (no_key, wrong_server):
        assert "from 127.0.0.1:" in line or UNKNOWN_PEER in line, line
        assert "on tcp://127.0.0.1:" in line, line
    logged = [r.getMessage() for r in caplog.records if "refused a CURVE" in r.getMessage()]
    assert {no_key, unlisted, wrong_server} <= set(logged)


def test_refusals_are_rate_limited_and_counted() -> None:
    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test.handshakes")
    logger.addHandler(Sink())
    now = [0.0]
    handshakes = HandshakeLog(logger, burst=3, window_s=10.0, clock=lambda: now[0])
    for i in range(50):
        handshakes.refused(f"10.0.0.{i}:1234", "no CURVE key (a plain client)")
    assert len(lines) == 3 and handshakes.total == 50
    now[0] = 10.0
    handshakes.refused("10.0.0.99:1", "no CURVE key (a plain client)")
    assert lines[3:] == [
        "... and 47 more refused handshakes",
        "refused a CURVE handshake from 10.0.0.99:1: no CURVE key (a plain client)",
    ]
    assert len(handshakes.recent) == 51 and handshakes.recent[-1] == lines[-1]


def test_a_failure_is_reported_with_the_address_its_connection_was_accepted_from() -> None:
    seen: list[tuple[str, str]] = []

    class Record(HandshakeLog):
        def refused(self, peer: str, why: str) -> None:
            seen.append((peer, why))

    watch = HandshakeWatch(Record(logging.getLogger("test")), "tcp://127.0.0.1:5555")
    with socket.create_server(("127.0.0.1", 0)) as server:
        outgoing = socket.create_connection(server.getsockname())
        accepted, peer = server.accept()
        with outgoing, accepted:
            watch.event(zmq.EVENT_ACCEPTED, accepted.fileno())
            watch.event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000001)  # cryptographic
            watch.event(zmq.EVENT_DISCONNECTED, accepted.fileno())
            watch.event(zmq.EVENT_DISCONNECTED, 999)  # a connection that failed nothing: quiet
    assert seen == [
        (
            f"127.0.0.1:{peer[1]}",
            "its hello does not decrypt (it pins another controller public key); "
            "on tcp://127.0.0.1:5555",
        )
    ]
