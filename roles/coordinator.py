"""Rank 0 of a group: serves the controller's calls and fans each out to the group's ranks.

Two threads, as in vLLM v1's engine core: an I/O thread owns every socket — the DEALER to the
controller, the fan-out ROUTER to the other ranks, their monitors — and the main thread only
computes. So a 20-second training step never delays a reply to the controller, a worker's death is
reported while rank 0 is busy, and calls for different colocated roles queue in one order on every
rank (which keeps collectives matched).

Per call the I/O thread runs the endpoint's transfer protocol: ``distribute`` gives each rank its
arguments, ranks that share identical arguments share one encoding (and one shared-memory copy),
rank 0's share goes to the main thread's queue; results are gathered as they arrive, ``collect``
makes the reply. The first error from any rank is replied at once as an ERROR naming the rank.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import zmq

from roles.base import RoleHost
from roles.calls import error_body, run_call
from roles.endpoint import TransferProtocol
from roles.fanout import RpcFanOut, init_rpc
from roles.runtime import GroupEnv
from roles.worker import FANOUT_KEY, hello_body
from transport.channel import PeerWatch, bind_router, connect_dealer, host_id, send_frames
from transport.codec import decode, encode
from transport.errors import RegistrationError
from transport.protocol import Message, MsgType, ProtocolError
from transport.shm import ShmArena, ShmReader

log = logging.getLogger("hybridflow.coordinator")


@dataclass
class PendingCall:
    role: str
    protocol: TransferProtocol
    waiting: set[int]
    results: list[Any]
    release: threading.Event | None = None  # set once rank 0's result is no longer referenced


@dataclass
class _Task:
    call_id: int
    body: dict[str, Any]
    released: threading.Event = field(default_factory=threading.Event)


class Coordinator:
    def __init__(self, env: GroupEnv, host: RoleHost, store: dist.Store) -> None:
        self.env = env
        self.host = host
        self.ctx = zmq.Context()
        self.arena = ShmArena(prefix="hfr")
        self.reader = ShmReader()
        self.tasks: queue.Queue[_Task | None] = queue.Queue()
        self.done: queue.Queue[tuple[int, Message, _Task | None]] = queue.Queue()
        self.wake_r, self.wake_w = os.pipe()
        self.calls: dict[int, PendingCall] = {}
        self.trackers: list[tuple[zmq.MessageTracker, threading.Event]] = []
        self.worker_ids = {r: f"rank{r}".encode() for r in range(1, env.world_size)}
        self.same_host_workers: set[int] = set()
        self.rpc: RpcFanOut | None = None
        self._open_fanout(store)
        self._register()

    # -- set-up ---------------------------------------------------------------------------------
    def _open_fanout(self, store: dist.Store) -> None:
        """Bind the fan-out ROUTER, publish its address through the store, await every rank."""
        local = self.env.master_addr in {"127.0.0.1", "localhost"}
        address = (
            f"ipc://{self.env.socket_dir}/{self.env.group}-{os.getpid()}.fanout"
            if local
            else f"tcp://{self.env.master_addr}:0"
        )
        self.fan, address = bind_router(self.ctx, address, self.env.timeouts)
        self.fan_watch = PeerWatch.on(self.fan)
        store.set(FANOUT_KEY, json.dumps({"address": address, "host": host_id()}))
        deadline = time.monotonic() + self.env.timeouts.group_init_s
        missing = set(self.worker_ids.values())
        while missing:
            left = deadline - time.monotonic()
            if left <= 0 or not self.fan.poll(int(left * 1000)):
                raise RegistrationError(
                    f"ranks {sorted(m.decode() for m in missing)} never reached the coordinator "
                    f"within {self.env.timeouts.group_init_s:.0f} s (raise timeouts.group_init_s)"
                )
            ident, *frames = self.fan.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("rejected a message while gathering ranks: %s", exc)
                continue
            if msg.type == MsgType.HELLO and ident.bytes in missing:
                missing.discard(ident.bytes)
                self.fan_watch.learn(ident.bytes, ident)
                if msg.body["host"] == host_id():
                    self.same_host_workers.add(int(msg.body["rank"]))
        if self.env.fanout == "rpc":
            e = self.env
            init_rpc(0, e.world_size, e.master_addr, store, e.timeouts.call_s)
            self.rpc = RpcFanOut(e.world_size, self._post)

    def _register(self) -> None:
        """Say hello to the controller; wait for WELCOME (or REFUSE with its reason)."""
        self.ctrl = connect_dealer(
            self.ctx,
            self.env.controller,
            f"{self.env.group}:{os.getpid()}".encode(),
            self.env.timeouts,
            self.env.curve,
        )
        self.ctrl_monitor = self.ctrl.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        send_frames(self.ctrl, encode(Message(MsgType.HELLO, 0, hello_body(self.env))))
        if not self.ctrl.poll(int(self.env.timeouts.connect_s * 1000)):
            raise RegistrationError(
                f"no answer from the controller at {self.env.controller} within "
                f"{self.env.timeouts.connect_s:.0f} s (is it running? raise timeouts.connect_s)"
            )
        reply = decode(self.ctrl.recv_multipart(copy=False))
        if reply.type == MsgType.REFUSE:
            raise RegistrationError(
                f"the controller refused group {self.env.group!r}: {reply.body['reason']}"
            )
        if reply.type != MsgType.WELCOME:
            raise RegistrationError(f"expected WELCOME from the controller, got {reply.type.name}")
        self.ctrl_same_host = bool(reply.body.get("host") == host_id())

    # -- main thread ----------------------------------------------------------------------------
    def serve(self) -> None:
        threading.Thread(target=self._io_loop, name="coordinator-io", daemon=True).start()
        while (task := self.tasks.get()) is not None:
            reply = run_call(self.host, task.call_id, task.body)
            self._post(0, reply, task)
            task.released.wait()  # the reply may alias role state; wait until it has left

    def _post(self, rank: int, reply: Message, task: _Task | None = None) -> None:
        """Hand a rank's result to the I/O thread (any thread may call this)."""
        self.done.put((rank, reply, task))
        os.write(self.wake_w, b"\0")

    # -- I/O thread -----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.ctrl, self.ctrl_monitor, self.fan, self.fan_watch.monitor):
            poller.register(sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1 if self.trackers else None))
                for ident in self.fan_watch.lost():  # cheap; also catches losses seen in learn()
                    self._rank_lost(int(ident.decode().removeprefix("rank")))
                if self.wake_r in ready:
                    os.read(self.wake_r, 4096)
                    while not self.done.empty():
                        rank, reply, task = self.done.get()
                        self._collect(rank, reply, task)
                if self.fan in ready:
                    self._drain_fanout()
                if self.ctrl in ready or self.ctrl_monitor in ready:
                    self._drain_controller()  # a SHUTDOWN arrives before the disconnect
                if self.ctrl_monitor in ready:
                    log.warning("lost the controller; shutting the group down")
                    self._shutdown(1)
                self._release_sent()
        except Exception:
            log.exception("coordinator I/O thread failed")
            self._shutdown(2)

    def _release_sent(self) -> None:
        """Let rank 0 go on once ZeroMQ no longer holds the tensors of its last reply."""
        still = []
        for tracker, released in self.trackers:
            if tracker.done:
                released.set()
            else:
                still.append((tracker, released))
        self.trackers = still

    def _drain_controller(self) -> None:
        while self.ctrl.poll(0):
            frames = self.ctrl.recv_multipart(copy=False)
            try:
                msg = decode(frames, self.reader, 0, self.env.timeouts.max_frame_bytes)
            except ProtocolError as exc:
                log.warning("rejected a message from the controller: %s", exc)
                continue
            if msg.type == MsgType.CALL:
                self._start_call(msg.call_id, msg.body)
            elif msg.type == MsgType.SHUTDOWN:
                self._shutdown(0)
            else:
                log.warning("unexpected %s from the controller; ignored", msg.type.name)

    def _drain_fanout(self) -> None:
        while self.fan.poll(0):
            ident, *frames = self.fan.recv_multipart(copy=False)
            rank = int(ident.bytes.decode().removeprefix("rank"))
            try:
                msg = decode(frames, self.reader, 0, self.env.timeouts.max_frame_bytes)
            except ProtocolError as exc:
                log.warning("rejected a message from rank %d: %s", rank, exc)
                continue
            if msg.type in (MsgType.REPLY, MsgType.ERROR):
                self._collect(rank, msg, None)

    def _start_call(self, call_id: int, body: dict[str, Any]) -> None:
        role = str(body["role"])
        try:
            protocol = self.host.spec(role, str(body["method"])).protocol
            per_rank = protocol.distribute(
                tuple(body["args"]), dict(body["kwargs"]), self.env.layout
            )
            if len(per_rank) != self.env.world_size:
                raise ValueError(
                    f"{protocol.name} gave {len(per_rank)} shares for {self.env.world_size} ranks"
                )
        except Exception as exc:
            self._send_ctrl(Message(MsgType.ERROR, call_id, error_body(role, 0, exc)))
            return
        waiting = {r for r, share in enumerate(per_rank) if share is not None}
        self.calls[call_id] = PendingCall(role, protocol, waiting, [None] * self.env.world_size)
        shared: dict[int, list[int]] = {}  # ranks given the very same arguments share an encoding
        for rank in sorted(waiting - {0}):
            shared.setdefault(id(per_rank[rank]), []).append(rank)
        for ranks in shared.values():
            share = per_rank[ranks[0]]
            assert share is not None
            args, kwargs = share
            sub = {"role": role, "method": body["method"], "args": list(args), "kwargs": kwargs}
            self._send_workers(call_id, sub, ranks)
        if 0 in waiting:
            args, kwargs = per_rank[0]  # type: ignore[misc]
            self.tasks.put(_Task(call_id, {**body, "args": list(args), "kwargs": kwargs}))
        if not waiting:
            self._finish(call_id)

    def _send_workers(self, call_id: int, body: dict[str, Any], ranks: list[int]) -> None:
        if self.rpc is not None:
            self.rpc.submit(call_id, body, ranks)
            return
        use_shm = all(r in self.same_host_workers for r in ranks)
        encoded = encode(
            Message(MsgType.CALL, call_id, body), self.arena if use_shm else None, len(ranks)
        )
        for index, rank in enumerate(ranks):
            frames = [self.worker_ids[rank], bytes([index]), *encoded.frames]
            self.fan.send_multipart(frames, copy=not encoded.big)

    def _collect(self, rank: int, msg: Message, task: _Task | None) -> None:
        pending = self.calls.get(msg.call_id)
        if pending is None:  # the call already failed on another rank
            if task is not None:
                task.released.set()
            return
        if task is not None:
            pending.release = task.released
        if msg.type == MsgType.ERROR:
            del self.calls[msg.call_id]
            self._send_ctrl(msg, pending.release)
            return
        pending.results[rank] = msg.body["result"]
        pending.waiting.discard(rank)
        if not pending.waiting:
            self._finish(msg.call_id)

    def _finish(self, call_id: int) -> None:
        pending = self.calls.pop(call_id)
        try:
            result = pending.protocol.collect(pending.results, self.env.layout)
        except Exception as exc:
            reply = Message(MsgType.ERROR, call_id, error_body(pending.role, 0, exc))
        else:
            reply = Message(MsgType.REPLY, call_id, {"result": result})
        self._send_ctrl(reply, pending.release)

    def _send_ctrl(self, msg: Message, release: threading.Event | None = None) -> None:
        arena = self.arena if self.ctrl_same_host else None
        try:
            encoded = encode(msg, arena)
        except (TypeError, ValueError) as exc:
            role = str(msg.body.get("role", "?"))
            encoded = encode(Message(MsgType.ERROR, msg.call_id, error_body(role, 0, exc)))
        tracker = send_frames(self.ctrl, encoded)
        if release is not None:
            if tracker is None:
                release.set()
            else:
                self.trackers.append((tracker, release))

    def _rank_lost(self, rank: int) -> None:
        cause = "exited: its connection to the coordinator closed"
        log.error("rank %d %s", rank, cause)
        self._send_ctrl(
            Message(MsgType.DEAD, 0, {"roles": self.env.roles, "rank": rank, "cause": cause})
        )
        self._shutdown(3)

    def _shutdown(self, code: int) -> None:
        encoded = encode(Message(MsgType.SHUTDOWN, 0, {"reason": "coordinator exiting"}))
        for ident in self.worker_ids.values():
            try:
                self.fan.send_multipart([ident, b"\0", *encoded.frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank is gone already
        self.arena.close()
        self.ctx.destroy(linger=500)  # flush the SHUTDOWNs before the process goes
        os._exit(code)
