"""The `model:` section (the policy's weights, dtype, attention, LoRA) and its checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlframe.bounds import bounded, one_of
from rlframe.config.checks import resolvable
from rlframe.workers.engine.registry import ENGINES

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2")
LORA_WEIGHT_SYNC = ("merged", "adapter")


@dataclass
class LoraConfig:
    """LoRA on the actor (workers/engine/lora.py, through peft): the base frozen, low-rank adapters
    trained, the optimizer holding the adapters only. The reference policy is the actor with its
    adapters disabled (no ref model is started). LoRA usually wants a ~10x higher LR than full
    fine-tuning (actor.optim.lr). The critic (PPO) is not affected."""

    rank: int = bounded(0, ">= 0", "0: off")  # 0 = off (full fine-tuning)
    alpha: float = bounded(16.0, "> 0")  # the update is scaled by alpha / rank
    dropout: float = bounded(0.0, "[0, 1)")  # dropout on the adapters' input during training (peft's lora_dropout)
    target_modules: Any = "all-linear"  # all-linear (every linear layer but the LM head) | [q_proj, v_proj, ...] | a regex
    # module names (or a regex) left without adapters, out of target_modules
    exclude_modules: list[str] = field(default_factory=list)
    # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, CUDA only), the adapters in full precision.
    load_in_4bit: bool = False
    # How the rollout engine gets the policy after each update: merged (W + alpha/r B A under the base
    # model's names; every engine and placement) | adapter (only A and B; the engine applies them
    # itself: vLLM's LoRA support or the HF engine's own LoRA layers; colocated placement only).
    weight_sync: str = one_of("merged", LORA_WEIGHT_SYNC)
    # lora | dora (weight-decomposed: a trained magnitude per output row) | rslora (alpha / sqrt(rank) scaling);
    # adalora and ia3 are refused (workers/engine/lora.py: adapter_kind_problem says why)
    kind: str = "lora"


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # embedded model name, HF folder, or hub id
    dtype: str = one_of("auto", DTYPES)  # auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fp32 on CPU)
    attn_implementation: str = one_of("auto", ATTENTION)  # auto | sdpa | eager | flash_attention_2
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30% more compute
    # run the model folder's own Python code (transformers' trust_remote_code); only for folders you trust
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


def lora_engines() -> tuple[str, ...]:
    """The training engines that implement LoRA (workers/engine/lora.py), from the engine registry."""
    return tuple(name for name, entry in ENGINES.items() if entry.lora)


# ------------------------------------------------------------------------------------ checks
def path_resolves(cfg, need) -> None:
    need(resolvable(cfg.model.path), "model.path",
         f"'{cfg.model.path}' is neither a folder on disk, an embedded model, nor an HF hub id. "
         "Fix: model.path=/path/to/hf_model_dir (or smollm2-135m-instruct).")


def qlora_needs_lora(cfg, need) -> None:
    lora = cfg.model.lora
    need(lora.rank != 0 or not lora.load_in_4bit, "model.lora.load_in_4bit",
         "QLoRA trains LoRA adapters over a 4-bit base: it needs model.lora.rank > 0. Fix: model.lora.rank=16")


def lora_engine_implements_it(cfg, need) -> None:
    lora, engines = cfg.model.lora, lora_engines()
    need(lora.rank == 0 or cfg.actor.strategy in engines, "actor.strategy",
         f"the {cfg.actor.strategy} engine does not implement LoRA (model.lora.rank={lora.rank}); engines with "
         f"LoRA: {', '.join(engines)}. Fix: actor.strategy=fsdp, or model.lora.rank=0 for full fine-tuning")


def lora_weight_sync_known(cfg, need) -> None:
    """model.lora.weight_sync: merged anywhere, adapter with colocated engines only."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return
    need(lora.weight_sync != "adapter" or cfg.trainer.placement == "colocated", "model.lora.weight_sync",
         "adapter-only sync is for colocated engines; the disaggregated broadcast sends merged weights. "
         "Fix: model.lora.weight_sync=merged")


def lora_kind_supported(cfg, need) -> None:
    """model.lora.kind: an adapter kind peft has and the engines and weight sync here carry."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return
    from rlframe.workers.engine.lora import adapter_kind_problem

    problem = adapter_kind_problem(lora.kind, lora.weight_sync)
    need(problem is None, "model.lora.kind", str(problem))


def lora_targets_well_formed(cfg, need) -> None:
    targets = cfg.model.lora.target_modules
    need(cfg.model.lora.rank == 0 or _well_formed(targets), "model.lora.target_modules",
         f"{targets!r}: must be all-linear, a regex, or a non-empty list of module names")


def qlora_has_a_gpu(cfg, need) -> None:
    """QLoRA's 4-bit base needs bitsandbytes on a CUDA device (workers/engine/lora.py says why not)."""
    lora = cfg.model.lora
    if lora.rank == 0 or not lora.load_in_4bit:
        return
    import torch

    from rlframe.workers.engine.lora import qlora_unavailable_reason

    gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    reason = qlora_unavailable_reason(gpu)
    need(reason is None, "model.lora.load_in_4bit", str(reason))


CHECKS = (path_resolves, qlora_needs_lora, lora_engine_implements_it,
          lora_weight_sync_known, lora_kind_supported, lora_targets_well_formed, qlora_has_a_gpu)


def _well_formed(targets: Any) -> bool:
    return isinstance(targets, str) or (isinstance(targets, (list, tuple)) and bool(targets)
                                        and all(isinstance(t, str) for t in targets))


# ---------------------------------------------------------------------- checks on the model folder
def lora_targets_in_model(cfg, need, model_dir: str | None) -> None:
    """model.lora.target_modules / exclude_modules against the model's own linear layers."""
    lora = cfg.model.lora
    targets = lora.target_modules
    if lora.rank == 0 or model_dir is None or not (isinstance(targets, str)
                                                  or (isinstance(targets, (list, tuple)) and targets)):
        return
    from rlframe.workers.engine.lora import model_linear_names, target_module_problems

    linear, names, output = model_linear_names(model_dir, cfg.model.trust_remote_code)
    for key, problem in target_module_problems(targets, list(lora.exclude_modules), linear, names, output):
        need(False, key, problem)


def context_within_positions(cfg, need, model_dir: str | None) -> None:
    """Prompt + response (+ the tool prompt of multi-turn rollouts) within the model's positions, when the
    model declares no RoPE scaling (which would stretch them): otherwise vLLM refuses it only when the
    workers start, and the trainer would read positions it never learned."""
    if model_dir is None:
        return
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config") or config
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or config.get("rope_scaling"):
        return
    mt = cfg.rollout.multi_turn
    tool_prompt = mt.tool_prompt_tokens if mt.enable else 0
    length = cfg.data.max_prompt_length + cfg.data.max_response_length + tool_prompt
    need(length <= positions, "data.max_prompt_length",
         f"{cfg.data.max_prompt_length} + data.max_response_length {cfg.data.max_response_length}"
         + (f" + rollout.multi_turn.tool_prompt_tokens {tool_prompt}" if tool_prompt else "")
         + f" = {length} tokens exceeds the model's max_position_embeddings ({positions}, {model_dir}/config.json). "
         f"Fix: shorten them to at most {positions} in total")


FOLDER_CHECKS = (lora_targets_in_model, context_within_positions)
