"""The socket channels of a weight transfer (``reshard/channels.py``), in one process: TCP inboxes
take only CURVE senders that pin their key, buckets of another transfer are dropped, shared
memory carries the bytes, and a closed sender is reported."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import zmq

from reshard.channels import ZmqInlet, ZmqOutlet, arena, context, header
from reshard.peers import PathError, Peer, choose_path
from tests.waiting import wait_for

PARTS = [torch.arange(6, dtype=torch.float32), torch.arange(12.0).view(3, 4)[:, 1:3]]
JOINED = torch.cat([PARTS[0], PARTS[1].reshape(-1)])


def take(inlet: ZmqInlet, seconds: float = 2.0) -> list[tuple[int, int, torch.Tensor]]:
    deadline = time.monotonic() + seconds
    found: list[tuple[int, int, torch.Tensor]] = []
    while not found and time.monotonic() < deadline:
        found = [(s, i, d.clone()) for s, i, d in inlet.poll(20)]
    return found


def test_a_tcp_inbox_takes_a_curve_sender_with_its_key() -> None:
    inlet = ZmqInlet(None, "127.0.0.1", "secret", 3)
    assert inlet.tcp is not None and inlet.key is not None
    outlet = ZmqOutlet(inlet.tcp, inlet.key, "secret", 3, 5, None, 5.0, "rollout rank 0")
    try:
        outlet.send(7, PARTS)
        [(src, index, data)] = take(inlet)
        outlet.finish()
    finally:
        inlet.close()
    assert (src, index) == (5, 7)
    assert torch.equal(data.view(torch.float32), JOINED)


def test_a_plain_sender_gets_nothing_into_a_curve_inbox() -> None:
    inlet = ZmqInlet(None, "127.0.0.1", "secret", 3)
    assert inlet.tcp is not None
    plain = context().socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(inlet.tcp)
    try:
        plain.send_multipart([header("secret", 3, 0, 0, None), b"\0" * 16], zmq.NOBLOCK)
    except zmq.Again:
        pass  # no handshake completed: nothing can be queued either
    try:
        assert take(inlet, 0.5) == []
    finally:
        plain.close()
        inlet.close()


def test_buckets_of_another_token_or_version_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inlet = ZmqInlet(str(tmp_path), None, "secret", 3)
    assert inlet.ipc is not None
    wrong = [
        ZmqOutlet(inlet.ipc, None, "guess", 3, 0, None, 5.0, "r0"),
        ZmqOutlet(inlet.ipc, None, "secret", 2, 0, None, 5.0, "r0"),
    ]
    right = ZmqOutlet(inlet.ipc, None, "secret", 3, 1, None, 5.0, "r0")
    found: list[tuple[int, int, torch.Tensor]] = []

    def both_dropped() -> bool:
        found.extend(inlet.poll(20))
        return sum("of another transfer" in r.getMessage() for r in caplog.records) == 2

    try:
        with caplog.at_level(logging.WARNING, logger="hybridflow.reshard"):
            for outlet in wrong:
                outlet.send(0, PARTS)
            wait_for(both_dropped, 5, "the inbox dropping the two buckets of another transfer")
            right.send(4, PARTS)
            found += take(inlet)
    finally:
        for outlet in [*wrong, right]:
            outlet.close()
        inlet.close()
    assert [(s, i) for s, i, _ in found] == [(1, 4)]  # every bucket sent is accounted for


def test_shared_memory_carries_the_bytes_and_a_closed_sender_is_reported(
    tmp_path: Path,
) -> None:
    inlet = ZmqInlet(str(tmp_path), None, "secret", 1)
    assert inlet.ipc is not None
    outlet = ZmqOutlet(inlet.ipc, None, "secret", 1, 2, arena(1 << 20), 5.0, "r0")
    try:
        outlet.send(0, PARTS)
        [(src, index, data)] = take(inlet)
        assert (src, index) == (2, 0)
        assert torch.equal(data.view(torch.float32), JOINED)
        outlet.finish()
        lost = wait_for(inlet.lost, 2.0, "the inbox reporting its closed sender")
    finally:
        inlet.close()
    assert lost == {2}


def test_paths_by_host_and_cluster() -> None:
    a, b, c = Peer("h1", ""), Peer("h2", ""), Peer("h3", "other")
    assert [choose_path("auto", a, x) for x in (a, b, c)] == ["shm", "group", "zmq"]
    assert choose_path("zmq", a, a) == "zmq"
    with pytest.raises(PathError, match="shared memory needs one host"):
        choose_path("shm", a, b)
