"""Multipart messages over a plain stream socket (Unix domain or TCP), for links inside a group.

ZeroMQ routes every message through its own I/O threads: a send wakes the sender's I/O thread, a
receive wakes the receiver's application thread — three wake-ups per hop, each tens of
microseconds on a small VM. Between a coordinator and its ranks, which need no routing, a plain
socket does it in one: the sender's thread writes, the receiver's thread wakes. A closed
connection (the peer died) reads as end-of-file, which is also the liveness signal.

Framing: ``u32 n`` then ``n`` u64 frame lengths, then the frames. Frames are received into fresh
``bytearray``s (writable: ``torch.frombuffer`` wraps them without a copy or warning).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

MAX_FRAMES = 1 << 16


def send_message(sock: socket.socket, frames: Sequence[Any]) -> None:
    """Write every frame (bytes-like) as one message; blocks until the kernel has them all."""
    views = [memoryview(f).cast("B") for f in frames]
    header = struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views))
    pending = [memoryview(header), *(v for v in views if v.nbytes)]
    while pending:
        sent = sock.sendmsg(pending)
        while sent:
            if sent >= pending[0].nbytes:
                sent -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def _read_exact(sock: socket.socket, buf: bytearray | memoryview) -> bool:
    view = memoryview(buf)
    while view.nbytes:
        got = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
        if got == 0:
            return False
        view = view[got:]
    return True


def recv_message(sock: socket.socket, max_frame_bytes: int = 1 << 40) -> list[bytearray] | None:
    """One message's frames, or ``None`` when the peer closed the connection. A header that
    announces too many frames or a frame over ``max_frame_bytes`` raises ``ValueError`` (the
    stream cannot be resynchronised; the caller should drop the connection)."""
    count = bytearray(4)
    if not _read_exact(sock, count):
        return None
    (n,) = struct.unpack("<I", count)
    if n > MAX_FRAMES:
        raise ValueError(f"message announces {n} frames (limit {MAX_FRAMES})")
    lengths_raw = bytearray(8 * n)
    if not _read_exact(sock, lengths_raw):
        return None
    lengths = struct.unpack(f"<{n}Q", lengths_raw)
    if any(length > max_frame_bytes for length in lengths):
        raise ValueError(f"frame of {max(lengths)} bytes over the limit of {max_frame_bytes}")
    frames = [bytearray(length) for length in lengths]
    for frame in frames:
        if not _read_exact(sock, frame):
            return None
    return frames


def listen(address: str) -> tuple[socket.socket, str]:
    """A listening socket: ``unix:PATH`` or ``tcp:HOST:PORT`` (port 0 picks one); returns it
    with the address to connect to."""
    kind, _, rest = address.partition(":")
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(rest)
    elif kind == "tcp":
        host, _, port = rest.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        address = f"tcp:{host}:{sock.getsockname()[1]}"
    else:
        raise ValueError(f"stream address {address!r} must start with unix: or tcp:")
    sock.listen(256)
    return sock, address


def connect(address: str, timeout: float) -> socket.socket:
    kind, _, rest = address.partition(":")
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = rest
    elif kind == "tcp":
        host, _, port = rest.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = (host, int(port))
    else:
        raise ValueError(f"stream address {address!r} must start with unix: or tcp:")
    sock.settimeout(timeout)
    sock.connect(target)
    sock.settimeout(None)
    tune(sock)
    return sock


def tune(sock: socket.socket) -> None:
    """No Nagle delay on TCP; keepalive so a vanished host is noticed."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
