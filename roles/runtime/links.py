"""The links between a coordinator and the other ranks of its group (the fan-out transport).

Two interchangeable kinds, chosen by ``HYBRIDFLOW_FANOUT``:

- ``socket`` (default): one plain stream socket per rank on one host (Unix domain), see
  ``transport.stream``. One wake-up per message; a dead rank reads as end-of-file.
- ``zmq``: a ROUTER at the coordinator, a DEALER per rank; deaths come from the monitor. A group
  whose ranks span hosts takes these when it has CURVE keys, encrypted with the group's key pair
  (``GroupEnv.link_curve``): plain sockets would carry batches and weights in the clear.

``python -m bench.transport`` measures both (and the rpc backend, which sends tasks with
torch.distributed.rpc and uses these links only for hello, liveness and shutdown); the default is
the fastest there. Messages to a rank carry a first frame holding the rank's index among the
message's receivers (shared-memory release flags are per receiver).
"""

from __future__ import annotations

import abc
import socket
import time
from typing import Any

import zmq

from transport.channel import PeerWatch, bind_router, connect_dealer, send_frames
from transport.codec import Encoded, decode
from transport.errors import RegistrationError
from transport.protocol import Message, MsgType, ProtocolError
from transport.security import CurveSide, token_ok
from transport.settings import Timeouts
from transport.stream import connect, listen, recv_message, send_message, tune

LINK_KINDS = ("socket", "zmq")


def _missing_error(missing: set[int], timeouts: Timeouts) -> RegistrationError:
    return RegistrationError(
        f"ranks {sorted(missing)} never reached the coordinator within "
        f"{timeouts.group_init_s:.0f} s (raise timeouts.group_init_s)"
    )


def _is_hello(msg: Message, token: str) -> bool:
    return msg.type == MsgType.HELLO and token_ok(token, msg.body.get("token"))


