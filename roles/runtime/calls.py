"""Running one call on a rank and turning its outcome into a REPLY or an ERROR message."""

from __future__ import annotations

import traceback
from typing import Any

from roles.runtime.host import RoleHost
from transport.protocol import Message, MsgType


def error_body(role: str, rank: int, exc: BaseException) -> dict[str, Any]:
    return {
        "role": role,
        "rank": rank,
        "exc_type": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def run_call(host: RoleHost, call_id: int, body: dict[str, Any]) -> Message:
    """Run ``body``'s method on this rank; any exception becomes an ERROR naming role and rank."""
    role = str(body["role"])
    try:
        result = host.run(role, str(body["method"]), list(body["args"]), dict(body["kwargs"]))
    except Exception as exc:
        return Message(MsgType.ERROR, call_id, error_body(role, host.rank, exc))
    return Message(MsgType.REPLY, call_id, {"result": result})
