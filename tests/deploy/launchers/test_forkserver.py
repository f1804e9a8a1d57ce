"""Ranks forked by the fork server start as a fresh interpreter would: their own session, the
launcher's working directory and import path at the time (a module written after the server
started imports), the rank's environment, /dev/null as stdin, a fresh interpreter's signal
handlers and the rank's title. Environment that libraries read at import, changed, gets a fresh
server; ``HYBRIDFLOW_FORK_RANKS=0`` starts ranks as their own interpreters; ``kill -9`` of the
launching process leaves neither the server nor a rank behind."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.launchers.forkserver import ENABLE_ENV, ForkServer
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]


def facts(module: str, names: list[str]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with local_session(
            [group("g", 1, echo="tests.fixtures.roles:Echo")], TEST_TIMEOUTS
        ) as c:
            found: dict[str, Any] = await EchoClient(c, "echo").process(names, module)
            return found

    found: dict[str, Any] = run(main)
    return found


def test_a_forked_rank_starts_as_a_fresh_interpreter_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["HYBRIDFLOW_TEST_MARK", "HF_HUB_DISABLE_TELEMETRY", "TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("HYBRIDFLOW_TEST_MARK", "first")
    first = facts("json", names)
    server = ForkServer.shared()
    assert first["ppid"] == server.pid != os.getpid()  # forked by the server
    assert first["sid"] == first["pid"]  # a session of its own: a terminal's Ctrl-C skips it
    assert first["env"]["HYBRIDFLOW_TEST_MARK"] == "first"
    assert first["stdin"] == "/dev/null" and first["sigint"] and first["sigchld"]
    assert first["cmdline"].startswith("hybridflow g:0 (echo)")  # its title, as ps shows it
    # the launcher moved and learnt a module after the server started: the next rank follows
    (tmp_path / "written_later.py").write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{tmp_path}")
    monkeypatch.setenv("HYBRIDFLOW_TEST_MARK", "second")
    # what torch sets in the launcher once it imported transformers (read when inductor compiles)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    second = facts("written_later", names)
    assert second["ppid"] == server.pid  # the same server: nothing it imported changed
    assert second["cwd"] == str(tmp_path) == second["path0"] and second["imported"]
    assert second["env"]["HYBRIDFLOW_TEST_MARK"] == "second"
    assert second["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    # a variable huggingface reads at import: that server's imports no longer hold
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    third = facts("json", names)
    fresh = ForkServer.shared()
    assert fresh.pid != server.pid and third["ppid"] == fresh.pid
    assert third["env"]["HF_HUB_DISABLE_TELEMETRY"] == "1"
    wait_for(lambda: server.proc.poll() is not None, 30, "the stale server ending")
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert facts("json", names)["ppid"] == os.getpid()  # its own interpreter, started here


LAUNCHER = """
import asyncio, json, sys
from deploy.launchers.forkserver import ForkServer
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group

async def main():
    async with local_session([group("g", 2, echo="tests.fixtures.roles:Echo")], TEST_TIMEOUTS,
                             run_dir=__import__("pathlib").Path(sys.argv[1])):
        ranks = json.loads(open(sys.argv[1] + "/processes.json").read())["ranks"]
        print(json.dumps([ForkServer.shared().pid, *[r["pid"] for r in ranks]]), flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


def ignores_sigint(pid: int) -> bool:
    """Whether SIGINT is ignored in process ``pid`` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise AssertionError(f"no SigIgn line for {pid}")


def test_kill_9_of_the_launcher_leaves_no_server_and_no_rank(tmp_path: Path) -> None:
    """The launcher starts with SIGINT ignored, as a shell's background job does; the server
    inherits that through exec, the ranks it forks do not (Ctrl-C's KeyboardInterrupt, as a
    fresh interpreter)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert ignores_sigint(pids[0]) and not any(ignores_sigint(p) for p in pids[1:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not any(alive(p) for p in pids), 10, "the server and both ranks gone")
    finally:
        if proc.poll() is None:
            proc.kill()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_launcher_that_leaves_an_answer_unread_does_not_end_the_server() -> None:
    """A launcher killed with an answer unread resets its connection (ECONNRESET on the
    server's next read): the server drops it and goes on serving the others."""
    server = ForkServer()
    try:
        stale = json.dumps({"id": 1, "env": {"HF_HYBRIDFLOW_TEST_STALE": "1"}}).encode() + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.connect(str(server.path))
            first.sendall(stale)
            ready, _, _ = select.select([first], [], [], 120)
            assert ready, "the server answered nothing within 120 s"
        # closed with the answer unread: the kernel resets the server's end
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as second:
            second.settimeout(120)
            second.connect(str(server.path))
            second.sendall(stale)
            answer = json.loads(second.makefile().readline())
        assert answer["id"] == 1 and "HF_HYBRIDFLOW_TEST_STALE" in answer["stale"]
        assert server.proc.poll() is None
    finally:
        server.end()