class FanOutLinks(abc.ABC):
    """The coordinator's end."""

    address: str

    def wait_hellos(
        self, ranks: set[int], timeouts: Timeouts, token: str
    ) -> dict[int, dict[str, Any]]:
        """Every rank's hello body, by rank; hellos without the group's token are ignored."""
        deadline = time.monotonic() + timeouts.group_init_s
        hellos: dict[int, dict[str, Any]] = {}
        while set(hellos) != ranks:
            got = self._next_hello(deadline)
            if got is None:
                raise _missing_error(ranks - set(hellos), timeouts)
            peer, msg = got
            body = msg.body if msg is not None and _is_hello(msg, token) else {}
            rank = body.get("rank")  # from the wire: admitted only if it is one we wait for
            if type(rank) is int and rank in ranks and rank not in hellos:
                self._admit(rank, peer)
                hellos[rank] = body
            else:
                self._turn_away(peer)
        self._admitted_all()
        return hellos

    @abc.abstractmethod
    def _next_hello(self, deadline: float) -> tuple[Any, Message | None] | None:
        """The next peer and its first message (``None`` if not ours); ``None`` at the deadline."""

    @abc.abstractmethod
    def _admit(self, rank: int, peer: Any) -> None: ...

    def _turn_away(self, peer: Any) -> None:
        """Drop a peer that is not one of the group's ranks (default: nothing to close)."""
        del peer

    def _admitted_all(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Called once every rank is in."""

    @abc.abstractmethod
    def pollables(self) -> list[Any]:
        """Sockets or file descriptors to register with a ``zmq.Poller``."""

    @abc.abstractmethod
    def send(self, rank: int, frames: list[Any]) -> None: ...

    @abc.abstractmethod
    def receive(self, ready: dict[Any, int]) -> list[tuple[int, list[Any]]]:
        """The messages that arrived, as (rank, frames)."""

    @abc.abstractmethod
    def lost(self) -> list[int]:
        """Ranks whose link closed since the last call."""

    @abc.abstractmethod
    def shutdown(self, frames: list[Any]) -> None:
        """Best effort: send ``frames`` to every rank, flush, close."""


class SocketFanOut(FanOutLinks):
    def __init__(self, address: str) -> None:
        self.listener, self.address = listen(address)
        self.conns: dict[int, socket.socket] = {}
        self.by_fd: dict[int, int] = {}
        self._lost: list[int] = []

    def _next_hello(self, deadline: float) -> tuple[Any, Message | None] | None:
        self.listener.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            conn, _ = self.listener.accept()
        except TimeoutError:
            return None
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            return conn, decode(recv_message(conn) or [])
        except (ProtocolError, OSError):
            return conn, None  # not one of ours

    def _admit(self, rank: int, peer: Any) -> None:
        peer.settimeout(None)
        tune(peer)
        self.conns[rank] = peer
        self.by_fd[peer.fileno()] = rank

    def _turn_away(self, peer: Any) -> None:
        peer.close()

    def _admitted_all(self) -> None:
        self.listener.close()

    def pollables(self) -> list[Any]:
        return list(self.by_fd)

    def send(self, rank: int, frames: list[Any]) -> None:
        send_message(self.conns[rank], frames)

    def receive(self, ready: dict[Any, int]) -> list[tuple[int, list[Any]]]:
        got: list[tuple[int, list[Any]]] = []
        for fd, rank in list(self.by_fd.items()):
            if fd not in ready:
                continue
            try:
                frames = recv_message(self.conns[rank])
            except (OSError, ValueError):
                frames = None  # a broken stream is as good as a dead rank
            if frames is None:
                del self.by_fd[fd]
                self._lost.append(rank)
            else:
                got.append((rank, frames))
        return got

    def lost(self) -> list[int]:
        gone, self._lost = self._lost, []
        return gone

    def shutdown(self, frames: list[Any]) -> None:
        for conn in self.conns.values():
            try:
                send_message(conn, [b"\0", *frames])
                conn.close()
            except OSError:
                pass  # that rank is gone already


class ZmqFanOut(FanOutLinks):
    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        timeouts: Timeouts,
        curve: CurveSide | None = None,
    ) -> None:
        self.sock, self.address = bind_router(ctx, address, timeouts, curve)
        self.watch = PeerWatch.on(self.sock)
        self.ids: dict[int, bytes] = {}

    def _next_hello(self, deadline: float) -> tuple[Any, Message | None] | None:
        left = deadline - time.monotonic()
        if left <= 0 or not self.sock.poll(int(left * 1000)):
            return None
        ident, *frames = self.sock.recv_multipart(copy=False)
        try:
            return ident, decode(frames)
        except ProtocolError:
            return ident, None

    def _admit(self, rank: int, peer: Any) -> None:
        self.ids[rank] = peer.bytes
        self.watch.learn(peer.bytes, peer)

    def pollables(self) -> list[Any]:
        return [self.sock, self.watch.monitor]

    def send(self, rank: int, frames: list[Any]) -> None:
        self.sock.send_multipart([self.ids[rank], *frames], copy=False)

    def receive(self, ready: dict[Any, int]) -> list[tuple[int, list[Any]]]:
        got: list[tuple[int, list[Any]]] = []
        ranks = {ident: rank for rank, ident in self.ids.items()}
        while self.sock.poll(0):
            ident, *frames = self.sock.recv_multipart(copy=False)
            if ident.bytes in ranks:
                got.append((ranks[ident.bytes], frames))
        return got

    def lost(self) -> list[int]:
        ranks = {ident: rank for rank, ident in self.ids.items()}
        return [ranks[ident] for ident in self.watch.lost() if ident in ranks]

    def shutdown(self, frames: list[Any]) -> None:
        for ident in self.ids.values():
            try:
                self.sock.send_multipart([ident, b"\0", *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank is gone already


class WorkerLink(abc.ABC):
    """A rank's end: blocking, single-threaded."""

    @abc.abstractmethod
    def send(self, encoded: Encoded) -> None:
        """Send; returns once nothing of ``encoded`` is held by the transport any more."""

    @abc.abstractmethod
    def recv(self) -> list[Any] | None:
        """The next message's frames, or ``None`` once the coordinator is gone."""


class SocketWorkerLink(WorkerLink):
    def __init__(self, address: str, timeouts: Timeouts) -> None:
        self.sock = connect(address, timeouts.group_init_s)
        self.max_frame_bytes = timeouts.max_frame_bytes

    def send(self, encoded: Encoded) -> None:
        send_message(self.sock, encoded.frames)  # returns after the kernel copied everything

    def recv(self) -> list[Any] | None:
        try:
            return recv_message(self.sock, self.max_frame_bytes)
        except (OSError, ValueError):
            return None


class ZmqWorkerLink(WorkerLink):
    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        rank: int,
        timeouts: Timeouts,
        curve: CurveSide | None = None,
    ) -> None:
        self.sock = connect_dealer(ctx, address, f"rank{rank}".encode(), timeouts, curve)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.call_s = timeouts.call_s

    def send(self, encoded: Encoded) -> None:
        tracker = send_frames(self.sock, encoded)
        if tracker is not None:
            tracker.wait(self.call_s)

    def recv(self) -> list[Any] | None:
        while True:
            ready = dict(self.poller.poll())
            if self.sock.poll(0):  # messages first: a SHUTDOWN precedes the disconnect
                frames: list[Any] = self.sock.recv_multipart(copy=False)
                return frames
            if self.monitor in ready:
                return None


def fanout_links(
    kind: str,
    ctx: zmq.Context[Any],
    address_base: str,
    timeouts: Timeouts,
    curve: CurveSide | None = None,
) -> FanOutLinks:
    """The coordinator's links; ``address_base`` is ``unix:PATH`` or ``tcp:HOST``; ``curve``
    (zmq only) when they leave the host."""
    if kind == "socket":
        return SocketFanOut(
            address_base if address_base.startswith("unix:") else f"{address_base}:0"
        )
    if address_base.startswith("unix:"):
        return ZmqFanOut(ctx, f"ipc://{address_base[len('unix:') :]}", timeouts)
    return ZmqFanOut(ctx, f"tcp://{address_base[len('tcp:') :]}:0", timeouts, curve)


def worker_link(
    kind: str,
    ctx: zmq.Context[Any],
    address: str,
    rank: int,
    timeouts: Timeouts,
    curve: CurveSide | None = None,
) -> WorkerLink:
    if kind == "socket":
        return SocketWorkerLink(address, timeouts)
    return ZmqWorkerLink(ctx, address, rank, timeouts, curve)
