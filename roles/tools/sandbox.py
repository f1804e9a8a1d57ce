"""The python tool: run the model's code in a separate, isolated interpreter.

Each call starts ``python -I -B`` (isolated: no environment variables of Python's, no user site,
no current folder on the path) in a fresh working folder under the sandbox's root (a temporary
folder per env group, removed when the process ends; the call's folder is removed after the
call, however deep the code nested it). ``sandbox_child.py`` isolates the child before the code
runs: PID, IPC, mount and (network off, the default) network namespaces with the code as PID 1
of its own, a ``/proc`` of that namespace, System V memory, semaphores and queues capped in its
IPC namespace, **a uid and gid of the call's own** that own nothing on the host (as root; the
call's folder is the one thing given to it), a fresh session keyring, Landlock (writes in the
working folder only, reads of the interpreter and system libraries only), resource limits
(address space ``memory_mb``, CPU seconds, file size, open files, ``processes``, no core files),
a cgroup for the whole call where the host lets one be made (memory ``memory_mb`` and
``processes`` in all) and a seccomp filter (socket families allow-listed, datagram socket pairs,
memfd, file metadata, inotify/fanotify/aio, key syscalls, ptrace, namespaces, mounts, io_uring
refused), with every capability dropped. The call dies with the rank that made it (a death
signal). Each call checks that it got every layer the probe found (else ``SandboxUnavailable``).
A wall-clock limit (``timeout_s``) ends the call by killing its PID namespace's init (a pidfd):
then the kernel kills whatever it started. The environment is a minimal one (``PATH``, ``HOME``
and ``TMPDIR`` set to the working folder), so no secret of the role's environment reaches it;
stdin is empty.

``isolation()`` says which layers took effect here (a probe child applies them all once).
Where one is missing the sandbox refuses to run (``SandboxUnavailable``) unless the settings opt
into the weak mode by name (``allow_weak``): then what that layer stops is not stopped. The
identity needs root (a caller that is not root has no other uid to give; subordinate uid ranges
are not used yet). What it never protects against: a disk filled with many files each under the
file-size limit, and reading what the allowed paths hold; without a writable cgroup, memory is
limited per process (``processes`` x ``memory_mb`` in all). docs/agentic.md has the table of
layers.

The python tool reports what the code printed (stdout and stderr together, cut to
``output_chars``), and its exit status when it is not 0; a program killed by a limit raises
``SandboxKilled``, one stopped at its wall-clock limit ``ToolTimeout``. The env role sets the
limits from its config with ``configure`` (``sandbox_*`` keys); without it, the defaults below.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roles.tools.failures import SandboxKilled, SandboxUnavailable, ToolTimeout

log = logging.getLogger(__name__)
CHILD = Path(__file__).with_name("sandbox_child.py")
KILL_WAIT_S = 10.0  # how long a SIGKILLed child may take to be reaped
PROBE_TIMEOUT_S = 60.0  # how long the probe of what the kernel enforces may take
MEMORY_EXIT = 86  # the child's exit code when a MemoryError reached the top
#: each call's uid and gid: ``uid_base`` + this process's pid (22 bits) x ``SLOTS`` + a slot
SLOTS = 256
UID_SPAN = (1 << 22) * SLOTS
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
    #: processes and threads of one call, in all
    processes: int = 64
    #: the first uid (and gid) calls run as: a range no account on the host uses
    uid_base: int = 2_000_000_000

    def __post_init__(self) -> None:
        if self.memory_mb < 32 or self.timeout_s <= 0 or self.output_chars < 1:
            raise ValueError(
                f"sandbox settings need memory_mb >= 32, timeout_s > 0 and output_chars >= 1 "
                f"(got {self.memory_mb}, {self.timeout_s}, {self.output_chars})"
            )
        if self.processes < 4:
            raise ValueError(f"sandbox processes must be >= 4 (got {self.processes})")
        if not 65536 <= self.uid_base <= 2**32 - 2 - UID_SPAN:
            raise ValueError(
                f"sandbox uid_base must leave the system's ids below it and {UID_SPAN} ids "
                f"above it: 65536 <= uid_base <= {2**32 - 2 - UID_SPAN} (got {self.uid_base})"
            )


@dataclass(frozen=True)
class Outcome:
    returncode: int
    output: str
    timed_out: bool
    #: the layers this call could not get (the child refused to run the code)
    refused: tuple[str, ...] = ()
    #: the kernel killed a process of the call at its cgroup's memory limit
    out_of_memory: bool = False


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
        """The folder of the calls' folders (the caller's alone: a call sees its own folder
        bound in place, nothing else of it)."""
        with self._lock:
            if self._root is None:
                base = self.settings.root
                self._root = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-", dir=base))
                weakref.finalize(self, remove_tree, self._root)
            return self._root

    def isolation(self) -> dict[str, Any]:
        """Each layer the kernel enforces here, by name, and ``weak``: the layers missing (found
        once, by a probe child that applies them all). Empty ``weak``: the full sandbox."""
        if self._isolation is None:
            with self._cell() as cell:  # not the code's time limit: a busy machine may start
                extra = {"probe": True}  # an interpreter slowly
                outcome = self._spawn(cell, extra, PROBE_TIMEOUT_S, limit=65536)
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
            self._isolation = layers(applied, self.settings)
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
        with self._cell() as cell:
            (cell.folder / "main.py").write_text(code)
            outcome = self._spawn(cell, {"required": self._required}, self.settings.timeout_s)
        return self._report(outcome)

    @contextlib.contextmanager
    def _cell(self) -> Iterator[_Cell]:
        """A call's place: its uid (as root; the child gives it the folder), its folder, its
        cgroups (where the host lets them be made); all of it removed or given back after."""
        uid = _uids.take(self.settings.uid_base) if os.geteuid() == 0 else None
        try:
            try:
                folder = Path(tempfile.mkdtemp(prefix="call-", dir=self.root))
            except FileNotFoundError:  # a cleaner of /tmp removed the root during a long run
                with self._lock:
                    self._root = None
                folder = Path(tempfile.mkdtemp(prefix="call-", dir=self.root))
            try:
                cgroups = _cgroups.make(f"hybridflow-sandbox-{os.getpid()}-{folder.name}")
                try:
                    cgroups.limit(self.settings.memory_mb * 2**20, self.settings.processes)
                    yield _Cell(folder, uid, cgroups)
                finally:
                    cgroups.remove()
            finally:
                remove_tree(folder)
        finally:
            if uid is not None:
                _uids.give(uid)

    def _report(self, outcome: Outcome) -> str:
        output = outcome.output
        if outcome.refused:
            raise SandboxUnavailable(
                "this call could not get the sandbox's isolation (missing: "
                f"{', '.join(outcome.refused)}; a namespace limit reached by concurrent calls, or "
                "memory) and refused to run the code"
            )
        if outcome.out_of_memory and (outcome.returncode < 0 or outcome.timed_out):
            raise SandboxKilled(
                f"the code ran out of memory (its limit is {self.settings.memory_mb} MiB for all "
                f"its processes, sandbox_memory_mb); its output:\n{output}"
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
        self, cell: _Cell, extra: dict[str, Any], timeout_s: float, limit: int | None = None
    ) -> Outcome:
        """Run the child in ``cell``; ``limit``: the output kept (default ``output_chars``)."""
        s = self.settings
        memory = s.memory_mb * 2**20
        folder = cell.folder
        config = {
            "folder": str(folder),
            "parent": os.getpid(),
            "uid": cell.uid,
            "gid": cell.uid,
            "cgroups": cell.cgroups.procs(),
            "processes": s.processes,
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
        out_of_memory = cell.cgroups.out_of_memory()
        return Outcome(proc.returncode, text.rstrip("\n"), timed_out, call.refused, out_of_memory)

    def _readable(self) -> list[str]:
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        return [*sorted(prefixes), *_SYSTEM_READ, *_DEVICES, *self.settings.readable]


#: the layers the full sandbox has (``isolation()``'s names)
LAYERS = (
    "identity",
    "namespaces",
    "network",
    "proc",
    "shared memory",
    "capabilities",
    "files",
    "seccomp",
    "keyring",
)


def layers(applied: dict[str, Any], settings: SandboxSettings) -> dict[str, Any]:
    """The probe child's report (``sandbox_child.isolate``) in words, per layer; ``weak``
    lists the layers that did not take effect. ``memory`` says how memory and processes are
    limited (a cgroup for the whole call, or per process where none could be made)."""
    spaces = applied.get("namespaces", "")
    abi = int(applied.get("landlock", 0))
    network = settings.network
    found: dict[str, Any] = {
        "identity": "a uid and gid of each call's own, no supplementary group"
        if applied.get("identity")
        else "",
        "namespaces": f"pid, ipc, mount ({spaces} namespaces)" if spaces else "",
        "network": "allowed" if network else ("namespace" if spaces else ""),
        "proc": "its own /proc" if applied.get("proc") else "",
        "shared memory": "own IPC namespace; shared memory, semaphores and queues capped"
        if applied.get("shared_memory")
        else "",
        "capabilities": "all dropped, bounding set empty" if applied.get("capabilities") else "",
        "files": f"landlock ABI {abi}" if abi else "",
        "seccomp": "socket families and pair types allow-listed; memfd, file metadata, inotify, "
        "fanotify, aio, keys, ptrace, namespaces, mounts refused"
        if applied.get("seccomp")
        else "",
        "keyring": "fresh session keyring" if applied.get("keyring") else "",
    }
    found["weak"] = [name for name in LAYERS if not found[name]]
    for name in found["weak"]:
        found[name] = "none"
    mb, processes = settings.memory_mb, settings.processes
    found["memory"] = (
        f"a cgroup per call: {mb} MiB and {processes} processes in all"
        if applied.get("cgroup")
        else f"per process only (no writable cgroup): {mb} MiB each, {processes} processes"
    )
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


def remove_tree(path: Path) -> None:
    """Remove a folder however deep the code nested it (``shutil.rmtree`` recurses and raises
    ``RecursionError`` past Python's limit, and paths past PATH_MAX fail): each folder's
    subfolders are moved up into ``path`` before it is emptied, so the work is flat and no path
    is longer than two names. Symbolic links are removed, never followed."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("could not remove the sandbox folder %s: %s", path, exc)
        return
    moved = 0
    try:
        while True:
            with os.scandir(top) as entries:
                names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            if not names:
                break
            for name, is_dir in names:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                try:
                    os.rmdir(name, dir_fd=top)
                    continue
                except OSError:  # not empty: its files go, its folders move up to the top
                    pass
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    with os.scandir(inner) as entries:
                        children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                    for child, child_is_dir in children:
                        if child_is_dir:
                            moved += 1
                            os.rename(child, f".up-{moved}", src_dir_fd=inner, dst_dir_fd=top)
                        else:
                            os.unlink(child, dir_fd=inner)
                finally:
                    os.close(inner)
    except OSError as exc:
        log.warning("could not remove the sandbox folder %s: %s", path, exc)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError as exc:
        log.warning("could not remove the sandbox folder %s: %s", path, exc)


class _Uids:
    """The uids of this process's running calls: ``uid_base`` + its pid's low 22 bits x
    ``SLOTS`` + a free slot, so calls at once, and the calls of other processes, never share
    one (the call's processes count against its own process limit, its folder is its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def take(self, base: int) -> int:
        with self._lock:
            first = base + (os.getpid() & 0x3FFFFF) * SLOTS
            for uid in range(first, first + SLOTS):
                if uid not in self._taken:
                    self._taken.add(uid)
                    return uid
        raise SandboxUnavailable(
            f"more than {SLOTS} python tool calls at once in one process; lower the env "
            "role's workers"
        )

    def give(self, uid: int) -> None:
        with self._lock:
            self._taken.discard(uid)


class _CallCgroups:
    """One call's cgroup folders, by controller (none where the host lets none be made)."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def limit(self, memory: int, processes: int) -> None:
        settings = {
            "memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
            "pids": [("pids.max", processes)],
        }
        for controller, folder in self.folders.items():
            for name, value in settings[controller]:
                path = folder / name
                if path.exists():  # memsw: only where swap is accounted
                    path.write_text(str(value))

    def procs(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.folders.values()]

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the call at the memory limit."""
        folder = self.folders.get("memory")
        if folder is None:
            return False
        try:
            lines = (folder / "memory.oom_control").read_text().split("\n")
        except OSError:
            return False
        counts = dict(line.split() for line in lines if line.count(" ") == 1)
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """Remove the folders once the kernel has let the call's exited processes go (their
        exit may still be under way when the parent has reaped the child)."""
        deadline = time.monotonic() + KILL_WAIT_S
        for folder in self.folders.values():
            while True:
                try:
                    folder.rmdir()
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("could not remove the sandbox's cgroup %s: %s", folder, exc)
                        break
                time.sleep(0.01)


class _Cgroups:
    """Where calls' cgroups are made: for the cgroup v1 ``memory`` and ``pids`` controllers, the
    folder of this process's own cgroup in each, when this process may write there (found once).
    cgroup v2 is not used yet: where only it is mounted, limits are per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parents: dict[str, Path] | None = None

    def parents(self) -> dict[str, Path]:
        with self._lock:
            if self._parents is None:
                self._parents = _writable_cgroups() if os.geteuid() == 0 else {}
                for parent in self._parents.values():
                    _remove_orphans(parent)
            return self._parents

    def make(self, name: str) -> _CallCgroups:
        made: dict[str, Path] = {}
        for controller, parent in self.parents().items():
            try:
                (parent / name).mkdir()
            except OSError as exc:
                log.warning("the sandbox could not make a %s cgroup: %s", controller, exc)
                continue
            made[controller] = parent / name
        return _CallCgroups(made)


