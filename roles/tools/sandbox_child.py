"""The sandboxed interpreter's first steps: isolate this process, then run the user's code.

Run as a script by ``sandbox.py`` (``python -I -B sandbox_child.py CONFIG``), never imported: it
runs before anything else in a fresh interpreter, while the process is single-threaded. In order:

0. **tied to the rank**: a death signal (SIGKILL) tied to the process that started it, checked
   to still be its parent, so a call never outlives a rank killed during it; then into the
   call's cgroups (memory and pids, made by the parent where the host lets it), before anything
   else can start;
1. **namespaces** (``unshare(2)``): PID, IPC, mount and, with the network off, network
   namespaces; as root they need no user namespace (its identity change below needs none
   either); without privilege, a user namespace mapping the caller's own uid and gid;
2. **fork**: this process stays outside and only waits; its child is PID 1 of the new PID
   namespace. Nothing outside it can be named (``kill``, ``prlimit``, ``setpriority``,
   ``sched_setaffinity`` and ``ptrace`` of an outside PID find no such process), and when it
   exits the kernel kills every process left in the namespace: nothing outlives the call. It
   dies with this process too (``PR_SET_PDEATHSIG``), so the parent's kill of this one ends all;
3. in the child: a private mount tree with a ``/proc`` of its own PID namespace (the host's
   processes are not listed); System V shared memory, semaphores and message queues capped
   inside its own IPC namespace (and gone with it); then **an identity that owns nothing**: the
   call's own uid and gid from the parent (never the caller's: as root that owns every root
   file's metadata), no supplementary group; a fresh session keyring of that uid; **every
   capability dropped**, the bounding set emptied and the securebits locked, so it holds nothing
   and an ``execve`` gets nothing back. Without privilege the identity cannot change: the layer
   is missing and the parent refuses to run code unless the weak mode is chosen;
4. **files** (Landlock, Linux 5.13+): writes only beneath the working folder (and to
   ``/dev/null``), reads only beneath the paths the parent lists (the interpreter, its packages,
   system libraries); the rules are made before the identity changes, so the folder need not be
   reachable by that uid from ``/``;
5. **resource limits**: address space, CPU seconds, file size, open files, processes (of the
   call's uid: threads count), no core files;
6. **seccomp** (libseccomp, through the ``pyseccomp`` binding): socket families are an
   allow-list (AF_INET and AF_INET6 with the network on, none with it off: never unix, netlink
   or vsock), ``socketpair`` of a stream or seqpacket type only (a datagram pair ``sendto``s any
   named unix socket), ``memfd_create`` and ``memfd_secret`` (pages no rlimit counts), the file
   metadata calls (``chmod``, ``chown``, ``utime``, xattrs: Landlock has no right for them),
   inotify, fanotify and ``io_setup`` (host-wide quotas, and a sibling's file names), the key
   syscalls, ``ptrace`` and cross-process memory, ``unshare``/``setns`` and ``clone`` with any
   CLONE_NEW* flag (``clone3``: ENOSYS, so libc falls back to ``clone``), mounts old and new
   (``fsopen``, ``open_tree``, ...), ``io_uring``, ``bpf``, ``perf_event_open``,
   ``userfaultfd`` and clearing the death signal fail with EPERM. Arguments the kernel reads as
   ``int`` are compared on their low 32 bits, as the kernel reads them;
7. **the check**: each layer the parent's probe found in force must have taken effect in this
   call too, or the child writes ``refused LAYERS`` on its report pipe and runs nothing (a
   namespace limit reached by concurrent calls must not run code in the host's namespaces);
8. an audit hook that turns a refused network call into a clear message (a courtesy, not a
   boundary: code can switch it off);
9. the code, compiled from ``main.py`` and run as ``__main__`` in the working folder.

The report pipe (``report_fd``) also carries ``init PID``: the PID namespace's init, which the
parent kills (by pidfd) to end a call, wherever the code moved its process group or session.
With ``"probe": true`` the child stops after 6 and prints, as JSON, which layers took effect.
A ``MemoryError`` that reaches the top exits with the parent's ``memory_exit`` code, so the
parent can tell a program killed by its memory limit from one that failed.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import traceback

try:  # before the identity changes: the uid the code runs as need not reach the packages' folder
    import pyseccomp
except (ImportError, OSError):  # the binding, or the libseccomp it loads, is missing
    pyseccomp = None

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 12, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
#: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (off), NO_CAP_AMBIENT_RAISE: each set and locked
SECUREBITS = 0b11101111
CAPABILITY_VERSION_3 = 0x20080522
CAP_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same on every arch
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
AF_INET, AF_INET6 = 2, 10
#: socketpair types that stay inside the pair (a datagram one can ``sendto`` a named socket)
PAIR_TYPES, SOCK_TYPE_MASK = (1, 5), 0xF  # SOCK_STREAM, SOCK_SEQPACKET
#: System V limits of the call's IPC namespace besides shared memory (the namespace's defaults
#: allow ~65 GB of kernel memory in semaphores and queues): semaphores per set, in all, per
#: semop, sets; queues, bytes per queue, bytes per message
SEMAPHORES = "32 256 32 16"
QUEUES, QUEUE_BYTES, MESSAGE_BYTES = 16, 65536, 8192
#: socket families the kernel knows are below 64 (it refuses the rest with EAFNOSUPPORT)
FAMILIES = 64
LOW_32 = 0xFFFFFFFF  # an ``int`` argument: the kernel reads these bits only
ENOSYS = 38
#: clone(2) flags that make a namespace (CLONE_NEWTIME has no clone(2) form)
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_AND_REMOVE = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char..symlink
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
FILE_ACCESS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # what a rule on a file may allow

#: syscalls the code never needs and an escape would: they fail with EPERM
REFUSED = (
    "memfd_create",
    "memfd_secret",
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "setxattrat",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "removexattrat",
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    "io_setup",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "mount_setattr",
    "open_by_handle_at",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def enter_namespaces(network: bool) -> str:
    """Unshare PID, IPC, mount and (network off) network namespaces: ``"privileged"`` (as root,
    no user namespace needed), ``"user"`` (inside a new user namespace mapping the caller's own
    ids) or ``""`` when the kernel refuses both."""
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS | (0 if network else CLONE_NEWNET)
    if libc.unshare(flags) == 0:
        return "privileged"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | flags) == 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
        return "user"
    return ""


def wait_for(child: int) -> int:
    """Outside the PID namespace: wait for its init and leave as it did."""
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return code
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)  # the parent reads the signal that ended the code
    return 128 - code


def own_proc() -> bool:
    """A private mount tree and a /proc of this PID namespace (as its PID 1)."""
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    return libc.mount(b"proc", b"/proc", b"proc", flags, None) == 0


def reach(paths: list[str]) -> bool:
    """Make ``paths`` reachable by a uid that is not the caller's, in this mount namespace only:
    where a parent folder is closed to others (a pyenv interpreter under ``/root``, the
    sandbox's own root), that folder is covered by an empty tmpfs in which each such path alone
    is bound in place; nothing else of the folder is there. True when all of it took effect."""
    covered: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in paths if os.path.exists(p)}):
        closed = first_closed(path)
        if closed is not None:
            covered.setdefault(closed, []).append(path)
    for top, inside in covered.items():
        kept: list[str] = []
        for path in inside:  # a path beneath one already bound comes with it
            if not any(path.startswith(k + "/") for k in kept):
                kept.append(path)
        fds = [os.open(path, os.O_PATH | os.O_CLOEXEC) for path in kept]
        try:
            if libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755"):
                return False
            for path, fd in zip(kept, fds, strict=True):
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(path, 0o755)
                else:
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
                source = f"/proc/self/fd/{fd}".encode()
                if libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None):
                    return False
        finally:
            for fd in fds:
                os.close(fd)
    return True


def first_closed(path: str) -> str | None:
    """The topmost parent folder of ``path`` that others may not enter, if any."""
    parts = path.strip("/").split("/")
    for n in range(1, len(parts)):
        folder = "/" + "/".join(parts[:n])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def cap_ipc(memory: int) -> bool:
    """System V shared memory of this IPC namespace limited to ``memory`` bytes in all, its
    semaphores and message queues to a few (``SEMAPHORES``, ``QUEUES``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    limits = (
        ("shmmax", memory),
        ("shmall", memory // page),
        ("sem", SEMAPHORES),
        ("msgmni", QUEUES),
        ("msgmnb", QUEUE_BYTES),
        ("msgmax", MESSAGE_BYTES),
    )
    try:
        for name, value in limits:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))
    except OSError:
        return False
    return True


def fresh_keyring() -> bool:
    number = syscall_number("keyctl")
    if number is None:
        return False
    return libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def lock_capabilities() -> None:
    """The bounding set emptied, ambient capabilities cleared and the securebits locked (root
    gains nothing by ``execve``; a uid change keeps the sets until ``drop_capabilities``)."""
    for cap in range(64):  # past the last capability: EINVAL, nothing to drop
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0)


