"""A stranger that floods the controller's socket, run as its own process by
tests/controller/test_flood.py and by ``tests.controller.flood_measure`` (the full-length figures).

``python -m tests.controller.flood_peer ADDRESS ATTACK SECONDS [SIZE [PEERS]]``: PEERS raw ZeroMQ
DEALERs (one by default), one connection each, that never read and never know the token.
``hellos``: wrong-token hellos; ``named-hellos``: the same from a socket that names itself (one
ZeroMQ identity for all its connections); ``frames``: a hello followed by a frame of SIZE bytes
(zero pages, which cost this process nothing). Each is sent as fast as ZeroMQ takes it until SECONDS
have passed (a send that ZeroMQ holds back, the controller's back-pressure, is tried again);
then it leaves without waiting for what is queued and prints how many messages ZeroMQ took
(and, once its first messages are out, ``flooding``).
"""

from __future__ import annotations

import sys
import time

import zmq

from tests.controller.hostile_peer import hello

SEND_POLL_MS = 100  # how long one send may wait for room before the deadline is looked at


def flood(address: str, attack: str, seconds: float, size: int = 0, peers: int = 1) -> int:
    """Send ``attack`` messages from ``peers`` sockets (one connection each) for ``seconds``;
    returns how many ZeroMQ accepted."""
    ctx = zmq.Context()
    socks = []
    for _ in range(peers):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, SEND_POLL_MS // peers)
        if attack == "named-hellos":  # the same identity on every connection it makes
            sock.setsockopt(zmq.IDENTITY, b"named-stranger-%d" % len(socks))
        sock.connect(address)
        socks.append(sock)
    if attack in ("hellos", "named-hellos"):
        frames: list[bytes | memoryview] = [hello(roles=["linear"])]
    elif attack == "frames":
        frames = [hello(roles=["linear"]), memoryview(bytes(size))]  # zero pages, sent zero-copy
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    for sock in socks:
        sock.send_multipart(frames, copy=attack != "frames")
    print("flooding", flush=True)  # the test times its calls from here
    sent = peers
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock in socks:
            for _ in range(256):
                try:
                    sock.send_multipart(frames, copy=attack != "frames")
                except zmq.Again:
                    break
                sent += 1
    for sock in socks:
        sock.close()
    ctx.term()
    return sent


def main(argv: list[str]) -> None:
    address, attack, seconds = argv[0], argv[1], float(argv[2])
    size = int(argv[3]) if len(argv) > 3 else 0
    peers = int(argv[4]) if len(argv) > 4 else 1
    started = time.monotonic()
    sent = flood(address, attack, seconds, size, peers)
    print(f"{sent} {attack} in {time.monotonic() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
