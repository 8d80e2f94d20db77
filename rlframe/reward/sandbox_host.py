"""The host side of the sandbox (sandbox.py): what the parent process asks of the machine.

`allow_list` (the files the program's root is built from), the namespace probe, the uid map, and finding
and killing every process of a per-execution uid. The launcher (sandbox_launcher.py run as a script with
``-I -S``) imports none of this: it gets the allow-list in its configuration.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time

def _uid_mapped(uid: int) -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _outside, count = map(int, line.split())
                if inside <= uid < inside + count:
                    return True
    except OSError:
        return False
    return False


def _probe(flags: int) -> bool:
    """Can a child process unshare these namespaces here? (Asked once, in a throwaway process.)"""
    code = ("import ctypes,sys; l=ctypes.CDLL(None, use_errno=True); "
            f"sys.exit(0 if l.unshare(ctypes.c_int({flags})) == 0 else 1)")
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", code], timeout=30,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


def _shared_libraries(files: list[str]) -> set[str]:
    """The shared libraries `files` (the interpreter, its extension modules) load, as ldd names them
    (the paths the dynamic loader opens, its own included); empty when ldd is missing."""
    ldd = shutil.which("ldd")
    if ldd is None or not files:
        return set()
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    libraries = set()
    for line in out.splitlines():
        words = line.split()
        path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
        if path.startswith("/") and os.path.isfile(path):
            libraries.add(path)
    return libraries


@functools.lru_cache(maxsize=None)
def allow_list(python: str) -> tuple[list[list[str]], list[str]]:
    """What the sandbox's root holds: ([path, kind] pairs bound read-only, paths hidden under them).

    The interpreter, its standard library (its site-packages hidden: programs run with -S anyway), the
    shared libraries the interpreter and the standard library's extension modules load (by ldd; without
    ldd, the system library folders), and /dev/null, /dev/zero, /dev/urandom."""
    import sysconfig

    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dynload = [d for d in {os.path.join(stdlib, "lib-dynload"), sysconfig.get_config_var("DESTSHARED") or ""}
               if d and os.path.isdir(d)]
    extensions = [os.path.join(d, f) for d in dynload for f in sorted(os.listdir(d)) if f.endswith(".so")]
    allowed = {python: "file", stdlib: "dir", **{d: "dir" for d in dynload if not d.startswith(stdlib + "/")}}
    libraries = _shared_libraries([python, *extensions])
    if libraries:
        allowed.update({path: "file" for path in libraries})
    else:
        allowed.update({d: "dir" for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if os.path.isdir(d)})
    allowed.update({d: "device" for d in DEVICES if os.path.exists(d)})
    hidden = [os.path.join(stdlib, name) for name in ("site-packages", "dist-packages")
              if os.path.isdir(os.path.join(stdlib, name))]
    return sorted([path, kind] for path, kind in allowed.items()), hidden


def _processes_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break  # dead already, waiting to be reaped
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:  # the real uid
                            pids.append(int(name))
                        break
        except OSError:
            continue  # gone meanwhile
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the per-execution uid: it owns nothing else), until none
    is left -- a fork bomb may still be forking while we look."""
    for _ in range(50):
        pids = _processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
