"""The controller's ROUTER is bounded (``bind_router(..., exposed=True)``), a group's own links
are not: what ZeroMQ 4.3 does at each limit, checked on this build.

- a send to a peer that does not read fails with EAGAIN once ``controller_queue`` messages wait
  for it (ROUTER_MANDATORY is on: without it ZeroMQ would drop it silently), and nothing of it
  was sent — the controller drops a refusal there, or keeps a call in the group's backlog;
- a peer sending faster than the ROUTER is read waits (the queue does not grow past the mark);
- a frame over ``controller_frame_bytes`` disconnects its sender before it is buffered; frames
  up to it pass, however many a message has.
"""

from __future__ import annotations

from typing import Any

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from tests.conftest import TEST_TIMEOUTS
from tests.waiting import wait_for
from transport.channel import bind_router, send_frames
from transport.codec import encode
from transport.protocol import Message, MsgType

LIMITS = TEST_TIMEOUTS.model_copy(update={"controller_queue": 8, "controller_frame_bytes": 1024})


def _pair(
    ctx: zmq.Context[Any], exposed: bool, ipc: str
) -> tuple[zmq.Socket[Any], zmq.Socket[Any], bytes]:
    router, address = bind_router(ctx, f"ipc://{ipc}", LIMITS, exposed=exposed)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)  # it never reads: its own queue is no buffer either
    dealer.connect(address)
    dealer.send(b"hello")
    assert router.poll(5000)
    identity, _ = router.recv_multipart()
    return router, dealer, identity


def _sent_before_eagain(router: zmq.Socket[Any], identity: bytes, most: int) -> int:
    reply = encode(Message(MsgType.REFUSE, 0, {"reason": "x" * 100}))
    for n in range(most):
        try:
            send_frames(router, reply, identity, block=False)
        except zmq.Again:
            return n
    return most


def test_replies_to_a_peer_that_never_reads_stop_at_the_queue_limit(tmp_path: Any) -> None:
    ctx = zmq.Context()
    try:
        router, _dealer, identity = _pair(ctx, True, f"{tmp_path}/r")
        sent = []

        def full() -> bool:  # ZeroMQ's I/O thread may make room a few times before it stops
            sent.append(_sent_before_eagain(router, identity, 100_000))
            return sent[-1] == 0

        wait_for(full, 10, "EAGAIN at once, the queue to the peer full")
        # the queue's 8, the socket buffers and the peer's one message: a few thousand at most
        assert sum(sent) < 20_000, sent
        plain, _d, ident = _pair(ctx, False, f"{tmp_path}/p")
        assert _sent_before_eagain(plain, ident, 50_000) == 50_000  # a group's own links
    finally:
        ctx.destroy(linger=0)


def test_a_frame_over_the_cap_disconnects_its_sender_unbuffered(tmp_path: Any) -> None:
    ctx = zmq.Context()
    try:
        router, dealer, _ = _pair(ctx, True, f"{tmp_path}/r")
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        dealer.send_multipart([b"a" * 1024, b"b" * 1024, b"c" * 1024])  # each at the cap
        assert router.poll(5000)
        assert [len(f) for f in router.recv_multipart()[1:]] == [1024, 1024, 1024]
        dealer.send_multipart([b"a", b"b" * 1025])
        wait_for(lambda: monitor.poll(0), 5, "the ROUTER drops the connection")
        assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
        assert not router.poll(100)  # nothing of it was delivered
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("exposed", [True, False])
def test_a_fast_sender_waits_at_the_queue_limit(tmp_path: Any, exposed: bool) -> None:
    ctx = zmq.Context()
    try:
        _router, dealer, _ = _pair(ctx, exposed, f"{tmp_path}/r")
        dealer.setsockopt(zmq.SNDHWM, 8)
        dealer.setsockopt(zmq.SNDTIMEO, 200)
        sent = 0
        try:
            for _ in range(50_000):
                dealer.send(b"h" * 200)
                sent += 1
        except zmq.Again:
            pass
        # bounded: both queues' 8 plus what the socket buffers hold (a thousand or so here)
        assert sent < 10_000 if exposed else sent == 50_000
    finally:
        ctx.destroy(linger=0)