def become(uid: int | None, gid: int | None) -> int:
    """The working folder given to the call's own uid and gid, then those ids taken, no
    supplementary group (as root, in ``privileged`` namespaces); the uid when all of it took
    effect, else 0."""
    if uid is None or gid is None:
        return 0
    try:
        os.chown(".", uid, gid)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError:  # no privilege, or an id this user namespace does not map
        return 0
    held = os.getresuid() == (uid,) * 3 and os.getresgid() == (gid,) * 3
    return uid if held and not os.getgroups() else 0


def drop_capabilities() -> bool:
    """No capability left in any set (after ``lock_capabilities``); True when
    /proc/self/status shows all five sets empty."""
    empty = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, for two 32-bit words
    libc.capset(ctypes.byref(CapHeader(CAPABILITY_VERSION_3, 0)), empty)
    with open("/proc/self/status") as f:
        sets = dict(line.split(":", 1) for line in f if line.startswith("Cap"))
    return all(int(sets.get(name, "1"), 16) == 0 for name in CAP_FIELDS)


def syscall_number(name: str) -> int | None:
    if pyseccomp is None:
        return None
    return int(pyseccomp.resolve_syscall(pyseccomp.system_arch(), name))


def file_rules(folder: str, readable: list[str]) -> tuple[int, int]:
    """Landlock's rules (not yet in force): write beneath ``folder`` only, read beneath
    ``readable`` (and this process's own /proc entry) only; (the ruleset's descriptor, the
    ABI), (-1, 0) when Landlock is unavailable. Made while the paths are still reachable."""
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    if abi < 1:
        return -1, 0
    write = (
        WRITE_FILE | MAKE_AND_REMOVE | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    )
    read = EXECUTE | READ_FILE | READ_DIR
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(read | write, 0, scoped)
    size = ctypes.sizeof(attr) if abi >= 6 else 8  # older kernels know the first field only
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return -1, 0
    allow(ruleset, folder, read | write)
    allow(ruleset, "/dev/null", READ_FILE | WRITE_FILE | (TRUNCATE if abi >= 3 else 0))
    for path in [*readable, "/proc/self"]:
        allow(ruleset, path, read)
    return int(ruleset), int(abi)


