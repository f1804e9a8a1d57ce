"""Address helpers of ``transport.channel``: tcp address parsing and the spare-port choice."""

from __future__ import annotations

import socket

import pytest

from transport.channel import spare_port, split_tcp


def test_split_tcp() -> None:
    assert split_tcp("tcp://10.0.0.1:5555") == ("10.0.0.1", 5555)
    assert split_tcp("tcp://[::1]:7") == ("::1", 7)
    for bad in ("tcp://h", "ipc:///x", "tcp://:5", "tcp://h:x"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            split_tcp(bad)
    with pytest.raises(ValueError, match="above 65535"):
        split_tcp("tcp://h:70000")


def test_spare_ports_avoid_the_ephemeral_range_and_bind() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {spare_port() for _ in range(20)}
    assert len(ports) > 10  # random, not a fixed port every launcher would collide on
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
