"""The Megatron engine's model: a megatron-core GPTModel built from an HF architecture (local layer spec,
SDPA core attention), wrapped as a causal LM (vocabulary-parallel logits gathered) or a value model, and
loaded from the HF checkpoint one tensor at a time.

- Sequence parallelism: the local spec's torch norm refuses it, so the norms are `SequenceParallelRMSNorm`
  (torch RMSNorm, weight marked `sequence_parallel`: its gradient is a partial sum the engine all-reduces
  over TP); the critic's replicated head sees the gathered sequence.
- Mixture of experts: routing as HF: Qwen2-MoE's softmax over all experts then top-k without
  renormalisation (norm_topk_prob=False) is `moe_router_pre_softmax`; renormalised top-k (Mixtral,
  norm_topk_prob=True) is Megatron's default. No load-balancing loss (`moe_router_load_balancing_type="none"`):
  the FSDP engine's HF forward computes none either (transformers adds it only with output_router_logits and
  labels), so both optimise the same objective. Token dispatcher: "allgather" (megatron-core 0.16's
  "alltoall" creates a `torch.cuda.Stream` in its constructor).
- PPO's critic (`MegatronValueModel`): the same GPT body without its LM head (embedding -> decoder with the
  final norm) and the value head of `value_model.py` (`Linear(hidden, 1)`, zero-initialised, replicated
  over TP, on the last pipeline stage).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.workers.engine.megatron.attention import SDPACoreAttention, attention_mask_for
from rlframe.workers.engine.megatron.convert import GPTArch
from rlframe.workers.engine.megatron.parallel import import_megatron
from rlframe.workers.engine.megatron.shims import moe_without_transformer_engine, on_cpu


class MegatronCausalLM(nn.Module):
    """The Megatron GPTModel (this pipeline stage's part of it) with the HF config attached (roles write
    `model.config` next to exported weights). `weight_view`: the HF names, global shapes and dtypes of
    the whole model in `iter_full_weights` order (the engine sets it once its stages are known)."""

    def __init__(self, gpt: nn.Module, hf_config, arch: GPTArch, tp_group=None, tp: int = 1):
        super().__init__()
        self.gpt, self.config, self.arch, self.tp_group, self.tp = gpt, hf_config, arch, tp_group, tp
        self.weight_view: dict[str, torch.Tensor] = {}

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The HF-named view of the weights: global shapes and dtypes on the meta device (no data, no
        collective), in `iter_full_weights` order, every pipeline stage's. It is what the disaggregated
        broadcast plans its buckets from (`merged_weight_view`); the weights come from `iter_full_weights`."""
        return dict(self.weight_view)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cp_index: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary logits [b, s, V] (the TP shards of the LM head gathered) on the last pipeline
        stage; the hidden states [s, b, h] for the next stage on the others. Context parallelism:
        `input_ids` / `position_ids` are this rank's columns `cp_index` of the padded sequence whose
        padding mask is `attention_mask` (all columns); the outputs are those columns'."""
        out = self.gpt(input_ids=input_ids, position_ids=position_ids,
                       attention_mask=attention_mask_for(attention_mask, cp_index))
        if not self.gpt.post_process:
            return out
        if self.tp_group is not None:
            out = _GatherVocab.apply(out, self.tp_group)
        return out[..., : self.arch.vocab_size]


