"""A two-node Ray cluster on one machine, started the way users start clusters: `ray start` twice.

    with LocalRayCluster([{"node_a": 10}, {"node_b": 10}], cpus_per_node=2) as cluster:
        cluster.address          # for RAY_ADDRESS
        cluster.dashboard_url    # for ray.util.state.list_*(address=...)

Each raylet is a `ray start ... --block` process of our own; stopping the cluster terminates exactly
those (their Ray daemons exit with them). We never call `ray stop`: it kills every Ray process on the
machine, including other people's test clusters. Every port is picked free, and the cluster gets a
temp dir of its own, so it shares nothing with other clusters on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _terminated_with_parent() -> None:
    """(In the forked child) SIGTERM when the test process that started it dies, even by SIGKILL: `ray start
    --block` then stops its node, rather than outliving the tests."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalRayCluster:
    def __init__(self, node_resources: list[dict], cpus_per_node: int = 2, object_store_bytes: int | None = 150 << 20,
                 start_timeout_s: float = 180, dashboard: bool = True, env: dict[str, str] | None = None,
                 in_temp_dir: bool = False):
        """`object_store_bytes` None: Ray's default size. Without the `dashboard`, a one-node cluster is ready when its
        `ray start` says so. `env`: what the nodes (and so their workers) start with, instead of ours;
        `in_temp_dir`: they run in the cluster's temp dir, not in our working directory."""
        self.node_resources = node_resources
        self.in_temp_dir = in_temp_dir
        self.dashboard = dashboard
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.processes: list[subprocess.Popen] = []
        self.temp_dir = tempfile.mkdtemp(prefix="rlmn", dir="/tmp")  # short: unix socket paths are limited
        self.ip = node_ip()
        self.port = free_port()
        self.dashboard_port = free_port()
        self.address = f"{self.ip}:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {**(os.environ if env is None else env), "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "",
                    "RAY_AUTH_MODE": "disabled"}

    def _start(self, args: list[str], name: str) -> None:
        log = open(Path(self.temp_dir) / f"{name}.log", "w")
        self.processes.append(subprocess.Popen(
            [RAY, "start", *args, f"--num-cpus={self.cpus_per_node}",
             *([f"--object-store-memory={self.object_store_bytes}"] if self.object_store_bytes else []),
             f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--block"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            cwd=self.temp_dir if self.in_temp_dir else None, preexec_fn=_terminated_with_parent))

    def start(self) -> LocalRayCluster:
        head, *others = self.node_resources
        dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
                     if self.dashboard else ["--include-dashboard=false"])
        self._start(["--head", f"--port={self.port}", *dashboard, f"--ray-client-server-port={free_port()}",
                     f"--resources={json.dumps(head)}"], "head")
        if not self.dashboard:
            assert not others, "a cluster of several nodes is watched through its dashboard"
            return self._wait_started("head")
        self._wait_nodes(1)
        for i, resources in enumerate(others, start=1):
            self._start([f"--address={self.address}", f"--resources={json.dumps(resources)}"], f"node{i}")
        self._wait_nodes(len(self.node_resources))
        return self

    def _wait_nodes(self, n: int) -> None:
        """Until the state API (dashboard) lists n alive nodes."""
        from ray.util.state import list_nodes

        deadline = time.monotonic() + self.start_timeout_s
        last = None
        while time.monotonic() < deadline:
            for p in self.processes:
                if p.poll() is not None:
                    raise RuntimeError(f"`ray start` exited with {p.returncode}; logs in {self.temp_dir}:\n{self.logs()}")
            try:
                alive = [x for x in list_nodes(address=self.dashboard_url) if x.state == "ALIVE"]
                if len(alive) >= n:
                    return
            except Exception as error:  # dashboard not up yet
                last = error
            time.sleep(2)
        raise TimeoutError(f"cluster did not reach {n} nodes in {self.start_timeout_s}s ({last}):\n{self.logs()}")

    def _wait_started(self, name: str) -> LocalRayCluster:
        """Until `ray start` of node `name` says its node runs."""
        deadline = time.monotonic() + self.start_timeout_s
        log = Path(self.temp_dir) / f"{name}.log"
        while time.monotonic() < deadline:
            if "Ray runtime started" in log.read_text():
                return self
            if self.processes[-1].poll() is not None:
                raise RuntimeError(f"`ray start` exited with {self.processes[-1].returncode}:\n{self.logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"`ray start` did not start in {self.start_timeout_s}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in Path(self.temp_dir).glob("*.log"))

    def stop(self) -> None:
        """Terminate our `ray start --block` processes (they take their daemons along), then our temp dir."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: only this cluster's processes
                p.wait(timeout=30)
        self.processes = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def leftover_processes(self) -> list[str]:
        """Processes still running from this cluster (their command line names our temp dir)."""
        out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if self.temp_dir in line and "ps -eo" not in line]

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
