"""The DeepSpeed engine's settings (the config's `deepspeed:` section, handed to the engine as is) and its checks.

Importing this module is cheap: it needs neither torch nor deepspeed (the one check that asks DeepSpeed
about its C++ extension imports it when it runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SUPPORTED_ZERO_STAGES = (2, 3)

# OpenRLHF's DeepSpeed flags that rlframe does not implement: key -> (the value that leaves it off, what it is).
UNHONOURED_DEEPSPEED_KEYS = {
    "zpg": (1, "ZeRO++ hierarchical partitioning"),
    "ds_tensor_parallel_size": (1, "DeepSpeed AutoTP tensor parallelism"),
    "deepspeed_enable_sleep": (False, "DeepSpeed's sleep (offload_states between phases)"),
    "enable_ema": (False, "an EMA copy of the actor"),
    "use_ds_universal_ckpt": (False, "DeepSpeed universal checkpoints (rlframe writes its own full-weight layout)"),
    "deepcompile": (False, "DeepCompile"),
}


@dataclass
class DeepSpeedSettings:
    """actor.strategy=deepspeed (workers/engine/deepspeed/): DeepSpeed ZeRO for the actor, the reference
    policy and the critic. Keys are named as OpenRLHF's flags, so its users' settings carry over; the
    flags every rlframe engine has live with them: --bf16 is model.dtype, --gradient_checkpointing
    model.gradient_checkpointing, --max_norm actor.optim.grad_clip, --packing_samples
    actor.use_remove_padding, --micro_train_batch_size actor.ppo_micro_batch_size_per_device.

    The offload flags reach the engine as EngineSettings.offload_params / offload_optimizer, as for every
    engine (rlframe/trainer/worker_settings.py: engine_offload). Sizes are in elements, as DeepSpeed counts them."""

    zero_stage: int = 2  # 2: optimizer state + gradients sharded over the ranks | 3: parameters too
    adam_offload: bool = False  # ZeRO-Offload: optimizer state and step on the CPU (DeepSpeedCPUAdam)
    offload: bool = False  # ZeRO-Infinity: the parameters on the CPU (needs zero_stage=3)
    ref_reward_offload: bool = False  # the reference policy's parameters on the CPU (ZeRO-3 inference)
    overlap_comm: bool = False  # overlap the gradient reduction with the backward pass
    # copy gradients into one contiguous buffer as they are produced (less fragmentation)
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduction
    allgather_bucket_size: int = 500_000_000  # ZeRO-2: elements per all-gather of the updated parameters
    stage3_prefetch_bucket_size: int = 50_000_000  # ZeRO-3: elements fetched ahead of use
    stage3_param_persistence_threshold: int = 100_000  # ZeRO-3: smaller parameters stay whole on every rank
    # ZeRO-3: parameter elements kept gathered at once before some are released
    stage3_max_live_parameters: int = 1_000_000_000
    # ZeRO-3: a parameter used again within this many elements is not released
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000  # ZeRO-3: elements per optimizer sub-group
    grad_accum_dtype: Optional[str] = None  # fp32 | bf16; null: DeepSpeed's default
    # rlframe's own: ZeRO-3 parameter elements gathered at once to stream the full weights (weight sync,
    # export, checkpoints); never the whole model on one rank. A larger single tensor is gathered alone.
    gather_bucket_size: int = 64 * 2**20
    # OpenRLHF flags rlframe does not implement (UNHONOURED_DEEPSPEED_KEYS): an error unless left as they are.
    zpg: int = 1  # not implemented: ZeRO++ hierarchical partitioning (1: off)
    ds_tensor_parallel_size: int = 1  # not implemented: DeepSpeed AutoTP (1: off)
    deepspeed_enable_sleep: bool = False  # not implemented: DeepSpeed's offload_states between phases (false)
    enable_ema: bool = False  # not implemented: an EMA copy of the actor (false)
    # not implemented: DeepSpeed universal checkpoints (false; rlframe writes its own layout)
    use_ds_universal_ckpt: bool = False
    deepcompile: bool = False  # not implemented: DeepCompile (false)


# ------------------------------------------------------------------------------------ checks
# Each check is `rule(cfg, need)` on the whole run config; only the first one runs whatever the strategy
# (the section is otherwise ignored, so a recipe can be compared with fsdp).
def openrlhf_flags_unhonoured(cfg, need) -> None:
    """OpenRLHF flags rlframe does not implement must keep the value that leaves them off."""
    for key, (off, what) in UNHONOURED_DEEPSPEED_KEYS.items():
        need(getattr(cfg.deepspeed, key) == off, f"deepspeed.{key}",
             f"{what} is not implemented by rlframe's DeepSpeed engine. Fix: remove deepspeed.{key} (or set it to {off})")


def _chosen(cfg) -> bool:
    """actor.strategy=deepspeed and the package is here (else `installed` reports it once)."""
    import importlib.util

    return cfg.actor.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is not None


def installed(cfg, need) -> None:
    import importlib.util

    if cfg.actor.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        need(False, "actor.strategy", "deepspeed is not installed. Fix: make install (or pip install -e '.[deepspeed]' "
             "next to your torch), or actor.strategy=fsdp")


def zero_stage_supported(cfg, need) -> None:
    if not _chosen(cfg):
        return
    ds = cfg.deepspeed
    need(ds.zero_stage in SUPPORTED_ZERO_STAGES, "deepspeed.zero_stage",
         f"{ds.zero_stage} is not supported (stages {', '.join(map(str, SUPPORTED_ZERO_STAGES))}: 2 shards optimizer "
         "state and gradients, 3 parameters too). Fix: deepspeed.zero_stage=2 or 3")


def param_offload_needs_zero3(cfg, need) -> None:
    if not _chosen(cfg):
        return
    ds = cfg.deepspeed
    need(not (ds.offload or cfg.actor.offload_params) or ds.zero_stage == 3, "deepspeed.offload",
         "parameter offload needs partitioned parameters, i.e. ZeRO stage 3. Fix: deepspeed.zero_stage=3, or "
         "deepspeed.offload=false (and actor.offload_params=false)")


def no_ulysses(cfg, need) -> None:
    if not _chosen(cfg):
        return
    need(cfg.actor.ulysses_sequence_parallel_size == 1, "actor.ulysses_sequence_parallel_size",
         "Ulysses sequence parallelism runs on the fsdp engine only. Fix: 1, or actor.strategy=fsdp")


def no_float16(cfg, need) -> None:
    if not _chosen(cfg):
        return
    need(cfg.model.dtype != "float16", "model.dtype",
         "float16 needs loss scaling, which the deepspeed engine does not use. Fix: model.dtype=bfloat16 (or auto)")


def grad_accum_dtype_known(cfg, need) -> None:
    if not _chosen(cfg):
        return
    ds = cfg.deepspeed
    need(ds.grad_accum_dtype in (None, "fp32", "bf16"), "deepspeed.grad_accum_dtype",
         f"'{ds.grad_accum_dtype}' is not fp32, bf16 or null")


def zero3_colocated_only(cfg, need) -> None:
    if not _chosen(cfg):
        return
    need(not (cfg.trainer.placement == "disaggregated" and cfg.deepspeed.zero_stage == 3), "deepspeed.zero_stage",
         "the disaggregated weight broadcast plans its buckets from the module's parameter shapes, which ZeRO-3 "
         "partitions. Fix: deepspeed.zero_stage=2, or trainer.placement=colocated")


def bucket_sizes_positive(cfg, need) -> None:
    if not _chosen(cfg):
        return
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size",
                "gather_bucket_size"):
        need(getattr(cfg.deepspeed, key) > 0, f"deepspeed.{key}", "must be > 0 (elements)")


def cpu_adam_loads(cfg, need) -> None:
    """Optimizer offload steps with DeepSpeedCPUAdam: its C++ extension must load (or compile) here."""
    if not _chosen(cfg) or not (cfg.deepspeed.adam_offload or cfg.actor.offload_optimizer):
        return
    from rlframe.workers.engine.deepspeed.ops import extension_problem

    problem = extension_problem()
    need(problem is None, "deepspeed.adam_offload",
         f"optimizer offload steps with DeepSpeedCPUAdam, whose C++ extension (cpu_adam) cannot load here: "
         f"{problem}. Fix: install ninja and a C++ compiler (make install then builds it once), or "
         "deepspeed.adam_offload=false and actor.offload_optimizer=false")


CHECKS = (openrlhf_flags_unhonoured, installed, zero_stage_supported, param_offload_needs_zero3, no_ulysses,
          no_float16, grad_accum_dtype_known, zero3_colocated_only, bucket_sizes_positive, cpu_adam_loads)
