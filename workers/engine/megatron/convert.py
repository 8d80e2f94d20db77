"""HF Llama / Qwen2 / Qwen2-MoE / Mixtral checkpoints <-> Megatron-core GPT parameters (local layer spec), with
TP (and, for the experts, EP) sharding.

Pure tensor code (no process group): the Megatron engine (`engine.py` here) and its tests use it.

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
- MoE layers (every layer of a Qwen2-MoE / Mixtral): `mlp.router.weight` <- the HF router (`mlp.gate`,
  `block_sparse_moe.gate`), replicated; each routed expert's gate/up -> `mlp.experts.local_experts.j.linear_fc1`
  (gate_up as above), down -> `linear_fc2` (row), local expert j of EP rank e being global expert
  `e * experts / EP + j`; Qwen2-MoE's shared expert -> `mlp.shared_experts.linear_fc1 / fc2` and its sigmoid
  gate -> `mlp.shared_experts.gate_weight` (replicated). The HF names are the checkpoint's per-expert ones
  (`experts.N.gate_proj` / `w1`, ...), which is what transformers writes and vLLM loads (transformers 5 fuses
  the experts only in memory).
The same functions convert Adam's moments (same shapes as the parameters): optimizer state is
saved under HF names, so a checkpoint resumes at another TP size or on the FSDP engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "MixtralForCausalLM")
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
    # Mixture of experts (every layer's MLP; 0 experts: dense)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated); 0: none
    moe_pre_softmax: bool = False  # softmax over all experts, then top-k, no renormalisation (Qwen2-MoE, norm_topk_prob=False)

    @property
    def moe_prefix(self) -> str:
        """The HF module of a layer's experts and router (`mlp.` for Qwen2-MoE, `block_sparse_moe.` for Mixtral)."""
        return "block_sparse_moe." if self.architecture == "MixtralForCausalLM" else "mlp."

    @classmethod
    def from_hf(cls, config) -> GPTArch:
        problem = architecture_problem(config)
        if problem:
            raise ValueError(problem)
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        name = config.architectures[0]
        moe = {}
        if name == "Qwen2MoeForCausalLM":
            moe = dict(num_experts=config.num_experts, moe_topk=config.num_experts_per_tok,
                       moe_ffn_hidden_size=config.moe_intermediate_size,
                       shared_expert_ffn_hidden_size=config.shared_expert_intermediate_size or 0,
                       moe_pre_softmax=not config.norm_topk_prob)
        elif name == "MixtralForCausalLM":  # softmax over the top-k logits = Megatron's default top-k routing
            moe = dict(num_experts=config.num_local_experts, moe_topk=config.num_experts_per_tok,
                       moe_ffn_hidden_size=config.intermediate_size)
        return cls(**moe,architecture=config.architectures[0], num_layers=config.num_hidden_layers,
                   hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size, num_heads=heads,
                   num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                   rope_theta=float(theta), norm_eps=config.rms_norm_eps,
                   qkv_bias=name in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
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
    if getattr(config, "use_sliding_window", False) or (name == "MixtralForCausalLM" and config.sliding_window):
        return f"{name} with sliding-window attention is not converted by the megatron engine. Fix: actor.strategy=fsdp"
    if name == "Qwen2MoeForCausalLM" and (config.decoder_sparse_step != 1 or list(config.mlp_only_layers or [])):
        return (f"{name} with dense layers among the MoE ones (decoder_sparse_step={config.decoder_sparse_step}, "
                f"mlp_only_layers={config.mlp_only_layers}) is not converted: every layer must be MoE. "
                "Fix: actor.strategy=fsdp")
    if name == "MixtralForCausalLM" and getattr(config, "router_jitter_noise", 0.0):
        return f"{name} with router_jitter_noise is not converted by the megatron engine. Fix: actor.strategy=fsdp"
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


# MoE layers (megatron-core's MoELayer, local spec: SequentialMLP experts numbered locally per EP rank)
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def _moe_layer_map(arch: GPTArch) -> dict[str, tuple[tuple[str, ...], str]]:
    """Megatron per-layer suffixes of the router and the shared expert -> HF suffixes and TP split."""
    p = arch.moe_prefix
    out = {"mlp.router.weight": ((f"{p}gate.weight",), "replicated")}
    if arch.shared_expert_ffn_hidden_size:
        out["mlp.shared_experts.linear_fc1.weight"] = ((f"{p}shared_expert.gate_proj.weight",
                                                        f"{p}shared_expert.up_proj.weight"), "gate_up")
        out["mlp.shared_experts.linear_fc2.weight"] = ((f"{p}shared_expert.down_proj.weight",), "row")
        out["mlp.shared_experts.gate_weight"] = ((f"{p}shared_expert_gate.weight",), "replicated")
    return out


def _expert_hf(arch: GPTArch, expert: int, which: str) -> tuple[str, ...]:
    """HF suffixes of one expert's fc1 (gate, up) or fc2 (down)."""
    base = f"{arch.moe_prefix}experts.{expert}."
    if arch.architecture == "MixtralForCausalLM":
        return (base + "w1.weight", base + "w3.weight") if which == "linear_fc1" else (base + "w2.weight",)
    return (base + "gate_proj.weight", base + "up_proj.weight") if which == "linear_fc1" else (base + "down_proj.weight",)


def is_expert(name: str) -> bool:
    """Whether this Megatron parameter is one of a layer's routed experts (held per expert-parallel rank)."""
    return _EXPERT.search(name) is not None


def megatron_names(arch: GPTArch, layer_offset: int = 0, num_layers: int | None = None, ep: int = 1) -> list[str]:
    """The Megatron parameter names of a stage holding layers [offset, offset + num_layers) (local numbering;
    MoE: the experts of one expert-parallel rank, `num_experts / ep` of them, numbered from 0)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(num_layers if num_layers is not None else arch.num_layers):
        for suffix in _LAYER_MAP:
            if suffix.endswith("linear_qkv.bias") and not arch.qkv_bias:
                continue
            if arch.num_experts and suffix in _DENSE_MLP:
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
        if arch.num_experts:
            names += [f"decoder.layers.{i}.{suffix}" for suffix in _moe_layer_map(arch)]
            names += [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.{fc}.weight"
                      for j in range(arch.num_experts // ep) for fc in ("linear_fc1", "linear_fc2")]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_embeddings:
        names.append("output_layer.weight")
    return names


def _hf_names_and_kind(name: str, layer_offset: int = 0, arch: GPTArch | None = None,
                       expert_offset: int = 0) -> tuple[list[str], str]:
    """HF names and TP split of a Megatron parameter. MoE names need `arch` (the HF names differ between
    Qwen2-MoE and Mixtral); a local expert j is global expert `expert_offset + j`."""
    if name.startswith(VALUE_HEAD_PREFIX):  # the critic's value head: our own Linear(hidden, 1), replicated
        return [name], "replicated"
    if name in _GLOBAL_MAP:
        hf, kind = _GLOBAL_MAP[name]
        return list(hf), kind
    match = _LAYER.fullmatch(name)
    suffix = match.group(2) if match else ""
    expert = _EXPERT.fullmatch(suffix)
    if expert or suffix.startswith(("mlp.router.", "mlp.shared_experts.")):
        if arch is None:  # (only the split is asked: is_tensor_parallel)
            return [], ("replicated" if suffix.endswith(("router.weight", "gate_weight"))
                        else "row" if suffix.endswith("linear_fc2.weight") else "gate_up")
        layer = int(match.group(1)) + layer_offset
        if expert:
            hf = _expert_hf(arch, expert_offset + int(expert.group(1)), expert.group(2))
            kind = "gate_up" if expert.group(2) == "linear_fc1" else "row"
        else:
            moe = _moe_layer_map(arch)
            if suffix not in moe:
                raise KeyError(f"no HF counterpart for the Megatron parameter {name!r}")
            hf, kind = moe[suffix]
        return [f"model.layers.{layer}.{s}" for s in hf], kind
    if not match or suffix not in _LAYER_MAP:
        raise KeyError(f"no HF counterpart for the Megatron parameter {name!r}")
    layer = int(match.group(1)) + layer_offset
    hf, kind = _LAYER_MAP[suffix]
    return [f"model.layers.{layer}.{s}" for s in hf], kind


def is_tensor_parallel(name: str) -> bool:
    """Whether the TP ranks hold different slices of this Megatron parameter (else identical copies).
    (Experts are split over TP as the dense MLP: megatron-core's expert TP size defaults to TP.)"""
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
                   names: list[str] | None = None, layer_offset: int = 0, ep_rank: int = 0,
                   ep: int = 1) -> dict[str, torch.Tensor]:
    """This TP (and expert-parallel) rank's Megatron tensors (contiguous copies) for `names` (default: the
    whole model)."""
    if arch.num_query_groups % tp or arch.num_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide the {arch.num_heads} attention heads and "
                         f"{arch.num_query_groups} key/value heads")
    expert_offset = ep_rank * (arch.num_experts // ep) if arch.num_experts else 0
    out = {}
    for name in names if names is not None else megatron_names(arch, ep=ep):
        hf_names, kind = _hf_names_and_kind(name, layer_offset, arch, expert_offset)
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
                   layer_offset: int = 0, expert_offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one Megatron parameter from its TP shards in TP-rank order (one shard if replicated);
    a routed expert's local index j is global expert `expert_offset + j`."""
    hf_names, kind = _hf_names_and_kind(name, layer_offset, arch, expert_offset)
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


def hf_state_from_shards(per_rank: list[dict[str, torch.Tensor]], arch: GPTArch,
                         ep_ranks: list[list[dict[str, torch.Tensor]]] | None = None) -> dict[str, torch.Tensor]:
    """Whole-model inverse of `hf_to_megatron` (tests, tools): one dict per TP rank -> HF state dict.
    `ep_ranks` (MoE, EP > 1): the per-TP-rank dicts of expert-parallel ranks 1.. (their experts)."""
    out = {}
    for ep_rank, tp_dicts in enumerate([per_rank, *(ep_ranks or [])]):
        per_ep = arch.num_experts // (1 + len(ep_ranks or [])) if arch.num_experts else 0
        for name in tp_dicts[0]:
            if ep_rank and not is_expert(name):
                continue
            shards = [s[name] for s in tp_dicts] if is_tensor_parallel(name) else [tp_dicts[0][name]]
            out.update(megatron_to_hf(name, shards, arch, expert_offset=ep_rank * per_ep))
    return out
