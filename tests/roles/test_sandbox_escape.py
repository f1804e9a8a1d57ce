"""Escapes from the python tool's sandbox, each tried as model output would try it, through the
real tool on this machine's kernel: every one must fail (``roles/tools/sandbox_child.py``).

The victims are real: a sacrificial process outside the sandbox (to renice, limit, pin and kill),
a unix socket listening outside it, a key in the caller's session keyring, the host's System V
shared memory. Then the same sandbox under a seccomp wrapper that takes user namespaces and
Landlock away (what Docker's default profile does): the tool refuses to run, unless the weak
mode is chosen by name, and then says what it lacks."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roles.tools.failures import SandboxKilled, ToolTimeout
from roles.tools.sandbox import Sandbox, SandboxSettings
from tests.conftest import require_system

MB = 2**20


@pytest.fixture(scope="module")
def box() -> Sandbox:
    found = Sandbox(SandboxSettings(memory_mb=128, timeout_s=3.0, output_chars=4000))
    weak = found.isolation()["weak"]
    require_system("kernel isolation (user namespaces, Landlock, seccomp)", not weak, str(weak))
    return found


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside the sandbox, of the same user, that the code will go after."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def require_cgroup(found: dict) -> None:
    """This machine's cgroup v1 memory and pids hierarchies, which root may write."""
    has = found["memory"].startswith("a cgroup per call")
    require_system("a writable cgroup v1 memory and pids hierarchy", has, found["memory"])


def limits_of(pid: int) -> str:
    return Path(f"/proc/{pid}/limits").read_text()


def test_every_layer_is_in_force_here(box: Sandbox) -> None:
    found = box.isolation()
    assert found["weak"] == []
    assert found["namespaces"].startswith("pid, ipc, mount")
    assert found["network"] == "namespace" and found["files"].startswith("landlock ABI")
    assert found["identity"].startswith("a uid and gid of each call's own")
    require_cgroup(found)
    assert found["memory"] == "a cgroup per call: 128 MiB and 64 processes in all"
    # the probe's report is read whole, whatever the calls' output limit
    again = Sandbox(SandboxSettings(memory_mb=128, output_chars=20)).isolation()
    assert again == found


def test_the_code_cannot_limit_renice_pin_or_kill_a_process_outside(
    box: Sandbox, victim: subprocess.Popen[bytes]
) -> None:
    """Row 1 and 2: prlimit, setpriority, sched_setaffinity and kill of an outside PID find no
    such process (a PID namespace), whatever Landlock's ABI; the victim is untouched."""
    pid = victim.pid
    before, nice = limits_of(pid), os.getpriority(os.PRIO_PROCESS, pid)
    code = "\n".join(
        [
            "import os, resource",
            "for name, act in [",
            f"    ('prlimit', lambda: resource.prlimit({pid}, resource.RLIMIT_CPU, (1, 1))),",
            f"    ('renice', lambda: os.setpriority(os.PRIO_PROCESS, {pid}, 19)),",
            f"    ('affinity', lambda: os.sched_setaffinity({pid}, {{0}})),",
            f"    ('kill', lambda: os.kill({pid}, 9)),",
            "    ('parent', lambda: resource.prlimit(os.getppid() or 1, resource.RLIMIT_CPU, "
            "(1, 1)) if os.getppid() else print('parent: none')),",
            "]:",
            "    try:",
            "        act(); print(name, 'done')",
            "    except OSError as exc:",
            "        print(name, type(exc).__name__)",
        ]
    )
    out = box.run(code)
    for name in ("prlimit", "renice", "affinity", "kill"):
        assert f"{name} ProcessLookupError" in out, out
    assert "parent: none" in out  # PID 1 of its namespace: no parent to name
    assert victim.poll() is None
    assert limits_of(pid) == before and os.getpriority(os.PRIO_PROCESS, pid) == nice
    assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
    assert resource.getrlimit(resource.RLIMIT_CPU) == (resource.RLIM_INFINITY,) * 2


