"""ZeroMQ sockets: how hybridflow binds, connects, secures, sends and notices a peer's death.

One ROUTER per security domain accepts many peers: plain for ``ipc://`` and loopback TCP, ZeroMQ
CURVE for TCP that leaves the host (``transport.security``). Peers connect a DEALER whose routing
id names them. Liveness needs no application pings: a process that dies closes its socket and a
silent remote host is dropped by ZeroMQ's own heartbeats; either way the ROUTER's monitor socket
reports ``DISCONNECTED`` with the file descriptor, and ``PeerWatch`` maps that descriptor back to
the peer it learnt from the peer's first message (``zmq.SRCFD``).
"""

from __future__ import annotations

import logging
import os
import random
import socket
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from transport.codec import Encoded
from transport.security import HANDSHAKE_EVENTS, CurveClient, CurveServer, HandshakeWatch
from transport.settings import Timeouts

log = logging.getLogger(__name__)

HOST_ID_ENV = "HYBRIDFLOW_HOST_ID"


def host_id() -> str:
    """Identifies the machine for same-host shortcuts (shared memory). Overridable so tests can
    make network namespaces look like separate hosts."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def is_local_address(address: str) -> bool:
    """True for links that never leave this host (ipc, inproc, loopback TCP)."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        return host in {"localhost", "127.0.0.1", "::1"} or host.startswith("127.")
    raise ValueError(f"unsupported address {address!r}: use ipc://PATH or tcp://HOST:PORT")


def spare_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a listener that binds it a moment later (a group's
    store, the rpc agent). It is chosen below the kernel's ephemeral range: a port from that
    range can be handed to any outgoing connection in between (a peer reconnecting in a loop
    takes a new one every 100 ms), and the listener then fails with EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded low range: any free port
        s.bind((host, 0))
        return int(s.getsockname()[1])


def split_tcp(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT`` (``[::1]`` for IPv6); ValueError that shows the form
    otherwise."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not an address of the form tcp://HOST:PORT")
    if int(port) > 65535:
        raise ValueError(f"{address!r}: port {port} is above 65535")
    return host, int(port)


def readable(sock: zmq.Socket[Any]) -> bool:
    """A message is waiting (reads ZeroMQ's EVENTS: no syscall, unlike ``poll(0)``)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _heartbeats(sock: zmq.Socket[Any], timeouts: Timeouts) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(timeouts.heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeouts.heartbeat_timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeouts.heartbeat_timeout_s * 1000))


def bind_router(
    ctx: zmq.Context[Any], address: str, timeouts: Timeouts, curve: CurveServer | None = None
) -> tuple[zmq.Socket[Any], str]:
    """A ROUTER bound at ``address`` (``tcp://HOST:0`` picks a free port); returns the socket
    and the address peers should connect to. TCP that leaves the host requires ``curve``."""
    if address.startswith("tcp://") and not is_local_address(address) and curve is None:
        raise ValueError(
            f"{address} leaves this host: it needs CURVE keys (make them with `hybridflow keys`)"
        )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    _heartbeats(sock, timeouts)
    if curve is not None:
        curve.apply(sock)
    if address.startswith("tcp://") and address.endswith(":0"):
        port = sock.bind_to_random_port(address[: -len(":0")])
        address = f"{address[: -len(':0')]}:{port}"
    else:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"cannot bind {address}: {exc} (is the port in use?)") from exc
    return sock, address


def connect_dealer(
    ctx: zmq.Context[Any],
    address: str,
    identity: bytes,
    timeouts: Timeouts,
    curve: CurveClient | None = None,
) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    _heartbeats(sock, timeouts)
    if curve is not None:
        curve.apply(sock)
    sock.connect(address)
    return sock


def send_frames(
    sock: zmq.Socket[Any], encoded: Encoded, identity: bytes | None = None
) -> zmq.MessageTracker | None:
    """Send one message. Big frames go zero-copy and tracked: the caller must not let anyone
    mutate the tensors until the returned tracker is done (``None``: nothing to wait for)."""
    frames = encoded.frames if identity is None else [identity, *encoded.frames]
    if encoded.big:
        tracker: zmq.MessageTracker | None = sock.send_multipart(frames, copy=False, track=True)
        return tracker
    sock.send_multipart(frames, copy=True)
    return None


@dataclass
class PeerWatch:
    """Which peer each connection belongs to, and which peers the monitor says are gone.

    File descriptors are reused: a refused stranger's connection may close, and the next peer
    may get the same number before we read that DISCONNECTED event. So ``learn`` first consumes
    every pending event (all of them predate the message being learnt from), then maps the fd."""

    monitor: zmq.Socket[Any]
    handshakes: HandshakeWatch | None = None  # a CURVE server's refused handshakes, logged

    def __post_init__(self) -> None:
        self._by_fd: dict[int, bytes] = {}
        self._lost: list[bytes] = []

    @classmethod
    def on(cls, sock: zmq.Socket[Any], handshakes: HandshakeWatch | None = None) -> PeerWatch:
        events = HANDSHAKE_EVENTS if handshakes is not None else zmq.EVENT_DISCONNECTED
        watch = cls(sock.get_monitor_socket(events), handshakes)
        # ZeroMQ's FD signals only changes seen after ZMQ_EVENTS was read: read it once, so a
        # reader on the FD hears the first event (a refused handshake may come before any hello)
        watch._pump()
        return watch

    def _pump(self) -> None:
        while readable(self.monitor):
            event = parse_monitor_message(self.monitor.recv_multipart())
            if self.handshakes is not None:
                self.handshakes.event(int(event["event"]), int(event["value"]))
            if event["event"] == zmq.EVENT_DISCONNECTED:
                ident = self._by_fd.pop(int(event["value"]), None)
                if ident is not None:
                    self._lost.append(ident)

    def learn(self, identity: bytes, first_frame: zmq.Frame) -> None:
        """Remember the connection a peer's message came from (call on its hello)."""
        self._pump()
        self._by_fd[first_frame.get(zmq.SRCFD)] = identity

    def lost(self) -> list[bytes]:
        """The identities whose connection closed since the last call."""
        self._pump()
        gone, self._lost = self._lost, []
        return gone

    def close(self) -> None:
        self.monitor.close(linger=0)