class MegatronValueModel(nn.Module):
    """The GPT body (embedding, decoder with its final norm; no LM head) + a scalar value head: values [b, s]
    (the head on the last pipeline stage; the other stages return their hidden states [s, b, h])."""

    def __init__(self, gpt: nn.Module, hf_config, arch: GPTArch):
        super().__init__()
        self.gpt, self.config, self.arch = gpt, hf_config, arch
        self.weight_view: dict[str, torch.Tensor] = {}
        gpt.output_layer = None  # (untied checkpoints: the LM head is not part of the value model)
        self.value_head = nn.Linear(arch.hidden_size, 1) if gpt.post_process else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cp_index: torch.Tensor | None = None) -> torch.Tensor:
        hidden = None  # (a later pipeline stage: the decoder takes the tensor set by set_input_tensor)
        if self.gpt.pre_process:  # (sequence parallel: the embedding scatters its output along the sequence)
            hidden = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        rope = self.gpt.rotary_pos_emb(attention_mask.size(1))  # (context parallel: this rank's columns of it)
        hidden = self.gpt.decoder(hidden_states=hidden, attention_mask=attention_mask_for(attention_mask, cp_index),
                                  rotary_pos_emb=rope)
        if self.value_head is None:
            return hidden
        if self.gpt.config.sequence_parallel:  # the replicated head on every position: gather the sequence
            # (backward: this rank's slice; every TP rank computes the same values and loss)
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.value_head(hidden).squeeze(-1).transpose(0, 1).float()


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary-parallel logits along the last dim; the backward keeps this rank's slice.

    (megatron-core 0.16's own gather allocates on torch.cuda.current_device(): not on CPU.)"""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.width = group, local.size(-1)
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = dist.get_rank(ctx.group) * ctx.width
        return grad[..., start: start + ctx.width].contiguous(), None


def build_gpt(arch: GPTArch, tp: int, profile: DeviceProfile, dtype: torch.dtype = torch.float32,
              pp: int = 1, pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
              cp: int = 1, ep: int = 1) -> nn.Module:
    """An empty GPTModel for this TP rank and pipeline stage (local layer spec, SDPA core attention).

    Under PP the stage holds `num_layers / pp` layers; the first stage has the embedding, the last the
    final norm and the LM head. Tied embeddings under PP: the last stage's LM head is its own parameter
    (`output_layer.weight`, loaded from the embedding) kept equal to the first stage's embedding by the
    engine (one all-reduce of their gradients over Megatron's embedding group: what megatron-core's
    DDP wrapper does in finalize_model_grads; its own tying, share_embeddings_and_output_weights, copies
    the weight at build time with `weight.data.cuda()`, which fails on CPU).

    `sequence_parallel` (TP > 1): megatron-core's own sequence parallelism (the embedding reduce-scatters
    along the sequence, column-parallel linears all-gather their input, row-parallel ones reduce-scatter
    their output); the norms are `SequenceParallelRMSNorm` (the local spec's torch norm refuses it) and
    their gradients are partial sums the engine all-reduces over TP. `cp`: the core attention gathers
    key/value chunks over the CP group and the rotary table is cut to this rank's chunks."""
    _, GPTModel, get_gpt_layer_local_spec, TransformerConfig = import_megatron()
    moe = {}
    if arch.num_experts:  # every layer's MLP is megatron-core's MoELayer (local spec: SequentialMLP experts)
        moe = dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk,
                   moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                   moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
                   moe_shared_expert_gate=bool(arch.shared_expert_ffn_hidden_size),
                   moe_router_pre_softmax=arch.moe_pre_softmax,
                   # no load-balancing loss: the FSDP engine's HF forward adds none either (it is HF's only
                   # with output_router_logits and labels), so both engines optimise the same objective
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   # (the alltoall dispatcher creates a torch.cuda.Stream in its constructor: not on CPU)
                   moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep, moe_grouped_gemm=False)
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} does not divide the model's {arch.num_layers} layers")
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, params_dtype=dtype,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        # the loss of each micro-batch is already its share of the global mini-batch loss (rlframe's
        # normalisers): the schedule must not divide it by the number of micro-batches or tokens
        calculate_per_token_loss=True,
        use_cpu_initialization=not profile.is_gpu, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, sequence_parallel=sequence_parallel and tp > 1,
        context_parallel_size=cp, **moe)
    # Micro-batches are trimmed to their own padding: the pipeline schedule sends each activation's shape
    # ahead of it. (Set after __post_init__, which refuses it with the MoE all-gather token dispatcher,
    # the default even without experts.)
    config.variable_seq_lengths = pp > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                        normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if config.sequence_parallel:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                          layer_norm=SequenceParallelRMSNorm)
    if arch.num_experts:
        moe_without_transformer_engine()
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.padded_vocab(tp),
                   max_sequence_length=arch.max_position_embeddings, pre_process=pre_process,
                   post_process=post_process, parallel_output=True,
                   share_embeddings_and_output_weights=arch.tie_embeddings and pp == 1,
                   position_embedding_type="rope", rotary_base=int(arch.rope_theta)
                   if float(arch.rope_theta).is_integer() else arch.rope_theta)
    if not profile.is_gpu:
        on_cpu(gpt, pp=pp, cp=cp, sequence_parallel=config.sequence_parallel, moe=bool(arch.num_experts))
    return gpt.to(profile.device)


class SequenceParallelRMSNorm:
    """The local spec's norm (torch RMSNorm) under sequence parallelism: the weight is replicated over TP
    but each TP rank normalises only its slice of the sequence, so its gradient is a partial sum, marked
    `sequence_parallel` (as megatron-core's fused norms mark theirs) for the engine's all-reduce over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


class _LazyHFState(Mapping):
    """An HF safetensors folder as a mapping that reads a tensor only when asked (each rank reads the
    tensors its shards come from, one at a time, never the whole checkpoint at once)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder} (the megatron engine reads safetensors checkpoints)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: handle for handle in self._handles for key in handle.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def __contains__(self, key) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_hf_state(path: str) -> Mapping[str, torch.Tensor]:
    return _LazyHFState(path)


def load_local_state(params: dict[str, nn.Parameter], local: dict[str, torch.Tensor]) -> None:
    """Copy converted tensors into the parameters; every parameter must be covered."""
    missing = sorted(set(params) - set(local))
    if missing:
        raise KeyError(f"no converted tensor for Megatron parameters {missing[:5]}")
    with torch.no_grad():
        for name, tensor in local.items():
            if name not in params:
                raise KeyError(f"the converted checkpoint has {name!r}, which the GPT model lacks")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: converted shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def recomputed(forward: Callable) -> Callable:
    """A transformer layer's forward whose activations are recomputed in the backward (torch's non-reentrant
    checkpoint) when gradients are on. megatron-core's own recompute (`recompute_granularity`) goes through
    its CheckpointFunction, which saves and restores CUDA RNG states: not on CPU. The layer's collectives (TP,
    SP, CP, the MoE dispatcher) run again in the recompute, in the same layer order on every rank."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
