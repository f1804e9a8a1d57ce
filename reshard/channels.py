"""The three ways a bucket travels from a sending rank to a receiving rank of another group.

* ``zmq`` — a PUSH socket on the sender, the receiver's PULL socket: ipc on one host, TCP with an
  ephemeral CURVE key pair off the host (the receiver's public key and a per-transfer token reach
  the sender through the controller, which is itself authenticated). Frame 0 is a msgpack header
  ``[token, version, src, index, shm]``, frame 1 the bucket's bytes.
* ``shm`` — the same socket carries only the header; the bytes go through a shared-memory segment
  (``transport.shm``) that the receiver copies out of and releases.
* ``group`` — gloo ``send``/``recv`` on a stateless process group spanning both role groups
  (``stateless_group``): tag 0 carries ``[version, buckets]``, tag ``i + 1`` bucket ``i``.

Every wait is bounded by ``stall_s``; errors name the role and rank at the other end.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections import deque
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import zmq

from reshard.slices import join
from transport.channel import PeerWatch
from transport.security import token_ok
from transport.shm import ShmArena, ShmReader

log = logging.getLogger("hybridflow.reshard")

_SHM_PREFIX = "hfr2"  # swept like the runtime's own segments (transport.shm.sweep_dead)
_arena: ShmArena | None = None
_groups: dict[str, dist.ProcessGroupGloo] = {}
_stores: dict[str, dist.TCPStore] = {}


class TransferError(RuntimeError):
    """A weight transfer that could not finish; says which role and rank, and why."""


def context() -> zmq.Context[Any]:
    return zmq.Context.instance()


def arena(bucket_bytes: int) -> ShmArena:
    """This process's arena for outgoing buckets: room for four in flight."""
    global _arena
    segment = 1 << max(bucket_bytes - 1, 0).bit_length()
    if _arena is None or _arena.max_bytes < 4 * (segment + 4096):
        if _arena is not None:
            _arena.close()
        _arena = ShmArena(prefix=_SHM_PREFIX, max_bytes=4 * (segment + 4096))
    return _arena


def header(token: str, version: int, src: int, index: int, shm: dict[str, Any] | None) -> bytes:
    packed: bytes = msgpack.packb([token, version, src, index, shm], use_bin_type=True)
    return packed


class ZmqOutlet:
    """Buckets from this rank to one receiving rank, as frames or through shared memory."""

    def __init__(
        self,
        address: str,
        server_key: str | None,
        token: str,
        version: int,
        src: int,
        shm: ShmArena | None,
        stall_s: float,
        peer: str,
    ) -> None:
        self.sock = context().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.SNDTIMEO, int(stall_s * 1000))
        self.sock.setsockopt(zmq.LINGER, int(stall_s * 1000))
        if server_key is not None:
            public, secret = zmq.curve_keypair()
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
            self.sock.curve_serverkey = server_key.encode()
        self.sock.connect(address)
        log.info("weights to %s at %s (version %d)", peer, address, version)
        self.token, self.version, self.src = token, version, src
        self.shm, self.stall_s, self.peer = shm, stall_s, peer
        self.trackers: list[zmq.MessageTracker] = []

    def send(self, index: int, parts: list[torch.Tensor]) -> None:
        """One bucket: its slices (views of the sender's tensors), copied once on the way."""
        try:
            if self.shm is not None:
                desc = self._put(parts)
                self.sock.send(header(self.token, self.version, self.src, index, desc))
                return
            head = header(self.token, self.version, self.src, index, None)
            # a private buffer: a numpy view would pin the parameter's storage (FSDP frees it)
            payload = join(parts, private=True).numpy()
            tracker = self.sock.send_multipart([head, payload], copy=False, track=True)
            self.trackers.append(tracker)
        except zmq.Again:
            raise TransferError(
                f"{self.peer} took no bucket for {self.stall_s:.1f} s (dead or stuck? "
                "weight_sync.stall_s)"
            ) from None

    def _put(self, parts: list[torch.Tensor]) -> dict[str, Any]:
        assert self.shm is not None
        deadline = time.monotonic() + self.stall_s
        while True:
            desc = self.shm.put_parts(parts)
            if desc is not None:
                return desc
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self.peer} released no shared-memory bucket for {self.stall_s:.1f} s "
                    "(dead or stuck? weight_sync.stall_s)"
                )
            time.sleep(0.0005)

    def finish(self) -> None:
        deadline = time.monotonic() + self.stall_s
        for tracker in self.trackers:
            tracker.wait(max(0.0, deadline - time.monotonic()))
            if not tracker.done:
                raise TransferError(f"{self.peer} did not take its last buckets in time")
        self.close()

    def close(self) -> None:
        self.sock.close()


class GroupOutlet:
    """Buckets from this rank to one receiving rank over the stateless gloo group."""

    def __init__(
        self, pg: dist.ProcessGroup, dst: int, version: int, count: int, stall_s: float, peer: str
    ) -> None:
        self.pg, self.dst, self.stall_s, self.peer = pg, dst, stall_s, peer
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()
        self._post(0, torch.tensor([version, count], dtype=torch.int64))

    def _post(self, tag: int, data: torch.Tensor) -> None:
        self.pending.append((self.pg.send([data], self.dst, tag), data))
        while len(self.pending) > 2:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, _ = self.pending.popleft()
        try:
            work.wait(datetime.timedelta(seconds=self.stall_s))
        except RuntimeError as exc:
            raise TransferError(f"sending to {self.peer} failed: {short(exc)}") from exc

    def send(self, index: int, parts: list[torch.Tensor]) -> None:
        self._post(index + 1, join(parts))

    def finish(self) -> None:
        while self.pending:
            self._wait_oldest()

    def close(self) -> None:
        self.pending.clear()


