"""Finding a test's rank processes from outside: by the title each rank gives itself
(``hybridflow GROUP:RANK (ROLES) python -m roles.runtime``, what ``ps`` shows), never by
``/proc/PID/environ``, which for a rank forked by the fork server holds the server's
environment (``deploy/launchers/forkserver.py``)."""

from __future__ import annotations

import re
from pathlib import Path

_TITLE = re.compile(rb"hybridflow ([\w-]+):(\d+) \(")


def rank_title(pid: int) -> tuple[str, int] | None:
    """(group, rank) of a rank process, None for any other process (or one gone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    found = _TITLE.match(cmdline)
    if found is None or b"roles.runtime" not in cmdline:
        return None
    return found[1].decode(), int(found[2])


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
