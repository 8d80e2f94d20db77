"""DeepSpeed's compiled ops: build them once under a file lock, and say why one cannot load here.

DeepSpeed JIT-compiles C++ ops the first time a process needs them: the engine needs `cpu_adam`, for
optimizer offload. Two processes compiling the same op at once abort (seen with deepspeed 0.19.8), so
`build_ops` compiles under a file lock, and the DeepSpeed engine calls it before it starts DeepSpeed's
communication layer: on a fresh machine the first rank compiles (minutes) while the others wait, then load
what it built. Nothing compiles it at install time (no default recipe uses DeepSpeed); `make deepspeed-ops`
(`python -m rlframe.workers.engine.deepspeed`) compiles it ahead.

DeepSpeed's communication layer would also compile its shared-memory all-reduce op (`deepspeed_shm_comm`)
whenever it starts on CPU. Only DeepSpeed-Inference's tensor-parallel layers call that op
(`inference_all_reduce`), which a training engine never uses; without it, such a call falls back to the
process group's all_reduce. `skip_shared_memory_comm_op` tells DeepSpeed it is unavailable, so no engine
compiles it (its two C++ files took 94 and 95 s, side by side, on our 2-core machine).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from rlframe.device import DeviceProfile

# The op the engine may JIT-compile (a DeepSpeed op-builder class name), and the one it keeps DeepSpeed from compiling.
CPU_ADAM_OP = "CPUAdamBuilder"
SHARED_MEMORY_COMM_OP = "ShareMemCommBuilder"  # loaded by deepspeed.comm on the CPU accelerator


def _extensions_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


@contextmanager
def _ops_lock():
    """One process at a time compiles or loads DeepSpeed's JIT ops on this machine."""
    folder = _extensions_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "rlframe-deepspeed-ops.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_ops(names: tuple[str, ...] | list[str]) -> None:
    """Compile (first time) and load the named DeepSpeed ops under the file lock; the accelerator's
    builders only: an op this accelerator does not use is skipped."""
    from deepspeed.accelerator import get_accelerator

    with _ops_lock():
        for name in names:
            builder = get_accelerator().create_op_builder(name)
            if builder is not None and builder.is_compatible(verbose=False):
                builder.load(verbose=False)


def skip_shared_memory_comm_op() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op incompatible in this process (DeepSpeed's own record of which
    ops can build here), so that its communication layer starts without compiling it (see the module's note).
    Call after `_import_deepspeed`, before DeepSpeed's communication layer starts."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHARED_MEMORY_COMM_OP)
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def extension_problem(op: str = CPU_ADAM_OP) -> str | None:
    """Why DeepSpeed cannot load op `op` on this machine (no prebuilt op and no way to compile one),
    or None. Checked by validate_config before any worker starts."""
    if importlib.util.find_spec("deepspeed") is None:
        return "the deepspeed package is not installed"
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(op)
    if builder is None:
        return f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {op}"
    if installed_ops.get(builder.NAME) or (_extensions_dir() / _cache_folder(builder)).is_dir():
        return None  # prebuilt into the wheel, or compiled here before
    if not builder.is_compatible(verbose=False):
        return f"DeepSpeed reports {builder.NAME} incompatible here: {'; '.join(builder.error_log or []) or 'see ds_report'}"
    if shutil.which("ninja") is None:
        return f"{builder.NAME} must be compiled on first use and ninja is missing (pip install ninja)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"{builder.NAME} must be compiled on first use and there is no C++ compiler ('{compiler}')"
    return None


def _cache_folder(builder) -> str:
    """Where torch.utils.cpp_extension puts a JIT-compiled op (under the extensions directory)."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}_{'cu' + torch.version.cuda.replace('.', '') if torch.version.cuda else 'cpu'}"
    return f"{version}/{builder.NAME}"


def _import_deepspeed(profile: DeviceProfile):
    """deepspeed, with the accelerator of our device profile (not whatever it would detect)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if profile.is_gpu else "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def main() -> None:
    """`make deepspeed-ops`: compile the engine's op ahead of its first use. An op that cannot be built is
    reported, not fatal: validate_config names it if a run asks for it."""
    _import_deepspeed(DeviceProfile("cuda" if torch.cuda.is_available() else "cpu", torch.float32, "", "", "", False))
    try:
        build_ops([CPU_ADAM_OP])
        print(f"deepspeed op {CPU_ADAM_OP}: ready")
    except Exception as error:  # (a missing compiler or CUDA toolkit; the message says which)
        print(f"deepspeed op {CPU_ADAM_OP}: NOT built ({type(error).__name__}: {error}); "
              "runs that need it will say so before they start")
