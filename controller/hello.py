"""A coordinator's HELLO, read field by field with its type checked before anything uses it.

A hello comes from a peer that has not yet proved anything: any process that reaches the socket
can send one, with any msgpack value in any field (``roles: 5``, ``roles: [1, "a"]``, a tensor or a
60 MB string as ``version``). ``read_hello`` turns the body into a typed ``Hello`` or raises
``ProtocolError`` naming the field and its expected type, quoting the value only through
``short``; the controller sends that reason back as a refusal. Fields the controller does not use
(``pid``, ``rank``) are still type-checked so a hello is either wholly well-formed or refused.

``Strangers`` counts what each peer that has not registered sends. A coordinator sends one hello
and waits; a peer that sends more than ``timeouts.stranger_messages`` (or anything larger than a
hello can be) is flooding: the controller closes its connection and drops, unread, what it had
queued. A flood then costs the controller a few microseconds a message for a moment and the
flooder a reconnection, instead of a decoded hello and a refusal each, queued without end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeGuard

from controller.rejections import short
from transport.protocol import PROTOCOL_VERSION, Layout, ProtocolError

MAX_ROLES = 64  # roles one group may host; a placement with more is not a real one
MAX_NAME_CHARS = 256  # a role or group name, a host id, a token
REMEMBER_STRANGERS = 4096  # peers counted at once; the oldest is forgotten first


@dataclass(frozen=True)
class Hello:
    roles: list[str]
    world_size: int
    layout: Layout
    token: str
    host: str
    group: str | None  # a group started by hand may omit it: its roles then name it


def _is_int(value: Any) -> TypeGuard[int]:
    return type(value) is int  # bool is an int to isinstance; not here


def _text(body: dict[str, Any], key: str, optional: bool = False) -> str | None:
    value = body.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ProtocolError(
            f"hello field {key!r} must be a string of at most {MAX_NAME_CHARS} characters, "
            f"got {short(value)}"
        )
    return value


def _roles(value: Any) -> list[str]:
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_ROLES
        or not all(isinstance(r, str) and len(r) <= MAX_NAME_CHARS for r in value)
    ):
        raise ProtocolError(
            f"hello field 'roles' must be a list of 1 to {MAX_ROLES} role names, got {short(value)}"
        )
    return value


def _check_version(value: Any) -> None:
    if not _is_int(value) or value != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {short(value)}; this controller speaks {PROTOCOL_VERSION}"
        )


def read_hello(body: dict[str, Any]) -> Hello:
    """The typed hello, or ``ProtocolError`` with a reason fit to send back. The version comes
    first: a peer from another release is told that, whatever else its hello holds."""
    _check_version(body.get("version"))
    world_size, pid = body.get("world_size"), body.get("pid")
    if not _is_int(world_size) or world_size < 1:
        raise ProtocolError(
            f"hello field 'world_size' must be a positive integer, got {short(world_size)}"
        )
    if not _is_int(pid):
        raise ProtocolError(f"hello field 'pid' must be an integer, got {short(pid)}")
    if "rank" in body and not _is_int(body["rank"]):
        raise ProtocolError(f"hello field 'rank' must be an integer, got {short(body['rank'])}")
    try:
        layout = Layout.from_wire(body.get("layout"))
    except ProtocolError:
        raise ProtocolError(
            f"hello field 'layout' must be a map of positive integers dp, tp, pp, "
            f"got {short(body.get('layout'))}"
        ) from None
    return Hello(
        roles=_roles(body.get("roles")),
        world_size=world_size,
        layout=layout,
        token=_text(body, "token") or "",
        host=_text(body, "host") or "",
        group=_text(body, "group", optional=True),
    )


class Verdict(enum.Enum):
    READ = "read"  # within its allowance: handle it
    CUT = "cut"  # the first over it: drop it, close the connection
    RECUT = "recut"  # cut off, and still sending: drop it, close its connection (again)
    DROP = "drop"  # cut off: drop it unread


class Strangers:
    """What each peer that has not registered has sent (the newest ``REMEMBER_STRANGERS``):
    a count of messages while within ``allowance``, then, once cut off, of messages dropped.

    A cut connection's messages already queued arrive after the cut; more than ``recut_after``
    of them means a live connection under the same identity (a peer that names itself and
    connected again, or one whose connection could not be cut): it is cut again."""

    def __init__(
        self, allowance: int, recut_after: int, remember: int = REMEMBER_STRANGERS
    ) -> None:
        self.allowance = allowance
        self.recut_after = recut_after
        self.remember = remember
        # > 0: messages read; <= -1: cut off, -1 - the messages dropped since (insertion
        # order: the oldest first)
        self._sent: dict[bytes, int] = {}

    def judge(self, identity: bytes, oversize: bool) -> Verdict:
        """The verdict on one more message from ``identity`` (``oversize``: larger than any
        hello can be)."""
        sent = self._sent.pop(identity, 0)
        if sent < 0:
            dropped = -sent
            verdict = Verdict.RECUT if dropped > self.recut_after else Verdict.DROP
            self._sent[identity] = -1 if verdict == Verdict.RECUT else -1 - dropped
        elif oversize or sent >= self.allowance:
            verdict = Verdict.CUT
            self._sent[identity] = -1
        else:
            verdict = Verdict.READ
            self._sent[identity] = sent + 1
        if len(self._sent) > self.remember:
            del self._sent[next(iter(self._sent))]
        return verdict

    def first(self, identity: bytes) -> bool:
        """The message just judged READ was its first."""
        return self._sent.get(identity) == 1

    def retry(self, identity: bytes) -> None:
        """Its connection could not be cut (not known to be open): try again on its next
        message, which may come from a connection that can be told apart."""
        self._sent[identity] = -1 - self.recut_after

    def forget(self, identity: bytes) -> None:
        """It registered: it is no stranger."""
        self._sent.pop(identity, None)
