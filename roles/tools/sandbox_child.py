"""The sandboxed interpreter's first steps: limit this process, then run the user's code.

Run as a script by ``sandbox.py`` (``python -I -B sandbox_child.py CONFIG``), never imported, and
written with the standard library only: it runs before anything else in a fresh interpreter. In
order, while the process is still single-threaded:

1. network off (``"network": false``): a new user and network namespace, so the process sees
   only a loopback interface that is down (``unshare(2)``; the user namespace maps the caller's
   own uid and gid, so files keep their owner);
2. files (Landlock, Linux 5.13+): writes only beneath the working folder (and to ``/dev/null``),
   reads only beneath the paths the parent lists (the interpreter, its packages, system
   libraries); with Landlock ABI 6+ also no signals to, and no abstract unix sockets of,
   processes outside the sandbox;
3. resource limits: address space, CPU seconds, file size, open files, no core files;
4. an audit hook (Python's ``sys.addaudithook``): refuses sockets with a clear message when the
   network is off, and stands in, as a Python-level guard only, for what the kernel could not
   do (1 or 2 unavailable);
5. the code, compiled as ``main.py`` and run as ``__main__`` in the working folder.

With ``"probe": true`` it stops after 2 and prints, as JSON, which of 1 and 2 took effect.
A ``MemoryError`` that reaches the top exits with the parent's ``memory_exit`` code, so the
parent can tell a program killed by its memory limit from one that failed.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same on every arch
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_AND_REMOVE = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char..symlink
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
FILE_ACCESS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # what a rule on a file may allow

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def leave_network() -> bool:
    """Enter new user + network namespaces; False when the kernel refuses."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
        return True
    return libc.unshare(CLONE_NEWNET) == 0  # privileged, without user namespaces


def restrict_files(folder: str, readable: list[str]) -> int:
    """Landlock: write beneath ``folder`` only, read beneath ``readable`` only; the ABI applied,
    0 when Landlock is unavailable."""
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    if abi < 1:
        return 0
    write = (
        WRITE_FILE | MAKE_AND_REMOVE | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    )
    read = EXECUTE | READ_FILE | READ_DIR
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(read | write, 0, scoped)
    size = ctypes.sizeof(attr) if abi >= 6 else 8  # older kernels know the first field only
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return 0
    allow(ruleset, folder, read | write)
    allow(ruleset, "/dev/null", READ_FILE | WRITE_FILE | (TRUNCATE if abi >= 3 else 0))
    for path in [*readable, f"/proc/{os.getpid()}"]:
        allow(ruleset, path, read)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return 0
    if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
        return 0
    os.close(ruleset)
    return int(abi)


def allow(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine does not have
    try:
        if not os.path.isdir(path):
            access &= FILE_ACCESS
        rule = PathBeneath(access, fd)
        libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0)
    finally:
        os.close(fd)


def set_limits(config: dict) -> None:
    memory, cpu, file_bytes = config["memory_bytes"], config["cpu_s"], config["file_bytes"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


NETWORK_EVENTS = {
    "socket.bind",
    "socket.connect",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
    "socket.sendmsg",
    "socket.sendto",
}
ESCAPES = {"ctypes.dlopen", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn"}
ESCAPES |= {"os.system", "subprocess.Popen", "os.kill", "os.killpg"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link"}
PATH_EVENTS |= {"os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree"}


def install_guard(config: dict, applied: dict) -> None:
    folder = os.path.realpath(config["folder"])
    no_network = not config["network"]
    kernel_net = applied["netns"]
    kernel_files = applied["landlock"] > 0

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # an open file descriptor: already allowed when it was opened
        where = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
        return where == folder or where.startswith(folder + os.sep) or where == os.devnull

    def hook(event: str, args: tuple) -> None:
        if no_network and event in NETWORK_EVENTS:
            raise PermissionError(f"the network is off in this sandbox ({event} refused)")
        if no_network and not kernel_net and event in ESCAPES:
            raise PermissionError(f"{event} is refused in this sandbox")
        if kernel_files:
            return
        if event == "open" and args[2] & WRITE_FLAGS and not inside(args[0]):
            raise PermissionError(f"writing outside the working folder is refused ({args[0]})")
        if event in PATH_EVENTS and args and not inside(args[0]):
            raise PermissionError(f"{event} outside the working folder is refused ({args[0]})")

    sys.addaudithook(hook)


def run(config: dict) -> int:
    path = os.path.join(config["folder"], "main.py")
    with open(path) as f:
        source = f.read()
    sys.argv = ["main.py"]
    sys.path.insert(0, config["folder"])
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": path})
    except MemoryError as exc:
        print_user_traceback(exc)
        return int(config["memory_exit"])
    except SystemExit:
        raise
    except BaseException as exc:  # the user's program failed: show its traceback, as python does
        print_user_traceback(exc)
        return 1
    return 0


def print_user_traceback(exc: BaseException) -> None:
    """The traceback from the user's code on (this file's frame left out)."""
    frames = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, frames)


def main() -> int:
    config = json.loads(sys.argv[1])
    applied = {"netns": False, "landlock": 0}
    if not config["network"]:
        applied["netns"] = leave_network()
    applied["landlock"] = restrict_files(config["folder"], config["readable"])
    if config.get("probe"):
        print(json.dumps(applied))
        return 0
    set_limits(config)
    os.chdir(config["folder"])
    install_guard(config, applied)
    return run(config)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
