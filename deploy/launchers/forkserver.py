"""A fork server for the local launcher: ranks forked from a process that has imported what ranks
import, instead of each importing it again.

A rank started as ``python -m roles.runtime`` spends 2-4 s of CPU importing torch, transformers
and the roles before it does anything: three one-rank groups took 5.5 s to register on two
cores, most of a short run. The local launcher asks this server instead. One server runs per
launching process (``ForkServer.shared``); it imports those modules once, then forks each rank
from that state, and the rank goes straight to ``roles.runtime.rank.main``.

Forking is safe because the server runs no thread and never computes (no OpenMP pool, no CUDA
context): it imports, then waits on its sockets. Each child gets what a fresh process started by
the launcher would: a session of its own, the rank's environment, working directory and import
path (``PYTHONPATH`` applied again, import caches dropped), its log as stdout and stderr,
/dev/null as stdin, the title argument, and a fresh interpreter's signal dispositions. It dies
with the server (``PR_SET_PDEATHSIG``, which the rank sets against its parent, the server), and
the server ends its children and itself when the launching process is gone (a pidfd on it), so
``kill -9`` of the launcher still leaves nothing behind.

Not forked (started as before, ``python -m roles.runtime``): ranks on a GPU (nothing here has
run a CUDA process forked this way), every rank when ``HYBRIDFLOW_FORK_RANKS=0``, and any rank
whose environment differs from the server's in what libraries read once at import (``HF_*``,
``TORCH*``, ``OMP_*``, ...): the launcher then starts a fresh server with the new environment.

The wire is local and private (a unix socket in a 0700 folder): one JSON object per line. A
request ``{"id", "title", "env", "cwd", "log"}`` is answered ``{"id", "pid"}``, ``{"id",
"stale": true}`` or ``{"id", "error"}``; when a child of a connection ends the server says
``{"exit": PID, "code": C}`` on it (C negative: the signal, as ``Popen.returncode``). A
connection that closes takes its children with it (SIGKILL).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridflow.launcher")

#: what every rank imports, imported once by the server (a failure to import one is skipped)
PRELOAD = (
    "roles.runtime.rank",
    "roles.runtime.coordinator",
    "roles.runtime.worker",
    "roles.engine_role",
    "roles.actor",
    "roles.rollout",
    "roles.reward",
)
#: environment that libraries read once, at import: a rank whose values differ needs a server
#: that imported with them
IMPORT_TIME_ENV = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "KMP_",
    "MKL_",
    "GOMP_",
    "CUDA_",
    "NCCL_",
    "GLOO_",
)
ENABLE_ENV = "HYBRIDFLOW_FORK_RANKS"  # "0": every rank starts as its own interpreter
TITLE_ROOM = 240  # argv bytes the server keeps for a rank's title (setproctitle writes there)


#: matched above but not fixed at import: OMP_NUM_THREADS is applied again by every rank
#: (``torch.set_num_threads``); TORCHINDUCTOR_CACHE_DIR is read when inductor first compiles, and
#: torch sets it in ``os.environ`` itself on that first use, so a launcher that imported
#: transformers after starting its server has it and the server does not (that difference alone
#: made every run start a second server: ~4 s of a quick run)
APPLIED_BY_THE_RANK = ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_TIME_ENV) and k not in APPLIED_BY_THE_RANK
    }


# -- the launcher's side --------------------------------------------------------------------------


class Forked:
    """A rank the server forked: what the launcher needs of a ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            raise RuntimeError(f"rank process {self.pid} has not ended")
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # ended; the server's word on it is on its way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


ExitCallback = Callable[[Forked], None]


