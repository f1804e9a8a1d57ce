"""The controller's side of the mesh: ROUTER sockets, group registry, calls in flight, deaths.

Runs inside the controller's asyncio loop (uvloop when installed). Each ROUTER is read by one
``loop.add_reader`` callback that drains the socket without blocking (ZeroMQ's FD is
edge-triggered, so every drain loops until ``EVENTS`` has no POLLIN and re-arms after sends). A
call is a future in its group's table, keyed by call id; replies resolve it, errors fail it with
``RemoteError``, and a group's death fails every pending and later call with ``RoleDeadError``.
Deaths are learnt three ways — the ROUTER monitor (connection closed, or ZeroMQ heartbeats timed
out), a coordinator's DEAD notice about one of its ranks, and the local launcher's process
sentinels — and the most precise cause wins.

Anyone who reaches a socket can send anything, so one message can never break the loop: a
message from a peer that has not registered is checked by size before it is decoded (it may
hold ``UNREGISTERED_MAX_BYTES`` in all, under small ``HeaderLimits`` and no tensors), a hello is
read field by field (``controller.hello``), a refusal to a peer that already left is dropped, and
whatever still goes wrong in handling one message is recorded as a rejection (bounded and
rate-limited, ``controller.rejections``) while the drain goes on to the next.

Nor can anyone make it hoard: the ROUTER's queues are bounded per peer and its frames capped
(``transport.channel``, ``timeouts.controller_*``); a peer that has not registered may send
``timeouts.stranger_messages`` messages, then its connection is cut and the rest it had queued is
dropped unread (``controller.hello.Strangers``); a reply to a peer that does not read is dropped
when its queue is full; a call to a group whose queue is full waits in the group's backlog, in
order, and never blocks the loop. The summary of rate-limited refusals is logged on a timer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator

from controller.hello import Hello, Strangers, Verdict, read_hello
from controller.placement import GroupSpec, check_placement
from controller.rejections import Rejections, short
from transport.channel import PeerWatch, bind_router, host_id, readable, send_frames
from transport.codec import Encoded, HeaderLimits, decode, encode, frame_buffer
from transport.errors import (
    CallTimeoutError,
    RegistrationError,
    RemoteError,
    RoleDeadError,
    remote_error,
)
from transport.protocol import Layout, Message, MsgType, ProtocolError
from transport.security import CurveServer, HandshakeLog, HandshakeWatch, new_token, token_ok
from transport.settings import Timeouts
from transport.shm import ShmArena, ShmReader

log = logging.getLogger("hybridflow.controller")

GROUP_ROLE = "_group"
LOCAL_DEATH_GRACE_S = 0.5  # wait this long for a launcher's exit status before blaming a socket
_instances = itertools.count()

# A peer that has not registered may send only a hello: a few hundred bytes of names and
# numbers. Anything bigger from it is dropped undecoded, and its header may not build more than
# a few thousand small objects (a 32 MB header of empty maps once decoded to 2.3 GB).
UNREGISTERED_MAX_BYTES = 64 << 10
UNREGISTERED_LIMITS = HeaderLimits(
    header_bytes=UNREGISTERED_MAX_BYTES, entries=256, str_bytes=4096, ext_bytes=0
)
DRAIN_BUDGET = 256  # messages per reader callback: a flood must not starve timers and calls
BACKLOG_RETRY_S = 0.002  # how soon a group's backlog is offered to ZeroMQ again


class Supervision(Protocol):
    """What the controller asks of its supervisor (``controller/supervisor.py``): to hear of
    each death (returning words to add to its cause when the group will not be restarted), to
    hold calls while a group restarts, and whether a failed call may be sent again."""

    armed: bool
    restore: dict[str, Callable[[], Awaitable[None]]]  # per group: bring its state back

    def died(self, name: str, rank: int | None, cause: str) -> str | None: ...

    async def serving(self, name: str) -> None: ...

    async def recovered(self, name: str) -> bool: ...

    def close(self) -> None: ...


@dataclass
class Traffic:
    """Bytes through the controller's sockets, shared-memory payloads included: a test proves
    with it that weights never pass through the controller."""

    sent: int = 0
    received: int = 0
    #: of those, tensor payloads: frames after a message's header, and shared-memory segments
    #: (tensors under the codec's inline size travel inside the header and are not counted)
    tensors: int = 0


class _CountingArena(ShmArena):
    def __init__(self, traffic: Traffic, prefix: str) -> None:
        super().__init__(prefix=prefix)
        self.traffic = traffic

    def put(self, data: Any, readers: int = 1) -> dict[str, Any] | None:
        desc = super().put(data, readers)
        if desc is not None:
            self.traffic.sent += int(desc["nbytes"])
            self.traffic.tensors += int(desc["nbytes"])
        return desc


class _CountingReader(ShmReader):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def get(self, desc: dict[str, Any], reader_index: int = 0) -> Any:
        data = super().get(desc, reader_index)
        self.traffic.received += int(data.numel())
        self.traffic.tensors += int(data.numel())
        return data


@dataclass
class Group:
    spec: GroupSpec
    identity: bytes = b""
    sock: zmq.Socket[Any] | None = None
    same_host: bool = False
    endpoints: dict[str, dict[str, str]] = field(default_factory=dict)
    pending: dict[int, tuple[asyncio.Future[Any], str, str]] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dead: tuple[int | None, str] | None = None  # (rank, cause)
    dead_precise: bool = False
    backlog: deque[Encoded] = field(default_factory=deque)  # no room in ZeroMQ's queue yet
    incarnation: int = 0  # restarts so far (``Controller.reset``)
    #: why the group's first hello was refused (its roles, size or layout are not the
    #: placement's): the wait for the groups ends at once with it (``wait_ready``)
    refused: str | None = None

    def error(self, role: str) -> RoleDeadError:
        assert self.dead is not None
        return RoleDeadError(role, self.dead[0], self.dead[1])


def _fd(sock: zmq.Socket[Any]) -> int:
    return int(sock.getsockopt(zmq.FD))


def exit_cause(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class Controller:
    """Accepts groups, builds their roles, and carries calls to them."""

    def __init__(
        self, groups: list[GroupSpec], timeouts: Timeouts | None = None, token: str | None = None
    ) -> None:
        check_placement(groups)
        self.timeouts = timeouts or Timeouts()
        self.token = token or new_token()
        self.groups = {g.name: Group(g) for g in groups}
        self.role_group = {role: g.name for g in groups for role in g.roles}
        self.by_identity: dict[bytes, Group] = {}
        self.local_groups: set[str] = set()
        self.supervisor: Supervision | None = (
            None  # restarts dead groups (controller/supervisor.py)
        )
        self.rejections = Rejections(log)
        # a cut connection's queue holds at most ~controller_queue messages; twice that from a
        # cut-off identity means it is sending on another connection
        self.strangers = Strangers(
            self.timeouts.stranger_messages, 2 * self.timeouts.controller_queue
        )
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.traffic = Traffic()
        # one arena per prefix per process
        self.arena = _CountingArena(self.traffic, prefix=f"hfc{next(_instances)}")
        self.reader = _CountingReader(self.traffic)
        self._sockets: list[tuple[zmq.Socket[Any], PeerWatch]] = []
        self.addresses: list[str] = []
        self._auth: ThreadAuthenticator | None = None
        self.handshakes = HandshakeLog(log)  # refused CURVE handshakes (transport/security.py)
        self._tasks: set[asyncio.Future[None]] = set()  # background work, kept referenced
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_pending = False
        self._backlog_timer: asyncio.TimerHandle | None = None
        self._summary: asyncio.Future[None] | None = None
        #: ``shutdown`` began: the groups were told to stop, so one leaving is no death
        self.closing = False
        self.registering = True  # until every group first joined (``wait_ready``)

    @property
    def rejected(self) -> list[str]:
        """Reasons for the newest refused messages, newest last (``rejections.total`` counts
        all of them)."""
        return self.rejections.reasons

    # -- sockets --------------------------------------------------------------------------------
    def bind(self, address: str, curve: CurveServer | None = None) -> str:
        """Bind one ROUTER (one security domain); returns the address groups connect to."""
        self._loop = asyncio.get_running_loop()
        if curve is not None and self._auth is None:  # ZAP must answer before the first peer
            self._auth = curve.start_authenticator(self.ctx, self.handshakes)
        sock, address = bind_router(self.ctx, address, self.timeouts, curve, exposed=True)
        # a CURVE socket's refused handshakes are logged, rate-limited, with the peer's address
        seen = HandshakeWatch(self.handshakes, address) if curve is not None else None
        watch = PeerWatch.on(sock, seen, silent=True)
        self._sockets.append((sock, watch))
        self._loop.add_reader(_fd(sock), self._drain, sock, watch)
        self._loop.add_reader(_fd(watch.monitor), self._drain_monitor, watch)
        self.addresses.append(address)
        if self._summary is None:
            self._summary = asyncio.ensure_future(self._summarise())
        return address

    async def _summarise(self) -> None:
        """Log each window's summary of rate-limited refusals when the window ends, not when
        (if ever) the next refusal comes."""
        while True:
            await asyncio.sleep(max(self.rejections.due(), 0.05))
            self.rejections.flush()
            self.handshakes.flush()

    def _send(self, sock: zmq.Socket[Any], identity: bytes, msg: Message, arena: bool) -> None:
        """Send to a group without blocking: what ZeroMQ has no room for waits in the group's
        backlog, and so does all that follows it. To anyone else, ``zmq.Again`` when its queue
        is full (``_send_to_peer`` drops it)."""
        encoded = encode(msg, self.arena if arena else None)
        self.traffic.sent += encoded.nbytes
        self.traffic.tensors += encoded.nbytes - len(encoded.frames[0])
        group = self.by_identity.get(identity)
        if group is not None and group.backlog:
            group.backlog.append(encoded)
        else:
            try:
                send_frames(sock, encoded, identity, block=False)
            except zmq.Again:
                if group is None:
                    raise
                group.backlog.append(encoded)
                self._offer_backlogs_soon()
            except zmq.ZMQError as exc:
                if group is None or exc.errno != zmq.EHOSTUNREACH:
                    raise
                # its connection is gone and its death not yet reported: the call waits for
                # that report (or its timeout), as one sent a moment earlier would
                log.debug("group %r unreachable; its death is reported on its own", group.spec.name)
        assert self._loop is not None
        if not self._drain_pending:  # a send can swallow the FD's edge
            self._drain_pending = True
            self._loop.call_soon(self._drain_all)

    def _offer_backlogs_soon(self) -> None:
        if self._backlog_timer is None and self._loop is not None:
            self._backlog_timer = self._loop.call_later(BACKLOG_RETRY_S, self._offer_backlogs)

    def _offer_backlogs(self) -> None:
        """Hand each group's backlog to ZeroMQ as far as its queue has room; look again soon
        while any is left."""
        self._backlog_timer = None
        for group in self.groups.values():
            while group.backlog and group.sock is not None and group.dead is None:
                try:
                    send_frames(group.sock, group.backlog[0], group.identity, block=False)
                except zmq.Again:
                    self._offer_backlogs_soon()
                    break
                except zmq.ZMQError as exc:  # it left: its death is reported on its own
                    log.debug("backlog of group %r dropped: %s", group.spec.name, exc)
                    group.backlog.clear()
                    break
                group.backlog.popleft()
            if group.dead is not None or group.sock is None:
                group.backlog.clear()

    def _send_to_peer(self, sock: zmq.Socket[Any], identity: bytes, msg: Message) -> bool:
        """Answer a peer that may have left already (ROUTER_MANDATORY then raises "Host
        unreachable") or does not read what it is sent (its queue is full); False, and nothing
        else happens, when so."""
        try:
            self._send(sock, identity, msg, False)
        except zmq.Again:
            log.debug("%s to %s dropped: its queue is full", msg.type.name, short(identity))
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("%s to %s dropped: the peer has left", msg.type.name, short(identity))
            return False
        return True

    def _drain_all(self) -> None:
        self._drain_pending = False
        for sock, watch in self._sockets:
            self._drain(sock, watch)
            self._drain_monitor(watch)

    def _drain(self, sock: zmq.Socket[Any], watch: PeerWatch) -> None:
        for _ in range(DRAIN_BUDGET):
            if sock.closed or not readable(sock):
                return
            try:
                identity, *frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sizes = [frame_buffer(f).nbytes for f in frames]
            size = sum(sizes)
            self.traffic.received += size
            self.traffic.tensors += size - (sizes[0] if sizes else 0)
            if identity.bytes in self.by_identity or self._admit(watch, identity, size):
                self._handle_one(sock, watch, identity, frames)
        assert self._loop is not None  # more may be queued, and the FD's edge is spent
        self._loop.call_soon(self._drain, sock, watch)

    def _admit(self, watch: PeerWatch, ident: zmq.Frame, size: int) -> bool:
        """Whether a message from a peer that has not registered is read. One over its
        allowance (``timeouts.stranger_messages``, or bigger than a hello can be) closes its
        connection; the rest it had queued is counted and dropped unread."""
        identity = ident.bytes
        verdict = self.strangers.judge(identity, size > UNREGISTERED_MAX_BYTES)
        if verdict == Verdict.READ:
            if self.strangers.first(identity):
                watch.meet(identity, ident)
            return True
        if verdict == Verdict.DROP:
            self.rejections.dropped()
            return False
        cut = watch.cut(identity) or (watch.meet(identity, ident) and watch.cut(identity))
        if verdict == Verdict.RECUT:
            self.rejections.dropped()
            return False
        if not cut:
            self.strangers.retry(identity)
        then = (
            "its connection is cut" if cut else "its connection is not known to be open"
        ) + " and what else it sends is dropped unread"
        if size > UNREGISTERED_MAX_BYTES:
            self._reject(
                f"message of {size} bytes from {short(identity)}, which has not registered: "
                f"over the limit of {UNREGISTERED_MAX_BYTES} bytes before registration (dropped "
                f"undecoded); {then}"
            )
        else:
            self._reject(
                f"{short(identity)} sent more than {self.strangers.allowance} messages without "
                f"registering (timeouts.stranger_messages): {then}"
            )
        return False

    def _handle_one(
        self, sock: zmq.Socket[Any], watch: PeerWatch, ident: zmq.Frame, frames: list[Any]
    ) -> None:
        """Handle one message; whatever goes wrong is this message's rejection, and the drain
        goes on (before, one exception stopped it until the next message arrived)."""
        try:
            self._handle(sock, watch, ident, frames)
        except Exception as exc:  # logged with its traceback, rate-limited; never re-raised
            reason = f"{type(exc).__name__}: {exc}"
            self._reject(f"message from {short(ident.bytes)} broke its handler ({reason})", exc)

    def _drain_monitor(self, watch: PeerWatch) -> None:
        if watch.monitor.closed:
            return
        silent = watch.silent_closes()
        if silent:
            self._reject(
                f"{silent} connection(s) closed before sending a whole message: the peer hung "
                "up, or sent a frame over timeouts.controller_frame_bytes="
                f"{self.timeouts.controller_frame_bytes}, which ZeroMQ drops unread"
            )
            self.rejections.dropped(silent - 1)
        for identity in watch.lost():
            group = self.by_identity.get(identity)
            if group is not None:
                cause = (
                    "(the coordinator) lost its connection: it exited, or ZeroMQ heartbeats "
                    "timed out"
                )
                if not group.same_host:  # its tensors come as frames, not in shared memory
                    cause += (
                        ", or it sent a frame over timeouts.controller_frame_bytes="
                        f"{self.timeouts.controller_frame_bytes} (raise it for larger batches)"
                    )
                self.declare_dead(group.spec.name, 0, cause, False)

    # -- messages -------------------------------------------------------------------------------
    def _handle(
        self, sock: zmq.Socket[Any], watch: PeerWatch, ident: zmq.Frame, frames: list[Any]
    ) -> None:
        identity = ident.bytes
        group = self.by_identity.get(identity)
        if group is None:
            size = sum(frame_buffer(f).nbytes for f in frames)
            if size > UNREGISTERED_MAX_BYTES:
                self._reject(
                    f"message of {size} bytes from {short(identity)}, which has not registered: "
                    f"over the limit of {UNREGISTERED_MAX_BYTES} bytes before registration "
                    "(dropped undecoded)"
                )
                return
        try:
            msg = self._decode(group, frames)
        except ProtocolError as exc:
            self._reject(f"message from {short(identity)}: {exc}")
            return
        if msg.type == MsgType.HELLO:
            self._hello(sock, watch, ident, msg.body)
        elif group is None:
            self._reject(f"{msg.type.name} from {short(identity)}, which has not registered")
        elif msg.type in (MsgType.REPLY, MsgType.ERROR):
            self._resolve(group, msg)
        elif msg.type == MsgType.DEAD:
            self._dead_notice(group, msg.body)
        else:
            self._reject(f"unexpected {msg.type.name} from group {group.spec.name!r}")

    def _decode(self, group: Group | None, frames: list[Any]) -> Message:
        if group is None:
            return decode(frames, None, 0, UNREGISTERED_MAX_BYTES, UNREGISTERED_LIMITS)
        reader = self.reader if group.same_host else None
        return decode(frames, reader, 0, self.timeouts.max_frame_bytes)

    def _dead_notice(self, group: Group, body: dict[str, Any]) -> None:
        rank, cause = body["rank"], body["cause"]
        if type(rank) is not int or not isinstance(cause, str):
            self._reject(f"DEAD from group {group.spec.name!r} with rank {short(rank)}")
            return
        self.declare_dead(group.spec.name, rank, cause, False)

    def _reject(self, reason: str, exc: BaseException | None = None) -> None:
        self.rejections.add(reason, exc)

    def _hello(
        self, sock: zmq.Socket[Any], watch: PeerWatch, ident: zmq.Frame, body: dict[str, Any]
    ) -> None:
        try:
            hello = read_hello(body)
        except ProtocolError as exc:
            self._refuse(sock, ident.bytes, f"hello from {short(ident.bytes)}", str(exc))
            return
        name = self._group_name(hello)
        reason = self._refusal(name, hello)
        if reason is not None:
            self._refuse(sock, ident.bytes, f"group {short(name)}", reason)
            self._refused_shape(name, hello, reason)
            return
        welcome = {"group": name, "host": host_id()}
        if not self._send_to_peer(sock, ident.bytes, Message(MsgType.WELCOME, 0, welcome)):
            self._reject(f"group {name!r} left before its welcome; it may try again")
            return
        group = self.groups[name]
        if group.refused is not None:  # started again as placed before the wait gave up
            group.refused, group.ready = None, asyncio.Event()
        group.identity, group.sock = ident.bytes, sock
        group.same_host = hello.host == host_id()
        self.by_identity[ident.bytes] = group
        self.strangers.forget(ident.bytes)
        watch.learn(ident.bytes, ident)
        self._tasks.add(task := asyncio.ensure_future(self._build(group)))
        task.add_done_callback(self._tasks.discard)

    def _refused_shape(self, name: str, hello: Hello, reason: str) -> None:
        """A placed group that says hello with the right token but another shape (roles, world
        size, layout) cannot join as it was started: while the groups first join, that ends
        the wait at once (a stranger, a wrong token or a second hello does not)."""
        group = self.groups.get(name)
        if not self.registering or group is None or group.identity:
            return
        if not token_ok(self.token, hello.token):
            return
        log.error("group %r was refused: %s", name, reason)
        group.refused = reason
        group.ready.set()

    def _refuse(self, sock: zmq.Socket[Any], identity: bytes, who: str, reason: str) -> None:
        """Record the refusal and tell the peer why, in the clipped words that were kept."""
        kept = self.rejections.add(f"{who}: {reason}").removeprefix(f"{who}: ")
        self._send_to_peer(sock, identity, Message(MsgType.REFUSE, 0, {"reason": kept}))

    def _group_name(self, hello: Hello) -> str:
        """The placed group a hello speaks for: by name, or (a group started by hand under
        another name) by the exact set of roles it hosts."""
        if hello.group is not None and hello.group in self.groups:
            return hello.group
        roles = sorted(hello.roles)
        for group in self.groups.values():
            if sorted(group.spec.roles) == roles:
                return group.spec.name
        return str(hello.group)

    def _refusal(self, name: str, hello: Hello) -> str | None:
        if not token_ok(self.token, hello.token):
            return "bad token (the group was not started for this controller)"
        group = self.groups.get(name)
        if group is None:
            placed = {n: sorted(g.spec.roles) for n, g in self.groups.items()}
            return (
                f"unknown group {name!r} with roles {sorted(hello.roles)}; "
                f"this experiment places {placed}"
            )
        spec = group.spec
        if sorted(hello.roles) != sorted(spec.roles):
            return f"roles {sorted(hello.roles)} but the placement puts {sorted(spec.roles)} in {spec.name!r}"
        if hello.world_size != spec.nproc:
            return f"world size {hello.world_size} but the placement says nproc={spec.nproc}"
        layout = hello.layout
        if layout != Layout.for_world(spec.nproc, spec.tp, spec.pp, spec.gen_tp, spec.gen_pp):
            return (
                f"layout {layout} but the placement says tp={spec.tp} pp={spec.pp} "
                f"gen_tp={spec.gen_tp} gen_pp={spec.gen_pp}"
            )
        if group.identity:
            return f"group {name!r} has already registered"
        return None

    async def _build(self, group: Group) -> None:
        specs = {role: spec.model_dump() for role, spec in group.spec.roles.items()}
        try:
            group.endpoints = await self.call(GROUP_ROLE, "build", [specs], {}, group=group)
        except (RemoteError, RoleDeadError) as exc:
            log.error("group %r failed to build its roles: %s", group.spec.name, exc)
            self.declare_dead(
                group.spec.name, getattr(exc, "rank", None), f"failed to build: {exc}", True
            )
        group.ready.set()

    def _resolve(self, group: Group, msg: Message) -> None:
        entry = group.pending.pop(msg.call_id, None)
        if entry is None:
            log.info(
                "late answer for call %d from %r (timed out?); dropped",
                msg.call_id,
                group.spec.name,
            )
            return
        future, _role, _method = entry
        if future.done():
            return
        if msg.type == MsgType.REPLY:
            future.set_result(msg.body["result"])
        else:
            b = msg.body
            future.set_exception(
                remote_error(b["role"], b["rank"], b["exc_type"], b["message"], b["traceback"])
            )

    # -- deaths ---------------------------------------------------------------------------------
    def declare_dead(self, name: str, rank: int | None, cause: str, precise: bool) -> None:
        """Mark a group dead (sticky). A socket-level cause waits briefly for the launcher's exit
        status of a local group, which says more (exit code or signal)."""
        group = self.groups[name]
        if self.closing:  # told to stop: leaving (its connection lost, its exit) is no death
            log.debug("group %r left after the shutdown: %s", name, cause)
            return
        if group.dead is not None and (group.dead_precise or not precise):
            return
        if not precise and name in self.local_groups and self._loop is not None:
            later = (name, group.incarnation, rank, cause)
            self._loop.call_later(LOCAL_DEATH_GRACE_S, self._settle_later, *later)
            return
        self._settle_dead(name, rank, cause, precise)

    def _settle_later(self, name: str, incarnation: int, rank: int | None, cause: str) -> None:
        """``declare_dead``'s grace is over (it may end after ``shutdown`` began: a group that
        left on SHUTDOWN then is no death)."""
        if self.closing:
            return
        if self.groups[name].incarnation == incarnation:  # not a restarted group's new ranks
            self._settle_dead(name, rank, cause)

    def _settle_dead(self, name: str, rank: int | None, cause: str, precise: bool = False) -> None:
        group = self.groups[name]
        if group.dead is not None and (group.dead_precise or not precise):
            return
        first = group.dead is None  # not a more precise cause of a death already settled
        group.dead, group.dead_precise = (rank, cause), precise
        log.error("group %r is dead: %s%s", name, "" if rank is None else f"rank {rank} ", cause)
        if self.supervisor is not None and first:
            refused = self.supervisor.died(name, rank, cause)
            if refused is not None:
                group.dead = (rank, f"{cause}; {refused}")
        for future, role, _ in group.pending.values():
            if not future.done():
                future.set_exception(group.error(role))
        group.pending.clear()
        group.ready.set()

    def reset(self, name: str) -> None:
        """Forget the group's current incarnation so that a new one may register under its
        name (a restart, ``controller/supervisor.py``): the old one is told to stop first,
        dead or not (a group declared dead for a lost ssh session or one rank may still run on
        its host, its coordinator linked here); what its old ranks still send or report is no
        longer read as the group's."""
        group = self.groups[name]
        if group.sock is not None:
            stop = Message(MsgType.SHUTDOWN, 0, {"reason": "restarted by the controller"})
            self._send_to_peer(group.sock, group.identity, stop)
        for future, role, _ in group.pending.values():
            if not future.done():
                future.set_exception(RoleDeadError(role, None, "was restarted by the controller"))
        self.by_identity.pop(group.identity, None)
        group.identity, group.sock, group.same_host = b"", None, False
        group.endpoints, group.pending = {}, {}
        group.dead, group.dead_precise = None, False
        group.backlog.clear()
        group.ready = asyncio.Event()
        group.incarnation += 1

    def report_exit(self, name: str, rank: int, returncode: int, said: str = "") -> None:
        """The local launcher saw a rank process end; ``said`` is its log's last error line."""
        cause = exit_cause(returncode)
        self.declare_dead(name, rank, f"{cause}: {said}" if said else cause, True)

    # -- calls ----------------------------------------------------------------------------------
    def group_of(self, role: str) -> Group:
        name = self.role_group.get(role)
        if name is None:
            raise KeyError(f"no role {role!r} in this placement; roles: {sorted(self.role_group)}")
        return self.groups[name]

    async def call(
        self,
        role: str,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        group: Group | None = None,
    ) -> Any:
        """Call ``method`` of ``role`` on its group's ranks. A group the supervisor restarts
        (a stateless one under a restart policy) is waited for, and a call its death failed is
        sent again to the new incarnation with the same arguments."""
        if group is not None or self.supervisor is None:
            return await self._call(role, method, args, kwargs, timeout, group)
        name = self.group_of(role).spec.name
        while True:
            await self.supervisor.serving(name)
            try:
                return await self._call(role, method, args, kwargs, timeout)
            except RoleDeadError:
                if not await self.supervisor.recovered(name):
                    raise
                log.info("re-issuing %s.%s on the restarted group %r", role, method, name)

    async def _call(
        self,
        role: str,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None = None,
        group: Group | None = None,
    ) -> Any:
        group = group or self.group_of(role)
        if group.dead is not None:
            raise group.error(role)
        if group.sock is None:
            raise RegistrationError(
                f"group {group.spec.name!r} has not registered yet (await wait_ready)"
            )
        if role != GROUP_ROLE and method not in group.endpoints.get(role, {}):
            have = sorted(group.endpoints.get(role, {}))
            raise AttributeError(f"role {role!r} has no endpoint {method!r}; it has {have}")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        group.pending[call_id] = (future, role, method)
        body = {"role": role, "method": method, "args": args, "kwargs": kwargs}
        self._send(
            group.sock, group.identity, Message(MsgType.CALL, call_id, body), group.same_host
        )
        limit = self.timeouts.call_s if timeout is None else timeout
        # A timer, not asyncio.wait_for: on 3.11 wait_for can swallow a cancellation (Ctrl-C)
        # that lands just as the reply does, and it costs a task per call.
        timer = asyncio.get_running_loop().call_later(limit, self._expire, group, call_id, limit)
        try:
            return await future
        finally:
            timer.cancel()
            group.pending.pop(call_id, None)

    def _expire(self, group: Group, call_id: int, limit: float) -> None:
        entry = group.pending.pop(call_id, None)
        if entry is not None and not entry[0].done():
            _, role, method = entry
            entry[0].set_exception(
                CallTimeoutError(
                    f"call {role}.{method} got no answer within {limit:.1f} s "
                    "(raise timeouts.call_s, or pass timeout= for this call)"
                )
            )

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every placed group has registered and built its roles; a group that died
        or was refused for its shape meanwhile ends the wait at once, named."""
        limit = self.timeouts.connect_s if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await self._joined_or_stopped()
        except TimeoutError:
            missing = [n for n, g in self.groups.items() if not g.ready.is_set()]
            raise RegistrationError(
                f"groups {missing} did not register within {limit:.0f} s "
                "(are they running and pointed at this controller? raise timeouts.connect_s)"
            ) from None
        for name, group in self.groups.items():
            if group.refused is not None:
                raise RegistrationError(
                    f"group {name!r} was refused: {group.refused}; start it as the placement "
                    "says (the controller stopped waiting)"
                )
            if group.dead is not None:
                raise RegistrationError(
                    f"group {name!r} died while starting: "
                    + ("" if group.dead[0] is None else f"rank {group.dead[0]} ")
                    + group.dead[1]
                )
        self.registering = False
        if self.supervisor is not None:
            self.supervisor.armed = True  # from here on a death may be restarted

    async def _joined_or_stopped(self) -> None:
        """Until every group is ready, or one is dead or refused."""
        while True:
            if any(g.dead is not None or g.refused is not None for g in self.groups.values()):
                return
            waiting = [g.ready.wait() for g in self.groups.values() if not g.ready.is_set()]
            if not waiting:
                return
            tasks = [asyncio.ensure_future(w) for w in waiting]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()

    async def shutdown(self) -> None:
        """Tell every live group to stop, then close the sockets."""
        self.closing = True
        if self.supervisor is not None:
            self.supervisor.close()
        for group in self.groups.values():
            if group.sock is not None and group.dead is None:
                try:
                    self._send(
                        group.sock,
                        group.identity,
                        Message(MsgType.SHUTDOWN, 0, {"reason": "run over"}),
                        False,
                    )
                except zmq.ZMQError:
                    pass  # it went away meanwhile
        self._offer_backlogs()  # what still fits; the launcher ends what does not hear it
        await asyncio.sleep(0)
        if self._summary is not None:
            self._summary.cancel()
        if self._backlog_timer is not None:
            self._backlog_timer.cancel()
        for sock, watch in self._sockets:
            if self._loop is not None:
                self._loop.remove_reader(_fd(sock))
                self._loop.remove_reader(_fd(watch.monitor))
            sock.disable_monitor()
            watch.close()
            sock.close(linger=200)
        self._sockets.clear()
        if self._auth is not None:
            self._auth.stop()
        self.arena.close()
