"""Ray workers for the tests' forked runs, forked from a process that already imported a worker's libraries.

A fresh worker of a tiny run spends most of its CPU importing torch, transformers, tensordict, vLLM and Ray before it
does any work (py-spy: ~80% of its samples, ~10 CPU-seconds for a vLLM worker), and the suite starts a few hundred.
One server per test process imports them once, and the forked runs' workers are its forked children:

    zygote = WorkerZygote(env)  # with the environment the runs' workers get (tests/conftest.py worker_zygote_env)
    run_env = {**env, **zygote.run_env()}  # a forked run's: RAY_RUNTIME_ENV_HOOK and the server's socket

The run's `ray.init` calls Ray's runtime-env hook (add_py_executable), which sets the job's `py_executable`, Ray's own
runtime-env field for the command that runs a worker: Ray then starts each worker as `python -S worker_zygote.py
SOCKET default_worker.py ARGS`, after its setup_worker.py applied the runtime env, with the worker's environment,
working directory and stdout/stderr (its log files). That client imports only the standard library (~20 ms), hands
these and its argv to the server over the socket, and waits. The server forks; the child becomes the worker: a
session of its own, the client's fds 0-2, directory and environment, `sys.argv` and `sys.path` as `python
default_worker.py` has them, new seeds for `random` and numpy, torch's threads as OMP_NUM_THREADS says, then Ray's
default_worker.py run as `__main__`. Ray registers it by the startup token in its arguments, and talks to, signals
and kills it as any worker. The client ends with the child's exit status; a signal it gets goes to the child, and
its death kills the child.

The server never imports Ray: `import ray` fixes Ray's C++ settings from the environment of that moment, the job id
of a worker among them (its worker then fails a check in Ray's core worker). So each child imports Ray itself
(~1.4 s of CPU) and reimports the one vLLM module that looks for Ray when it is imported (preload).

A worker whose environment differs in what a preloaded library reads at import (_read_at_preload: OMP_*, VLLM_*,
PYTHON*, TORCH*, ...) is not forked: the client execs the interpreter, as Ray would have. The server's log says, for
each worker, "forked PID" or why not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

HOOK = "worker_zygote.add_py_executable"
SOCKET_ENV = "RLFRAME_TESTS_WORKER_ZYGOTE"  # in a run's environment: the server's socket, for the hook
CLIENT_WAIT_S = 45  # a client waits this long for a server still importing (Ray gives a worker 60 s to register)


def add_py_executable(runtime_env: dict | None) -> dict:
    """Ray's RAY_RUNTIME_ENV_HOOK (ray.init calls it in the driver): the job's workers start through the server."""
    env = dict(runtime_env or {})
    path = os.environ.get(SOCKET_ENV)
    if path and "py_executable" not in env:
        env["py_executable"] = f"{sys.executable} -S {os.path.abspath(__file__)} {path}"
    return env


class WorkerZygote:
    """The server, in a process of its own started with `env` (the environment the runs' workers get), listening on
    a Unix socket in a temp dir of its own."""

    def __init__(self, env: dict[str, str]):
        import subprocess
        import tempfile

        from ray_cluster import _terminated_with_parent

        self.folder = tempfile.mkdtemp(prefix="rlzy", dir="/tmp")  # short: Unix socket paths are limited
        self.path = os.path.join(self.folder, "socket")
        self.log = os.path.join(self.folder, "log")
        open(os.path.join(self.folder, "starting"), "w").close()  # until it listens (clients wait for it)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"import worker_zygote; worker_zygote.serve({self.path!r})"],
                cwd=os.path.dirname(os.path.abspath(__file__)), env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_terminated_with_parent)

    def alive(self) -> bool:
        return self.process.poll() is None

    def run_env(self) -> dict[str, str]:
        """What the environment of a run whose workers the server forks adds."""
        return {"RAY_RUNTIME_ENV_HOOK": HOOK, SOCKET_ENV: self.path}

    def wait_listening(self, timeout_s: float = 180) -> None:
        """Until it has imported what it preloads and listens (its first clients would wait, or start fresh)."""
        import time

        deadline = time.monotonic() + timeout_s
        while os.path.exists(os.path.join(self.folder, "starting")) and self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(self.log, errors="replace") as log:
            assert os.path.exists(self.path), f"the worker server is not listening; its log:\n{log.read()[-3000:]}"

    def forked(self) -> set[int]:
        """The pids of the workers it forked so far."""
        with open(self.log, errors="replace") as log:
            return {int(line.split()[1]) for line in log if line.startswith("forked ")}

    def close(self) -> None:
        import shutil

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # its workers die with it (PR_SET_PDEATHSIG)
            self.process.wait(30)
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- the server (the client below does not import what it uses) ----

def preload() -> None:
    """What a worker of the tests' runs imports before it works, except Ray (see the module's docstring). Imports
    only: no thread, pool or computation is started (a forked child inherits none of them)."""
    import importlib.util

    sys.modules["ray"] = None  # an `import ray` below fails as if Ray were not installed
    try:
        import rlframe  # noqa: F401  (first: transformers without scikit-learn)
        import tensordict  # noqa: F401
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        if importlib.util.find_spec("vllm") is not None:
            import vllm.v1.sample.sampler  # noqa: F401
            from vllm import LLM, SamplingParams  # noqa: F401
    finally:
        del sys.modules["ray"]


def _reimport_what_looked_for_ray() -> None:
    """(In the child) vLLM's Ray helpers, which found no Ray in the server, imported again as a fresh worker has
    them."""
    import importlib

    if "vllm.v1.executor.ray_utils" in sys.modules:
        importlib.reload(sys.modules["vllm.v1.executor.ray_utils"])


def serve(path: str) -> None:
    """Import a worker's libraries, then fork one worker per connection until SIGTERM."""
    import selectors

    environment = dict(os.environ)  # (before the imports: some set variables that a fresh worker starts without)
    starting = os.path.join(os.path.dirname(path), "starting")
    try:
        preload()
    except BaseException:
        os.remove(starting)  # the clients start their workers themselves
        raise
    wake_read, wake_write = socket.socketpair()
    for end in (wake_read, wake_write):
        end.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())  # a SIGCHLD or SIGTERM wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.remove(starting)
    watch = selectors.DefaultSelector()
    watch.register(listener, selectors.EVENT_READ)
    watch.register(wake_read, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while not stopping:
        for key, _ in watch.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                pid = _fork_worker(connection, environment, [listener, wake_read, wake_write, *children.values()])
                if pid:
                    children[pid] = connection
                    watch.register(connection, selectors.EVENT_READ, pid)
                else:
                    connection.close()
            elif key.fileobj is wake_read:
                while True:
                    try:
                        wake_read.recv(4096)
                    except BlockingIOError:
                        break
                while children:  # each ended child's status to its client
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    connection = children.pop(pid, None)
                    if connection is not None:
                        watch.unregister(connection)
                        try:
                            connection.sendall(json.dumps({"status": status}).encode() + b"\n")
                        except OSError:
                            pass
                        connection.close()
            else:  # the client closed its end: it died, and its worker goes with it
                _kill(key.data)
                watch.unregister(key.fileobj)
    for pid in children:
        _kill(pid)


def _read_at_preload(name: str) -> bool:
    """Whether a preloaded library reads environment variable `name` when it is imported: fork_runner's prefixes but
    RAY_* (the server never imports Ray; a child reads RAY_* when it does), and not OMP_NUM_THREADS, which Ray sets
    for each worker and the child applies (_become_the_worker)."""
    from fork_runner import IMPORT_TIME_PREFIXES

    return name.startswith(IMPORT_TIME_PREFIXES) and not name.startswith("RAY_") and name != "OMP_NUM_THREADS"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork_worker(connection: socket.socket, environment: dict[str, str], inherited: list) -> int | None:
    """Read one client's request and fork its worker if its environment allows. Returns the child's pid, or None:
    the client was told to start the worker itself."""
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    size, data = int.from_bytes(header, "big"), b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    request = json.loads(data)
    env = request["env"]
    differ = sorted(k for k in {*env, *environment} if env.get(k) != environment.get(k) and _read_at_preload(k))
    if differ or len(fds) != 3:
        print(f"not forked: its environment differs in {differ}", flush=True)
        connection.sendall(json.dumps({"pid": None}).encode() + b"\n")
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for thing in inherited:
            thing.close()
        connection.close()
        _become_the_worker(request, fds)
    for fd in fds:
        os.close(fd)
    print(f"forked {pid}", flush=True)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _become_the_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: `python default_worker.py ARGS` with the client's fds, directory and environment; never
    returns."""
    import atexit
    import ctypes
    import random
    import runpy
    import threading
    import traceback

    from fork_runner import exit_status

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        os.setsid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the server
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script, *args = request["argv"]
        script = os.path.abspath(script)
        paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *paths, *[p for p in sys.path[1:] if p not in paths]]
        sys.argv = [script, *args]
        random.seed()
        import numpy

        numpy.random.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit():  # what OpenMP reads when torch loads it in a fresh worker
            sys.modules["torch"].set_num_threads(int(threads))
        _reimport_what_looked_for_ray()
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_status(stop)
    except BaseException:  # noqa: BLE001  (the interpreter's last resort: the traceback, status 1)
        traceback.print_exc()
    finally:  # the interpreter's exit: its threads joined, its exit hooks run
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ---- the client: `python -S worker_zygote.py SOCKET default_worker.py ARGS` (the standard library only) ----

def _client(path: str, argv: list[str]) -> None:
    import time

    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    starting = os.path.join(os.path.dirname(path), "starting")
    deadline = time.monotonic() + CLIENT_WAIT_S
    while not os.path.exists(path) and os.path.exists(starting) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.connect(path)
        socket.send_fds(server, [len(request).to_bytes(8, "big")], [0, 1, 2])
        server.sendall(request)
        answers = server.makefile("r")
        pid = json.loads(answers.readline())["pid"]
    except (OSError, ValueError):
        pid = None
    if pid is None:  # not forkable, or no server: the worker as Ray starts it
        os.execv(sys.executable, [sys.executable, *argv])
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, lambda received, _frame: os.kill(pid, received))
    line = answers.readline()
    code = os.waitstatus_to_exitcode(json.loads(line)["status"]) if line else -signal.SIGKILL  # (the server died)
    if code < 0:  # ended by a signal: end by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    _client(sys.argv[1], sys.argv[2:])