class ForkLink:
    """One launcher's connection to the server: its requests, and its children's exits."""

    def __init__(self, server: ForkServer, on_exit: ExitCallback) -> None:
        self.server, self.on_exit = server, on_exit
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(server.path))
        self.buffer = b""
        self.children: dict[int, Forked] = {}
        self.next_id = 0
        self.watched = False
        self.closed = False

    def spawn(self, title: str, env: dict[str, str], log_path: Path, timeout_s: float) -> Forked:
        """Fork one rank; blocks until the server answered (the first answer of a new server
        waits for its imports). RuntimeError when it cannot; ``StaleServer`` when the server
        imported with other import-time environment."""
        self.next_id += 1
        request = {"id": self.next_id, "title": title, "env": env, "cwd": os.getcwd()}
        request["log"] = str(log_path)
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        self.sock.settimeout(timeout_s)
        try:
            while True:
                for message in self._read():
                    if message.get("id") != self.next_id:
                        self._note(message)
                        continue
                    if message.get("stale"):
                        raise StaleServer(self.server, message["stale"])
                    if "pid" not in message:
                        raise RuntimeError(f"the fork server refused: {message.get('error')}")
                    child = Forked(int(message["pid"]))
                    self.children[child.pid] = child
                    return child
        except TimeoutError:
            raise RuntimeError(
                f"the fork server did not answer within {timeout_s:.0f} s (timeouts.group_init_s)"
            ) from None
        finally:
            self.sock.settimeout(None)

    def watch(self) -> None:
        """Report exits from the running event loop from now on."""
        if not self.watched:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)
            self.watched = True

    def _readable(self) -> None:
        self.sock.setblocking(False)
        try:
            for message in self._read():
                self._note(message)
        except BlockingIOError:
            pass
        finally:
            if not self.closed:
                self.sock.setblocking(True)

    def _read(self) -> list[dict[str, Any]]:
        data = self.sock.recv(1 << 16)
        if not data:  # the server is gone, and with it every child (their death signal)
            self._lost()
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def _note(self, message: dict[str, Any]) -> None:
        child = self.children.pop(int(message.get("exit", -1)), None)
        if child is not None:
            child.returncode = int(message["code"])
            self.on_exit(child)

    def _lost(self) -> None:
        self.close()
        for child in list(self.children.values()):
            child.returncode = -signal.SIGKILL
            self.on_exit(child)
        self.children.clear()

    def close(self) -> None:
        """End the connection; the server kills what is left of its children."""
        if self.closed:
            return
        self.closed = True
        if self.watched:
            try:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            except RuntimeError:
                pass  # no loop any more: nothing to remove it from
        self.sock.close()


class StaleServer(RuntimeError):
    def __init__(self, server: ForkServer, differ: list[str]) -> None:
        super().__init__(f"the fork server imported with other values of {', '.join(differ)}")
        self.server = server


