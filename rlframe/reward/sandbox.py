"""Run untrusted Python programs (generated code) in a locked-down child process.

    sandbox = Sandbox(max_concurrency=4)
    result = sandbox.run("print(int(input()) * 2)", stdin="21\\n", expected_stdout="42")
    result.verdict      # "passed" | "failed" | "timeout" | "error"
    results = sandbox.run_many([{"code": ..., "stdin": ..., "expected_stdout": ...}, ...])

Generated code is hostile by assumption. Every execution gets a process of its own, started through
a small launcher (rlframe/reward/sandbox_launcher.py run as a script, ``python -I -S sandbox_launcher.py
--launch CONFIG``) that sets up the isolation and then ``execve``s the interpreter on the program. The layers, each listed
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
  (``sandbox_launcher._setup_root``): the interpreter, its standard library and libraries read-only, a fresh
  ``/proc``, and ``/tmp/work``, the one writable place, a tmpfs of ``max_disk_bytes`` (not the host's ``/tmp``);
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
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from rlframe.reward import sandbox_launcher
from rlframe.reward.sandbox_host import _kill_uid, _probe, _processes_of_uid, _uid_mapped, allow_list
from rlframe.reward.sandbox_launcher import (CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, DEFAULT_UID_BASE,
                                             LAUNCH_ERROR_EXIT, LAUNCH_FLAG, NOBODY, PROGRAM_NAME, _USERNS_SYSCALLS)

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
        self._launcher = os.path.abspath(sandbox_launcher.__file__)
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
