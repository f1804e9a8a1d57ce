"""ZeroMQ sockets: how hybridflow binds, connects, secures, sends and notices a peer's death.

One ROUTER per security domain accepts many peers: plain for ``ipc://`` and loopback TCP, ZeroMQ
CURVE for TCP that leaves the host (``transport.security``). Peers connect a DEALER whose routing
id names them. Liveness needs no application pings: a process that dies closes its socket and a
silent remote host is dropped by ZeroMQ's own heartbeats; either way the ROUTER's monitor socket
reports ``DISCONNECTED`` with the file descriptor, and ``PeerWatch`` maps that descriptor back to
the peer it learnt from the peer's first message (``zmq.SRCFD``).

The controller's ROUTER is ``exposed``: anyone who reaches it can send before proving anything,
so its queues are bounded per peer (``timeouts.controller_queue`` messages each way: a peer that
sends faster than the controller reads waits, and a reply to one that never reads is refused with
EAGAIN rather than queued) and ZeroMQ disconnects a peer whose frame is over
``timeouts.controller_frame_bytes`` before buffering it. ``PeerWatch`` also remembers each
stranger's connection, so the controller can ``cut`` one that keeps sending without registering.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from transport.codec import Encoded
from transport.security import HANDSHAKE_EVENTS, CurveSide, HandshakeWatch
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
    ctx: zmq.Context[Any],
    address: str,
    timeouts: Timeouts,
    curve: CurveSide | None = None,
    exposed: bool = False,
) -> tuple[zmq.Socket[Any], str]:
    """A ROUTER bound at ``address`` (``tcp://HOST:0`` picks a free port); returns the socket
    and the address peers should connect to. TCP that leaves the host requires ``curve``.
    ``exposed`` (the controller's): bounded queues and frame size, from ``timeouts``; otherwise
    (a group's own links, between its ranks) unbounded."""
    if address.startswith("tcp://") and not is_local_address(address) and curve is None:
        raise ValueError(
            f"{address} leaves this host: it needs CURVE keys (make them with `hybridflow keys`)"
        )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone or full peer raises, not drops
    queue = timeouts.controller_queue if exposed else 0
    sock.setsockopt(zmq.SNDHWM, queue)
    sock.setsockopt(zmq.RCVHWM, queue)
    if exposed:
        sock.setsockopt(zmq.MAXMSGSIZE, timeouts.controller_frame_bytes)
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
    curve: CurveSide | None = None,
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
    sock: zmq.Socket[Any], encoded: Encoded, identity: bytes | None = None, block: bool = True
) -> zmq.MessageTracker | None:
    """Send one message. Big frames go zero-copy and tracked: the caller must not let anyone
    mutate the tensors until the returned tracker is done (``None``: nothing to wait for).
    ``block=False``: ``zmq.Again`` when the peer's queue is full, and nothing was sent."""
    frames = encoded.frames if identity is None else [identity, *encoded.frames]
    flags = 0 if block else zmq.NOBLOCK
    if encoded.big:
        tracker: zmq.MessageTracker | None = sock.send_multipart(
            frames, flags, copy=False, track=True
        )
        return tracker
    sock.send_multipart(frames, flags, copy=True)
    return None


SEND_RETRY_S = 0.05  # how often ``send_within`` tries again


def send_within(sock: zmq.Socket[Any], encoded: Encoded, timeout_s: float) -> bool:
    """Send one small message, waiting at most ``timeout_s`` for a connection to take it;
    False when none did. A DEALER with no connection blocks a send for ever, and ZeroMQ drops
    a connection whose handshake failed (a refused CURVE key) with what was queued on it;
    POLLOUT is no guide then (it says ready while a send would block), so the send is tried."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            send_frames(sock, encoded, block=False)
            return True
        except zmq.Again:
            if time.monotonic() >= deadline:
                return False
            time.sleep(SEND_RETRY_S)


def _shut(fd: int) -> None:
    """End the connection on ``fd``, which ZeroMQ owns: a duplicate is shut down (that ends the
    connection for every descriptor of it) and closed, and ZeroMQ's I/O thread, reading end of
    file, closes its own as if the peer had left."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            conn.shutdown(socket.SHUT_RDWR)
    except OSError as exc:  # gone meanwhile (ENOTCONN) or not a socket: nothing to end
        log.debug("could not shut connection fd %d: %s", fd, exc)


def _sockname(endpoint: str) -> str | None:
    """What an accepted connection of a socket bound at ``endpoint`` reports as its own
    address: the path for ipc, the port for TCP (bound to a wildcard host, its connections
    name the host they came in on)."""
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    if endpoint.startswith("tcp://"):
        return endpoint.rsplit(":", 1)[1]
    return None


def _is_connection_of(fd: int, address: str) -> bool:
    """``fd`` is a connection accepted by the socket whose ``_sockname`` is ``address`` (not
    its listener, not any other file a reused fd number may now be)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            name = conn.getsockname()
    except OSError:
        return False
    if isinstance(name, tuple):
        return str(name[1]) == address
    return isinstance(name, str) and name == address


@dataclass
class PeerWatch:
    """Which peer each connection belongs to, and which peers the monitor says are gone.

    File descriptors are reused: a refused stranger's connection may close, and the next peer
    may get the same number before we read that DISCONNECTED event. So ``learn`` first consumes
    every pending event (all of them predate the message being learnt from), then maps the fd.

    ``silent`` (the controller's socket) also counts connections that closed before a whole
    message came from them: ZeroMQ disconnects a peer whose frame is over the socket's
    MAXMSGSIZE without a word to the application, and this is the trace it leaves."""

    monitor: zmq.Socket[Any]
    handshakes: HandshakeWatch | None = None  # a CURVE server's refused handshakes, logged
    silent: bool = False

    def __post_init__(self) -> None:
        self._by_fd: dict[int, bytes] = {}
        self._lost: list[bytes] = []
        # strangers (peers that have not registered) whose connection is open, both ways
        self._stranger_by_fd: dict[int, bytes] = {}
        self._stranger_fd: dict[bytes, int] = {}
        self._dirty: set[int] = set()  # a connection on it closed since a stranger last met there
        self._address: str | None = None  # the socket's own, as its connections see it
        self._unheard: set[int] = set()  # accepted, no message read from it yet
        self._silent_closes = 0
        self.cuts = 0  # connections cut

    @classmethod
    def on(
        cls, sock: zmq.Socket[Any], handshakes: HandshakeWatch | None = None, silent: bool = False
    ) -> PeerWatch:
        events = HANDSHAKE_EVENTS if handshakes is not None else zmq.EVENT_DISCONNECTED
        events |= zmq.EVENT_ACCEPTED if silent else 0
        watch = cls(sock.get_monitor_socket(events), handshakes, silent)
        # ZeroMQ's FD signals only changes seen after ZMQ_EVENTS was read: read it once, so a
        # reader on the FD hears the first event (a refused handshake may come before any hello)
        watch._pump()
        watch._address = _sockname(str(sock.getsockopt_string(zmq.LAST_ENDPOINT)))
        return watch

    def _pump(self) -> None:
        while readable(self.monitor):
            event = parse_monitor_message(self.monitor.recv_multipart())
            kind, fd = int(event["event"]), int(event["value"])
            refused = self.handshakes is not None and self.handshakes.failing
            if self.handshakes is not None:
                self.handshakes.event(kind, fd)
            if kind == zmq.EVENT_ACCEPTED and self.silent:
                self._unheard.add(fd)
            if kind == zmq.EVENT_DISCONNECTED:
                self._closed(fd, refused)

    def _closed(self, fd: int, refused: bool) -> None:
        self._dirty.add(fd)
        if fd in self._unheard:
            self._unheard.discard(fd)
            self._silent_closes += not refused  # a refused handshake is logged as such
        ident = self._by_fd.pop(fd, None)
        if ident is not None:
            self._lost.append(ident)
        stranger = self._stranger_by_fd.pop(fd, None)
        if stranger is not None:
            del self._stranger_fd[stranger]

    def learn(self, identity: bytes, first_frame: zmq.Frame) -> None:
        """Remember the connection a peer's message came from (call on its hello)."""
        self._pump()
        fd = first_frame.get(zmq.SRCFD)
        self._by_fd[fd] = identity
        self._unheard.discard(fd)
        self._stranger_by_fd.pop(self._stranger_fd.pop(identity, -1), None)

    def meet(self, identity: bytes, frame: zmq.Frame) -> bool:
        """Remember the connection a stranger's message came from, so that it can be ``cut``.

        A message read now may have come from a connection that has closed since, and its fd
        may be another connection's by now; ZeroMQ reports the close (DISCONNECTED) before
        the fd can be reused. So a fd on which a connection closed since the last stranger met
        there is not trusted — that meeting only clears the doubt, the next one on it counts.
        False when the connection was not remembered."""
        self._pump()
        fd = frame.get(zmq.SRCFD)
        self._unheard.discard(fd)
        if fd in self._dirty:
            self._dirty.discard(fd)
            return False
        if fd in self._by_fd or fd in self._stranger_by_fd:
            return False
        self._stranger_by_fd[fd] = identity
        self._stranger_fd[identity] = fd
        return True

    def cut(self, identity: bytes) -> bool:
        """Close a stranger's connection: ZeroMQ drops what is queued for it, and the peer must
        connect again (a new connection; ZeroMQ gives it a new identity unless it names
        itself). False when its connection is not known to be open, or its fd is not one of
        this socket's connections (then it is left alone)."""
        self._pump()
        fd = self._stranger_fd.pop(identity, None)
        if fd is None:
            return False
        del self._stranger_by_fd[fd]
        if self._address is None or not _is_connection_of(fd, self._address):
            return False
        _shut(fd)
        self.cuts += 1
        return True

    def silent_closes(self) -> int:
        """Connections that closed before a whole message was read from them, since the last
        call (``silent`` only). A peer that sent and left at once may be counted too: its
        close can be seen before its message is read."""
        self._pump()
        count, self._silent_closes = self._silent_closes, 0
        return count

    def lost(self) -> list[bytes]:
        """The identities whose connection closed since the last call."""
        self._pump()
        gone, self._lost = self._lost, []
        return gone

    def close(self) -> None:
        self.monitor.close(linger=0)
