"""HF Llama / Qwen2 checkpoints <-> Megatron-core GPT parameters (local layer spec), with TP sharding.

Pure tensor code (no process group): the Megatron engine (`megatron.py`) and its tests use it.

    arch = GPTArch.from_hf(hf_config)                       # ValueError naming an unsupported architecture
    local = hf_to_megatron(hf_state, arch, tp_rank, tp)      # this TP rank's Megatron parameters
    hf = megatron_to_hf(name, [shard_0, ..., shard_tp-1], arch)  # [(hf name, full tensor), ...]

A pipeline stage numbers its layers from 0 (`decoder.layers.0` is global layer `layer_offset`): both
directions take `layer_offset=`; the last stage's copy of a tied LM head (`output_layer.weight`) is read
from `model.embed_tokens.weight` when the checkpoint has no `lm_head.weight`.

Megatron's fused layouts:
- `linear_qkv` (column parallel): per query group g, [the group's q heads; its k head; its v head],
  groups outermost, so TP rank r holds groups [r * G/tp, (r + 1) * G/tp) with their q, k, v rows;
- `linear_fc1` (column parallel, gated MLP): each TP rank holds [its gate rows; its up rows];
- `linear_proj` / `linear_fc2` (row parallel): split along the input dimension;
- `word_embeddings` / `output_layer` (vocab parallel): rows split; the vocabulary is padded to a
  multiple of `tp` with zero rows (dropped again on the way back; logits past the real vocabulary are
  never used).
The same functions convert Adam's moments (same shapes as the parameters): optimizer state is
saved under HF names, so a checkpoint resumes at another TP size or on the FSDP engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
VALUE_HEAD_PREFIX = "value_head."  # (workers/engine/value_model.py's names, kept as they are)


@dataclass(frozen=True)
class GPTArch:
    """What the conversion and the GPT model need from an HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool

    @classmethod
    def from_hf(cls, config) -> GPTArch:
        problem = architecture_problem(config)
        if problem:
            raise ValueError(problem)
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(architecture=config.architectures[0], num_layers=config.num_hidden_layers,
                   hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size, num_heads=heads,
                   num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                   rope_theta=float(theta), norm_eps=config.rms_norm_eps,
                   qkv_bias=config.architectures[0] == "Qwen2ForCausalLM",
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def architecture_problem(config) -> str | None:
    """Why the Megatron engine cannot take this HF config (the architecture or a feature named), or None."""
    archs = list(getattr(config, "architectures", None) or [])
    name = archs[0] if archs else type(config).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return (f"the megatron engine converts {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints; this model is "
                f"{name}. Fix: actor.strategy=fsdp (any transformers causal LM)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        return f"{name} with rope scaling '{rope_type}' is not converted by the megatron engine. Fix: actor.strategy=fsdp"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{name} with hidden_act={config.hidden_act} is not converted (SwiGLU only). Fix: actor.strategy=fsdp"
    if getattr(config, "mlp_bias", False) or (name == "LlamaForCausalLM" and getattr(config, "attention_bias", False)):
        return f"{name} with linear-layer biases is not converted by the megatron engine. Fix: actor.strategy=fsdp"
    if getattr(config, "use_sliding_window", False):
        return f"{name} with sliding-window attention is not converted by the megatron engine. Fix: actor.strategy=fsdp"
    return None


# ------------------------------------------------------------------------------------ names
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Megatron per-layer suffix -> HF per-layer suffixes (several: fused) and how the TP shards split.
_LAYER_MAP = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                        "self_attn.v_proj.bias"), "qkv"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "replicated"),
}


