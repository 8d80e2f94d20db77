"""The one place a rollout engine is built: vLLM or HF `generate`, by the device profile."""

from __future__ import annotations

from rlframe.device import DeviceProfile
from rlframe.workers.rollout.base import eos_and_pad_ids
from rlframe.workers.rollout.tensor_parallel import TensorParallelGroup
from rlframe.workers.settings import RolloutSettings


def tensor_parallel_group(settings: RolloutSettings) -> TensorParallelGroup | None:
    """The ranks that share this rank's engine (rollout.tensor_parallel_size > 1); every rank calls it,
    before the engine is built."""
    return TensorParallelGroup.create(settings.tensor_parallel_size) if settings.tensor_parallel_size > 1 else None


def build_rollout_engine(settings: RolloutSettings, profile: DeviceProfile, rank: int, *, shares_devices: bool):
    """The configured engine for this process. `shares_devices`: colocated with a trainer (the hybrid
    engine), so vLLM may sleep while the trainer trains; engines on devices of their own never sleep.
    With tensor parallelism every rank of an engine gets the same seed (they sample together)."""
    eos_ids, pad_id = eos_and_pad_ids(settings.model_path, settings.trust_remote_code)
    if profile.rollout_engine == "vllm":
        from rlframe.workers.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(
            settings.model_path, profile, max_model_len=settings.max_model_len,
            seed=settings.seed + rank // settings.tensor_parallel_size, tensor_parallel_size=settings.tensor_parallel_size,
            pad_token_id=pad_id, gpu_memory_utilization=settings.gpu_memory_utilization,
            cpu_kv_cache_gib=settings.cpu_kv_cache_gib, enable_prefix_caching=settings.enable_prefix_caching,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_sleep_mode=settings.enable_sleep_mode and shares_devices,
            enforce_eager=settings.enforce_eager, trust_remote_code=settings.trust_remote_code, lora=settings.lora,
            limit_mm_per_prompt=settings.limit_mm_per_prompt)
    from rlframe.workers.rollout.hf_rollout import HFRollout

    return HFRollout(settings.model_path, profile, eos_token_ids=eos_ids, pad_token_id=pad_id,
                     trust_remote_code=settings.trust_remote_code, lora=settings.lora)
