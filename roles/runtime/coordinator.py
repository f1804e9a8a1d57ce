"""Rank 0 of a group: serves the controller's calls and fans each out to the group's ranks.

Socket I/O must never wait behind a long computation (a worker's death is reported while rank 0
trains; new calls are queued), yet on a small machine every thread hand-off on the path of a call
costs a wake-up (tens of microseconds on a VM). So the sockets are owned by whoever holds
``self.io``: the main thread holds it while idle and serves the sockets itself — a short call
costs no hand-off at all — and releases it while computing. A watchdog thread looks every
``HANDOVER_S``; if the main thread has been computing, it takes the sockets over until the main
thread signals (a pipe) that it is done. ZeroMQ's heartbeats run in its own C++ thread, so
liveness never depends on either Python thread.

Per call, ``distribute`` gives each rank its arguments; ranks that share identical arguments
share one encoding (and one shared-memory copy); rank 0's share is queued for the main thread.
Results are gathered as they arrive, ``collect`` makes the reply, and the first error from any
rank is replied at once as an ERROR naming that rank. Rank 0 starts its next call only after its
last result has left (results may alias role state the next call mutates).

Threads and what each may touch:

- **the ``io`` holder** — the main thread while idle, the watchdog while the main thread computes
  (never both: ``io`` is a lock). Only the holder touches the controller socket and its monitor,
  the fan-out links, the poller, the outgoing shared-memory arena and the call book-keeping
  (``calls``, ``held``, ``tasks``, ``trackers``).
- **the main thread** runs rank 0's share of each call with ``io`` released and touches no socket
  meanwhile; to get the sockets back it writes the wake pipe.
- **the watchdog** reads the wake pipe (through the poller) while it holds ``io``.
- **rpc threads** (rpc fan-out only) put results on ``rpc_done`` and write the rpc pipe; nothing
  else.

The process ends in one place, ``_end``: whoever decides the group is over (SHUTDOWN from the
controller, the controller gone, a rank lost, an unexpected error) calls it while holding ``io``,
with the reason; it reports how the group ended to whoever started it (``status.py``), tells the
other ranks, flushes the sockets and ``os._exit``s. A second caller (the other thread failing at
the same moment) waits for the first to finish the job. Having joined, rank 0 reports that too.

On one host the ranks reach rank 0 through a Unix socket file, ``{socket_dir}/{group}-{pid}.fan``
(``fanout_path``). It is needed only until every rank has connected: it is removed then, or when
the group never came together, so no exit (a clean one, a refusal, the controller killed) leaves
it behind; only a ``kill -9`` of rank 0 while its ranks connect can, and ``hybridflow role``
removes it after its ranks are gone.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import zmq

from roles.runtime.calls import error_body, run_call
from roles.runtime.endpoint import TransferProtocol
from roles.runtime.env import FANOUT_KEY, GroupEnv, hello_body
from roles.runtime.fanout import RpcFanOut, init_rpc
from roles.runtime.host import RoleHost
from roles.runtime.links import fanout_links
from roles.runtime.status import ENDED, JOINED, report
from transport.channel import connect_dealer, host_id, readable, send_frames, send_within
from transport.codec import decode, encode
from transport.errors import RegistrationError
from transport.protocol import Message, MsgType, ProtocolError
from transport.shm import ShmArena, ShmReader

log = logging.getLogger("hybridflow.coordinator")

HANDOVER_S = 0.05  # a computation longer than this hands the sockets to the watchdog
#: rank 0's share of a call failed while other ranks' are out: how long to look for one of them
#: exiting first. A rank that died mid-collective makes rank 0's collective fail ("connection
#: closed by peer") at about the time its link closes; the death is the cause to report.
LOST_RANK_GRACE_S = 1.0


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def fanout_path(socket_dir: Path | str, group: str, pid: int) -> Path:
    """The Unix socket rank 0 (process ``pid``) of ``group`` listens on for its ranks (one host)."""
    return Path(socket_dir) / f"{group}-{pid}.fan"


@dataclass
class PendingCall:
    role: str
    protocol: TransferProtocol
    waiting: set[int]
    results: list[Any]


@dataclass
class _Task:
    call_id: int
    body: dict[str, Any]


class Coordinator:
    def __init__(self, env: GroupEnv, host: RoleHost, store: dist.Store) -> None:
        self.env = env
        self.host = host
        self.ctx = zmq.Context()
        self.arena = ShmArena(prefix="hfr")
        self.reader = ShmReader()
        self.io = threading.Lock()  # whoever holds it owns the sockets
        self.ending = threading.Lock()  # taken once, by the thread that ends the process
        self.tasks: deque[_Task] = deque()  # rank 0's shares, in arrival order
        self.rpc_done: queue.SimpleQueue[tuple[int, Message]] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK)  # "compute finished"
        self.rpc_r, self.rpc_w = os.pipe2(os.O_NONBLOCK)  # "an rpc result is queued"
        self.calls: dict[int, PendingCall] = {}
        self.held: set[int] = set()  # calls holding rank 0's unsent result
        self.failing: set[int] = set()  # calls whose reply is rank 0's error, once ranks are seen
        self.trackers: list[zmq.MessageTracker] = []
        self.computing_since: float | None = None  # set while rank 0 computes
        self.same_host_workers: set[int] = set()
        self.rpc: RpcFanOut | None = None
        self._open_fanout(store)
        self._register()
        self._report_joined()

    # -- set-up ---------------------------------------------------------------------------------
    def _open_fanout(self, store: dist.Store) -> None:
        """Open the links to the other ranks, publish their address, await every rank."""
        e = self.env
        local = e.master_addr in {"127.0.0.1", "localhost"}
        path = fanout_path(e.socket_dir, e.group, os.getpid()) if local else None
        base = f"unix:{path}" if path is not None else f"tcp:{e.master_addr}"
        self.links = fanout_links(e.link_kind, self.ctx, base, e.timeouts, e.link_curve(True))
        try:
            store.set(FANOUT_KEY, json.dumps({"address": self.links.address, "host": host_id()}))
            hellos = self.links.wait_hellos(set(range(1, e.world_size)), e.timeouts, e.token)
        finally:  # every rank connected, or none will: nobody needs the socket file any more
            if path is not None:
                path.unlink(missing_ok=True)
        self.same_host_workers = {r for r, h in hellos.items() if h["host"] == host_id()}
        if e.fanout == "rpc":
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
        deadline = time.monotonic() + self.env.timeouts.connect_s
        hello = encode(Message(MsgType.HELLO, 0, hello_body(self.env)))
        if not send_within(self.ctrl, hello, self.env.timeouts.connect_s):  # never blocks
            raise RegistrationError(self._no_answer())
        if not self.ctrl.poll(_ms_left(deadline)):
            raise RegistrationError(self._no_answer())
        reply = decode(self.ctrl.recv_multipart(copy=False))
        if reply.type == MsgType.REFUSE:
            raise RegistrationError(
                f"the controller refused group {self.env.group!r}: {reply.body['reason']}"
            )
        if reply.type != MsgType.WELCOME:
            raise RegistrationError(f"expected WELCOME from the controller, got {reply.type.name}")
        self.ctrl_same_host = bool(reply.body.get("host") == host_id())

    def _report_joined(self) -> None:
        e = self.env
        report(
            JOINED,
            group=e.group,
            roles=list(e.roles),
            controller=e.controller,
            world_size=e.world_size,
            layout=vars(e.layout),
            device=str(e.device),
            fanout=e.fanout,
        )

    def _no_answer(self) -> str:
        """Why no WELCOME or REFUSE came. A CURVE controller answers nothing to a group without
        keys (ZeroMQ refuses the handshake before any message): say so, it looks the same."""
        text = (
            f"no answer from the controller at {self.env.controller} within "
            f"{self.env.timeouts.connect_s:.0f} s (is it running there and reachable? wait "
            "longer with hybridflow role --wait SECONDS, i.e. timeouts.connect_s)"
        )
        if not self.env.controller.startswith("tcp://"):
            return text
        if self.env.curve is None:
            return text + (
                "; the controller may require CURVE keys, and this group has none: start it "
                "with hybridflow role ... --keys DIR --client NAME (keys from hybridflow keys)"
            )
        return text + (
            "; or the controller refused this group's CURVE key (is its public key in the "
            "controller's allowed keys?), or it is not the controller whose key the group pins"
        )

    # -- threads --------------------------------------------------------------------------------
    def serve(self) -> None:
        self.poller = zmq.Poller()
        for sock in (self.ctrl, self.ctrl_monitor, *self.links.pollables()):
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.rpc_r, zmq.POLLIN)
        threading.Thread(target=self._watchdog, name="coordinator-watchdog", daemon=True).start()
        self.io.acquire()
        try:
            while True:
                if self.tasks and not self.held:
                    for tracker in self.trackers:  # ZeroMQ may still be reading a result
                        tracker.wait()
                    self.trackers.clear()
                    self._compute(self.tasks.popleft())
                else:
                    self._service(None)
        except Exception as exc:
            log.exception("coordinator failed")
            self._end(2, f"rank 0 failed: {type(exc).__name__}: {exc}")

    def _compute(self, task: _Task) -> None:
        """Run rank 0's share with the sockets handed to the watchdog meanwhile."""
        self.computing_since = time.monotonic()
        self.io.release()
        try:
            reply = run_call(self.host, task.call_id, task.body)
            task.body = {}  # free the arguments now: their shared memory goes back before we reply
        finally:
            if not self.io.acquire(blocking=False):  # the watchdog has the sockets: call it off
                os.write(self.wake_w, b"\0")
                self.io.acquire()
                _drain_pipe(self.wake_r)
            self.computing_since = None
        self._collect(0, reply)

    def _watchdog(self) -> None:
        """Serve the sockets whenever the main thread has been computing for a while."""
        while True:
            time.sleep(HANDOVER_S)
            since = self.computing_since
            if since is None or time.monotonic() - since < HANDOVER_S:
                continue  # idle (serving the sockets itself) or a short computation
            if not self.io.acquire(blocking=False):
                continue
            try:
                while not self._service(self.wake_r):
                    pass
            except Exception as exc:
                log.exception("coordinator watchdog failed")
                self._end(2, f"rank 0 failed: {type(exc).__name__}: {exc}")
            finally:
                self.io.release()

    def _post(self, rank: int, reply: Message) -> None:
        """An rpc fan-out result (called on an rpc thread)."""
        self.rpc_done.put((rank, reply))
        os.write(self.rpc_w, b"\0")

    def _service(self, stop_fd: int | None) -> bool:
        """Wait for socket events and handle them; True once ``stop_fd`` became readable."""
        if stop_fd is not None:
            self.poller.register(stop_fd, zmq.POLLIN)
        try:
            ready: dict[Any, int] = {}
            if stop_fd is None and self.calls:  # a rank's answer is due: look before sleeping
                deadline = time.perf_counter() + self.env.timeouts.spin_us / 1e6
                while not ready and time.perf_counter() < deadline:
                    ready = dict(self.poller.poll(0))
            if not ready:
                ready = dict(self.poller.poll())
        finally:
            if stop_fd is not None:
                self.poller.unregister(stop_fd)
        for rank, frames in self.links.receive(ready):
            self._from_rank(rank, frames)
        for rank in self.links.lost():
            self._rank_lost(rank)
        if self.rpc_r in ready:
            _drain_pipe(self.rpc_r)
            while not self.rpc_done.empty():
                self._collect(*self.rpc_done.get())
        if self.ctrl in ready or self.ctrl_monitor in ready:
            # a SHUTDOWN arrives before the disconnect: read everything once the controller left
            self._drain_controller(defer=self.ctrl_monitor not in ready)
        if self.ctrl_monitor in ready:
            log.warning("lost the controller; shutting the group down")
            self._end(1, f"lost the controller at {self.env.controller} (it exited or was killed)")
        return stop_fd is not None and stop_fd in ready

    def _drain_controller(self, defer: bool = True) -> None:
        main = threading.current_thread() is threading.main_thread()
        while readable(self.ctrl):
            if defer and main and self.tasks and not self.held:
                # rank 0's share of a started call comes first: the workers may be waiting for
                # it in a collective, and handing them the next call (a blocking send) would
                # wait for them — the watchdog takes the next call while the main thread computes
                return
            frames = self.ctrl.recv_multipart(copy=False)
            try:
                msg = decode(frames, self.reader, 0, self.env.timeouts.max_frame_bytes)
            except ProtocolError as exc:
                log.warning("rejected a message from the controller: %s", exc)
                continue
            if msg.type == MsgType.CALL:
                self._start_call(msg.call_id, msg.body)
            elif msg.type == MsgType.SHUTDOWN:
                why = msg.body.get("reason") if isinstance(msg.body, dict) else None
                self._end(0, "the controller shut the group down" + (f" ({why})" if why else ""))
            else:
                log.warning("unexpected %s from the controller; ignored", msg.type.name)

    def _from_rank(self, rank: int, frames: list[Any]) -> None:
        try:
            msg = decode(frames, self.reader, 0, self.env.timeouts.max_frame_bytes)
        except ProtocolError as exc:
            log.warning("rejected a message from rank %d: %s", rank, exc)
            return
        if msg.type in (MsgType.REPLY, MsgType.ERROR):
            self._collect(rank, msg)

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
        shares = {r: share for r, share in enumerate(per_rank) if share is not None}
        waiting = set(shares)
        self.calls[call_id] = PendingCall(role, protocol, waiting, [None] * self.env.world_size)
        shared: dict[int, list[int]] = {}  # ranks given the very same arguments share an encoding
        for rank in sorted(waiting - {0}):
            shared.setdefault(id(shares[rank]), []).append(rank)
        for ranks in shared.values():
            args, kwargs = shares[ranks[0]]
            sub = {"role": role, "method": body["method"], "args": list(args), "kwargs": kwargs}
            self._send_workers(call_id, sub, ranks)
        if 0 in shares:
            args, kwargs = shares[0]
            self.tasks.append(_Task(call_id, {**body, "args": list(args), "kwargs": kwargs}))
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
            self.links.send(rank, [bytes([index]), *encoded.frames])

    def _collect(self, rank: int, msg: Message) -> None:
        pending = self.calls.get(msg.call_id)
        if pending is None:
            return  # the call already failed on another rank
        if msg.call_id in self.failing:  # rank 0's error will answer: others only end their wait
            pending.waiting.discard(rank)
            return
        if msg.type == MsgType.ERROR:
            if rank == 0 and pending.waiting - {0}:
                self.failing.add(msg.call_id)
                try:
                    self._look_for_lost_rank(msg.call_id)  # ends the process when one is lost
                finally:
                    self.failing.discard(msg.call_id)
            self._done(msg.call_id)
            self._send_ctrl(msg)
            return
        pending.results[rank] = msg.body["result"]
        pending.waiting.discard(rank)
        if rank == 0 and pending.waiting:
            self.held.add(msg.call_id)
        if not pending.waiting:
            self._finish(msg.call_id)

    def _look_for_lost_rank(self, call_id: int) -> None:
        """Read the ranks' links for up to ``LOST_RANK_GRACE_S`` while call ``call_id`` still
        waits on them; a lost rank is reported as dead (``_rank_lost``) instead of rank 0's
        error, which is then only its consequence."""
        poller = zmq.Poller()
        for sock in self.links.pollables():
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while self.calls[call_id].waiting - {0}:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready = dict(poller.poll(max(1, int(left * 1000))))
            for rank, frames in self.links.receive(ready):
                self._from_rank(rank, frames)
            for rank in self.links.lost():
                self._rank_lost(rank)

    def _done(self, call_id: int) -> PendingCall:
        self.held.discard(call_id)
        return self.calls.pop(call_id)

    def _finish(self, call_id: int) -> None:
        pending = self._done(call_id)
        try:
            result = pending.protocol.collect(pending.results, self.env.layout)
        except Exception as exc:
            reply = Message(MsgType.ERROR, call_id, error_body(pending.role, 0, exc))
        else:
            reply = Message(MsgType.REPLY, call_id, {"result": result})
        self._send_ctrl(reply)

    def _send_ctrl(self, msg: Message) -> None:
        arena = self.arena if self.ctrl_same_host else None
        try:
            encoded = encode(msg, arena)
        except (TypeError, ValueError) as exc:
            role = str(msg.body.get("role", "?"))
            encoded = encode(Message(MsgType.ERROR, msg.call_id, error_body(role, 0, exc)))
        tracker = send_frames(self.ctrl, encoded)
        if tracker is not None:
            self.trackers.append(tracker)

    def _rank_lost(self, rank: int) -> None:
        cause = "exited: its connection to the coordinator closed"
        log.error("rank %d %s", rank, cause)
        self._send_ctrl(
            Message(MsgType.DEAD, 0, {"roles": self.env.roles, "rank": rank, "cause": cause})
        )
        self._end(3, f"rank {rank} {cause}")

    def _end(self, code: int, reason: str) -> None:
        """End the process (the only exit of a coordinator; see the module docstring)."""
        if not self.ending.acquire(blocking=False):
            threading.Event().wait()  # the other thread is ending the process already
        report(ENDED, group=self.env.group, code=code, reason=reason)
        encoded = encode(Message(MsgType.SHUTDOWN, 0, {"reason": "coordinator exiting"}))
        self.links.shutdown(encoded.frames)
        self.arena.close()
        self.ctx.destroy(linger=500)  # flush the SHUTDOWNs before the process goes
        os._exit(code)


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
