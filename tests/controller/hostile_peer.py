"""A stranger on the controller's socket, run as its own process by tests/controller/test_hostile_peers.py.

``python -m tests.controller.hostile_peer ADDRESS ATTACK [COUNT]``. It never knows the token.
Attacks: ``cycles`` (COUNT times: connect, send a hello that is wrong in some way, leave at once
or after the refusal), ``big-frame`` (one frame of COUNT bytes), ``empty-maps`` (a header of
COUNT bytes that is an array of empty maps), ``long-version`` (a hello whose ``version`` is a
string of COUNT characters). It prints how many cycles it ran and how long they took.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import msgpack
import zmq

from transport.protocol import PROTOCOL_VERSION, MsgType

HELLO = int(MsgType.HELLO)


def hello(**fields: Any) -> bytes:
    body: dict[str, Any] = {
        "roles": ["echo"],
        "world_size": 1,
        "layout": {"dp": 1, "tp": 1, "pp": 1},
        "version": PROTOCOL_VERSION,
        "token": "not-the-token",
        "host": "elsewhere",
        "pid": 1,
        "group": "g",
    }
    body.update(fields)
    return msgpack.packb([PROTOCOL_VERSION, HELLO, 0, body])


ODD_HELLOS = [
    hello(),
    hello(roles=5),
    hello(roles=[1, "a"]),
    hello(version="1"),
    hello(version=[1]),
    hello(world_size="1"),
    hello(layout=7),
    hello(group=["g"], roles=None),
]


def cycles(address: str, count: int) -> None:
    ctx = zmq.Context()
    started = time.monotonic()
    for i in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # the hello still goes out after close
        sock.connect(address)
        sock.send(ODD_HELLOS[i % len(ODD_HELLOS)])
        if i % 4 == 0:  # sometimes stay for the refusal, mostly leave before it comes
            sock.poll(1000)
        sock.close()
    ctx.term()
    print(f"{count} cycles in {time.monotonic() - started:.2f} s", flush=True)


def one_message(address: str, frames: list[Any]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 30_000)
    sock.connect(address)
    sock.send_multipart(frames, copy=False)
    sock.close()
    ctx.term()  # waits until the frames are out


def main(argv: list[str]) -> None:
    address, attack = argv[0], argv[1]
    count = int(argv[2]) if len(argv) > 2 else 1
    if attack == "cycles":
        cycles(address, count)
    elif attack == "big-frame":
        header = msgpack.packb([PROTOCOL_VERSION, int(MsgType.REPLY), 1, {"result": 1}])
        one_message(address, [header, bytes(count)])  # calloc'd: costs this process nothing
    elif attack == "empty-maps":
        n = count - 10
        array = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
        one_message(address, [bytes([0x94, PROTOCOL_VERSION, HELLO, 0]) + array])
    elif attack == "long-version":
        one_message(address, [hello(version="v" * count)])
    else:
        raise SystemExit(f"unknown attack {attack!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
