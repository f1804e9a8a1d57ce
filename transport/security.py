"""Authentication: a shared token on local links, ZeroMQ CURVE on TCP that leaves the host.

CURVE is set per socket. The controller's TCP ROUTER is a CURVE server that accepts only client
public keys listed in a directory (a ZAP handler from pyzmq checks each handshake); coordinators
are CURVE clients that pin the controller's public key, so both sides are authenticated and the
link is encrypted. Keys are the ZeroMQ certificate files written by ``zmq.auth``
(``NAME.key`` public, ``NAME.key_secret`` secret); ``hybridflow keys`` makes them.

Local links (ipc, loopback) rely on file permissions plus a random per-run token in the hello,
compared in constant time.

Refused handshakes are logged (``HandshakeLog``: a warning per refusal with the peer's address,
at most ``burst`` per ``window_s``, the rest counted into one line when the window ends, on the
next refusal or the controller's timer, ``flush``). Two places see them:

- the ZAP handler, for a CURVE client whose key is not listed: ZeroMQ hands it the peer's address
  and key, so that line is exact;
- the server socket's monitor (``HandshakeWatch``), for handshakes that fail before ZAP is asked:
  a client with no CURVE key (mechanism mismatch) or one that pins another server key (the
  controller cannot decrypt its hello). libzmq's monitor events (v1; v2 is a draft API not in
  the wheels) carry no peer address, only the fd of the accepted connection, so the address is
  read from that fd when the ACCEPTED event is read; when the connection was already closed by
  then (a refusal takes well under a millisecond) the line says the address is unknown.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "hybridflow"
UNKNOWN_PEER = "an unknown address (the connection closed before it could be read)"
HANDSHAKE_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_PROTOCOL_ERRORS: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "no CURVE key (a plain client)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): (
        "its hello does not decrypt (it pins another controller public key)"
    ),
}


def new_token() -> str:
    return secrets.token_hex(16)


def token_ok(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def make_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file."""
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE secret key file at {path} (make one: hybridflow keys)")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ValueError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


