"""Runs a user's agent function in its own process: one episode, or a fork server of episodes.

    python episode_runner.py FILE NAME RESULT      # one episode: the row as JSON on stdin
    python episode_runner.py --serve               # fork server: one JSON job per stdin line

An episode calls `NAME(row)` and writes its return value (text, or a dict with `answer` and optionally `reward`) as
JSON to the file RESULT; an exception exits with status 1 (the traceback on stderr). The fork server imports the
heavy client libraries once (`openai`, `httpx`: ~1 s of CPU each time otherwise), then per job forks a child that
starts a new session (its own process group, killed whole at its deadline), takes the job's stdin/stdout/stderr
files and environment (the episode's OPENAI_API_KEY), imports the user's file and runs the episode. It answers
each job with the child's pid and reports each exit, as JSON lines on its stdout. Standard library only (nothing
of rlframe is imported); the user's file is imported after the fork, so module-level clients see the episode's key.
"""

import importlib.util
import json
import os
import sys
import threading
import time
import traceback

PRELOAD = ("openai", "httpx")


def main(path: str, name: str, result_path: str) -> int:
    row = json.loads(sys.stdin.read() or "{}")
    spec = importlib.util.spec_from_file_location("rlframe_agent_program", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlframe_agent_program"] = module
    spec.loader.exec_module(module)
    answer = getattr(module, name)(row)
    if not isinstance(answer, (str, dict)) and answer is not None:
        answer = str(answer)
    with open(result_path, "w") as f:
        json.dump({"answer": answer}, f, default=str)
    return 0


def run_child(job: dict) -> None:
    """In the forked child: a new session, the job's files as fds 0/1/2, its environment, the episode; never returns."""
    code = 1
    try:
        os.setsid()
        for fd, path, flags in ((0, job["stdin"], os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own descriptors)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(job["env"])
        code = main(job["path"], job["name"], job["result"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # the agent's failure: its traceback on its stderr, exit status 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """The fork server's loop (see the module doc); it ends when its stdin closes."""
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:
            pass
    out = sys.stdout.fileno()

    def say(payload: dict) -> None:  # os.write: no Python-level lock a forked child could inherit held
        os.write(out, (json.dumps(payload) + "\n").encode())

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.02)
                continue
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    threading.Thread(target=reap, daemon=True).start()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(job)
        say({"pid": pid})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve()
        sys.exit(0)
    try:
        sys.exit(main(*sys.argv[1:4]))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