def restrict_files(ruleset: int, abi: int) -> int:
    """The rules of ``file_rules`` in force; the ABI applied, 0 when they could not be."""
    if ruleset < 0:
        return 0
    try:
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 0
        if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
            return 0
    finally:
        os.close(ruleset)
    return abi


def allow(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(os.path.realpath(path), os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine does not have
    try:
        if not os.path.isdir(path):
            access &= FILE_ACCESS
        rule = PathBeneath(access, fd)
        libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0)
    finally:
        os.close(fd)


def set_limits(config: dict, identity: int) -> None:
    memory, cpu, file_bytes = config["memory_bytes"], config["cpu_s"], config["file_bytes"]
    if identity:  # counted per uid: the caller's own would count its other processes too
        processes = config["processes"]
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def filter_syscalls(network: bool) -> bool:
    """The seccomp filter of the module docstring (step 6); False where it cannot load."""
    sc = pyseccomp
    if sc is None:
        return False
    refuse = sc.ERRNO(1)  # EPERM
    allowed = {AF_INET, AF_INET6} if network else set()
    try:
        rules = sc.SyscallFilter(sc.ALLOW)
        for family in range(FAMILIES):
            if family not in allowed:
                rules.add_rule(refuse, "socket", sc.Arg(0, sc.MASKED_EQ, LOW_32, family))
        for kind in range(SOCK_TYPE_MASK + 1):
            if kind not in PAIR_TYPES:
                pair_type = sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, kind)
                rules.add_rule(refuse, "socketpair", pair_type)
        rules.add_rule(refuse, "prctl", sc.Arg(0, sc.MASKED_EQ, LOW_32, PR_SET_PDEATHSIG))
        for flag in CLONE_NEW:
            rules.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        rules.add_rule(sc.ERRNO(ENOSYS), "clone3")  # its flags sit in memory no filter reads
        for name in REFUSED:
            try:
                rules.add_rule(refuse, name)
            except (ValueError, OSError):  # a syscall this architecture or libseccomp has not
                continue
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        rules.load()
    except OSError:
        return False
    return True