def load_public(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE public key file at {path}")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


class HandshakeLog:
    """Refused handshakes: counted, the newest kept, logged with the peer's address at most
    ``burst`` times per ``window_s`` (a refused client retries every 100 ms). Thread-safe: the
    ZAP handler reports from its own thread."""

    def __init__(
        self,
        log: logging.Logger,
        burst: int = 5,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.burst, self.window_s, self.clock = log, burst, window_s, clock
        self.total = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=64)
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._logged = self._held = 0

    def refused(self, peer: str, why: str) -> None:
        line = f"refused a CURVE handshake from {peer}: {why}"
        with self._lock:
            self.total += 1
            self.recent.append(line)
            self._close_window()
            if self._logged < self.burst:
                self._logged += 1
                self.log.warning("%s", line)
            else:
                self._held += 1

    def flush(self) -> None:
        """Log the count of the refusals held back, once their window has ended (the
        controller's timer calls this: the line must not wait for the next refusal)."""
        with self._lock:
            self._close_window()

    def _close_window(self) -> None:
        now = self.clock()
        if now - self._window_start >= self.window_s:
            if self._held:
                self.log.warning("... and %d more refused handshakes", self._held)
            self._window_start, self._logged, self._held = now, 0, 0


class HandshakeWatch:
    """Reads a CURVE server socket's monitor events into a ``HandshakeLog``: ACCEPTED remembers
    the connection's peer address by fd, a failure is reported on its connection's DISCONNECTED
    (libzmq emits the two back to back from its I/O thread)."""

    MAX_TRACKED = 4096

    def __init__(self, handshakes: HandshakeLog, endpoint: str) -> None:
        self.handshakes, self.endpoint = handshakes, endpoint
        self._peers: dict[int, str] = {}
        self._failed: str | None = None

    @property
    def failing(self) -> bool:
        """A handshake failure was seen, to be reported on its connection's DISCONNECTED."""
        return self._failed is not None

    def event(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            if len(self._peers) >= self.MAX_TRACKED:  # DISCONNECTEDs lost: forget the oldest
                self._peers.pop(next(iter(self._peers)))
            self._peers[value] = peer_address(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failed = _PROTOCOL_ERRORS.get(value, f"ZMTP protocol error {value:#x}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._failed = (
                f"the handshake broke off ({_errno_text(value)}): the peer hung up, e.g. a "
                "client with no CURVE key, or a port scan"
            )
        elif kind == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, UNKNOWN_PEER)
            if self._failed is not None:
                self.handshakes.refused(peer, f"{self._failed}; on {self.endpoint}")
                self._failed = None
        # HANDSHAKE_FAILED_AUTH: the ZAP handler has reported it, with the key


def _errno_text(value: int) -> str:
    try:
        return f"errno {value}: {os.strerror(value)}"
    except ValueError:
        return f"error {value}"


def peer_address(fd: int) -> str:
    """``host:port`` of the TCP connection on ``fd`` (a dup is read: the fd stays ZeroMQ's)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            host, port = conn.getpeername()[:2]
    except (OSError, ValueError):
        return UNKNOWN_PEER
    return f"{host}:{port}"


class _Gatekeeper(ThreadAuthenticator):
    """pyzmq's ZAP handler, told to report refusals: it notes each request's peer address, and
    its CURVE key check (``callback``, pyzmq's credentials-provider hook) reports a refusal."""

    def __init__(self, ctx: zmq.Context[Any], allowed_dir: Path, handshakes: HandshakeLog) -> None:
        super().__init__(ctx)
        self.handshakes = handshakes
        self.allowed = set(zmq.auth.load_certificates(str(allowed_dir)))
        self.peer = UNKNOWN_PEER

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.peer = msg[3].decode(errors="replace") if len(msg) > 3 else UNKNOWN_PEER
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        shown = key.decode(errors="replace")
        self.handshakes.refused(self.peer, f"its key {shown} is not in the allowed keys")
        return False


@dataclass
class CurveServer:
    """The controller side: its own key pair and a directory of accepted client public keys."""

    secret_file: Path
    allowed_dir: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = load_keypair(self.secret_file)
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = ZAP_DOMAIN.encode()

    def start_authenticator(
        self, ctx: zmq.Context[Any], handshakes: HandshakeLog | None = None
    ) -> ThreadAuthenticator:
        """Runs until stopped; refuses every client whose key is not in ``allowed_dir``, and
        reports each refusal to ``handshakes`` (default: one logging to hybridflow.security)."""
        if not self.allowed_dir.is_dir():
            raise FileNotFoundError(f"allowed client key directory {self.allowed_dir} is missing")
        found = handshakes or HandshakeLog(logging.getLogger("hybridflow.security"))
        auth = _Gatekeeper(ctx, self.allowed_dir, found)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=auth)
        return auth


@dataclass
class CurveClient:
    """A coordinator's side: its key pair and the controller's public key it insists on."""

    secret_file: Path
    server_public_file: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = load_keypair(self.secret_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = load_public(self.server_public_file)


class CurveSide(Protocol):
    """What a socket is given to speak CURVE: a side of a key exchange."""

    def apply(self, sock: zmq.Socket[Any]) -> None: ...


@dataclass(frozen=True)
class LinkServer:
    """A coordinator's end of its group's links between hosts: it serves with the group's own
    key pair (the client key files every rank of the group holds). Who may join stays the
    group token's business (the HELLO, which CURVE now encrypts)."""

    secret_file: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = load_keypair(self.secret_file)
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret


@dataclass(frozen=True)
class LinkClient:
    """A rank's end of the same: a key pair made on the spot, and the group's public key, which
    the coordinator must prove it holds."""

    secret_file: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        group_public, _ = load_keypair(self.secret_file)
        public, secret = zmq.curve_keypair()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = group_public