def _remove_orphans(parent: Path) -> None:
    """The cgroups of calls whose rank was killed during them (nothing else removed them)."""
    for folder in parent.glob("hybridflow-sandbox-*-call-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):  # still holding a process: not an orphan yet
                folder.rmdir()


def _writable_cgroups() -> dict[str, Path]:
    """{controller: this process's cgroup folder} for the v1 memory and pids controllers."""
    mounts: dict[str, tuple[Path, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                fstype, _, options = rest.split(" ", 2)
                parts = fields.split()
                if fstype != "cgroup":
                    continue
                for controller in ("memory", "pids"):
                    if controller in options.strip().split(","):
                        mounts[controller] = (Path(parts[4]), parts[3])
        own: dict[str, str] = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, where = line.rstrip("\n").split(":", 2)
                for controller in names.split(","):
                    own[controller] = where
    except (OSError, ValueError):
        return {}
    found = {}
    for controller, (mount, mount_root) in mounts.items():
        where = own.get(controller, "/")
        inside = os.path.relpath(where, mount_root) if where.startswith(mount_root) else "."
        for folder in (mount / inside, mount):
            if folder.is_dir() and os.access(folder, os.W_OK):
                found[controller] = folder.resolve()
                break
    return found


@dataclass(frozen=True)
class _Cell:
    folder: Path
    uid: int | None
    cgroups: _CallCgroups


_uids = _Uids()
_cgroups = _Cgroups()
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