class ForkServer:
    """The server process, started by this process and private to it."""

    _shared: ForkServer | None = None

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="hf-fork-"))  # 0700
        self.path = self.folder / "server"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(64)  # connections wait here while the server imports
        self.owner = os.getpid()
        argv = [sys.executable, "-m", "deploy.launchers.forkserver", str(listener.fileno())]
        self.proc = subprocess.Popen(
            [*argv, str(self.owner), "." * TITLE_ROOM],  # room for the ranks' titles
            pass_fds=[listener.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        listener.close()
        self.pid = self.proc.pid
        atexit.register(self.end)  # gone before this process is: nothing outlives a command

    def end(self) -> None:
        """Kill the server (its children die with it) and wait until it is gone."""
        if os.getpid() != self.owner:
            return  # a fork of the process that started it: not this one's to end
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    @classmethod
    def shared(cls) -> ForkServer:
        """This process's server, started on first use (again when it died or went stale)."""
        server = cls._shared
        if server is None or server.owner != os.getpid() or server.proc.poll() is not None:
            server = cls._shared = ForkServer()
        return server

    def retire(self) -> None:
        """No new connections: a stale server ends once its last connection closes."""
        if ForkServer._shared is self:
            ForkServer._shared = None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(self.path))
                s.sendall(b'{"retire": true}\n')
        except OSError:
            pass  # gone already


def fork_ranks_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0" and sys.platform.startswith("linux")


def prestart() -> None:
    """Start this process's server now, so its imports overlap other work (it answers the
    first rank once they are done)."""
    if fork_ranks_enabled():
        ForkServer.shared()


# -- the server ---------------------------------------------------------------------------------


class _Server:
    def __init__(self, listener: socket.socket, parent: int, env_key: dict[str, str]) -> None:
        self.listener = listener
        self.parent = parent
        self.unsafe = ", ".join(t.name for t in threading.enumerate()[1:])  # forking needs none
        self.parent_fd = os.pidfd_open(self.parent)  # readable once the launcher is gone
        self.base_path = self._base_path()
        self.env_key = env_key  # as the launcher gave it, before the imports set their own
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytes] = {}
        self.owner: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
        self.retired = False
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd needs a handler
        signal.set_wakeup_fd(self.wake_w)

    @staticmethod
    def _base_path() -> list[str]:
        """``sys.path`` without what this process's start added (its cwd, its PYTHONPATH)."""
        added = {os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))}
        return [p for p in sys.path[1:] if p not in added]

    def serve(self) -> dict[str, Any] | None:
        """Answer until the launcher is gone (None) or a child is forked: the child returns
        its request and becomes the rank."""
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.selector.register(self.parent_fd, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self.buffers[conn] = b""
                    self.selector.register(conn, selectors.EVENT_READ)
                elif key.fileobj == self.wake_r:
                    self._reap()
                elif key.fileobj == self.parent_fd:
                    self._end_all()
                    return None
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    request = self._readable(key.fileobj)
                    if request is not None:
                        return request  # in the child
            if self.retired and not self.buffers:
                self._end_all()
                return None

    def _readable(self, conn: socket.socket) -> dict[str, Any] | None:
        try:
            data = conn.recv(1 << 20)
        except OSError:  # reset: the launcher died (kill -9) with our answer unread
            data = b""
        if not data:
            self._drop(conn)
            return None
        *lines, self.buffers[conn] = (self.buffers[conn] + data).split(b"\n")
        for line in lines:
            if not line:
                continue
            request = json.loads(line)
            if request.get("retire"):
                self.retired = True
                continue
            child = self._fork(conn, request)
            if child is not None:
                return child
        return None

    def _fork(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any] | None:
        if self.unsafe:
            self._say(conn, {"id": request["id"], "error": f"threads run here: {self.unsafe}"})
            return None
        wanted = import_time_env(request["env"])
        if wanted != self.env_key:
            differ = sorted(
                k for k in {*wanted, *self.env_key} if wanted.get(k) != self.env_key.get(k)
            )
            self._say(conn, {"id": request["id"], "stale": differ})
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            self._say(conn, {"id": request["id"], "error": str(exc)})
            return None
        if pid == 0:
            return request
        self.owner[pid] = conn
        self._say(conn, {"id": request["id"], "pid": pid})
        return None

    def _say(self, conn: socket.socket, message: dict[str, Any]) -> None:
        try:
            conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # that launcher is gone; its children are ended with its connection

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.owner.pop(pid, None)
            if conn is not None:
                self._say(conn, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _drop(self, conn: socket.socket) -> None:
        """A launcher closed its connection: its children end with it."""
        self.selector.unregister(conn)
        self.buffers.pop(conn, None)
        for pid, owner in list(self.owner.items()):
            if owner is conn:
                _kill(pid)
        conn.close()

    def _end_all(self) -> None:
        for pid in self.owner:
            _kill(pid)

    def become_rank(self, request: dict[str, Any]) -> None:
        """In the child: leave the server behind and start as a fresh rank process would."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # as Python sets it up, whatever the server inherited: a SIGINT ignored by the process
        # that started the server (an ignored signal survives exec) must not reach the ranks
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        for fd in (self.wake_r, self.wake_w, self.parent_fd):
            os.close(fd)
        for conn in self.buffers:
            conn.close()
        self.listener.close()
        os.setsid()
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        cwd = request["cwd"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd, *extra, *self.base_path]
        importlib.invalidate_caches()
        sys.argv = [sys.argv[0], request["title"]]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_rank() -> int:
    try:
        from roles.runtime.rank import main

        main()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # the rank's last word goes to its log
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    parent = int(sys.argv[2])
    if os.getppid() != parent:  # the launcher died before this started: nothing to serve
        return
    env_key = import_time_env(dict(os.environ))
    os.environ["SPT_NOENV"] = "1"  # titles go in argv's room only (the environment stays)
    import setproctitle

    setproctitle.setproctitle(f"hybridflow fork server (for pid {os.getppid()})")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the rank imports it itself, and says why
            print(f"fork server: could not import {name}: {exc}", file=sys.stderr)
    server = _Server(listener, parent, env_key)
    folder = Path(listener.getsockname()).parent
    try:
        request = server.serve()
    except BaseException:  # its folder goes with it, whatever ended it
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if request is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    server.become_rank(request)
    code = _run_rank()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
