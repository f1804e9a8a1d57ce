"""The python tool: run the model's code in a separate, isolated interpreter.

Each call starts ``python -I -B`` (isolated: no environment variables of Python's, no user site,
no current folder on the path) in a fresh working folder under the sandbox's root (a temporary
folder per env group, removed when the process ends; the call's folder is removed after the
call). ``sandbox_child.py`` isolates the child before the code runs: PID, IPC, mount and (network
off, the default) network namespaces with the code as PID 1 of its own, a ``/proc`` of that
namespace, System V memory capped in its IPC namespace, a fresh session keyring, Landlock (writes
in the working folder only, reads of the interpreter and system libraries only), resource limits
(address space ``memory_mb``, CPU seconds, file size, open files, no core files) and a seccomp
filter (socket families allow-listed, no memfd, key syscalls, ptrace, namespaces, mounts,
io_uring), with every capability dropped. Each call checks that it got every layer the probe
found (else ``SandboxUnavailable``). A wall-clock limit (``timeout_s``) ends the call by killing
its PID namespace's init (a pidfd): then the kernel kills whatever it started.
The environment is a minimal one (``PATH``, ``HOME`` and ``TMPDIR`` set to the working folder),
so no secret of the role's environment reaches it; stdin is empty.

``isolation()`` says which layers took effect here (a probe child applies them all once).
Where one is missing the sandbox refuses to run (``SandboxUnavailable``) unless the settings opt
into the weak mode by name (``allow_weak``): then what that layer stops is not stopped. What it
never protects against: a fork bomb until the wall-clock limit (no cgroup), a disk filled with
many files each under the file-size limit, and reading what the allowed paths hold.
docs/agentic.md has the table of layers.

The python tool reports what the code printed (stdout and stderr together, cut to
``output_chars``), and its exit status when it is not 0; a program killed by a limit raises
``SandboxKilled``, one stopped at its wall-clock limit ``ToolTimeout``. The env role sets the
limits from its config with ``configure`` (``sandbox_*`` keys); without it, the defaults below.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roles.tools.failures import SandboxKilled, SandboxUnavailable, ToolTimeout

log = logging.getLogger(__name__)
CHILD = Path(__file__).with_name("sandbox_child.py")
KILL_WAIT_S = 10.0  # how long a SIGKILLed child may take to be reaped
PROBE_TIMEOUT_S = 60.0  # how long the probe of what the kernel enforces may take
MEMORY_EXIT = 86  # the child's exit code when a MemoryError reached the top
_SYSTEM_READ = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime"]
_DEVICES = ["/dev/urandom", "/dev/random", "/dev/zero", "/sys/devices/system/cpu"]
_KILLED_BY: dict[int, str] = {
    signal.SIGXCPU: "used up its CPU time limit",
    signal.SIGXFSZ: "wrote a file past its size limit",
    signal.SIGKILL: "was killed (SIGKILL)",
    signal.SIGSEGV: "crashed (SIGSEGV)",
    signal.SIGABRT: "aborted (SIGABRT)",
    signal.SIGBUS: "crashed (SIGBUS)",
}


@dataclass(frozen=True)
class SandboxSettings:
    memory_mb: int = 512
    timeout_s: float = 10.0
    network: bool = False
    output_chars: int = 8000
    #: extra paths the code may read (Landlock), beside the interpreter and system libraries
    readable: tuple[str, ...] = ()
    #: where the per-call working folders go (a new temporary folder when None)
    root: str | None = None
    threads: int = field(default=1)  # OMP/OpenBLAS/MKL threads: each thread costs address space
    #: run even where the kernel cannot isolate the code (a layer of ``isolation()`` missing)
    allow_weak: bool = False

    def __post_init__(self) -> None:
        if self.memory_mb < 32 or self.timeout_s <= 0 or self.output_chars < 1:
            raise ValueError(
                f"sandbox settings need memory_mb >= 32, timeout_s > 0 and output_chars >= 1 "
                f"(got {self.memory_mb}, {self.timeout_s}, {self.output_chars})"
            )


@dataclass(frozen=True)
class Outcome:
    returncode: int
    output: str
    timed_out: bool
    #: the layers this call could not get (the child refused to run the code)
    refused: tuple[str, ...] = ()


class Sandbox:
    """Runs code in limited child interpreters; one per process (``configure``, ``current``)."""

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        self.settings = settings or SandboxSettings()
        self._root: Path | None = None
        self._isolation: dict[str, Any] | None = None
        #: the probe's report of what took effect; each call must get the same (its check)
        self._required: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        with self._lock:
            if self._root is None:
                base = self.settings.root
                self._root = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-", dir=base))
                weakref.finalize(self, shutil.rmtree, self._root, True)
            return self._root

    def isolation(self) -> dict[str, Any]:
        """Each layer the kernel enforces here, by name, and ``weak``: the layers missing (found
        once, by a probe child that applies them all). Empty ``weak``: the full sandbox."""
        if self._isolation is None:
            folder = Path(tempfile.mkdtemp(dir=self.root))
            try:  # not the code's time limit: a busy machine may start an interpreter slowly
                outcome = self._spawn(folder, {"probe": True}, PROBE_TIMEOUT_S, limit=65536)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if outcome.timed_out:
                raise SandboxUnavailable(
                    f"the sandbox's probe did not answer within {PROBE_TIMEOUT_S:g} s; the "
                    "machine is too loaded to start an interpreter"
                )
            try:
                applied = json.loads(outcome.output or "{}")
            except json.JSONDecodeError:
                log.warning("the sandbox's probe answered no report: %s", outcome.output[-2000:])
                applied = {}
            self._required = {name: value for name, value in applied.items() if value}
            self._isolation = layers(applied, self.settings.network)
        return self._isolation

    def check(self) -> dict[str, Any]:
        """``isolation()``, or ``SandboxUnavailable`` when a layer is missing and the settings
        do not opt into the weak mode (``allow_weak``)."""
        found = self.isolation()
        if found["weak"] and not self.settings.allow_weak:
            raise SandboxUnavailable(
                "the python tool runs model output as code and this machine's kernel cannot "
                f"isolate it (missing: {', '.join(found['weak'])}); it refuses to run. Set "
                "sandbox_allow_weak: true on the env role to run it anyway, unprotected where "
                "a layer is missing (an audit hook is not a boundary)"
            )
        return found

    def run(self, code: str) -> str:
        """Run ``code`` and return what it printed; raises SandboxKilled or ToolTimeout, and
        SandboxUnavailable where the kernel cannot isolate it (``check``)."""
        self.check()
        folder = Path(tempfile.mkdtemp(prefix="call-", dir=self.root))
        try:
            (folder / "main.py").write_text(code)
            outcome = self._spawn(folder, {"required": self._required}, self.settings.timeout_s)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return self._report(outcome)

    def _report(self, outcome: Outcome) -> str:
        output = outcome.output
        if outcome.refused:
            raise SandboxUnavailable(
                "this call could not get the sandbox's isolation (missing: "
                f"{', '.join(outcome.refused)}; a namespace limit reached by concurrent calls, or "
                "memory) and refused to run the code"
            )
        if outcome.timed_out:
            raise ToolTimeout(
                f"the code ran past its time limit of {self.settings.timeout_s:g} s "
                f"(sandbox_timeout_s) and was stopped; its output so far:\n{output}"
            )
        code = outcome.returncode
        if code == MEMORY_EXIT:
            raise SandboxKilled(
                f"the code ran out of memory (its limit is {self.settings.memory_mb} MiB, "
                f"sandbox_memory_mb); its output:\n{output}"
            )
        if code < 0:
            how = _KILLED_BY.get(-code, f"was killed by signal {-code}")
            raise SandboxKilled(f"the code {how}; its output:\n{output}")
        if code:
            output = f"{output}\n[exit status {code}]" if output else f"[exit status {code}]"
        return output or "(no output)"

    def _spawn(
        self, folder: Path, extra: dict[str, Any], timeout_s: float, limit: int | None = None
    ) -> Outcome:
        """Run the child on ``folder``; ``limit``: the output kept (default ``output_chars``)."""
        s = self.settings
        memory = s.memory_mb * 2**20
        config = {
            "folder": str(folder),
            "network": s.network,
            "readable": self._readable(),
            "memory_bytes": memory,
            "file_bytes": memory,
            "cpu_s": int(timeout_s) + 1,
            "memory_exit": MEMORY_EXIT,
            **extra,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(folder),
            "TMPDIR": str(folder),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",  # (-I ignores it; the child's stdio is UTF-8 anyway)
            "MALLOC_ARENA_MAX": "2",  # each malloc arena reserves address space
            **{k: str(s.threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
            "MKL_NUM_THREADS": str(s.threads),
        }
        # -u: unbuffered, so stdout and stderr interleave in the order they were written
        report, config["report_fd"] = os.pipe()
        command = [sys.executable, "-I", "-B", "-u", str(CHILD), json.dumps(config)]
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=folder,
                env=env,
                pass_fds=(config["report_fd"],),
                start_new_session=True,  # its own process group: one kill ends all it started
            )
        finally:
            os.close(config["report_fd"])
        call = _Call(proc, report)
        try:
            kept, dropped, timed_out = call.read(
                time.monotonic() + timeout_s, limit or s.output_chars
            )
        finally:
            call.end()
        text = kept.decode("utf-8", errors="replace")
        if dropped:
            text += f"\n[... {dropped} more bytes of output cut]"
        return Outcome(proc.returncode, text.rstrip("\n"), timed_out, call.refused)

    def _readable(self) -> list[str]:
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        return [*sorted(prefixes), *_SYSTEM_READ, *_DEVICES, *self.settings.readable]


#: the layers the full sandbox has (``isolation()``'s names)
LAYERS = (
    "namespaces",
    "network",
    "proc",
    "shared memory",
    "capabilities",
    "files",
    "seccomp",
    "keyring",
)


def layers(applied: dict[str, Any], network: bool) -> dict[str, Any]:
    """The probe child's report (``sandbox_child.isolate``) in words, per layer; ``weak``
    lists the layers that did not take effect."""
    spaces = applied.get("namespaces", "")
    abi = int(applied.get("landlock", 0))
    found: dict[str, Any] = {
        "namespaces": f"pid, ipc, mount ({spaces} namespaces)" if spaces else "",
        "network": "allowed" if network else ("namespace" if spaces else ""),
        "proc": "its own /proc" if applied.get("proc") else "",
        "shared memory": "own IPC namespace, capped" if applied.get("shared_memory") else "",
        "capabilities": "all dropped, bounding set empty" if applied.get("capabilities") else "",
        "files": f"landlock ABI {abi}" if abi else "",
        "seccomp": "socket families allow-listed; memfd, keys, ptrace, namespaces, mounts refused"
        if applied.get("seccomp")
        else "",
        "keyring": "fresh session keyring" if applied.get("keyring") else "",
    }
    found["weak"] = [name for name in LAYERS if not found[name]]
    for name in found["weak"]:
        found[name] = "none"
    return found


class _Call:
    """One running child: its output pipe, its report pipe (``init PID``, ``refused LAYERS``)
    and, once reported, a pidfd of its PID namespace's init, the process whose death ends every
    process of the call wherever they moved their process group or session."""

    def __init__(self, proc: subprocess.Popen[bytes], report: int) -> None:
        self.proc = proc
        self.report = report
        self.lines = b""
        self.init: int | None = None  # a pidfd
        self.refused: tuple[str, ...] = ()

    def read(self, deadline: float, limit: int) -> tuple[bytes, int, bool]:
        """(the first ``limit`` bytes of output, how many more there were, whether the deadline
        passed first). Reads until the pipe's writers have all closed it; when the child itself
        exits first, what it left running is killed (so a background process holding the pipe
        open does not keep the call waiting)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        kept, dropped = bytearray(), 0
        exited = _exit_watch(self.proc)
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ, "output")
            selector.register(self.report, selectors.EVENT_READ, "report")
            if exited is not None:
                selector.register(exited, selectors.EVENT_READ, "exit")
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return bytes(kept), dropped, True
                    for key, _ in selector.select(left):
                        if key.data == "exit":
                            selector.unregister(key.fd)
                            self.kill(reap=False)  # the stragglers: the pipe closes
                            continue
                        chunk = os.read(key.fd, 65536)
                        if key.data == "report":
                            if not chunk:
                                selector.unregister(key.fd)
                            self._reported(chunk)
                            continue
                        if not chunk:
                            return _finish(self.proc, deadline, kept, dropped)
                        room = max(0, limit - len(kept))
                        kept += chunk[:room]
                        dropped += len(chunk) - min(room, len(chunk))
            finally:
                if exited is not None:
                    os.close(exited)

    def _reported(self, chunk: bytes) -> None:
        self.lines += chunk
        *done, self.lines = self.lines.split(b"\n")
        for line in done:
            what, _, rest = line.decode("ascii", errors="replace").partition(" ")
            if what == "init" and rest.isdigit() and self.init is None:
                self.init = _pidfd_of_child(int(rest), self.proc.pid)
            elif what == "refused":
                self.refused = tuple(rest.split())

    def kill(self, reap: bool = True) -> None:
        """Kill the PID namespace's init (so the kernel kills everything in it), then what is
        left of the child's process group (and, with ``reap``, reap the child)."""
        if self.init is not None:
            try:
                signal.pidfd_send_signal(self.init, signal.SIGKILL)
            except ProcessLookupError:  # it has exited: its namespace is empty already
                pass
            else:  # the kernel lets init exit only once it has reaped the rest of its namespace
                _wait_exit(self.init, KILL_WAIT_S)
        _kill_group(self.proc, reap)

    def end(self) -> None:
        self.kill()
        for fd in (self.report, self.init):
            if fd is not None:
                os.close(fd)
        self.init = None


