"""Ranks 1..N-1 of a group: receive calls from the coordinator, run them, send results back.

A worker is single-threaded on purpose: ZeroMQ's own I/O thread keeps the link alive (and the
kernel closes it if the process dies), so a long computation needs no Python heartbeat. The worker
exits when the coordinator says SHUTDOWN or its link drops.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch.distributed as dist
import zmq

from roles.runtime.calls import error_body, run_call
from roles.runtime.env import FANOUT_KEY, GroupEnv, hello_body
from roles.runtime.fanout import init_rpc, serve_rpc_worker
from roles.runtime.host import RoleHost
from roles.runtime.links import worker_link
from transport.channel import host_id
from transport.codec import Encoded, decode, encode, frame_buffer
from transport.protocol import Message, MsgType, ProtocolError
from transport.shm import ShmArena, ShmReader

log = logging.getLogger("hybridflow.worker")


class Worker:
    def __init__(self, env: GroupEnv, host: RoleHost, store: dist.Store) -> None:
        self.env = env
        self.host = host
        self.store = store
        info = json.loads(store.get(FANOUT_KEY))
        same_host = info["host"] == host_id()
        self.reader = ShmReader() if same_host else None
        self.arena = ShmArena(prefix="hfw") if same_host else None
        self.ctx = zmq.Context()
        curve = env.link_curve(False)
        self.link = worker_link(
            env.link_kind, self.ctx, info["address"], env.rank, env.timeouts, curve
        )

    def serve(self) -> None:
        self.link.send(encode(Message(MsgType.HELLO, 0, hello_body(self.env))))
        if self.env.fanout == "rpc":
            serve_rpc_worker(self.host)
            e = self.env
            init_rpc(e.rank, e.world_size, e.master_addr, self.store, e.timeouts.call_s)
        while True:
            frames = self.link.recv()
            if frames is None:
                log.warning("lost the coordinator; exiting")
                self._exit(1)
            elif not self._handle(frames):
                self._exit(0)

    def _handle(self, frames: list[Any]) -> bool:
        """Handle one message; False when the worker should stop. Frame 0 is this worker's
        index among the message's receivers (shared-memory release flags are per receiver)."""
        try:
            first = bytes(frame_buffer(frames[0])) if frames else b""
            index = first[0] if len(first) == 1 else 0
            msg = decode(frames[1:], self.reader, index, self.env.timeouts.max_frame_bytes)
        except ProtocolError as exc:
            log.warning("rejected a message from the coordinator: %s", exc)
            return True
        if msg.type == MsgType.SHUTDOWN:
            return False
        if msg.type != MsgType.CALL:
            log.warning("unexpected %s from the coordinator; ignored", msg.type.name)
            return True
        role = str(msg.body["role"])
        self.link.send(self._encode(run_call(self.host, msg.call_id, msg.body), role))
        return True

    def _encode(self, reply: Message, role: str) -> Encoded:
        try:
            return encode(reply, self.arena)
        except (TypeError, ValueError) as exc:
            body = error_body(role, self.env.rank, exc)
            return encode(Message(MsgType.ERROR, reply.call_id, body))

    def _exit(self, code: int) -> None:
        if self.arena is not None:
            self.arena.close()
        self.ctx.destroy(linger=0)
        os._exit(code)
