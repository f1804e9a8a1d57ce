"""What rank 0 of a group tells whoever started the group: that it joined, and how it ended.

A group started by hand (``hybridflow role``, ``deploy/commands/role.py``) has a person watching its
terminal, who must learn from it that the group joined the controller, what it runs (roles,
ranks, layout, device) and how it ended (exit status and why) — not only from the controller's
side or from rank logs. The coordinator reports these events (``report``); where they go is
named by the environment variable ``HYBRIDFLOW_STATUS``:

- unset: nowhere (``hybridflow run``'s own groups, whose controller is the one watching);
- ``-``: as sentences on this process's stderr (the rank runs inside ``hybridflow role`` itself,
  under torchrun or srun);
- ``@NAME``: a Unix datagram socket of that name in the abstract namespace (Linux: no file, so
  nothing is left behind however the launcher ends), bound by the ``hybridflow role`` that
  started the ranks (``StatusInbox``); one JSON object per datagram, which it prints
  (``describe``).

Reporting never fails the group: a launcher that is gone, or a socket that is full, loses the
event, nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from typing import Any

STATUS_ENV = "HYBRIDFLOW_STATUS"
TO_STDERR = "-"
MAX_EVENT_BYTES = 16384  # a reason longer than this is cut (a datagram is read whole)

JOINED = "joined"
ENDED = "ended"


def report(event: str, **fields: Any) -> None:
    """Send ``event`` with ``fields`` where ``HYBRIDFLOW_STATUS`` says (module docstring)."""
    target = os.environ.get(STATUS_ENV, "")
    if not target:
        return
    body = {"event": event, **fields}
    if target == TO_STDERR:
        print(describe(body), file=sys.stderr, flush=True)
        return
    data = json.dumps(body).encode()
    if len(data) > MAX_EVENT_BYTES:
        body["reason"] = str(body.get("reason", ""))[: MAX_EVENT_BYTES // 2] + " ..."
        data = json.dumps(body).encode()[:MAX_EVENT_BYTES]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
        try:
            out.sendto(data, _address(target))
        except OSError:
            pass  # the launcher is gone (or its queue is full): the event is lost, not the group


def describe(event: dict[str, Any]) -> str:
    """One line a person reads: what the group joined and runs, or how it ended."""
    group = event.get("group", "?")
    if event.get("event") == JOINED:
        layout = event.get("layout", {})
        shape = f"dp {layout.get('dp')} x tp {layout.get('tp')} x pp {layout.get('pp')}"
        gen = (layout.get("gen_tp") or layout.get("tp"), layout.get("gen_pp") or layout.get("pp"))
        if gen != (layout.get("tp"), layout.get("pp")):
            shape += f"; generating at tp {gen[0]} x pp {gen[1]}"
        ranks = event.get("world_size")
        return (
            f"group {group} joined the controller at {event.get('controller')}: roles "
            f"{', '.join(event.get('roles', []))} on {ranks} rank{'s' if ranks != 1 else ''} "
            f"({shape}), device {event.get('device')}, fan-out {event.get('fanout')}"
        )
    if event.get("event") == ENDED:
        return f"group {group} ended: {event.get('reason')} (exit {event.get('code')})"
    return f"group {group}: {event}"


def _address(target: str) -> str:
    """``@NAME`` as the socket API spells an abstract name (a leading NUL)."""
    return "\0" + target[1:] if target.startswith("@") else target


class StatusInbox:
    """The launcher's end: an abstract Unix datagram socket the group's rank 0 reports to;
    ``target`` is what ``HYBRIDFLOW_STATUS`` says to the ranks. ``read`` returns the events
    queued so far."""

    def __init__(self, group: str) -> None:
        self.target = f"@hybridflow-status-{group}-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(_address(self.target))
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(MAX_EVENT_BYTES)
            except BlockingIOError:
                return found
            try:
                event = json.loads(data)
            except ValueError:
                continue  # not from a rank of ours: the socket is ours alone, but be safe
            if isinstance(event, dict):
                found.append(event)

    def close(self) -> None:
        self.sock.close()
