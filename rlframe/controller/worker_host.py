"""The Ray actor that hosts the worker objects of one rank.

Worker classes are plain Python classes: they know nothing about Ray and can be built in one
process for debugging. ``_WorkerHost`` is the only Ray actor class. For its bundle it

1. records rank, world size and where it runs (node IP, hostname, pid);
2. sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and calls
   ``torch.distributed.init_process_group`` once, before any worker object exists;
3. builds one object per role (several roles in one process = the hybrid engine);
4. runs ``execute(role, method, *args, **kwargs)``, turning any exception into a WorkerError that
   names this rank and carries the formatted traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from typing import Any

import ray
import torch

from rlframe.collector import collector_paused
from rlframe.controller.errors import WorkerError


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def process_group_backend(uses_gpus: bool) -> str:
    """The workers' default process group: on GPUs one group that carries both devices -- CUDA tensors
    over NCCL, CPU tensors over gloo (scalar metrics, Python objects, FSDP2's CPU-offloaded gradients
    in the norm of gradient clipping, checkpoint metadata) -- so no collective meets a backend that
    refuses its device; gloo alone on CPUs."""
    return "cpu:gloo,cuda:nccl" if uses_gpus else "gloo"


def _select_cuda_device() -> None:
    """Bind this process to its GPU. Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPUs."""
    gpu_ids = ray.get_gpu_ids()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpu_ids and visible and len(visible.split(",")) == len(gpu_ids):
        torch.cuda.set_device(0)
    elif gpu_ids:
        torch.cuda.set_device(int(gpu_ids[0]))


def reset_peak_rss() -> bool:
    """Linux: set this process's resident-set high-water mark (VmHWM) back to its current RSS, so that
    the next read is the peak since now. False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _load_malloc_trim():
    """glibc's malloc_trim, or None (another C library, or not Linux)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_host_memory() -> None:
    """Hand the memory the C allocator keeps after frees back to the OS (glibc's malloc_trim(0)).

    Between calls a trainer process has freed the activations, logits and gradients of the phase
    that just ended; glibc keeps part of those pages in its heaps and arenas (their free space is
    returned only at their top). Measured once on the main job: the following phases' peaks 0.1-0.7
    GiB lower, a few ms per call."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def peak_rss_gib() -> float:
    """VmHWM of /proc/self/status (the peak resident set since start or the last reset) in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    return float("nan")


class CallMemory:
    """The peak memory of each (role, method) a host runs, kept until read: the process's peak RSS
    during the call (host memory: on CPU everything -- weights, optimizer, activations, the vLLM
    engine running in-process) and, when CUDA is in use, the device's peak allocated memory."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.tracks_rss = reset_peak_rss()

    def start(self) -> None:
        if self.tracks_rss:
            reset_peak_rss()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def stop(self, key: str) -> None:
        found = {}
        if self.tracks_rss:
            found[f"rss/{key}"] = peak_rss_gib()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            found[f"device/{key}"] = torch.cuda.max_memory_allocated() / 2**30
        for name, value in found.items():
            self.peaks[name] = max(value, self.peaks.get(name, 0.0))

    def take(self) -> dict[str, float]:
        """The peaks since the last take (then forgotten)."""
        peaks, self.peaks = self.peaks, {}
        return peaks


class WorkerHost:
    """Plain version of the host; ``_WorkerHost`` below is its Ray actor class."""

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int, num_cpus: float,
                 group_name: str = "rlframe", role_names: list[str] | None = None):
        self.group_name = group_name
        self.role_names = list(role_names or [])  # for the log prefix, before the roles are built
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.roles: dict[str, Any] = {}
        self.node_ip = ray.util.get_node_ip_address()
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.memory = CallMemory()
        torch.set_num_threads(max(1, int(num_cpus)))

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this.
        roles = list(self.roles) or self.role_names
        return f"WorkerHost({self.group_name}, rank={self.rank}/{self.world_size}, roles={roles})"

    def info(self) -> dict:
        """Where this rank runs; rank 0 also offers a free port for the process group."""
        info = {"rank": self.rank, "node_ip": self.node_ip, "hostname": self.hostname, "pid": self.pid}
        if self.rank == 0:
            info["master_port"] = find_free_port()
        return info

    def init_roles(self, master_addr: str, master_port: int, backend: str | None,
                   roles: dict[str, tuple[type, dict]], timeout_s: float | None) -> dict[str, float]:
        """Join the process group, then build one object per role (all ranks run this together). Returns how long
        each part took here: `process_group`, `build/<role>`, and what a role reports in its `startup_times`
        (e.g. `model_load`, `engine_init`), in seconds."""
        current = "<init_process_group>"
        times: dict[str, float] = {}
        start = time.perf_counter()
        try:
            os.environ.update(
                RANK=str(self.rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK=str(self.local_rank),
                LOCAL_WORLD_SIZE=str(self.local_world_size),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )
            if backend is not None and not torch.distributed.is_initialized():
                if "nccl" in backend:
                    _select_cuda_device()
                kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
                torch.distributed.init_process_group(
                    backend, rank=self.rank, world_size=self.world_size, **kwargs
                )
            times["process_group"] = time.perf_counter() - start
            for current, (cls, kwargs) in roles.items():
                start = time.perf_counter()
                with collector_paused():  # (rlframe/collector.py: the imports and engine builds of a start)
                    self.roles[current] = cls(**kwargs)
                times[f"build/{current}"] = time.perf_counter() - start
                for key, seconds in (getattr(self.roles[current], "startup_times", None) or {}).items():
                    times[key] = times.get(key, 0.0) + seconds
        except Exception as error:
            raise self._error(error, current, "__init__") from None
        return times

    def execute(self, _role: str, _method: str, /, *args, **kwargs) -> Any:
        """Call ``roles[_role]._method(*args, **kwargs)``; failures become a WorkerError. The call's peak
        memory is kept for ``memory_peaks``."""
        self.memory.start()
        try:
            return getattr(self.roles[_role], _method)(*args, **kwargs)
        except Exception as error:
            raise self._error(error, _role, _method) from None
        finally:
            self.memory.stop(f"{_role}.{_method}")
            release_freed_host_memory()

    def memory_peaks(self) -> dict[str, float]:
        """{"rss/<role>.<method>": GiB, "device/<role>.<method>": GiB} of the calls since the last read:
        the largest peak over those calls."""
        return self.memory.take()

    def _error(self, error: Exception, role: str, method: str) -> WorkerError:
        return WorkerError(
            f"{type(error).__name__}: {error}",
            role=role, rank=self.rank, node_ip=self.node_ip, hostname=self.hostname, pid=self.pid,
            method=method, remote_traceback=traceback.format_exc(),
        )


_WorkerHost = ray.remote(WorkerHost)
