"""Fan-out links on their own: hellos need the group's token, a closed link is a lost rank."""

from __future__ import annotations

import tempfile
import threading
import time
from typing import Any

import pytest
import zmq

from roles.runtime.links import fanout_links, worker_link
from tests.conftest import TEST_TIMEOUTS
from transport.codec import decode, encode
from transport.errors import RegistrationError
from transport.protocol import Message, MsgType

TOKEN = "group-token"


def hello(rank: int, token: str) -> Any:
    return encode(
        Message(
            MsgType.HELLO,
            0,
            {
                "roles": ["r"],
                "world_size": 3,
                "layout": {"dp": 3, "tp": 1, "pp": 1},
                "version": 1,
                "token": token,
                "host": "h",
                "pid": 1,
                "rank": rank,
                "group": "g",
            },
        )
    )


@pytest.mark.parametrize("kind", ["socket", "zmq"])
def test_links_carry_messages_and_report_a_closed_rank(kind: str) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    base = f"unix:{tempfile.mkdtemp(prefix='hf-')}/links"
    links = fanout_links(kind, ctx, base, TEST_TIMEOUTS)
    workers: dict[int, Any] = {}

    def join() -> None:
        intruder = worker_link(kind, ctx, links.address, 9, TEST_TIMEOUTS)
        intruder.send(hello(1, "wrong token"))  # claims rank 1 without the token: ignored
        workers[9] = intruder
        for rank in (1, 2):
            workers[rank] = worker_link(kind, ctx, links.address, rank, TEST_TIMEOUTS)
            workers[rank].send(hello(rank, TOKEN))

    joiner = threading.Thread(target=join)
    joiner.start()
    hellos = links.wait_hellos({1, 2}, TEST_TIMEOUTS, TOKEN)
    joiner.join()
    assert sorted(hellos) == [1, 2]

    poller = zmq.Poller()
    for p in links.pollables():
        poller.register(p, zmq.POLLIN)
    call = encode(Message(MsgType.CALL, 5, {"role": "r", "method": "m", "args": [1], "kwargs": {}}))
    links.send(2, [bytes([0]), *call.frames])
    frames = workers[2].recv()
    assert frames is not None and decode(frames[1:]).body["args"] == [1]
    workers[2].send(encode(Message(MsgType.REPLY, 5, {"result": "ok"})))
    got: list[tuple[int, Any]] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = links.receive(dict(poller.poll(1000)))
    assert [(rank, decode(f).body["result"]) for rank, f in got] == [(2, "ok")]

    closer = workers[1]
    if kind == "socket":
        closer.sock.close()  # type: ignore[attr-defined]
    else:
        closer.sock.close(linger=0)  # type: ignore[attr-defined]
    lost: list[int] = []
    while not lost and time.monotonic() < deadline:
        links.receive(dict(poller.poll(1000)))
        lost = links.lost()
    assert lost == [1]
    ctx.destroy(linger=0)


def test_missing_ranks_are_named_with_the_setting() -> None:
    links = fanout_links("socket", zmq.Context(), f"unix:{tempfile.mkdtemp()}/l", TEST_TIMEOUTS)
    quick = TEST_TIMEOUTS.model_copy(update={"group_init_s": 0.3})
    with pytest.raises(RegistrationError, match=r"ranks \[1, 2\].*timeouts\.group_init_s"):
        links.wait_hellos({1, 2}, quick, TOKEN)