def test_the_code_sees_only_its_own_processes(box: Sandbox) -> None:
    out = box.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert out == "[1]"


def test_no_unix_socket_reaches_a_listener_outside(box: Sandbox, tmp_path: Path) -> None:
    """Row 3: a pathname unix socket (as pyzmq's ipc:// or a docker.sock) from Python, from
    ctypes and from a child interpreter; an abstract one too. The listener sees no one."""
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0hybridflow-test-agent")
    for s in (listener, abstract):
        s.listen(8)
        s.settimeout(0)
    inner = f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"
    attempts = {
        "python": f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})",
        "abstract": "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        "s.connect('\\0hybridflow-test-agent')",
        "ctypes": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('fd', libc.socket(1, 1, 0), 'errno', ctypes.get_errno())",
        "child": f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])",
    }
    for how, code in attempts.items():
        out = box.run(code)
        assert "PermissionError" in out or "fd -1 errno 1" in out, (how, out)
    for s in (listener, abstract):
        with pytest.raises(BlockingIOError):
            s.accept()
        s.close()


def sandbox_processes(root: Path) -> list[int]:
    """Processes whose command line names the sandbox's folder (its children, their orphans)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_nothing_the_code_starts_outlives_the_call(box: Sandbox) -> None:
    """Row 4: a double fork + setsid orphan re-forking itself is gone when the call returns,
    and so is a plain background process (the PID namespace's init exited: the kernel killed
    the rest)."""
    code = "\n".join(
        [
            "import os, subprocess, sys, time",
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])",
            "if os.fork() == 0:",
            "    os.setsid()",
            "    if os.fork() == 0:",
            "        while True:",
            "            if os.fork() == 0:",
            "                while True: pass",
            "            time.sleep(0.01)",
            "    os._exit(0)",
            "def alive():",
            "    return len([p for p in os.listdir('/proc') if p.isdigit()])",
            "deadline = time.monotonic() + 5",
            "while alive() < 4 and time.monotonic() < deadline:  # until the orphans run",
            "    time.sleep(0.01)",
            "print('left', alive())",
        ]
    )
    out = box.run(code)
    assert out.startswith("left ") and int(out.split()[1]) >= 4, out
    assert sandbox_processes(box.root) == []


def test_shared_memory_is_bounded_and_gone_after_the_call(box: Sandbox) -> None:
    """Row 5: memfd is refused; System V segments past the memory limit are refused, and those
    within it die with the call's IPC namespace (the host's list is unchanged)."""
    before = Path("/proc/sysvipc/shm").read_text()
    assert "PermissionError" in box.run("import os\nos.memfd_create('x')")
    code = "\n".join(
        [
            "import ctypes",
            "libc = ctypes.CDLL(None, use_errno=True)",
            f"big = libc.shmget(0, {300 * MB}, 0o1600)",
            "print('big', big, ctypes.get_errno())",
            f"small = libc.shmget(0, {16 * MB}, 0o1600)",
            "print('small', small >= 0)",
        ]
    )
    out = box.run(code)
    assert out.split("\n")[0] == "big -1 22" and "small True" in out, out  # EINVAL: > shmmax
    assert Path("/proc/sysvipc/shm").read_text() == before


KEY_SPEC_SESSION_KEYRING = -3


def test_the_callers_keys_cannot_be_read(box: Sandbox) -> None:
    """Row 6: a user key in the caller's session keyring; the code's keyctl read fails (a fresh
    session keyring, and the key syscalls refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    add_key = 248  # x86_64
    if os.uname().machine != "x86_64":
        pytest.skip("the key syscall numbers here are x86_64's")
    key = libc.syscall(add_key, b"user", b"hybridflow-test", b"secret", 6, KEY_SPEC_SESSION_KEYRING)
    assert key > 0, ctypes.get_errno()
    code = "\n".join(
        [
            "import ctypes",
            "libc = ctypes.CDLL(None, use_errno=True)",
            "buf = ctypes.create_string_buffer(64)",
            f"n = libc.syscall(250, 11, {key}, buf, 64)",  # keyctl(KEYCTL_READ)
            "print(n, ctypes.get_errno(), buf.value)",
        ]
    )
    assert box.run(code) == "-1 1 b''"


# -- without kernel isolation --------------------------------------------------------------------

WRAPPER = """
import json, sys, pyseccomp as sc
rules = sc.SyscallFilter(sc.ALLOW)
# no user namespaces (unshare with CLONE_NEWUSER), no Landlock: what Docker's default seccomp
# profile leaves a process that is not privileged
rules.add_rule(sc.ERRNO(1), "unshare")
for name in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
    rules.add_rule(sc.ERRNO(38), name)
rules.load()
from roles.tools.sandbox import Sandbox, SandboxSettings
from roles.tools.failures import SandboxUnavailable
box = Sandbox(SandboxSettings(timeout_s=3.0, allow_weak=json.loads(sys.argv[1])))
report = {"isolation": box.isolation()}
try:
    report["out"] = box.run("print(open('/etc/passwd').read()[:4])")
except SandboxUnavailable as exc:
    report["refused"] = str(exc)
print(json.dumps(report))
"""


def weakened(allow_weak: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", WRAPPER, json.dumps(allow_weak)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    found: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def test_without_namespaces_and_landlock_the_tool_refuses_to_run() -> None:
    found = weakened(allow_weak=False)
    weak = found["isolation"]["weak"]
    assert {"namespaces", "network", "files"} <= set(weak), weak
    assert "seccomp" not in weak  # seccomp still loads under the wrapper
    assert "refuses to run" in found["refused"] and "sandbox_allow_weak: true" in found["refused"]


def test_the_weak_mode_runs_by_name_and_reads_are_not_restricted() -> None:
    found = weakened(allow_weak=True)
    assert found["out"] == "root"  # /etc/passwd: nothing stops a read in the weak mode


# -- escapes a line-by-line review found -----------------------------------------------------------

SYS_SOCKET, SYS_PRCTL, SYS_CLONE, SYS_CLONE3 = 41, 157, 56, 435  # x86_64
SYS_OPEN_TREE, SYS_FSOPEN = 428, 430
HIGH = 1 << 32  # a bit the kernel drops from an ``int`` argument, and a 64-bit compare sees

SYSCALL_HELPER = "\n".join(
    [
        "import ctypes, os",
        "libc = ctypes.CDLL(None, use_errno=True)",
        "libc.syscall.restype = ctypes.c_long",
        "def sys_(*args):",
        "    ctypes.set_errno(0)",
        "    r = libc.syscall(*[ctypes.c_long(a) for a in args])",
        "    if r == 0 and args[0] in (56, 435):  # a raw clone's child: leave at once",
        "        os._exit(0)",
        "    return r, ctypes.get_errno()",
    ]
)


def x86_64_only() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the syscall numbers here are x86_64's")


def test_socket_families_are_allow_listed_whatever_the_high_bits(
    box: Sandbox, tmp_path: Path
) -> None:
    """``socket(0x1_00000001, ...)`` is AF_UNIX to the kernel (an ``int``); a filter comparing the
    whole register let it through and the code reached a unix socket on the host. Netlink
    (nf_tables' surface) and vsock (not namespaced: a VM's host) are refused too, and with the
    network off so is AF_INET."""
    x86_64_only()
    path = str(tmp_path / "host.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0)
    code = "\n".join(
        [
            SYSCALL_HELPER,
            "import socket",
            f"fd, err = sys_({SYS_SOCKET}, {HIGH | socket.AF_UNIX}, socket.SOCK_STREAM, 0)",
            "print('unix-high', fd, err)",
            "if fd >= 0:  # through libc, past the audit hook's courtesy message",
            f"    addr = ctypes.create_string_buffer(b'\\x01\\x00' + {path.encode()!r}, 110)",
            "    print('connect', libc.connect(fd, addr, 110), libc.write(fd, b'out', 3))",
            f"print('netlink', *sys_({SYS_SOCKET}, 16, socket.SOCK_RAW, 12))",  # NETFILTER
            f"print('vsock', *sys_({SYS_SOCKET}, {HIGH | 40}, socket.SOCK_STREAM, 0))",
            f"print('inet', *sys_({SYS_SOCKET}, socket.AF_INET, socket.SOCK_STREAM, 0))",
        ]
    )
    out = box.run(code)
    for name in ("unix-high", "netlink", "vsock", "inet"):
        assert f"{name} -1 1" in out, out  # EPERM
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


def test_the_death_signal_stays_and_a_call_ends_its_whole_namespace(box: Sandbox) -> None:
    """``prctl(0x1_00000001, 0)`` cleared PR_SET_PDEATHSIG past a 64-bit compare; after
    ``setsid()`` the call's kill of its process group missed the code, which ran on after
    ``ToolTimeout``. The option's low 32 bits are what the filter compares, and a call ends by
    killing its PID namespace's init."""
    x86_64_only()
    code = "\n".join(
        [
            SYSCALL_HELPER,
            f"print('prctl', *sys_({SYS_PRCTL}, {HIGH | 1}, 0))",
            "os.setsid()",
            "print('setsid', flush=True)",
            "while True: pass",
        ]
    )
    with pytest.raises(ToolTimeout) as stopped:
        box.run(code)
    assert "prctl -1 1" in str(stopped.value) and "setsid" in str(stopped.value)
    left = sandbox_processes(box.root)
    for pid in left:  # leave no spinning process behind, even when the test fails
        os.kill(pid, 9)
    assert left == []


def test_the_code_holds_no_capability_and_makes_no_namespace_or_mount(box: Sandbox) -> None:
    """Root inside its own user namespace kept every capability (CAP_NET_ADMIN in a new network
    namespace: nf_tables); only unshare/setns were filtered, so a raw ``clone`` or ``clone3``
    with CLONE_NEW* flags and the new mount API (fsopen, open_tree) worked."""
    x86_64_only()
    new = 0x10000000 | 0x40000000  # CLONE_NEWUSER | CLONE_NEWNET
    code = "\n".join(
        [
            SYSCALL_HELPER,
            "import signal",
            "status = dict(line.split(':\\t') for line in open('/proc/self/status').read()"
            ".splitlines() if line.startswith('Cap'))",
            "print(sorted((k, v) for k, v in status.items()))",
            f"print('clone', *sys_({SYS_CLONE}, {new} | signal.SIGCHLD, 0, 0, 0, 0))",
            "args = (ctypes.c_uint64 * 11)()",
            f"args[0] = {new}; args[4] = signal.SIGCHLD",
            f"r = libc.syscall(ctypes.c_long({SYS_CLONE3}), args, ctypes.c_long(88))",
            "if r == 0: os._exit(0)",
            "print('clone3', r, ctypes.get_errno())",
            f"print('fsopen', *sys_({SYS_FSOPEN}, ctypes.addressof(ctypes.c_char_p(b'tmpfs')), 0))",
            "path = ctypes.create_string_buffer(b'/')",
            f"print('open_tree', *sys_({SYS_OPEN_TREE}, -100, ctypes.addressof(path), 1))",
        ]
    )
    out = box.run(code)
    lines = out.splitlines()
    caps = dict(eval(lines[0]))  # the code's own printout of /proc/self/status
    assert set(caps.values()) == {"0000000000000000"}, caps
    assert "clone -1 1" in out, out
    assert "clone3 -1 38" in out, out  # ENOSYS: glibc falls back to clone, whose flags are checked
    assert "fsopen -1 1" in out and "open_tree -1 1" in out, out


# through libc, past the audit hook's courtesy message
CONNECT = """
import ctypes, socket, struct
s = socket.socket()
addr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
print("connect", ctypes.CDLL(None).connect(s.fileno(), addr, len(addr)))
"""

CALL_WITHOUT_NAMESPACES = """
import json, socket, sys
from tests.roles.test_sandbox_escape import CONNECT
from roles.tools.sandbox import Sandbox, SandboxSettings
from roles.tools.failures import SandboxUnavailable
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(8)
listener.settimeout(0)
box = Sandbox(SandboxSettings(timeout_s=5.0))
report = {"weak": box.isolation()["weak"]}
# after the probe: no more network namespaces for anyone beneath this user namespace
with open("/proc/sys/user/max_net_namespaces", "w") as f:
    f.write("0")
port = listener.getsockname()[1]
try:
    report["out"] = box.run(CONNECT.format(port=port))
except SandboxUnavailable as exc:
    report["refused"] = str(exc)
try:
    listener.accept()
    report["reached"] = True
except BlockingIOError:
    report["reached"] = False
print(json.dumps(report))
"""


#: runs its arguments as root of a new user namespace that maps every id to itself (``unshare
#: -Ur`` maps only root, and the sandbox's calls need uids of their own)
IN_USER_NAMESPACE = """
import ctypes, os, sys
ready, go = os.pipe(), os.pipe()
child = os.fork()
if child == 0:
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
        sys.exit(f"unshare: errno {ctypes.get_errno()}")
    os.write(ready[1], b"x")
    os.read(go[0], 1)
    os.execv(sys.argv[1], sys.argv[1:])
os.read(ready[0], 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{child}/{name}", "w") as f:
        f.write("0 0 4294967295")
os.write(go[1], b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_a_call_that_cannot_get_its_namespaces_refuses_to_run() -> None:
    """Isolation was checked once, by the probe: a call whose namespaces the kernel refused (a
    namespace limit reached after the probe) ran in the host's network and reached 127.0.0.1.
    Here the limit is lowered inside a user namespace of the test's own, so the host's limits
    stay as they were."""
    out = subprocess.run(
        [sys.executable, "-c", IN_USER_NAMESPACE, sys.executable, "-c", CALL_WITHOUT_NAMESPACES],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    require_system("user namespaces", out.returncode == 0, out.stderr[-500:])
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["weak"] == [], found
    assert found["reached"] is False, found
    assert "namespaces" in found.get("refused", ""), found


# -- the code owns nothing on the host (an attack on the sandbox as root) ------------------------


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A folder of root's any process may walk into (as /usr, /dev, /sys are), with a root-owned
    file in it: what the code may name, and must not change."""
    found = Path(tempfile.mkdtemp(prefix="hybridflow-host-"))
    found.chmod(0o755)
    (found / "python").write_bytes(b"#!/bin/sh\n")
    (found / "python").chmod(0o755)
    yield found
    shutil.rmtree(found, ignore_errors=True)


def metadata_of(path: Path) -> tuple[int, int, int, int, list[str]]:
    """Mode, owner, group, modification time (files only: a folder's changes with its calls)
    and extended attributes."""
    st = path.stat()
    mtime = 0 if path.is_dir() else st.st_mtime_ns
    return st.st_mode, st.st_uid, st.st_gid, mtime, os.listxattr(path)


def test_the_code_changes_no_metadata_of_a_host_file(box: Sandbox, host_dir: Path) -> None:
    """The code ran as the caller's uid mapped to itself: as root it owned every root file, and
    Landlock has no rights for metadata. ``chmod`` set the setuid bit on a root-owned copy of an
    interpreter, ``chmod 000`` on the sandbox's own root failed every later call, ``utime`` and
    ``user.*`` xattrs (an answer stored for a later episode) succeeded. Now it runs as a uid of
    its own and the metadata calls are refused: every attempt fails, nothing changed."""
    victim = host_dir / "python"
    before, root_before = metadata_of(victim), metadata_of(box.root)
    code = "\n".join(
        [
            "import os",
            "for name, act in [",
            f"    ('setuid', lambda: os.chmod({str(victim)!r}, 0o4755)),",
            f"    ('chown', lambda: os.chown({str(victim)!r}, os.getuid(), os.getgid())),",
            f"    ('utime', lambda: os.utime({str(victim)!r}, (0, 0))),",
            f"    ('xattr', lambda: os.setxattr({str(victim)!r}, 'user.answer', b'42')),",
            f"    ('root', lambda: os.chmod({str(box.root)!r}, 0)),",
            "    ('own', lambda: os.chmod('.', 0)),",
            "]:",
            "    try:",
            "        act(); print(name, 'done')",
            "    except OSError as exc:",
            "        print(name, type(exc).__name__)",
            "print('uid', os.getuid(), os.getgid(), os.getgroups())",
        ]
    )
    out = box.run(code)
    assert "done" not in out, out
    assert metadata_of(victim) == before and metadata_of(box.root) == root_before
    uid, gid, groups = out.splitlines()[-1].split(" ", 3)[1:]
    assert int(uid) not in (0, os.getuid()) and int(gid) not in (0, os.getgid()), out
    assert groups == "[]", out  # none of root's supplementary groups either
    assert box.run("print('next')") == "next"  # the root folder still serves calls


def test_sysv_semaphores_and_message_queues_are_capped(box: Sandbox) -> None:
    """Only shared memory was capped in the call's IPC namespace: its semaphores and message
    queues (about 65 GB allowed) took 2 GiB of unreclaimable kernel memory under a 64 MiB limit."""
    code = "\n".join(
        [
            "import ctypes",
            "libc = ctypes.CDLL(None, use_errno=True)",
            "sems = sum(libc.semget(0, 32, 0o1600) >= 0 for _ in range(200))",
            "queues = [q for q in (libc.msgget(0, 0o1600) for _ in range(200)) if q >= 0]",
            "message = ctypes.create_string_buffer(b'\\x01' + bytes(8 + 4096))",
            "sent = 0",
            "while sent < 2**22 and libc.msgsnd(queues[0], message, 4096, 0o4000) == 0:",
            "    sent += 4096",  # IPC_NOWAIT: until the queue is full
            "print('semaphores', sems * 32, 'queues', len(queues), 'bytes', sent)",
        ]
    )
    out = box.run(code).split()
    semaphores, queues, sent = int(out[1]), int(out[3]), int(out[5])
    assert 0 < semaphores <= 256 and 0 < queues <= 16 and 0 < sent <= 65536, out


SYS_MEMFD_SECRET, SYS_INOTIFY_INIT1, SYS_FANOTIFY_INIT, SYS_IO_SETUP = 447, 294, 300, 206


def test_memory_no_limit_counts_and_host_quotas_are_refused(box: Sandbox) -> None:
    """``memfd_secret`` held 1 GiB of unevictable memory with a 19 MB address space; inotify
    watched a sibling call's files and, with fanotify and ``io_setup``, took root's host-wide
    quotas (128 inotify instances, 128 fanotify groups, the system's aio contexts)."""
    x86_64_only()
    code = "\n".join(
        [
            SYSCALL_HELPER,
            f"print('memfd_secret', *sys_({SYS_MEMFD_SECRET}, 0))",
            f"print('inotify', *sys_({SYS_INOTIFY_INIT1}, 0))",
            f"print('fanotify', *sys_({SYS_FANOTIFY_INIT}, 0, 0))",
            "context = ctypes.c_ulong(0)",
            f"print('io_setup', *sys_({SYS_IO_SETUP}, 8, ctypes.addressof(context)))",
        ]
    )
    out = box.run(code)
    for name in ("memfd_secret", "inotify", "fanotify", "io_setup"):
        assert f"{name} -1 1" in out, out  # EPERM


def test_a_host_datagram_socket_is_not_reached(box: Sandbox, host_dir: Path) -> None:
    """``socketpair`` was not filtered (only ``socket``), and a datagram socket from it can
    ``sendto`` any named unix socket (journald, syslog, systemd's notify socket: Landlock ABI 7
    does not scope them); the listener saw uid 0. A stream pair (asyncio's own) still works."""
    path = str(host_dir / "journal.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    os.chmod(path, 0o666)  # as journald's socket is
    listener.settimeout(0)
    code = "\n".join(
        [
            "import asyncio, ctypes, socket",
            "try:",
            "    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)",
            f"    print('sent', a.sendto(b'from the sandbox', {path!r}))",
            "except OSError as exc:",
            "    print('dgram', type(exc).__name__)",
            "libc = ctypes.CDLL(None, use_errno=True)",
            "fds = (ctypes.c_int * 2)()",
            "ctypes.set_errno(0)",
            "print('raw', libc.socketpair(1, 2, 0, fds), ctypes.get_errno())",
            "if fds[0] > 0:  # through libc, past the audit hook's courtesy message",
            f"    addr = ctypes.create_string_buffer(b'\\x01\\x00' + {path.encode()!r}, 110)",
            "    print('raw sent', libc.sendto(fds[0], b'raw', 3, 0, addr, 110))",
            "asyncio.run(asyncio.sleep(0))",  # its self-pipe is a stream socketpair
            "print('stream', len(socket.socketpair()))",
        ]
    )
    out = box.run(code)
    assert "dgram PermissionError" in out and "raw -1 1" in out and "stream 2" in out, out
    with pytest.raises(BlockingIOError):
        listener.recv(100)
    listener.close()


def test_the_call_shares_one_memory_and_process_limit(box: Sandbox) -> None:
    """The limits were per process: ``fork`` gave 6 children 1.8 GiB under a 512 MiB limit, and
    root's process limit does not hold, so one call started 7,872 threads. The call's processes
    now share one memory limit and one process limit (a cgroup where the host lets one be made,
    and a process limit of the call's own uid)."""
    threads = "\n".join(
        [
            "import threading",
            "threading.stack_size(64 * 1024)",  # address space is not what stops them
            "stop, started = threading.Event(), 0",
            "try:",
            "    while started < 500:",
            "        threading.Thread(target=stop.wait).start()",
            "        started += 1",
            "except RuntimeError:",
            "    pass",
            "stop.set()",
            "print('threads', started)",
        ]
    )
    out = box.run(threads)
    assert 0 < int(out.split()[1]) < 64, out  # the process limit of the call's own uid
    require_cgroup(box.isolation())
    hold = "\n".join(
        [
            "import os",
            "children, (release, keep) = [], os.pipe()",
            "for _ in range(3):",
            "    ready, done = os.pipe()",
            "    pid = os.fork()",
            "    if pid == 0:",
            "        os.close(keep)",
            f"        block = b'x' * {90 * MB}",  # written: resident, not only reserved
            "        os.write(done, b'x')",
            "        os.read(release, 1)",  # held until the parent has exited
            "        os._exit(0)",
            "    os.close(done)",
            "    os.read(ready, 1)",  # b'' when the child died first
            "    children.append(pid)",
            "alive = [pid for pid in children if os.waitpid(pid, os.WNOHANG) == (0, 0)]",
            "print('holding', len(alive), flush=True)",
        ]
    )
    try:
        out = box.run(hold)
    except SandboxKilled as exc:  # the kernel's OOM killer chose the namespace's init
        assert "out of memory" in str(exc), exc
    else:
        assert out.startswith("holding ") and int(out.split()[1]) < 3, out


def test_a_sibling_call_is_out_of_reach(box: Sandbox) -> None:
    """Calls ran as one uid: ``chmod 0`` on each new call folder made its siblings fail (under
    GRPO that raises the attacker's own advantage). Each call now has a uid and a folder of its
    own, which another call can neither list, enter nor change."""
    result: dict[str, str] = {}
    sibling = threading.Thread(
        target=lambda: result.update(
            out=box.run(
                "import os, time\nopen('mine', 'w').write('kept')\n"
                "deadline = time.monotonic() + 20\n"
                "while not os.path.exists('go') and time.monotonic() < deadline:\n"
                "    time.sleep(0.01)\n"
                "print(open('mine').read(), sorted(os.listdir('.')))"
            )
        )
    )
    sibling.start()
    folder = wait_for_call_folder(box.root, "mine")
    code = "\n".join(
        [
            "import os",
            "for name, act in [",
            f"    ('list root', lambda: os.listdir({str(box.root)!r})),",
            f"    ('list', lambda: os.listdir({str(folder)!r})),",
            f"    ('read', lambda: open({str(folder / 'mine')!r}).read()),",
            f"    ('chmod', lambda: os.chmod({str(folder)!r}, 0)),",
            f"    ('write', lambda: open({str(folder / 'planted')!r}, 'w').write('x')),",
            "]:",
            "    try:",
            "        act(); print(name, 'done')",
            "    except OSError as exc:",
            "        print(name, type(exc).__name__)",
        ]
    )
    out = box.run(code)
    (folder / "go").touch()
    sibling.join(timeout=30)
    assert "done" not in out, out
    assert result.get("out") == "kept ['go', 'main.py', 'mine']", result


def wait_for_call_folder(root: Path, marker: str, timeout_s: float = 20.0) -> Path:
    """The running call's folder, once its code has written ``marker`` there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in root.rglob(marker):
            return entry.parent
        time.sleep(0.01)
    raise AssertionError(f"no call wrote {marker} in {root} within {timeout_s:g} s")


def test_a_deep_tree_is_removed_after_the_call(box: Sandbox) -> None:
    """3,000 nested folders made ``shutil.rmtree`` raise ``RecursionError`` (which
    ``ignore_errors`` does not catch): the call failed and its folder stayed on disk."""
    code = "\n".join(
        [
            "import os",
            "for _ in range(3000):",
            "    os.mkdir('d')",
            "    os.chdir('d')",
            "print('deep')",
        ]
    )
    before = set(box.root.iterdir())
    assert box.run(code) == "deep"
    assert set(box.root.iterdir()) == before


RANK = """
import sys
from roles.tools.sandbox import Sandbox, SandboxSettings
box = Sandbox(SandboxSettings(timeout_s=600.0, root=sys.argv[1]))
box.run("import time\\nopen('started', 'w').close()\\nwhile True:\\n    time.sleep(1)")
"""


def test_a_call_ends_when_its_rank_dies(tmp_path: Path) -> None:
    """The outer child had no death signal tied to the rank and the wall-clock limit is the
    rank's: a call sleeping in a loop (no CPU used) was alive 8 s after the rank was killed."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, str(root)], cwd=Path(__file__).resolve().parents[2]
    )
    try:
        wait_for_call_folder(root, "started", timeout_s=60)
        assert sandbox_processes(root) != []
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 10
        while sandbox_processes(root) and time.monotonic() < deadline:
            time.sleep(0.01)
        left = sandbox_processes(root)
        for pid in left:
            os.kill(pid, 9)
        assert left == []
    finally:
        rank.kill()
        rank.wait()


WITHOUT_A_UID = """
import json
from roles.tools.sandbox import Sandbox, SandboxSettings
from roles.tools.failures import SandboxUnavailable
report = {}
for weak in (False, True):
    box = Sandbox(SandboxSettings(timeout_s=5.0, allow_weak=weak))
    report["weak"] = box.isolation()["weak"]
    try:
        report[str(weak)] = box.run("import os\\nprint(os.getuid())")
    except SandboxUnavailable as exc:
        report[str(weak)] = str(exc)
print(json.dumps(report))
"""


def test_without_a_uid_of_its_own_the_tool_refuses_to_run() -> None:
    """Root of a user namespace that maps root alone (as in a rootless container) has no other
    uid to give the code: the identity is the one layer missing, and the tool refuses to run
    unless the weak mode is chosen by name (then the code runs as that root)."""
    out = subprocess.run(
        ["unshare", "-Ur", sys.executable, "-c", WITHOUT_A_UID],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    require_system("user namespaces (unshare -Ur)", out.returncode == 0, out.stderr[-500:])
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["weak"] == ["identity"], found
    assert "missing: identity" in found["False"] and "sandbox_allow_weak" in found["False"]
    assert found["True"] == "0", found
