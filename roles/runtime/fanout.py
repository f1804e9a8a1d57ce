"""The torch.distributed.rpc fan-out backend (select with ``HYBRIDFLOW_FANOUT=rpc``).

The default backend is ZeroMQ (``roles.runtime.coordinator`` sends each rank its share over the fan-out
ROUTER; big tensors ride in shared memory). This one sends shares with ``rpc_async`` instead:
pickle is acceptable here because it never leaves the group's own trusted process group. Workers
still keep their ZeroMQ link for the hello, liveness and shutdown. RPC runs requests on a thread
pool, so each worker executes tasks strictly in the order the coordinator numbered them —
otherwise two calls with collectives could interleave differently on different ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from roles.runtime.calls import run_call
from roles.runtime.host import RoleHost
from transport.channel import spare_port
from transport.protocol import Message, MsgType

RPC_PORT_KEY = "hybridflow/rpc_port"


def init_rpc(
    rank: int, world_size: int, master_addr: str, store: dist.Store, timeout_s: float
) -> None:
    if rank == 0:
        store.set(RPC_PORT_KEY, str(spare_port(master_addr)))
    port = int(store.get(RPC_PORT_KEY))
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{master_addr}:{port}", rpc_timeout=timeout_s
    )
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)


class _Sequencer:
    """Runs numbered tasks in number order, whatever thread they arrive on."""

    def __init__(self) -> None:
        self.next = 0
        self.cond = threading.Condition()

    def run(self, seq: int, fn: Callable[[], Any]) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.next == seq)
            try:
                return fn()
            finally:
                self.next += 1
                self.cond.notify_all()


_worker_host: RoleHost | None = None
_sequencer = _Sequencer()


def serve_rpc_worker(host: RoleHost) -> None:
    """Make this worker process the target of the coordinator's ``rpc_async`` calls."""
    global _worker_host
    _worker_host = host


def _run_task(seq: int, call_id: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    host = _worker_host
    if host is None:
        raise RuntimeError("an rpc task reached a process that is not a worker (no role host)")
    reply = _sequencer.run(seq, lambda: run_call(host, call_id, body))
    return int(reply.type), reply.body


class RpcFanOut:
    """Coordinator side: ``submit`` sends shares; results come back through ``post``."""

    def __init__(self, rank_count: int, post: Callable[[int, Message], None]) -> None:
        self.post = post
        self.seq = [0] * rank_count

    def submit(self, call_id: int, body: dict[str, Any], ranks: list[int]) -> None:
        for rank in ranks:
            seq = self.seq[rank]
            self.seq[rank] += 1
            fut = rpc.rpc_async(f"rank{rank}", _run_task, args=(seq, call_id, body))
            fut.add_done_callback(lambda f, r=rank: self._done(r, call_id, f))

    def _done(self, rank: int, call_id: int, fut: Any) -> None:
        try:
            type_code, body = fut.value()
            msg = Message(MsgType(type_code), call_id, body)
        except Exception as exc:  # the RPC itself failed (peer gone, timeout)
            msg = Message(
                MsgType.ERROR,
                call_id,
                {
                    "role": "?",
                    "rank": rank,
                    "exc_type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": "",
                },
            )
        self.post(rank, msg)
