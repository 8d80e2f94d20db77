"""The sandbox's launcher (rlframe/reward/sandbox.py): run as a script, ``python -I -S sandbox_launcher.py --launch
CONFIG``, it sets up the isolation (resource limits, the uid drop, the network, mount and pid namespaces, the
root built from the allow-list, or the audit hook) and then ``execve``s the interpreter on the program.

This file imports only the standard library: it runs with ``-I -S`` (no site-packages), and the parent side
(sandbox.py) imports its constants from it.
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
