"""The Megatron engine's settings (the config's `megatron:` section, handed to the engine as is) and its checks.

Importing this module is cheap: it needs neither torch nor megatron-core (the model checks import
the conversion module when they run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class MegatronSettings:
    """actor.strategy=megatron (workers/engine/megatron/): Megatron-core GPT (local layer spec, SDPA
    attention) for the actor, the reference policy and the critic. actor.world_size = TP x PP x CP x data-parallel size."""

    tensor_model_parallel_size: int = 1  # must divide the attention heads and key/value heads
    pipeline_model_parallel_size: int = 1  # must divide the layers (1F1B schedule over micro-batches)
    context_parallel_size: int = 1  # CP: each sequence split into 2 x CP chunks (load-balanced), key/value all-gathered
    sequence_parallel: bool = False  # Megatron's sequence parallelism (needs TP > 1): norms / residuals split along the sequence
    expert_model_parallel_size: int = 1  # EP (Qwen2-MoE / Mixtral): must divide the experts and the data-parallel x CP ranks


SIZE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size")


# ------------------------------------------------------------------------------------ checks
# Each check is `rule(cfg, need)` on the whole run config, and runs only under actor.strategy=megatron
# (the section is otherwise ignored, so a recipe can be compared with fsdp). Sequence lengths need no
# check: the engine pads to a multiple of TP (sequence parallel) x 2 CP.
def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def _chosen(cfg) -> bool:
    """actor.strategy=megatron and the package is here (else `installed` reports it once)."""
    return cfg.actor.strategy == "megatron" and _installed()


class Sizes(NamedTuple):
    tp: int
    pp: int
    cp: int
    ep: int
    world: int  # actor.world_size


def _sizes(cfg) -> Sizes | None:
    """The parallel sizes when megatron is chosen and every one is an integer >= 1, else None."""
    sizes = [getattr(cfg.megatron, key) for key in SIZE_KEYS]
    if not _chosen(cfg) or not all(isinstance(v, int) and v >= 1 for v in sizes):
        return None
    return Sizes(*sizes, world=cfg.actor.world_size)


def installed(cfg, need) -> None:
    if cfg.actor.strategy == "megatron" and not _installed():
        need(False, "actor.strategy", "megatron-core is not installed. Fix: make install (or pip install -e "
             "'.[megatron]'), or actor.strategy=fsdp")


def sizes_positive(cfg, need) -> None:
    if not _chosen(cfg):
        return
    for key in SIZE_KEYS:
        size = getattr(cfg.megatron, key)
        need(isinstance(size, int) and size >= 1, f"megatron.{key}", f"{size!r}: must be an integer >= 1")


def world_divisible(cfg, need) -> None:
    """The rest of actor.world_size after TP x PP x CP is data parallelism."""
    if (s := _sizes(cfg)) is None:
        return
    need(s.world % (s.tp * s.pp * s.cp) == 0, "actor.world_size",
         f"{s.world} is not divisible by TP x PP x CP = {s.tp} x {s.pp} x {s.cp} = {s.tp * s.pp * s.cp} (the rest is "
         f"data parallelism). Fix: actor.world_size={s.tp * s.pp * s.cp} (or a multiple), or smaller megatron.* sizes")


def sequence_parallel_needs_tp(cfg, need) -> None:
    if (s := _sizes(cfg)) is None:
        return
    need(not cfg.megatron.sequence_parallel or s.tp > 1, "megatron.sequence_parallel",
         "needs megatron.tensor_model_parallel_size > 1 (it splits along the sequence what TP replicates). "
         "Fix: megatron.sequence_parallel=false, or TP > 1")


def experts_fit_world(cfg, need) -> None:
    """The EP ranks are taken from the data-parallel ranks."""
    if (s := _sizes(cfg)) is None:
        return
    need(s.world % (s.tp * s.pp * s.ep) == 0, "megatron.expert_model_parallel_size",
         f"{s.ep}: the experts are split over EP ranks taken from the data-parallel ranks, so actor.world_size="
         f"{s.world} must be divisible by TP x PP x EP = {s.tp * s.pp * s.ep}. Fix: a divisor of {s.world // (s.tp * s.pp)}")


def no_experts_with_context_parallel(cfg, need) -> None:
    if (s := _sizes(cfg)) is None:
        return
    need(s.ep == 1 or s.cp == 1, "megatron.expert_model_parallel_size",
         f"{s.ep} with context_parallel_size={s.cp}: expert parallelism under context parallelism is not run here. "
         "Fix: one of them 1")


def no_ulysses(cfg, need) -> None:
    if _sizes(cfg) is None:
        return
    need(cfg.actor.ulysses_sequence_parallel_size == 1, "actor.ulysses_sequence_parallel_size",
         "Ulysses sequence parallelism runs on the fsdp engine only. Fix: 1, or actor.strategy=fsdp")


CHECKS = (installed, sizes_positive, world_divisible, sequence_parallel_needs_tp, experts_fit_world,
          no_experts_with_context_parallel, no_ulysses)


# ------------------------------------------------------------------------------------ model checks
# Each is `rule(cfg, need, model)` with `model` the HF config of the model folder (when it is on this
# machine), run after CHECKS and again once an embedded model is provisioned.
def _experts(model) -> int:
    return getattr(model, "num_experts", None) or getattr(model, "num_local_experts", None) or 0


def architecture_supported(cfg, need, model) -> None:
    if _sizes(cfg) is None:
        return
    from rlframe.workers.engine.megatron.convert import architecture_problem

    problem = architecture_problem(model)
    need(problem is None, "model.path", str(problem))


def heads_divisible_by_tp(cfg, need, model) -> None:
    if (s := _sizes(cfg)) is None:
        return
    tp = s.tp
    heads = getattr(model, "num_attention_heads", 0)
    kv_heads = getattr(model, "num_key_value_heads", None) or heads
    need(heads % tp == 0 and kv_heads % tp == 0, "megatron.tensor_model_parallel_size",
         f"{tp} does not divide the model's {heads} attention heads and {kv_heads} key/value heads. "
         "Fix: a common divisor of both")


def layers_divisible_by_pp(cfg, need, model) -> None:
    if (s := _sizes(cfg)) is None:
        return
    pp = s.pp
    layers = getattr(model, "num_hidden_layers", 0)
    need(layers % pp == 0, "megatron.pipeline_model_parallel_size",
         f"{pp} does not divide the model's {layers} layers. Fix: a divisor of {layers}")


def experts_divisible_by_ep(cfg, need, model) -> None:
    if (s := _sizes(cfg)) is None:
        return
    ep, experts = s.ep, _experts(model)
    need(ep == 1 or (experts and experts % ep == 0), "megatron.expert_model_parallel_size",
         f"{ep} does not divide the model's {experts} routed experts" + (" (a dense model)" if not experts else "")
         + ". Fix: " + (f"a divisor of {experts}" if experts else "1"))


def moe_tp_needs_sequence_parallel(cfg, need, model) -> None:
    if (s := _sizes(cfg)) is None:
        return
    tp = s.tp
    need(not _experts(model) or tp == 1 or cfg.megatron.sequence_parallel, "megatron.sequence_parallel",
         f"false with an MoE model at TP={tp}: megatron-core 0.16 refuses MoE x TP without sequence "
         "parallelism in training. Fix: megatron.sequence_parallel=true")


def moe_needs_vllm_rollout(cfg, need, model) -> None:
    """The HF rollout engine holds fused expert tensors; the weight sync streams per-expert names."""
    if _sizes(cfg) is None:
        return
    import importlib.util

    hf_rollout = cfg.rollout.engine == "hf" or (cfg.rollout.engine == "auto" and importlib.util.find_spec("vllm") is None)
    need(not _experts(model) or not hf_rollout, "rollout.engine",
         f"{cfg.rollout.engine} (the HF engine) with an MoE model on the megatron engine: its weight sync streams "
         "the checkpoint's per-expert names (experts.N.gate_proj, what vLLM loads), while transformers holds "
         "fused expert tensors (experts.gate_up_proj), so the experts would not sync. Fix: rollout.engine=vllm, "
         "or actor.strategy=fsdp")


MODEL_CHECKS = (architecture_supported, heads_divisible_by_tp, layers_divisible_by_pp, experts_divisible_by_ep,
                moe_tp_needs_sequence_parallel, moe_needs_vllm_rollout)
