"""Run untrusted Python programs (generated code) in a locked-down child process.

    sandbox = Sandbox(max_concurrency=4)
    result = sandbox.run("print(int(input()) * 2)", stdin="21\\n", expected_stdout="42")
    result.verdict      # "passed" | "failed" | "timeout" | "error"
    results = sandbox.run_many([{"code": ..., "stdin": ..., "expected_stdout": ...}, ...])

Generated code is hostile by assumption. Every execution gets a process of its own, started through
a small launcher (this very file run as a script, ``python -I -S sandbox.py --launch CONFIG``) that
sets up the isolation and then ``execve``s the interpreter on the program. The layers, each listed
in ``Sandbox.isolation`` as active or not, because which ones the kernel grants depends on the
machine:

* resource limits (always): ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space: a 50 GB
  allocation raises MemoryError), ``RLIMIT_NPROC`` (processes: no fork bombs), ``RLIMIT_FSIZE``
  (largest file it may write), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``; plus a wall-clock deadline
  enforced by the parent, which then SIGKILLs the whole process group;
* ``uid`` (when the parent is root): the program runs as an unprivileged uid of its own
  (``uid_base + pid * 256 + slot``: unique per concurrent execution, so that ``RLIMIT_NPROC`` -- which
  counts processes per uid, and is not enforced for root at all -- is a per-execution budget, and so
  that after the run every process of that uid can be killed, even one that escaped the process
  group with ``setsid``). Falls back to ``nobody`` (65534) when such uids are not mapped;
* ``netns``: its own network namespace (``unshare(CLONE_NEWNET)`` through libc; root, or an
  unprivileged user namespace): no interface but a downed loopback, so ``connect(("127.0.0.1", p))``
  fails with "Network is unreachable";
* ``mountns`` + ``pidns`` + ``root``: its own mount and pid namespaces and a root built from an allow-list
  (``_setup_root``): the interpreter, its standard library and libraries read-only, a fresh ``/proc``, and
  ``/tmp/work``, the one writable place, a tmpfs of ``max_disk_bytes`` (not the host's ``/tmp``);
* the mode (``Sandbox.mode``): "root" (all of the above with the uid drop), "userns" (not root: the same
  namespaces and root inside an unprivileged user namespace that maps only the caller's uid to itself, as
  bubblewrap does, so the program holds no capability once it execs), or "none";
* ``audit_hook`` (mode "none", when no namespace can be had: non-root where the kernel refuses user
  namespaces): a ``sys.addaudithook`` installed before the program runs refuses socket creation
  and connection, ``ctypes``, process spawning, reading outside the working directory and the standard
  library, writing, removing, renaming outside the working directory. This is a Python-level guard only
  (native code can get around it): a Sandbox in this mode refuses to be made (``SandboxUnisolatedError``)
  unless ``allow_unisolated=True`` (``reward.sandbox.allow_unisolated=true`` for a run).

Memory and disk in total: each process ``memory_bytes`` of address space, at most
``total_memory_bytes // memory_bytes`` processes (RLIMIT_NPROC: per uid as root, per user namespace in mode
userns), and the working directory's tmpfs. A memory cgroup would bound resident memory more tightly; it is
not used: on the machines this was built on the cgroup v2 hierarchy has no memory controller to delegate, so
that path could not be tested.

Always: a fresh temporary working directory, removed afterwards; an empty environment (``PATH``,
``HOME``, ``LANG`` only); the interpreter runs with ``-I -S`` (no site-packages, no user site, no
``PYTHON*`` variables); stdout and stderr are captured up to ``max_output_bytes`` each (the rest is
drained and dropped, ``truncated`` says so); stdin comes from a file.

Verdicts: "timeout" (the wall clock or the CPU limit ran out), "failed" (non-zero exit, killed by a
signal, or stdout differs from ``expected_stdout``), "passed" (exit 0 and the expected output, or no
expected output given), "error" (the sandbox itself could not run the program: a broken launcher,
not the program's fault).

This file imports only the standard library: it is also the launcher, run with ``-I -S``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

LAUNCH_FLAG = "--launch"
LAUNCH_ERROR_EXIT = 125  # the launcher's own failure (before the program started)
WORKDIR_IN_SANDBOX = "/tmp/work"
PROGRAM_NAME = "main.py"
NOBODY = 65534
DEFAULT_UID_BASE = 1_000_000_000  # + pid * 256 + slot; far above any real account

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> the mount flag a remount must keep (a user namespace may not drop a locked flag)
_KEPT_FLAGS = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
               (4096, MS_RELATIME))
WORK_INODES = 4096  # files and folders the program may create in its working directory
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
_PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# machine: (AUDIT_ARCH, unshare, clone, clone3, setns) system-call numbers
_USERNS_SYSCALLS = {"x86_64": (0xC000003E, 272, 56, 435, 308), "aarch64": (0xC00000B7, 97, 220, 435, 268)}

# The program is run by this bootstrap (``python -I -S -c BOOTSTRAP``), which installs the audit
# hook first when that fallback is active. %(hook)s is replaced by the hook or by nothing.
_AUDIT_HOOK = r'''
import os as _os, sys as _sys
def _rlframe_guard(event, args, _root=_os.getcwd(), _real=_os.path.realpath,
                   _readable=(_os.path.dirname(_os.__file__), "/dev/null", "/dev/urandom", "/dev/zero")):
    def inside(path, roots):
        if isinstance(path, int):  # a file descriptor the program already holds
            return True
        path = _real(path.decode() if isinstance(path, bytes) else _os.fspath(path))
        return any(path == root or path.startswith(root + "/") for root in roots)
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto",
                 "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
                 "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                 "os.fork", "os.forkpty", "os.kill", "os.killpg", "mmap.__new__"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and isinstance(args[0], (str, bytes)):
        mode, flags = args[1], args[2]
        writing = (mode is not None and any(c in mode for c in "wax+")) or (flags & 3) != 0
        if not inside(args[0], (_root,) if writing else (_root, *_readable)):
            raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {args[0]!r} "
                                  "(outside the working directory)")
    if event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                 "os.chflags", "os.setxattr", "os.removexattr", "os.listdir", "os.scandir", "os.mkfifo",
                 "os.mknod", "os.chdir") and args and not inside(args[0], (_root, _readable[0])
                                                                   if event in ("os.listdir", "os.scandir", "os.chdir")
                                                                   else (_root,)):
        raise PermissionError(f"sandbox: {event} of {args[0]!r} (outside the working directory)")
    if event in ("os.rename", "os.link", "os.symlink") and not all(inside(p, (_root,)) for p in args[:2]):
        raise PermissionError(f"sandbox: {event} of {args[0]!r} -> {args[1]!r} (outside the working directory)")
_sys.addaudithook(_rlframe_guard)
del _rlframe_guard
'''
_BOOTSTRAP = r'''%(hook)s
import sys
sys.argv = [%(program)r]
sys.path.insert(0, "")
with open(%(program)r, "rb") as _f:
    _code = compile(_f.read(), %(program)r, "exec")
del _f
exec(_code, {"__name__": "__main__", "__file__": %(program)r, "__builtins__": __builtins__})
'''


# ====================================================================== the launcher (child side)


def _libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    ctypes, libc = _libc()
    return libc.unshare(ctypes.c_int(flags)) == 0


def _mount(source, target, fstype, flags, data=None) -> None:
    ctypes, libc = _libc()
    enc = (lambda s: None if s is None else str(s).encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount({source}, {target}, {fstype}, {flags:#x}): {os.strerror(err)}")


def _pivot_root(new_root: str) -> None:
    """Make `new_root` (a mount point) the root of this mount namespace and detach the old root; where the
    pivot_root system call's number is not known, chroot (the program has no capability to leave it)."""
    ctypes, libc = _libc()
    os.chdir(new_root)
    number = _PIVOT_ROOT_SYSCALL.get(os.uname().machine)
    if number is not None and libc.syscall(ctypes.c_long(number), b".", b".") == 0:
        if libc.umount2(b".", ctypes.c_int(MNT_DETACH)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount2(old root): {os.strerror(err)}")
    else:
        os.chroot(".")
    os.chdir("/")


def _kept_flags(path: str) -> int:
    """The flags of the mount `path` is on that a read-only remount must repeat: in a user namespace the kernel
    refuses to drop nosuid, nodev, noexec or the atime flags of a mount it inherited (they are locked)."""
    have = os.statvfs(path).f_flag
    return sum(flag for bit, flag in _KEPT_FLAGS if have & bit)


def _bind_read_only(fd: int, target: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags | _kept_flags(target))


def _map_ids(uid: int, gid: int) -> None:
    """In a user namespace just made by an unprivileged process: map our own uid and gid to themselves (as
    bubblewrap does), so that the program runs there as the caller's uid, not as root, and holds no capability
    once it execs. setgroups is denied first (the kernel's condition for an unprivileged gid_map)."""
    for name, text in (("uid_map", f"{uid} {uid} 1\n"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1\n")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _setup_root(workdir: str, allowed: list[list], hidden: list[str], cfg: dict) -> None:
    """A root of our own, built from the allow-list: an empty tmpfs holding only `allowed` ((path, kind)
    pairs: "dir", "file" or "device"; bound read-only at their own paths), `hidden` (empty, read-only
    tmpfs over those paths, e.g. the standard library's site-packages), a fresh /proc (this process is pid 1
    of its own pid namespace: it shows only the program's processes) and /tmp/work, the one writable place: a
    tmpfs of its own of ``max_disk_bytes`` (and WORK_INODES files) holding a copy of the program, owned by the
    program's uid. Nothing else of the host is reachable: no /etc, no /home, no training data, no host /tmp.
    The same code builds it as root and in an unprivileged user namespace."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open(os.path.join(workdir, PROGRAM_NAME), "rb") as f:
        program = f.read()
    sources = [(path, kind, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path, kind in allowed]
    new_root = "/tmp"  # (in this private mount namespace; every source is held open above)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, kind, fd in sorted(sources):
        target = new_root + path
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if kind == "dir":
            os.makedirs(target, 0o755, exist_ok=True)
        elif not os.path.exists(target):
            open(target, "w").close()
        _bind_read_only(fd, target, MS_NOSUID if kind == "device" else MS_NOSUID | MS_NODEV)
        os.close(fd)
    for path in hidden:
        if os.path.isdir(new_root + path):
            _mount("tmpfs", new_root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    os.makedirs(new_root + "/proc", 0o555)
    try:  # (mounted before the pivot: in a user namespace the kernel wants the host's /proc still in view)
        _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # no /proc at all then: nothing of the host's shows either
    work = new_root + WORKDIR_IN_SANDBOX
    os.makedirs(work, 0o755)
    owner = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    group = cfg["gid"] if cfg["gid"] is not None else os.getgid()
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['max_disk_bytes']},nr_inodes={WORK_INODES},mode=700,uid={owner},gid={group}")
    with open(os.path.join(work, PROGRAM_NAME), "wb") as f:
        f.write(program)
    os.chown(os.path.join(work, PROGRAM_NAME), owner, group)
    _pivot_root(new_root)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _refuse_new_user_namespaces() -> bool:
    """A seccomp filter: unshare / clone asking for CLONE_NEWUSER and setns fail with EPERM, clone3 (whose
    flags a filter cannot read) with ENOSYS, so that libc falls back to clone. False where the
    architecture's system-call numbers are not known here (then the layer is reported inactive)."""
    numbers = _USERNS_SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return False
    arch, unshare, clone, clone3, setns = numbers
    ld_abs, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    program = [  # (code, jt, jf, k); seccomp_data: nr at 0, arch at 4, args[0] (low half) at 16
        (ld_abs, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),  # another ABI (i386 on x86_64): refused
        (ld_abs, 0, 0, 0),
        (jset, 0, 1, 0x40000000), (ret, 0, 0, eperm),  # x32 system calls: refused
        (jeq, 0, 1, clone3), (ret, 0, 0, enosys),
        (jeq, 0, 1, setns), (ret, 0, 0, eperm),
        (jeq, 1, 0, unshare), (jeq, 0, 3, clone),
        (ld_abs, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    ctypes, libc = _libc()

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*f) for f in program])
    fprog = Program(len(program), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def _set_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_time_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at soft, SIGKILL at hard
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_bytes"], cfg["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["max_open_files"], cfg["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc_limit"], cfg["nproc_limit"]))


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG): a reward worker killed for a
    timeout must not leave its sandboxes running."""
    ctypes, libc = _libc()
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def _become_program(cfg: dict, workdir: str) -> None:
    """Apply the limits, drop the uid and exec the interpreter on the program."""
    _set_limits(cfg)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    _die_with_parent()  # again: setuid cleared it
    if cfg["no_userns"]:
        _refuse_new_user_namespaces()
    os.chdir(workdir)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
    bootstrap = _BOOTSTRAP % {"hook": _AUDIT_HOOK if cfg["audit_hook"] else "",
                              "program": PROGRAM_NAME}
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-c", bootstrap], env)


def _launch(cfg: dict) -> None:
    """Set up the isolation, then run the program. Never returns.

    With namespaces (mode "root", or "userns": an unprivileged user namespace, mapped to our own uid): unshare
    net + mount + pid namespaces, fork the program as pid 1 of the new pid namespace, which builds the mount
    tree and execs; the launcher waits for it and exits as it did. When that pid 1 exits (or is killed, or the
    launcher dies: PDEATHSIG, which the launcher also sets for itself against its parent's death), the kernel
    kills and reaps every process left in the namespace -- no orphan, no zombie, even after ``setsid``.
    """
    try:
        _die_with_parent()
        if os.getppid() != cfg["parent_pid"]:
            raise OSError("the parent process is gone")
        if cfg["mode"] in ("root", "userns"):
            flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWUSER if cfg["mode"] == "userns" else 0)
            if not _unshare(flags):
                raise OSError(f"unshare({flags:#x}) failed")
            if cfg["mode"] == "userns":
                _map_ids(os.getuid(), os.getgid())
            pid = os.fork()
            if pid == 0:
                try:
                    _setup_root(cfg["host_workdir"], cfg["allowed"], cfg["hidden"], cfg)
                    _become_program(cfg, WORKDIR_IN_SANDBOX)
                except BaseException as exc:  # noqa: BLE001
                    os.write(2, f"rlframe sandbox launcher failed: {type(exc).__name__}: "
                                f"{exc}\n".encode())
                    os._exit(LAUNCH_ERROR_EXIT)
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):  # exit the way the program did
                sig = os.WTERMSIG(status)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        if cfg["netns"] and not _unshare(CLONE_NEWNET):
            raise OSError("unshare(CLONE_NEWNET) failed")
        _become_program(cfg, cfg["host_workdir"])
    except BaseException as exc:  # noqa: BLE001 -- report anything, then exit with our code
        os.write(2, f"rlframe sandbox launcher failed: {type(exc).__name__}: {exc}\n".encode())
        os._exit(LAUNCH_ERROR_EXIT)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == LAUNCH_FLAG:
    _launch(json.loads(sys.argv[2]))


# ====================================================================== the parent side

import math  # noqa: E402 -- below the launcher so that the launcher path stays minimal
import selectors  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

from rlframe.reward.sandbox_host import _kill_uid, _probe, _processes_of_uid, _uid_mapped, allow_list  # noqa: E402

PASSED, FAILED, TIMEOUT, ERROR = "passed", "failed", "timeout", "error"
ALLOW_UNISOLATED_ENV = "RLFRAME_SANDBOX_ALLOW_UNISOLATED"  # set from reward.sandbox.allow_unisolated
ISOLATED_MODES = ("root", "userns")


class SandboxUnisolatedError(RuntimeError):
    """No isolating mode on this machine and running unisolated was not allowed."""


def unisolated_message(isolation: dict) -> str:
    return ("the code sandbox cannot isolate programs on this machine (not root, and the kernel refuses an "
            "unprivileged user namespace: see /proc/sys/kernel/unprivileged_userns_clone, "
            "/proc/sys/user/max_user_namespaces, AppArmor's apparmor_restrict_unprivileged_userns): generated code "
            "would run with only a Python audit hook, able to read this machine's files (/etc, the checkout, the "
            f"training data) and other processes' environments. Isolation available: {isolation}. Fix: run as root "
            "or where user namespaces are allowed; or accept the risk with reward.sandbox.allow_unisolated=true "
            f"(environment {ALLOW_UNISOLATED_ENV}=1; Sandbox(allow_unisolated=True) in code)")


def isolation_mode() -> str:
    """The mode a default Sandbox gets on this machine: root, userns or none (asked in throwaway processes)."""
    return Sandbox._choose_mode("auto", "auto")


def allowed_unisolated_by_environment() -> bool:
    return os.environ.get(ALLOW_UNISOLATED_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 5.0
    cpu_time_s: float = 5.0
    memory_bytes: int = 1 << 30           # address space (RLIMIT_AS)
    max_processes: int = 16               # RLIMIT_NPROC for the program's own uid
    max_file_bytes: int = 16 << 20        # RLIMIT_FSIZE
    max_open_files: int = 64
    max_output_bytes: int = 64 << 10      # each of stdout and stderr
    # All of one execution's processes together (Sandbox.isolation["memory"]): RLIMIT_NPROC is lowered so that
    # processes x memory_bytes stays within it (no memory cgroup is used: see the module docstring).
    total_memory_bytes: int = 4 << 30
    max_disk_bytes: int = 64 << 20        # the working directory's tmpfs (all files together), with namespaces


@dataclass
class SandboxResult:
    verdict: str                  # "passed" | "failed" | "timeout" | "error"
    stdout: str
    stderr: str
    exit_code: int | None         # negative: killed by that signal; None: no exit status
    duration_s: float
    truncated: bool = False       # stdout or stderr exceeded max_output_bytes

    @property
    def passed(self) -> bool:
        return self.verdict == PASSED


def outputs_match(actual: str, expected: str) -> bool:
    """Compare program output the way judges usually do: trailing whitespace on each line and
    trailing blank lines do not matter."""
    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(actual) == norm(expected)


class Sandbox:
    """Runs programs concurrently (up to ``max_concurrency``), each in its own locked-down process.

    ``network``/``privileges`` choose the mechanisms: "auto" uses the strongest the machine allows;
    ``network="hook"`` forces the audit-hook fallback (also used when no namespace is possible);
    ``privileges="keep"`` keeps the caller's uid (no uid drop, no mount namespace).
    """

    def __init__(self, max_concurrency: int = 4, limits: SandboxLimits | None = None, *,
                 network: str = "auto", privileges: str = "auto",
                 uid_base: int = DEFAULT_UID_BASE, allow_unisolated: bool | None = None):
        if not 1 <= max_concurrency <= 256:
            raise ValueError(f"max_concurrency must be in [1, 256], got {max_concurrency}")
        if network not in ("auto", "hook") or privileges not in ("auto", "keep"):
            raise ValueError("network must be 'auto' or 'hook'; privileges 'auto' or 'keep'")
        self.max_concurrency = max_concurrency
        self.limits = limits or SandboxLimits()
        self._slots = list(range(max_concurrency))
        self._slots_lock = threading.Lock()
        self._slots_free = threading.Semaphore(max_concurrency)
        self._launcher = os.path.abspath(__file__)
        # The program's interpreter: the base installation, outside any virtualenv (-S anyway).
        self._python = os.path.realpath(sys.executable)
        self.mode = self._choose_mode(network, privileges)
        self._drop_uid = self.mode == "root"
        highest = uid_base + (2 ** 22) * 256  # pid_max is at most 2**22
        self._unique_uids = self._drop_uid and highest < 2 ** 32 - 1 and _uid_mapped(highest)
        self._uid_base = uid_base
        self._mountns = self.mode in ISOLATED_MODES
        self._netns = self._mountns or (network == "auto" and os.geteuid() == 0 and _probe(CLONE_NEWNET))
        self._audit_hook = not self._mountns
        self._allowed, self._hidden = allow_list(self._python) if self._mountns else ([], [])
        self._no_userns = os.uname().machine in _USERNS_SYSCALLS
        self.isolation = {
            "mode": self.mode,  # root | userns | none (then only the audit hook guards the host's files)
            "rlimits": True,
            "uid": (f"per-execution uid from {uid_base}" if self._unique_uids
                    else "nobody (65534)" if self._drop_uid
                    else f"own uid {os.getuid()} in a user namespace" if self.mode == "userns" else False),
            "userns": self.mode == "userns",
            "netns": self._netns,
            "mountns": self._mountns,
            "pidns": self._mountns,
            "root": "allow-list (interpreter, standard library, /dev/null)" if self._mountns else False,
            "no_userns": "seccomp" if self._no_userns else False,
            "audit_hook": self._audit_hook,
            "memory": self._memory_cap(self.limits),
            "disk": (f"tmpfs of {self.limits.max_disk_bytes} bytes" if self._mountns
                     else f"{self.limits.max_file_bytes} bytes per file only"),
        }
        if allow_unisolated is None:
            allow_unisolated = allowed_unisolated_by_environment()
        if not self.isolated and not allow_unisolated:
            raise SandboxUnisolatedError(unisolated_message(self.isolation))

    @property
    def isolated(self) -> bool:
        """True when programs run in an allow-list root of their own (mode root or userns)."""
        return self.mode in ISOLATED_MODES

    @staticmethod
    def _choose_mode(network: str, privileges: str) -> str:
        """root (uid drop + namespaces), userns (an unprivileged user namespace giving the same namespaces and
        root), or none; network="hook" forces none, privileges="keep" rules out the uid drop (root keeps root)."""
        if network == "hook":
            return "none"
        namespaces = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID
        if os.geteuid() == 0:
            return "root" if privileges == "auto" and _probe(namespaces) else "none"
        return "userns" if _probe(CLONE_NEWUSER | namespaces) else "none"

    def _process_cap(self, limits: SandboxLimits) -> int:
        """Processes (threads too) one execution may have: max_processes, fewer where the total memory needs it."""
        return max(1, min(limits.max_processes, limits.total_memory_bytes // max(limits.memory_bytes, 1)))

    def _memory_cap(self, limits: SandboxLimits) -> str:
        n = self._process_cap(limits)
        return f"rlimit: {n} processes x {limits.memory_bytes} bytes address space"

    # ---------------------------------------------------------------- running

    def run(self, code: str, stdin: str = "", expected_stdout: str | None = None,
            limits: SandboxLimits | None = None) -> SandboxResult:
        """Run the Python program ``code`` with ``stdin``; blocks while all slots are busy."""
        limits = limits or self.limits
        self._slots_free.acquire()
        with self._slots_lock:
            slot = self._slots.pop()
        try:
            return self._run_in_slot(slot, code, stdin, expected_stdout, limits)
        finally:
            with self._slots_lock:
                self._slots.append(slot)
            self._slots_free.release()

    def run_many(self, jobs: list[dict]) -> list[SandboxResult]:
        """Run ``jobs`` (keyword dicts for ``run``) concurrently; results in the jobs' order."""
        if len(jobs) <= 1:
            return [self.run(**job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self.run(**job), jobs))

    def _uid_for(self, slot: int) -> int | None:
        if not self._drop_uid:
            return None
        if self._unique_uids:
            return self._uid_base + os.getpid() * 256 + slot
        return NOBODY

    def _nproc_limit(self, uid: int | None, limits: SandboxLimits) -> int:
        cap = self._process_cap(limits)
        if uid is not None and self._unique_uids:
            return cap
        if self.mode == "userns":  # a user namespace of its own counts its own processes (the launcher too)
            return cap + 1
        # Shared uid (nobody, or our own): the limit counts that uid's other processes too.
        current = len(_processes_of_uid(os.getuid() if uid is None else uid))
        return current + cap

    def _run_in_slot(self, slot: int, code: str, stdin: str, expected_stdout: str | None,
                     limits: SandboxLimits) -> SandboxResult:
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="rlframe-sandbox-")
        uid = self._uid_for(slot)
        process = None
        try:
            with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8") as f:
                f.write(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
            cfg = {"python": self._python, "parent_pid": os.getpid(), "host_workdir": workdir, "uid": uid, "gid": uid,
                   "mode": self.mode, "netns": self._netns,
                   "audit_hook": self._audit_hook, "allowed": self._allowed, "hidden": self._hidden,
                   "no_userns": self._no_userns,
                   "cpu_time_s": max(1, math.ceil(limits.cpu_time_s)),
                   "memory_bytes": int(limits.memory_bytes),
                   "max_file_bytes": int(limits.max_file_bytes),
                   "max_open_files": int(limits.max_open_files),
                   "max_disk_bytes": int(limits.max_disk_bytes),
                   "nproc_limit": self._nproc_limit(uid, limits)}
            with tempfile.TemporaryFile() as stdin_file:  # a file: no pipe to keep fed
                stdin_file.write(stdin.encode("utf-8", "replace"))
                stdin_file.seek(0)
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", self._launcher, LAUNCH_FLAG, json.dumps(cfg)],
                    stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    cwd=workdir, env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
                    close_fds=True)
            out, err, truncated, timed_out = self._collect(process, uid, limits)
            exit_code = process.returncode
        except OSError as exc:
            return SandboxResult(ERROR, "", f"sandbox could not start the program: {exc}", None,
                                 time.monotonic() - start)
        finally:
            if process is not None:
                self._kill_all(process, uid)
            shutil.rmtree(workdir, ignore_errors=True)
        duration = time.monotonic() - start
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        if timed_out or exit_code in (-signal.SIGXCPU,):
            verdict = TIMEOUT
        elif exit_code == LAUNCH_ERROR_EXIT and "rlframe sandbox launcher failed" in stderr:
            verdict = ERROR
        elif exit_code != 0:
            verdict = FAILED
        elif expected_stdout is not None and not outputs_match(stdout, expected_stdout):
            verdict = FAILED
        else:
            verdict = PASSED
        return SandboxResult(verdict, stdout, stderr, exit_code, duration, truncated)

    def _collect(self, process: subprocess.Popen, uid: int | None, limits: SandboxLimits):
        """Read stdout/stderr (capped) until the program exits or the wall clock runs out."""
        deadline = time.monotonic() + limits.wall_time_s
        buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
        truncated = timed_out = False
        selector = selectors.DefaultSelector()
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        exited_at = None
        try:
            while selector.get_map():
                now = time.monotonic()
                if process.poll() is not None and exited_at is None:
                    exited_at = now
                    self._kill_all(process, uid)  # leftovers must not hold the pipes open
                if exited_at is None and now >= deadline:
                    timed_out = True
                    self._kill_all(process, uid)
                    exited_at = now
                if exited_at is not None and now - exited_at > 1.0:
                    break  # something still holds a pipe: stop reading
                for key, _ in selector.select(timeout=0.05):
                    try:
                        chunk = os.read(key.fileobj.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    buffer = buffers[key.fileobj]
                    room = limits.max_output_bytes - len(buffer)
                    if len(chunk) > room:
                        truncated = True
                    buffer += chunk[:max(room, 0)]
            if process.poll() is None:
                remaining = deadline - time.monotonic()
                try:
                    process.wait(timeout=max(remaining, 0.0))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    self._kill_all(process, uid)
                    process.wait()
        finally:
            selector.close()
            process.stdout.close()
            process.stderr.close()
        return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), truncated, timed_out

    def _kill_all(self, process: subprocess.Popen, uid: int | None) -> None:
        """SIGKILL the program's process group, and with a per-execution uid every process of
        that uid (catches children that left the group with setsid)."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None and self._unique_uids:
            _kill_uid(uid)
        if process.poll() is None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def with_limits(self, **changes) -> SandboxLimits:
        """A copy of this sandbox's limits with some fields changed (for ``run(limits=...)``)."""
        return replace(self.limits, **changes)