def megatron_names(arch: GPTArch, layer_offset: int = 0, num_layers: int | None = None) -> list[str]:
    """The Megatron parameter names of a stage holding layers [offset, offset + num_layers) (local numbering)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(num_layers if num_layers is not None else arch.num_layers):
        for suffix in _LAYER_MAP:
            if suffix.endswith("linear_qkv.bias") and not arch.qkv_bias:
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_embeddings:
        names.append("output_layer.weight")
    return names


def _hf_names_and_kind(name: str, layer_offset: int = 0) -> tuple[list[str], str]:
    if name.startswith(VALUE_HEAD_PREFIX):  # the critic's value head: our own Linear(hidden, 1), replicated
        return [name], "replicated"
    if name in _GLOBAL_MAP:
        hf, kind = _GLOBAL_MAP[name]
        return list(hf), kind
    match = _LAYER.fullmatch(name)
    if not match or match.group(2) not in _LAYER_MAP:
        raise KeyError(f"no HF counterpart for the Megatron parameter {name!r}")
    layer = int(match.group(1)) + layer_offset
    hf, kind = _LAYER_MAP[match.group(2)]
    return [f"model.layers.{layer}.{suffix}" for suffix in hf], kind


def is_tensor_parallel(name: str) -> bool:
    """Whether the TP ranks hold different slices of this Megatron parameter (else identical copies)."""
    return _hf_names_and_kind(name)[1] != "replicated"


# ------------------------------------------------------------------------------------ HF -> Megatron
def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: GPTArch) -> torch.Tensor:
    groups, per_group = arch.num_query_groups, arch.num_heads // arch.num_query_groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * arch.head_dim, *rest)
    k = k.reshape(groups, arch.head_dim, *rest)
    v = v.reshape(groups, arch.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: GPTArch, tp_rank: int = 0, tp: int = 1,
                   names: list[str] | None = None, layer_offset: int = 0) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron tensors (contiguous copies) for `names` (default: the whole model)."""
    if arch.num_query_groups % tp or arch.num_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide the {arch.num_heads} attention heads and "
                         f"{arch.num_query_groups} key/value heads")
    out = {}
    for name in names if names is not None else megatron_names(arch):
        hf_names, kind = _hf_names_and_kind(name, layer_offset)
        if name == "output_layer.weight" and "lm_head.weight" not in hf:
            hf_names = ["model.embed_tokens.weight"]  # a tied checkpoint stores the embedding only
        tensors = [hf[n] for n in hf_names]
        if kind == "replicated":
            local = tensors[0]
        elif kind == "vocab":
            full = tensors[0]
            pad = arch.padded_vocab(tp) - full.size(0)
            if pad:
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
            local = full.chunk(tp, dim=0)[tp_rank]
        elif kind == "row":
            local = tensors[0].chunk(tp, dim=1)[tp_rank]
        elif kind == "qkv":
            local = _qkv_full(*tensors, arch).chunk(tp, dim=0)[tp_rank]
        else:  # gate_up
            gate, up = tensors
            local = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
        out[name] = local.contiguous().clone()
    return out


# ------------------------------------------------------------------------------------ Megatron -> HF
def megatron_to_hf(name: str, shards: list[torch.Tensor], arch: GPTArch,
                   layer_offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one Megatron parameter from its TP shards in TP-rank order (one shard if replicated)."""
    hf_names, kind = _hf_names_and_kind(name, layer_offset)
    if kind == "replicated":
        return [(hf_names[0], shards[0])]
    if kind == "vocab":
        return [(hf_names[0], torch.cat(shards)[: arch.vocab_size])]
    if kind == "row":
        return [(hf_names[0], torch.cat(shards, dim=1))]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(hf_names[0], torch.cat([h[0] for h in halves])), (hf_names[1], torch.cat([h[1] for h in halves]))]
    groups, per_group = arch.num_query_groups, arch.num_heads // arch.num_query_groups
    full = torch.cat(shards)
    rest = full.shape[1:]
    grouped = full.reshape(groups, (per_group + 2) * arch.head_dim, *rest)
    q, k, v = grouped.split([per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
    return [(hf_names[0], q.reshape(-1, *rest)), (hf_names[1], k.reshape(-1, *rest)),
            (hf_names[2], v.reshape(-1, *rest))]


def hf_state_from_shards(per_rank: list[dict[str, torch.Tensor]], arch: GPTArch) -> dict[str, torch.Tensor]:
    """Whole-model inverse of `hf_to_megatron` (tests, tools): one dict per TP rank -> HF state dict."""
    out = {}
    for name in per_rank[0]:
        shards = [s[name] for s in per_rank] if is_tensor_parallel(name) else [per_rank[0][name]]
        out.update(megatron_to_hf(name, shards, arch))
    return out
