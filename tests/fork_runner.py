"""`python -m rlframe.main ARGS` for the tests, each run in a process forked from one that already imported the
driver's libraries (torch, transformers, Ray, tensordict, rlframe: 6-8 CPU-seconds a process on our 2 cores).

    server = ForkServer(env)                                  # one per test process, started once
    result = server.run(args, cwd=tmp_path, env=env, timeout=600)      # a subprocess.CompletedProcess

The run itself is what a user's command does: rlframe.main executed as `__main__` (runpy, as `python -m` does) in
a process of its own, with its own working directory, environment, argv, stdin (/dev/null), stdout and stderr
(files, read back), its own process group (killed on a timeout, with what it started), its own Ray workers (in a
cluster of its own, or the one $RAY_ADDRESS names: tests/conftest.py's suite cluster) and its exit status:
exit_now's, SystemExit's code, or 1 with the traceback on stderr. Only the interpreter's start and the imports of
fork_runner_preload.py are shared.

A run whose environment changes what a preloaded library reads when it is imported (RAY_*, HF_*, TORCH*, OMP_*,
...) cannot be forked (`forkable`): the caller starts a fresh interpreter instead. Tests of what the interpreter's
own start does (the start-up profile's imports, signals to a process group, the command line as a user types it)
start `python -m rlframe.main` themselves.

The server reads one JSON request per line on its stdin and answers on its stdout: the run's pid when it forked it,
then its exit status when it ended (one run at a time: run() waits for it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Read by torch, transformers, Ray, vLLM, wandb, Python or the OpenMP runtime when they are imported (the server
# imported them with the environment it started with).
IMPORT_TIME_PREFIXES = ("RAY_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_",
                        "KMP_", "VLLM_", "CUDA_", "TOKENIZERS_", "WANDB_", "PYTHON", "LD_")
READ_LATER = ("RAY_ADDRESS",)  # (read by ray.init)
TESTS_DIR = Path(__file__).resolve().parent


class ForkServer:
    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.process = subprocess.Popen([sys.executable, "-c", "import fork_runner; fork_runner.serve()"],
                                        cwd=TESTS_DIR, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1)
        self.path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

    def differences(self, env: dict[str, str]) -> set[str]:
        """The variables whose value in `env` is not the one the server started with (PYTHONPATH: when it names a
        folder outside the server's path)."""
        paths = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
        different = {"PYTHONPATH"} if not paths <= set(self.path) | {str(TESTS_DIR.parent)} else set()
        return different | {k for k in {*env, *self.env} - {"PYTHONPATH"}
                            if env.get(k) != self.env.get(k)}

    def forkable(self, env: dict[str, str]) -> bool:
        """Every variable a preloaded library reads at import has the value the server started with."""
        return self.process.poll() is None and not any(
            k.startswith(IMPORT_TIME_PREFIXES) and k not in READ_LATER for k in self.differences(env))

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """`python -m rlframe.main ARGS` in a forked process (forkable(env) must hold); raises
        subprocess.TimeoutExpired after `timeout` seconds, the run's process group killed."""
        with tempfile.TemporaryDirectory(prefix="rlframe-run-") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"args": list(args), "cwd": str(cwd), "env": dict(env), "out": out, "err": err}
            self.process.stdin.write(json.dumps(request) + "\n")
            pid = json.loads(self.process.stdout.readline())["pid"]
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                os.killpg(pid, signal.SIGKILL)
                self.process.stdout.readline()  # its status, once the server reaped it
                raise subprocess.TimeoutExpired(["rlframe.main", *args], timeout, _read(out), _read(err))
            status = json.loads(self.process.stdout.readline())["status"]
            return subprocess.CompletedProcess([sys.executable, "-m", "rlframe.main", *args],
                                               os.waitstatus_to_exitcode(status), _read(out), _read(err))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def serve() -> None:
    """The server: import the driver's libraries, then fork one run per request until stdin closes."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the answers
    import fork_runner_preload  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _become_the_run(**request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": status}) + "\n")


def exit_status(stop: SystemExit) -> int:
    """The status the interpreter exits with on an uncaught SystemExit (a code that is not an int: printed, 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def _become_the_run(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: `python -m rlframe.main ARGS` run from `cwd` with `env`; never returns."""
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills the run and what it started
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # as in a fresh `python -m`: rlframe.main runs as __main__ only (an `import rlframe.main` later gets its own copy)
        sys.argv = [sys.modules.pop("rlframe.main").__file__, *args]
        sys.path[0] = cwd  # as `python -m` puts the working directory first
        runpy.run_module("rlframe.main", run_name="__main__", alter_sys=True)
        code = 0  # (a finished run leaves through exit_now; --help and --cfg return)
    except SystemExit as stop:
        code = exit_status(stop)
    except BaseException:  # noqa: BLE001  (the interpreter's last resort: the traceback, status 1)
        traceback.print_exc()
    finally:  # then the interpreter's exit: its threads joined, its exit hooks (Ray's shutdown among them) run
        import threading

        from rlframe.main import exit_now

        threading._shutdown()
        exit_now(code)