def short(exc: BaseException) -> str:
    """A gloo error without its source path and advice."""
    text = str(exc)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(" This is typically", 1)[0]


def group_store(key: str, host: str) -> str:
    """Host (on the receiving group's rank 0) the TCPStore a stateless group meets at; returns
    ``host:port``. Kept for later transfers between the same pair of groups."""
    from transport.channel import spare_port

    port = spare_port("0.0.0.0" if host != "127.0.0.1" else host)
    timeout = datetime.timedelta(seconds=60)
    _stores[key] = dist.TCPStore(
        host, port, None, is_master=True, timeout=timeout, wait_for_workers=False
    )
    return f"{host}:{port}"


def stateless_group(
    key: str, store: str, rank: int, world: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The gloo group of both role groups' ranks (``rank`` of ``world``), made once per key from
    the TCPStore at ``store`` with explicit ranks: each side's default world stays as it is."""
    found = _groups.get(key)
    if found is not None:
        return found
    host, port = store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    client = dist.TCPStore(host, int(port), None, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"hybridflow/reshard/{key}", client)
    try:
        pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    except RuntimeError as exc:
        raise TransferError(
            f"the weight group {key} did not form within {timeout_s:.1f} s ({short(exc)})"
        ) from exc
    _groups[key] = pg
    return pg


def drop_group(key: str | None) -> None:
    """Forget a group after a failed transfer (both sides then build a fresh one)."""
    if key is not None:
        _groups.pop(key, None)


def drop_store(key: str) -> None:
    """Close a meeting point ``group_store`` opened (after a failed transfer)."""
    _stores.pop(key, None)


_reader: ShmReader | None = None
_ipc_count = 0


def shm_reader() -> ShmReader:
    global _reader
    if _reader is None:
        _reader = ShmReader()
    return _reader


class ZmqInlet:
    """The PULL sockets a receiving rank takes buckets on: ipc for senders on its host, TCP with
    CURVE for the others. Messages whose header does not hold this transfer's token and version
    are dropped (logged); a sender whose connection closes is reported by ``lost``."""

    def __init__(self, ipc_dir: str | None, tcp_host: str | None, token: str, version: int) -> None:
        self.token, self.version = token, version
        self.socks: list[zmq.Socket[Any]] = []
        self.watches: list[PeerWatch] = []
        self.ipc: str | None = None
        self.tcp: str | None = None
        self.key: str | None = None
        if ipc_dir is not None:
            global _ipc_count
            _ipc_count += 1
            self.ipc = f"ipc://{ipc_dir}/hfws-{os.getpid()}-{_ipc_count}"
            self._bind(self.ipc, None)
        if tcp_host is not None:
            public, secret = zmq.curve_keypair()
            self.key = public.decode()
            port = self._bind("tcp://*:0", secret)
            self.tcp = f"tcp://{tcp_host}:{port}"
        self.poller = zmq.Poller()
        for sock in self.socks:
            self.poller.register(sock, zmq.POLLIN)
        log.info("weight inbox %s %s (version %d)", self.ipc, self.tcp, version)

    def _bind(self, address: str, secret: bytes | None) -> int:
        sock = context().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 4)
        if secret is not None:
            sock.curve_server = True
            sock.curve_secretkey = secret
        port = 0
        if address.endswith(":0"):
            port = sock.bind_to_random_port(address[: -len(":0")])
        else:
            sock.bind(address)
        self.socks.append(sock)
        self.watches.append(PeerWatch.on(sock))
        return port

    def poll(self, timeout_ms: int) -> list[tuple[int, int, torch.Tensor]]:
        """(src, index, bytes) of every bucket that arrived within ``timeout_ms``."""
        found = []
        for sock, _ in self.poller.poll(timeout_ms):
            watch = self.watches[self.socks.index(sock)]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                got = self._read(frames, watch)
                if got is not None:
                    found.append(got)
        return found

    def _read(self, frames: list[Any], watch: PeerWatch) -> tuple[int, int, torch.Tensor] | None:
        try:
            token, version, src, index, shm = msgpack.unpackb(frames[0].bytes, raw=False)
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            log.warning("dropped a weight bucket with a malformed header: %s", exc)
            return None
        if not token_ok(self.token, token) or version != self.version:
            log.warning("dropped a weight bucket of another transfer (version %r)", version)
            return None
        if type(src) is not int or type(index) is not int:
            log.warning("dropped a weight bucket with src %r, index %r", src, index)
            return None
        watch.learn(str(src).encode(), frames[0])
        if shm is not None:
            try:
                return src, index, shm_reader().get(shm)
            except ValueError as exc:
                log.warning("dropped a weight bucket from rank %d: %s", src, exc)
                return None
        if len(frames) != 2:
            log.warning("dropped a weight bucket of %d frames from rank %d", len(frames), src)
            return None
        buf = frames[1].buffer
        empty = torch.empty(0, dtype=torch.uint8)
        return src, index, torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else empty

    def lost(self) -> set[int]:
        """Senders whose connection closed since the last call."""
        return {int(ident) for watch in self.watches for ident in watch.lost()}

    def close(self) -> None:
        # the monitor first: a socket whose monitor peer is gone blocks ZeroMQ's I/O thread on
        # its next event (every later socket of this process would then hang)
        for sock, watch in zip(self.socks, self.watches, strict=True):
            sock.disable_monitor()
            watch.close()
            sock.close(linger=0)
        if self.ipc is not None:
            try:
                os.unlink(self.ipc.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
