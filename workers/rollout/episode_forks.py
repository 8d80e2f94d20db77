"""The agent processes' side of the fork server (workers/rollout/episode_runner.py --serve), one per rollout.

`ForkServer.spawn(job)` -> a `ForkedChild` with the `pid`, `poll()` and `wait()` of a subprocess.Popen, so that the
episode runner treats a forked episode as it treats a spawned command. The server process is the children's
parent (it reaps them and reports each exit); `close()` ends it once the rollout's episodes have all ended.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

RUNNER = str(Path(__file__).with_name("episode_runner.py"))


class ForkedChild:
    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    def poll(self) -> int | None:
        return self.server.exits.get(self.pid)

    def wait(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self.pid not in self.server.exits:
            if time.monotonic() >= deadline or self.server.process.poll() is not None:
                return -9  # the server is gone (its children are in sessions of their own, killed by the caller)
            time.sleep(0.01)
        return self.server.exits[self.pid]


class ForkServer:
    def __init__(self, env: dict):
        self.process = subprocess.Popen([sys.executable, RUNNER, "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                        bufsize=1)
        self.exits: dict[int, int] = {}
        self.replies: queue.Queue[int] = queue.Queue()
        self.reader = threading.Thread(target=self.read, daemon=True, name="rlframe-episode-forks")
        self.reader.start()

    def read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            if "exit" in message:
                self.exits[int(message["exit"])] = int(message["code"])
            else:
                self.replies.put(int(message["pid"]))

    def spawn(self, job: dict, timeout_s: float = 30.0) -> ForkedChild:
        """Fork one episode (`job`: path, name, result, stdin, stdout, stderr, env); OSError if the server fails."""
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            return ForkedChild(self, self.replies.get(timeout=timeout_s))
        except (BrokenPipeError, queue.Empty) as error:
            raise OSError(f"the episode fork server did not answer ({type(error).__name__})") from None

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=5)