NETWORK_EVENTS = frozenset(
    {
        "socket.__new__",
        "socket.bind",
        "socket.connect",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "socket.getnameinfo",
        "socket.sendmsg",
        "socket.sendto",
    }
)
AF_UNIX = 1


def explain_network(config: dict) -> None:
    """A refused network call says why in words (the kernel refuses it anyway). Unix sockets
    are the kernel's to judge: a stream ``socketpair`` (asyncio's self-pipe) is allowed."""
    if config["network"]:
        return

    def hook(event: str, args: tuple) -> None:
        if event not in NETWORK_EVENTS:
            return
        family = args[1] if event == "socket.__new__" else getattr(args[0], "family", None)
        if family != AF_UNIX:
            raise PermissionError(f"the network is off in this sandbox ({event} refused)")

    sys.addaudithook(hook)


def run(config: dict) -> int:
    path = os.path.join(config["folder"], "main.py")
    with open("main.py") as f:  # the working folder (the parent started it there)
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


def isolate(config: dict, namespaces: str, outer: int | None) -> dict:
    """Steps 3-6 in the PID namespace's init (or, without namespaces, in this process);
    ``outer``: a pipe whose other end the process outside holds open while it lives."""
    applied: dict = {"namespaces": namespaces, "network": namespaces != "" or config["network"]}
    if namespaces:
        applied["proc"] = own_proc()
        applied["shared_memory"] = cap_ipc(config["memory_bytes"])
    # the /proc of its own PID namespace lists its own processes only: readable whole
    readable = [*config["readable"], *(["/proc"] if applied.get("proc") else [])]
    # the call's uid needs its own mount tree to reach what closed folders hold (without
    # namespaces it stays the caller's: the weak mode, where reads are not restricted anyway)
    owned = namespaces == "privileged" and reach([config["folder"], *config["readable"]])
    ruleset, abi = file_rules(config["folder"], readable)
    lock_capabilities()  # after the mounts and sysctls that need them
    applied["identity"] = become(config["uid"], config["gid"]) if owned else 0
    # after the uid change, which clears it: dies with the process outside (or the rank)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if outer is not None:
        if select.select([outer], [], [], 0)[0]:  # end of file: it died before the prctl
            os._exit(1)
        os.close(outer)
    applied["keyring"] = fresh_keyring()  # the call's uid's own
    applied["capabilities"] = drop_capabilities()
    applied["landlock"] = restrict_files(ruleset, abi)
    if not config.get("probe"):
        set_limits(config, applied["identity"])
    applied["seccomp"] = filter_syscalls(config["network"])
    return applied


def join_cgroups(procs: list[str]) -> bool:
    """This process into each cgroup (its ``cgroup.procs`` file), before it starts anything;
    True when there were some and it joined all."""
    try:
        for path in procs:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
    except OSError:
        return False
    return bool(procs)


def missing(applied: dict, required: dict) -> list[str]:
    """The layers the probe found in force (``required``) that this call did not get."""
    return [
        name
        for name, want in required.items()
        if not applied.get(name) or (name == "landlock" and applied[name] < want)
    ]


def report(fd: int, line: str) -> None:
    os.write(fd, f"{line}\n".encode())


def main() -> int:
    config = json.loads(sys.argv[1])
    fd = int(config["report_fd"])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the rank's thread
    if os.getppid() != config["parent"]:  # the rank died before the death signal was set
        return 1
    cgroup = join_cgroups(config["cgroups"])
    namespaces = enter_namespaces(config["network"])
    outer = None
    if namespaces:
        outer, alive = os.pipe()
        child = os.fork()
        if child:
            os.close(outer)
            report(fd, f"init {child}")
            os.close(fd)
            return wait_for(child)
        os.close(alive)
    applied = {**isolate(config, namespaces, outer), "cgroup": cgroup}
    if config.get("probe"):
        os.close(fd)
        print(json.dumps(applied))
        return 0
    lacking = missing(applied, config["required"])
    if lacking:
        report(fd, f"refused {' '.join(lacking)}")
        return 1
    os.close(fd)  # the code never sees the report pipe
    explain_network(config)
    return run(config)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