def _pidfd_of_child(pid: int, parent: int) -> int | None:
    """A pidfd of ``pid`` if it is still ``parent``'s child (not a process that took a freed
    PID: the check runs after the pidfd pins the process it names)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        ppid = -1
    if ppid != parent:
        os.close(fd)
        return None
    return fd


def _wait_exit(pidfd: int, timeout_s: float) -> None:
    """Until the process of ``pidfd`` has exited (its pidfd reads ready), at most ``timeout_s``;
    a process a SIGKILL did not end by then is logged (a kernel stuck in uninterruptible I/O)."""
    with selectors.DefaultSelector() as selector:
        selector.register(pidfd, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            log.warning("a sandbox call's init outlived its SIGKILL by %g s", timeout_s)


def _exit_watch(proc: subprocess.Popen[bytes]) -> int | None:
    """A descriptor that becomes readable when ``proc`` exits (a pidfd; None where the kernel
    has none: then the pipe's end alone says the code is done)."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def _finish(
    proc: subprocess.Popen[bytes], deadline: float, kept: bytearray, dropped: int
) -> tuple[bytes, int, bool]:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output but kept running
        return bytes(kept), dropped, True
    return bytes(kept), dropped, False


def _kill_group(proc: subprocess.Popen[bytes], reap: bool = True) -> None:
    """Kill what is left of the child's process group (and, with ``reap``, reap the child)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # an exited child stays a zombie until reaped:
    except (ProcessLookupError, PermissionError):  # its pid, the group's id, is not reused
        if proc.returncode is None:
            proc.kill()  # the group is gone (or the child left it): the child itself
    if reap:
        proc.wait(timeout=KILL_WAIT_S)  # SIGKILL cannot be ignored: this returns at once
        if proc.stdout is not None:
            proc.stdout.close()


_current: Sandbox | None = None
_current_lock = threading.Lock()


def configure(settings: SandboxSettings) -> Sandbox:
    """Set the sandbox the python tool runs code in, in this process."""
    global _current
    with _current_lock:
        _current = Sandbox(settings)
        return _current


def current() -> Sandbox:
    """The configured sandbox (one with the default settings when none was)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Sandbox()
        return _current


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed (stdout and stderr).

    Each call is a fresh interpreter in an empty working folder, without network access. Print
    the values you want to see.

    Args:
        code: the complete Python program to run, for example "print(sum(range(10)))".
    """
    return current().run(code)
