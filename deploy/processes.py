"""Which process is which: titles ``ps`` shows, ``RUN_DIR/processes.json`` and
``hybridflow status RUN_DIR``.

Every rank sets its title to ``hybridflow GROUP:RANK (ROLES)`` and writes its pid beside it as its
log's first line (``roles/runtime/rank.py``); the run command's process, which hosts the
controller, is ``hybridflow controller RUN_DIR``. The local launcher keeps ``processes.json``
current (rewritten when a group starts or restarts): the controller's pid and, per rank, its
group, rank, roles, pid, host and log; the Ray launcher adds its ranks (their node, and the
actor that runs each). ``hybridflow status RUN_DIR`` prints it with whether each process is alive
(on this host). Groups started elsewhere (SLURM, ssh, by hand) are not listed: their ranks'
titles and logs say the same on their hosts.

From outside, a run's ranks are found by those titles (``rank_title``, ``descendants``), never by
``/proc/PID/environ``: a rank forked by the fork server (``launchers/forkserver.py``) shows the
server's environment there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deploy.terminal import console

PROCESSES_FILE = "processes.json"


def started_as_command() -> bool:
    """Whether this process was started to run a hybridflow command (the ``hybridflow`` script,
    or ``python -m deploy.cli``), not by a program that calls the library (a user's script, a
    test runner): only then may the command set the process's title."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return Path(sys.argv[0]).name == "hybridflow" or getattr(spec, "name", "") == "deploy.cli"


def set_title(title: str, name: str) -> None:
    """This process's title, as ``ps`` shows it, written over its command line only: its
    environment stays readable in /proc (setproctitle would otherwise reuse that memory, and
    tools find a run's processes by their environment); cut to the command line's length.
    ``name``: its short name (``top``, the second field of ``/proc/PID/stat``), kept free of
    spaces and parentheses, which SLURM's process tracking (``%d %s %*s %d``) cannot read: a
    process whose name has a space escapes ``scancel``."""
    os.environ.setdefault("SPT_NOENV", "1")  # read when setproctitle is first imported
    import setproctitle

    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(short_name(name))


def short_name(name: str) -> str:
    """``name`` as a process name: at most 15 characters, none of them space or parenthesis."""
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in name)[:15]


def write_processes(run_dir: Path, ranks: Iterable[dict[str, Any]], cluster: str = "") -> Path:
    """``RUN_DIR/processes.json``: this process (the controller's) and ``ranks``, written aside
    and renamed so a reader never sees half of it. ``cluster`` names whose ranks these are: the
    ranks another launcher of this controller wrote (a cluster spec's clusters) are kept."""
    path = run_dir / PROCESSES_FILE
    kept: list[dict[str, Any]] = []
    try:
        before = json.loads(path.read_text())
        if before["controller"]["pid"] == os.getpid():
            kept = [r for r in before["ranks"] if r.get("cluster", "") != cluster]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or an earlier run's
    found = {
        "controller": {"pid": os.getpid(), "host": socket.gethostname()},
        "ranks": kept + [{**r, "cluster": cluster} if cluster else r for r in ranks],
    }
    aside = path.with_name(path.name + ".tmp")
    aside.write_text(json.dumps(found, indent=1))
    aside.replace(path)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def add_status_command(sub: argparse._SubParsersAction) -> None:
    what = "list a run's processes (controller and ranks: pid, group, rank, roles, alive)"
    cmd = sub.add_parser("status", help=what, description=what)
    cmd.add_argument("run_dir", type=Path, help="the run folder (holds processes.json)")
    cmd.add_argument("--json", action="store_true", help="print the list as JSON on stdout")
    cmd.set_defaults(fn=status_command)


def status_command(args: argparse.Namespace) -> int:
    path = Path(args.run_dir) / PROCESSES_FILE
    if not path.is_file():
        console.print(f"{path}: no such file (a run started here by `hybridflow run` writes it)")
        return 2
    found = json.loads(path.read_text())
    here = socket.gethostname()
    rows = [{"what": "controller", **found["controller"]}]
    rows += [
        {"what": f"{r['group']}:{r['rank']} ({','.join(r['roles'])})", **r} for r in found["ranks"]
    ]
    for row in rows:
        row["alive"] = alive(int(row["pid"])) if row["host"] == here else None
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        state = {True: "running", False: "gone", None: "(another host)"}[row["alive"]]
        log = f"  log {row['log']}" if row.get("log") else ""
        actor = f"  ray actor {row['actor']}" if row.get("actor") else ""
        console.print(f"{row['what']:<32} pid {row['pid']:<8} {row['host']}  {state}{actor}{log}")
    return 0


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
