"""The Megatron-core training engine (`actor.strategy=megatron`): tensor, pipeline, sequence, context and
expert parallelism for the actor, the reference policy and the critic (dense and MoE models).

    engine = MegatronEngine(settings, profile, name="actor")   # via build_engine(...)

Same interface and the same update loop as the FSDP engine (`base.TrainingEngine`, the loss functions
of rlframe/algos): what changes is the model.

- The HF checkpoint (Llama / Qwen2 family, Qwen2-MoE, Mixtral; anything else is a ValueError naming the architecture) is
  converted into a Megatron-core `GPTModel` built with the transformer-engine-free local layer spec
  (`convert.py`: fused QKV and gate/up, TP shards, layers renumbered per pipeline stage). Core
  attention is torch's SDPA (`SDPACoreAttention`) with our padding + causal mask, which is what runs on
  CPU over gloo (the CPU profile) and on GPU without transformer-engine.
- The ranks of one model replica (TP x PP: Megatron's model-parallel group) first exchange their
  data-parallel chunks (as Ulysses does, `gather_rows`), so the driver dispatches exactly as for FSDP
  and every rank of a replica holds the same rows; each returns its own rows' results.
- Tensor parallelism: groups of `tp` consecutive ranks (Megatron's parallel_state). Logits are
  all-gathered over the vocabulary-parallel LM head (`_GatherVocab`), so log-probs and entropies go
  through the same functions as FSDP's.
- Pipeline parallelism (`pipeline_model_parallel_size`, must divide the layers): each stage builds its
  part of the GPTModel (the first the embedding, the last the final norm + LM head or the critic's value
  head, `num_layers / pp` layers each). A mini-batch's micro-batches go through megatron-core's 1F1B
  schedule (`get_forward_backward_func`; forward_only for log-probs, entropy and values), each trimmed to
  its own padding (`variable_seq_lengths`: shapes travel ahead of activations). The last stage applies
  the same loss function to each micro-batch; `calculate_per_token_loss` stops the schedule from
  rescaling it, since it already is the micro-batch's share of the global loss. Outputs and loss values
  are broadcast from the last stage over the pipeline group. On CPU the schedule's CUDA-only
  allocations are redirected (`_TorchOnCPU`). Tied embeddings (SmolLM2): megatron-core's own tying
  copies the weight to the last stage with `.cuda()` and all-reduces gradients through its DDP
  wrapper's `main_grad`, so here the last stage holds its own LM head loaded from the embedding and the
  engine all-reduces the two gradients over Megatron's embedding group before each step: the copies
  stay equal (tested: log-probs after an update equal FSDP's).
- Loss normalisation: the base loop normalises by the global token / sequence counts (counted once per
  replica: `sequence_parallel_size` reports TP x PP as the number of ranks that hold each row) and
  calls `backward(loss * world)`; we backpropagate `loss / world` (the pipeline: the loss itself) and
  sum the gradients over the data-parallel group, which gives the gradient of the global mini-batch
  loss (TP 1 vs 2, PP 1 vs 2 and 1 vs several micro-batches are the same update: tests/test_megatron.py,
  tests/test_megatron_pipeline.py).
- Gradient norm: squares summed over TP shards and PP stages (the model-parallel group), replicated
  tensors (norms) counted once per TP group and the tied LM head copy not at all; clipped as torch's
  clip_grad_norm_ does. AdamW on each rank's shards is the same as on the full tensors (elementwise).
- Sequence parallelism (`megatron.sequence_parallel`, TP > 1): megatron-core's own (`sequence_parallel`
  in TransformerConfig): the embedding reduce-scatters its output along the sequence, the column-parallel
  linears all-gather their input, the row-parallel ones reduce-scatter their output, and norms and
  residuals hold 1 / TP of the sequence. The local spec's torch norm refuses it: `SequenceParallelRMSNorm`
  (torch RMSNorm, weight marked `sequence_parallel`), whose partial gradients the engine all-reduces over
  TP before the norm and the step (the critic's replicated head sees the gathered sequence). Micro-batches
  are padded on the right to a multiple of TP. On CPU, megatron-core 0.16's mappings / linears allocate
  their outputs on `torch.cuda.current_device()` and a global CUDA buffer, and call
  `all_gather_into_tensor` / `reduce_scatter_tensor`: redirected to the CPU, the collectives done as a list
  all_gather and an all_reduce + slice (`_sequence_parallel_on_cpu`, CPU profile only).
- Context parallelism (`megatron.context_parallel_size`): megatron-core's own CP attention is
  transformer-engine's (its local spec's DotProductAttention asserts CP == 1), so `SDPACoreAttention` does
  it: each (padded) sequence is cut into 2 x CP chunks, rank r holding chunks r and 2 CP - 1 - r (Megatron's
  causal load balance; `cp_positions`); its queries attend to every chunk's keys / values, all-gathered over
  the CP group (`_GatherChunks`, a list all_gather; backward: each chunk's dK / dV summed over the CP ranks),
  under the causal + padding mask of their global columns; RoPE from the global columns (the rotary table
  cut to the rank's chunks). The per-token log-probs / entropy / values of the rank's columns are gathered
  the same way (backward: its own columns), so every CP rank computes the same loss through the same loss
  functions, and gradients are summed over data-parallel x CP ranks (the rows are exchanged over TP x PP x
  CP: `sequence_parallel_size`).
- `iter_full_weights` streams every stage's parameters in stage order: the owner stage gathers one
  parameter's TP shards, converts it to HF names and layouts and (PP > 1) broadcasts each tensor over
  the pipeline group; the model's `state_dict` lists the same names and shapes (the disaggregated
  broadcast plans its buckets from it). Weight sync to vLLM, `save_hf` and checkpoints use it.
  Checkpoints use the FSDP engine's layout (`checkpoint.py`: full weights + Adam moments under HF
  names), so they export with `python -m rlframe.export` and resume at another TP / PP size or on the
  FSDP engine.

- Mixture of experts (Qwen2-MoE with its sigmoid-gated shared expert, Mixtral; every layer MoE): megatron-core's
  MoELayer from the local spec (SequentialMLP experts; router -> `mlp.router`, each expert's gate/up -> its
  `linear_fc1`, down -> `linear_fc2`, the shared expert and its gate -> `mlp.shared_experts`). Routing as HF:
  Qwen2-MoE's softmax over all experts then top-k without renormalisation (norm_topk_prob=False) is
  `moe_router_pre_softmax`; renormalised top-k (Mixtral, norm_topk_prob=True) is Megatron's default. No
  load-balancing loss (`moe_router_load_balancing_type="none"`): the FSDP engine's HF forward computes none
  either (transformers adds it only with output_router_logits and labels), so both optimise the same
  objective. Token dispatcher: "allgather" (megatron-core 0.16's "alltoall" creates a `torch.cuda.Stream` in
  its constructor). Expert parallelism (`megatron.expert_model_parallel_size`): the EP ranks are
  data-parallel ranks holding `experts / EP` experts each; micro-batches are padded to the EP group's
  largest (rows, columns) since the dispatcher all-gathers equal token counts; expert gradients already
  sum over the EP group's rows (the dispatcher's backward) and are all-reduced over the expert-data-parallel
  group only; the gradient norm adds the experts' squares over expert TP x EP x PP. Weight sync and
  checkpoints gather each local expert over EP and emit the checkpoint's per-expert HF names (what vLLM
  loads). megatron-core 0.16.1 fixes: moe_utils refers to `te_general_gemm`, bound only when
  transformer-engine imports (NameError without it: bound to None here), and the router moves its weight to
  `torch.cuda.current_device()` on first use (redirected on CPU). megatron-core refuses MoE x TP without
  sequence parallelism in training (validated).

Not here (config validation says so before any worker starts):
- ring attention: CP all-gathers the whole key/value sequence on every rank (memory O(S) for K/V per
  layer, activations and logits O(S / CP)); TE's p2p ring exchange is not reproduced.
- MoE: dense layers among MoE ones (Qwen2-MoE's decoder_sparse_step / mlp_only_layers), Mixtral's router
  jitter, grouped GEMM, the alltoall / flex dispatchers, EP x CP; the HF rollout engine (transformers holds
  fused expert tensors, the sync streams per-expert names: refused, use vLLM).
- virtual pipeline stages (interleaving); megatron-core's selective recompute (`model.gradient_checkpointing`
  recomputes whole layers with torch's checkpoint, `_recomputed`).

PPO's critic (`head="value"`): the same GPT body without its LM head (embedding -> decoder with the
final norm) and the value head of `value_model.py` (`Linear(hidden, 1)`, zero-initialised, replicated
over TP, on the last pipeline stage, its own LR), saved under the same names as the FSDP critic's.
"""

from __future__ import annotations

import functools
import logging
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.distributed import all_reduce_max, barrier, rank as global_rank, world_size
from rlframe.workers.engine.base import LossFn, LossOutput, TrainingEngine
from rlframe.workers.engine.checkpoint import OPTIMIZER_FILE, load_rank_state, save_rank_state
from rlframe.workers.engine.hf_model import LOGIT_CHUNK, trim_padding_columns
from rlframe.workers.engine.megatron.convert import (GPTArch, hf_to_megatron, is_expert, is_tensor_parallel,
                                                     megatron_to_hf)
from rlframe.workers.hf_folder import write_hf_folder
from rlframe.workers.sequence_parallel import SequenceParallelGroup, gather_rows
from rlframe.workers.engine.megatron.settings import MegatronSettings
from rlframe.workers.settings import EngineSettings

logger = logging.getLogger(__name__)

# Megatron's TP linear layers warn on every backward that CUDA_DEVICE_MAX_CONNECTIONS=1 would speed up
# their async all-reduce (a CUDA setting; meaningless on CPU): silenced.
warnings.filterwarnings("ignore", message="When using async grad allreduce")
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _import_megatron():
    """megatron.core, without its warnings about transformer-engine / apex being absent (expected here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
    return parallel_state, GPTModel, get_gpt_layer_local_spec, TransformerConfig


# ------------------------------------------------------------------------------------ core attention
class SDPACoreAttention(nn.Module):
    """Megatron's core-attention slot filled with torch SDPA: q [s, b, heads/tp, d], k/v [s, b, groups/tp, d]
    -> [s, b, heads/tp * d]. The mask is ours ([b, 1, s, s], True = masked, Megatron's convention)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale
        # Context parallelism: this rank holds 2 of the 2 x CP chunks of each sequence (see `cp_positions`);
        # its queries attend to the keys / values of every chunk, all-gathered over the CP group
        # (`_GatherChunks`: the backward sums each chunk's dK / dV over the ranks whose queries used it).
        # The mask the model passes is [b, 1, local queries, all keys in global order].
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = _import_megatron()[0].get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention takes padded rows with a mask only")
        if self.cp_group is not None:
            key = _GatherChunks.apply(key, self.cp_group, 0, True)
            value = _GatherChunks.apply(value, self.cp_group, 0, True)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.size(1) != q.size(1):
            repeat = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                               scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def cp_positions(length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The columns of a `length`-column sequence (a multiple of 2 x CP) that CP rank `cp_rank` holds:
    chunks `cp_rank` and `2 CP - 1 - cp_rank` of 2 x CP equal chunks (Megatron's load balance: under the
    causal mask every rank gets the same amount of attention work)."""
    chunk = length // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))


class _GatherChunks(torch.autograd.Function):
    """Every CP rank's local tensor (its two chunks, `cp_positions` order, along `dim`) -> the whole sequence in
    column order, on every rank of the CP group (a list all_gather: gloo-safe).

    backward: `reduce=True` (keys / values: every rank's queries used every chunk): each chunk's gradient
    summed over the CP ranks, this rank's chunks kept (a reduce-scatter; on gloo an all-reduce and a
    slice). `reduce=False` (per-token log-probs / entropy / values, from which every CP rank computes the
    same loss): this rank's chunks of the gradient only, which summed over the CP ranks (as the engine sums
    the gradients over data-parallel x CP ranks) is the loss's gradient once."""

    @staticmethod
    def forward(ctx, local, group, dim, reduce):
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        cp = dist.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        chunks: list = [None] * (2 * cp)
        for rank, piece in enumerate(pieces):
            chunks[rank], chunks[2 * cp - 1 - rank] = piece.chunk(2, dim=dim)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = grad.chunk(2 * cp, dim=dim)
        if not ctx.reduce:
            return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim).contiguous(), None, None, None
        per_rank = torch.stack([torch.cat((chunks[r], chunks[2 * cp - 1 - r]), dim=dim) for r in range(cp)])
        if dist.get_backend(group) == "nccl":
            mine = torch.empty_like(per_rank[0])
            dist.reduce_scatter_tensor(mine, per_rank.flatten(0, 1) if dim == 0 else per_rank, group=group)
            return mine, None, None, None
        dist.all_reduce(per_rank, group=group)
        return per_rank[rank].contiguous(), None, None, None


def attention_mask_for(attention_mask: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] padding mask -> [b, 1, q, s] bool, True where a query may NOT attend (causal + padding).

    `queries`: the global positions of the query rows, by default all s of them; under context
    parallelism a rank's own (`cp_index`) against every key in column order (what `SDPACoreAttention`
    gathers), so the rank never builds the whole [b, 1, s, s]. Every position may attend to itself, so
    padding queries (whose outputs are never read) get no all-masked row (SDPA would give NaN there)."""
    columns = torch.arange(attention_mask.size(1), device=attention_mask.device)
    queries = (columns if queries is None else queries).unsqueeze(1)
    allowed = (columns <= queries).unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    allowed |= (columns == queries).unsqueeze(0)
    return (~allowed).unsqueeze(1)


# ------------------------------------------------------------------------------------ the model
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


def init_model_parallel(tp: int, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
    """Megatron's process groups over our (gloo / nccl) world; once per process (actor and ref share them)."""
    parallel_state = _import_megatron()[0]
    if not dist.is_initialized():  # a plain object in a test process: a one-rank group
        from rlframe.controller.worker_host import find_free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            raise ValueError(f"this process already runs Megatron with (TP, PP, CP, EP)={have}, asked for "
                             f"{(tp, pp, cp, ep)}")
        return
    if dist.get_world_size() % (tp * pp * cp):
        raise ValueError(f"world size {dist.get_world_size()} is not divisible by TP x PP x CP = {tp * pp * cp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
    from megatron.core import tensor_parallel

    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # (the RNG states its dropout forks expect)
    else:  # every dropout is 0 here: the sequence-parallel embedding's RNG fork is a no-op on CPU
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)


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
    _, GPTModel, get_gpt_layer_local_spec, TransformerConfig = _import_megatron()
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
        _moe_without_transformer_engine()
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.padded_vocab(tp),
                   max_sequence_length=arch.max_position_embeddings, pre_process=pre_process,
                   post_process=post_process, parallel_output=True,
                   share_embeddings_and_output_weights=arch.tie_embeddings and pp == 1,
                   position_embedding_type="rope", rotary_base=int(arch.rope_theta)
                   if float(arch.rope_theta).is_integer() else arch.rope_theta)
    if not profile.is_gpu:
        # megatron-core 0.16's RotaryEmbedding.get_emb moves its inv_freq to CUDA on first use: on CPU
        # the same embedding without that move.
        gpt.rotary_pos_emb.get_emb = types.MethodType(_rope_emb_in_place, gpt.rotary_pos_emb)
        if cp > 1:  # (its CP cut, get_pos_emb_on_this_cp_rank, builds its index with .cuda())
            gpt.rotary_pos_emb.forward = types.MethodType(_rope_on_cp_rank, gpt.rotary_pos_emb)
        if pp > 1:
            _pipeline_on_cpu()
        if config.sequence_parallel or arch.num_experts:  # (the all-gather token dispatcher: the same mappings)
            _sequence_parallel_on_cpu()
        if arch.num_experts:
            _moe_on_cpu()
    return gpt.to(profile.device)


class SequenceParallelRMSNorm:
    """The local spec's norm (torch RMSNorm) under sequence parallelism: the weight is replicated over TP
    but each TP rank normalises only its slice of the sequence, so its gradient is a partial sum, marked
    `sequence_parallel` (as megatron-core's fused norms mark theirs) for the engine's all-reduce over TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def _rope_on_cp_rank(rope, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
    """RotaryEmbedding.forward on CPU under context parallelism: the table of the whole (padded) sequence,
    cut to this rank's chunks (`cp_positions`: the columns its tokens sit at)."""
    emb = rope.get_emb(max_seq_len, offset)
    group = cp_group if cp_group is not None else rope.cp_group
    if packed_seq or group is None or group.size() == 1:
        return emb
    return emb[cp_positions(emb.size(0), group.size(), group.rank(), device=emb.device)]


def _rope_emb_in_place(rope, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb on the device inv_freq is on ([s, 1, 1, dim], halves not interleaved)."""
    if rope.rotary_interleaved:
        raise NotImplementedError("interleaved RoPE on CPU")
    freqs = rope.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class _TorchOnCPU:
    """`torch` as megatron-core 0.16's pipeline schedule and p2p code see it on CPU: they allocate their
    receive buffers and shape messages on `torch.cuda.current_device()`, call `torch.cuda.synchronize()`
    after batched p2p, and count tokens in `torch.zeros(..., device="cuda")`; here those land on the
    CPU and the synchronisation is a no-op (gloo's isend/irecv complete on wait()). Everything else is torch."""

    class cuda:  # (stands in for the torch.cuda module)
        @staticmethod
        def current_device() -> str:
            return "cpu"

        @staticmethod
        def synchronize(*_, **__) -> None:
            return None

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


class _FreshBuffer:
    """megatron-core's global memory buffer on CPU: a new tensor each time (its buffer allocates on CUDA)."""

    @staticmethod
    def get_tensor(shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def _sequence_parallel_on_cpu() -> None:
    """Sequence parallelism on CPU (gloo): megatron-core 0.16's tensor-parallel layers and mappings allocate
    their gather / reduce-scatter outputs on `torch.cuda.current_device()` and in a global CUDA buffer;
    here `_TorchOnCPU` and a fresh CPU tensor. Their collectives, `all_gather_into_tensor` and
    `reduce_scatter_tensor`, are replaced by `_gloo_all_gather` / `_gloo_reduce_scatter` (a list
    all_gather; an all_reduce and a slice): older torch's gloo has neither, and on CPU the cost is moot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.tensor_parallel import layers, mappings
    for module in (layers, mappings):
        if not isinstance(module.torch, _TorchOnCPU):
            module.torch = _TorchOnCPU()
        module.get_global_memory_buffer = lambda: _FreshBuffer
        module.dist_all_gather_func, module.dist_reduce_scatter_func = _gloo_all_gather, _gloo_reduce_scatter


class _Done:
    """The handle of a collective that already completed (megatron's async_op=True callers `wait()` on it)."""

    @staticmethod
    def wait() -> None:
        return None


def _gloo_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """all_gather_into_tensor (concatenated along dim 0) as a list all_gather into views of `output`."""
    dist.all_gather(list(output.chunk(dist.get_world_size(group), dim=0)), input.contiguous(), group=group)
    return _Done() if async_op else None


def _gloo_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """reduce_scatter_tensor (sum; dim 0 split evenly) as an all_reduce of a copy and this rank's slice."""
    total = input.contiguous().clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)])
    return _Done() if async_op else None


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router gating (moe_utils.RouterGatingLinearFunction) tests
    `te_general_gemm is not None`, a name moe_utils binds only when transformer-engine imports: without TE
    a NameError ("name 'te_general_gemm' is not defined"). Bound to None there, it takes its torch.mm path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_on_cpu() -> None:
    """megatron-core 0.16's MoE router moves its weight to `torch.cuda.current_device()` on first use when it
    finds it on the CPU: on CPU processes that is a no-op (`_TorchOnCPU`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.transformer.moe import router
    if not isinstance(router.torch, _TorchOnCPU):
        router.torch = _TorchOnCPU()


def _pipeline_on_cpu() -> None:
    """Point megatron-core's pipeline schedule and p2p modules at `_TorchOnCPU` (CPU processes only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.pipeline_parallel import p2p_communication, schedules
    for module in (p2p_communication, schedules):
        if not isinstance(module.torch, _TorchOnCPU):
            module.torch = _TorchOnCPU()


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


def _read_hf_state(path: str) -> Mapping[str, torch.Tensor]:
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


# ------------------------------------------------------------------------------------ engine
def _recomputed(forward: Callable) -> Callable:
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


def _replica_row_group(dp_rank: int) -> SequenceParallelGroup:
    """The ranks of this rank's model replica (TP x PP x CP: those with its data-parallel rank) as a group,
    for the row exchange (`gather_rows`). Every rank creates every replica's group, in the same order."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dp_rank)
    mine = None
    for value in sorted(set(ranks)):
        members = [r for r, v in enumerate(ranks) if v == value]
        group = dist.new_group(members)
        if value == dp_rank:
            mine = SequenceParallelGroup(group, len(members), members.index(dist.get_rank()))
    return mine


class MegatronEngine(TrainingEngine):
    def __init__(self, settings: EngineSettings, profile: DeviceProfile, name: str = "actor"):
        from transformers import AutoConfig

        mg = settings.section or MegatronSettings()
        if settings.sequence_parallel_size > 1:
            raise ValueError(f"{name}: Ulysses sequence parallelism runs on the fsdp engine only. "
                             "Fix: actor.ulysses_sequence_parallel_size=1")
        self.settings, self.profile, self.name = settings, profile, name
        self.device = torch.device(profile.device)
        hf_config = AutoConfig.from_pretrained(settings.model_path, trust_remote_code=settings.trust_remote_code)
        arch = GPTArch.from_hf(hf_config)  # ValueError naming an unsupported architecture
        self.tp, self.pp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size
        self.cp = mg.context_parallel_size
        self.sp = bool(getattr(mg, "sequence_parallel", False)) and self.tp > 1
        self.ep = getattr(mg, "expert_model_parallel_size", 1)
        if self.ep > 1 and (not arch.num_experts or arch.num_experts % self.ep):
            raise ValueError(f"{name}: megatron.expert_model_parallel_size={self.ep} must divide the model's "
                             f"{arch.num_experts} experts. Fix: a divisor of it (or 1 for a dense model)")
        if arch.num_layers % self.pp:
            raise ValueError(f"{name}: megatron.pipeline_model_parallel_size={self.pp} does not divide the model's "
                             f"{arch.num_layers} layers. Fix: a divisor of {arch.num_layers}")
        init_model_parallel(self.tp, self.pp, self.cp, self.ep)
        parallel_state = _import_megatron()[0]
        # Expert parallelism: the EP ranks are data-parallel ranks (different rows) holding different experts;
        # megatron-core's all-gather token dispatcher gathers their tokens, so an expert's gradient already
        # sums over the EP group's rows and is summed further over the expert-data-parallel group only.
        self.ep_rank = parallel_state.get_expert_model_parallel_rank() if self.ep > 1 else 0
        self.ep_group = parallel_state.get_expert_model_parallel_group() if self.ep > 1 else None
        if self.ep > 1:
            if parallel_state.get_expert_tensor_parallel_rank() != parallel_state.get_tensor_model_parallel_rank():
                raise ValueError(f"{name}: the expert tensor-parallel rank differs from the TP rank (CP x EP "
                                 "layouts are not converted). Fix: megatron.context_parallel_size=1 with EP")
            self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
            self.expert_mp_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)  # global ranks of the stages, in stage order
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        # Gradients are summed over the data-parallel x context-parallel ranks (each CP rank's share of
        # the loss comes from its own chunks of the sequences).
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        self.cp_group = parallel_state.get_context_parallel_group() if self.cp > 1 else None
        self.cp_rank = parallel_state.get_context_parallel_rank()
        # The ranks of one model replica (TP x PP) hold the same rows: they exchange their data-parallel chunks.
        self.mp_group = parallel_state.get_model_parallel_group() if self.tp * self.pp > 1 else None
        self.row_group = (SequenceParallelGroup(self.mp_group, self.tp * self.pp, dist.get_rank(self.mp_group))
                          if self.mp_group is not None else None)
        if self.cp > 1:  # ... and so do the CP ranks of the replica: the rows are exchanged over TP x PP x CP
            self.row_group = _replica_row_group(parallel_state.get_data_parallel_rank())
        # Tied embeddings under PP: the last stage's LM head is a copy of the first stage's embedding (the
        # critic has no LM head).
        self.value_head = settings.head == "value"
        self.tied_copy = arch.tie_embeddings and self.pp > 1 and not self.value_head
        self.embedding_group = (parallel_state.get_embedding_group()
                                if self.tied_copy and (self.first_stage or self.last_stage) else None)
        torch.manual_seed(0)  # (perform_initialization=False: the values are all overwritten below)
        gpt = build_gpt(arch, self.tp, profile, pp=self.pp, pre_process=self.first_stage, post_process=self.last_stage,
                        sequence_parallel=self.sp, cp=self.cp, ep=self.ep)
        self.layer_offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
        if settings.gradient_checkpointing and settings.optim is not None:
            for layer in gpt.decoder.layers:  # (model.gradient_checkpointing: whole-layer activation recompute)
                layer.forward = _recomputed(layer.forward)
        if self.value_head:
            self.model = MegatronValueModel(gpt, hf_config, arch).to(self.device)
        else:
            self.model = MegatronCausalLM(gpt, hf_config, arch, self.tp_group if self.tp > 1 else None, self.tp)
        self.arch = arch
        hf_state = _read_hf_state(settings.model_path)
        # (a critic built from a causal LM has no value head on disk: it stays at zero)
        names = [n for n in self.params if n in self._gpt_names or n in hf_state]
        load_local_state({n: self.params[n] for n in names},
                         hf_to_megatron(hf_state, arch, self.tp_rank, self.tp, names=names,
                                        layer_offset=self.layer_offset, ep_rank=self.ep_rank, ep=self.ep))
        self._plan_weights()
        self.sharded = self.tp > 1 or self.pp > 1 or self.dp > 1
        self.optimizer_steps = self.consecutive_skips = 0
        train = settings.optim is not None
        if not train:
            self.model.eval()
            self.model.requires_grad_(False)
            self.optimizer = self.scheduler = None
            return
        self.model.train()
        optim = settings.optim
        if self.value_head:  # the head starts at zero and must reach the reward scale: its own LR
            head = list(self.model.value_head.parameters()) if self.model.value_head is not None else []
            groups = [{"params": [p for p in self.model.gpt.parameters()], "lr": optim.lr},
                      {"params": head, "lr": optim.head_lr or optim.lr}]  # (empty before the last stage)
        else:
            groups = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = max(optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """Megatron names (this stage's GPT part, layers numbered locally) and `value_head.*` (the critic's
        head, on the last stage) -> this rank's parameters."""
        named = dict(self.model.gpt.named_parameters())
        if self.value_head and self.model.value_head is not None:
            named.update({f"value_head.{n}": p for n, p in self.model.value_head.named_parameters()})
        return named

    @property
    def _gpt_names(self) -> set[str]:
        return {n for n, _ in self.model.gpt.named_parameters()}

    def _is_tied_copy(self, name: str) -> bool:
        """The last stage's copy of the tied embedding (PP > 1): neither streamed, saved nor counted twice."""
        return self.tied_copy and name == "output_layer.weight"

    def _hf_of(self, name: str, tensor: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
        """HF names (and global meta tensors) of one of this rank's Megatron parameters."""
        tensor = self.params[name] if tensor is None else tensor
        shard = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        shards = [shard] * (self.tp if is_tensor_parallel(name) else 1)
        if self.ep > 1 and is_expert(name):  # (every EP rank's expert of this local index)
            per = self.arch.num_experts // self.ep
            return [pair for e in range(self.ep)
                    for pair in megatron_to_hf(name, shards, self.arch, self.layer_offset, expert_offset=e * per)]
        return megatron_to_hf(name, shards, self.arch, self.layer_offset)

    def _plan_weights(self) -> None:
        """Every stage's parameters (Megatron name, HF names, global shapes) in stage order: what
        `iter_full_weights` streams and what the model's `state_dict` view lists (one exchange at build)."""
        mine = [(name, self.layer_offset, self._hf_of(name, p)) for name, p in self.params.items()
                if not self._is_tied_copy(name)]
        stages = [mine]
        if self.pp > 1:
            stages = [None] * self.pp
            dist.all_gather_object(stages, mine, group=self.pp_group)
        self.plan = [(stage, name, offset, metas) for stage, entries in enumerate(stages)
                     for name, offset, metas in entries]
        view = {}
        for _, _, _, metas in self.plan:
            for hf_name, meta in metas:
                view[hf_name] = meta
                if hf_name == "model.embed_tokens.weight" and self.arch.tie_embeddings:
                    view["lm_head.weight"] = meta
        self.model.weight_view = view

    # ------------------------------------------------------------------ the interface
    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that hold each row (one model replica: TP x PP x CP): the loop counts normalisers once per replica."""
        return self.tp * self.pp * self.cp

    def gather_sequence_parallel(self, data: DataProto) -> tuple[DataProto, slice]:
        return gather_rows(data, self.row_group) if self.row_group is not None else (data, slice(0, len(data)))

    def _inputs(self, micro: DataProto, response_width: int) -> tuple[tuple, tuple]:
        """The model inputs trimmed to the micro-batch's padding, and what `_outputs` needs to cut the response.

        Sequence parallelism needs a length divisible by TP, context parallelism by 2 x CP (x TP under
        both): padding columns are appended on the right (masked out: real tokens never attend to them,
        and their outputs are never read). Under CP the token and position ids are this rank's columns
        (`cp_positions`); the padding mask stays whole (the core attention sees every key)."""
        input_ids, attention_mask, position_ids = (micro.batch[k].to(self.device) for k in
                                                   ("input_ids", "attention_mask", "position_ids"))
        start, end = trim_padding_columns(attention_mask, response_width)
        prompt_width = input_ids.size(1) - response_width
        ids, positions, mask = input_ids[:, start:end], position_ids[:, start:end], attention_mask[:, start:end]
        rows = ids.size(0)
        if self.ep > 1:  # the all-gather token dispatcher needs as many tokens on every EP rank (rows, columns)
            shape = torch.tensor([rows, end - start], device=self.device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.ep_group)
            more_rows, more_columns = int(shape[0]) - rows, int(shape[1]) - (end - start)
            if more_columns:
                ids, mask = (torch.nn.functional.pad(t, (0, more_columns)) for t in (ids, mask))
                positions = torch.cat((positions, positions[:, -1:] + torch.arange(1, more_columns + 1,
                                                                                   device=self.device)), dim=1)
            if more_rows:  # (all-padding rows: their outputs are dropped in `_outputs`)
                ids, positions, mask = (torch.cat((t, t.new_zeros(more_rows, t.size(1)))) for t in (ids, positions, mask))
        multiple = (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)
        pad = -(end - start) % multiple
        if pad:
            ids, mask = (torch.nn.functional.pad(t, (0, pad)) for t in (ids, mask))
            positions = torch.cat((positions, positions[:, -1:] + torch.arange(1, pad + 1, device=self.device)), dim=1)
        cp_index = None
        if self.cp > 1:
            cp_index = cp_positions(ids.size(1), self.cp, self.cp_rank, device=self.device)
            local_ids, positions = ids[:, cp_index], positions[:, cp_index]
            return (local_ids, positions, mask, cp_index), (input_ids, start, end, prompt_width, response_width, ids,
                                                            cp_index, rows)
        return (ids, positions, mask), (input_ids, start, end, prompt_width, response_width, ids, cp_index, rows)

    def _outputs(self, out: torch.Tensor, span: tuple, temperature: float, with_entropy: bool) -> dict[str, torch.Tensor]:
        """The last stage's output (logits [b, s, V] or values [b, s]) -> the response's [B, R] outputs."""
        from rlframe.algos import entropy_from_logits, log_probs_from_logits

        input_ids, start, end, prompt_width, response_width, padded_ids, cp_index, rows = span
        pad = response_width - (end - prompt_width)
        out = out[:rows]  # (expert parallelism may have added all-padding rows)
        if cp_index is not None:
            return self._outputs_cp(out, span, temperature, with_entropy)
        if self.value_head:  # V before each response token: the previous column's hidden state
            values = out[:, prompt_width - start - 1: end - start - 1]
            return {"values": torch.nn.functional.pad(values, (0, pad)) if pad else values}
        # logits at column c predict the token at column c + 1
        response_logits = out[:, prompt_width - 1 - start: end - 1 - start]
        if temperature != 1.0:
            response_logits = response_logits / temperature
        targets = input_ids[:, prompt_width:end]
        result = {"log_probs": log_probs_from_logits(response_logits, targets, chunk_size=LOGIT_CHUNK)}
        if with_entropy:
            result["entropy"] = entropy_from_logits(response_logits, chunk_size=LOGIT_CHUNK)
        return {k: torch.nn.functional.pad(v, (0, pad)) if pad else v for k, v in result.items()}

    def _outputs_cp(self, out: torch.Tensor, span: tuple, temperature: float, with_entropy: bool) -> dict[str, torch.Tensor]:
        """`_outputs` under context parallelism: per-column values (log-prob of the next token, entropy, or
        V) of this rank's columns, gathered over the CP group into column order (`_GatherChunks`, backward:
        this rank's columns), then cut to the response as without CP. Every CP rank thus computes the same
        loss; the engine sums the gradients over DP x CP."""
        from rlframe.algos import entropy_from_logits, log_probs_from_logits

        input_ids, start, end, prompt_width, response_width, padded_ids, cp_index, rows = span
        pad = response_width - (end - prompt_width)
        padded_ids = padded_ids[:rows]
        if self.value_head:  # V before each response token: the previous column's hidden state
            per_column = {"values": out}
            first = prompt_width - start - 1
        else:  # logits at column c predict the token at column c + 1 (the last column predicts nothing read)
            next_ids = torch.nn.functional.pad(padded_ids[:, 1:], (0, 1))[:, cp_index]
            logits = out / temperature if temperature != 1.0 else out
            per_column = {"log_probs": log_probs_from_logits(logits, next_ids, chunk_size=LOGIT_CHUNK)}
            if with_entropy:
                per_column["entropy"] = entropy_from_logits(logits, chunk_size=LOGIT_CHUNK)
            first = prompt_width - 1 - start
        result = {}
        for key, local in per_column.items():
            whole = _GatherChunks.apply(local, self.cp_group, 1, False)
            response = whole[:, first: first + end - prompt_width]
            result[key] = torch.nn.functional.pad(response, (0, pad)) if pad else response
        return result

    def forward_micro(self, micro: DataProto, response_width: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> dict[str, torch.Tensor]:
        if self.pp > 1:
            raise RuntimeError("under pipeline parallelism micro-batches go through the pipeline schedule "
                               "(forward_micros / accumulate_gradients), not one at a time")
        inputs, span = self._inputs(micro, response_width)
        return self._outputs(self.model(*inputs), span, temperature, with_entropy)

    # ------------------------------------------------------------------ pipeline parallelism
    def _pipeline(self, micros: list[DataProto], response_width: int, on_output: Callable, forward_only: bool) -> None:
        """All micro-batches through megatron-core's 1F1B schedule (forward_only: forwards only). On the
        last stage `on_output(output, micro=, span=)` gets each micro-batch's logits / values and returns
        the (loss, token count, data) triple the schedule backpropagates from; with
        `calculate_per_token_loss` set the schedule takes the loss as it is."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, _gpt):
            micro = next(data_iterator)
            inputs, span = self._inputs(micro, response_width)
            return self.model(*inputs), functools.partial(on_output, micro=micro, span=span)

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micros), model=self.model.gpt,
                                    num_microbatches=len(micros), seq_length=1, micro_batch_size=1,
                                    forward_only=forward_only)

    def _from_last_stage(self, value):
        """The last stage's `value` (a picklable object) on every stage of this pipeline."""
        box = [value]
        dist.broadcast_object_list(box, src=self.pp_ranks[-1], group=self.pp_group)
        return box[0]

    def _check_micro_count(self, micros: list[DataProto]) -> None:
        """Expert parallelism: every EP rank must run as many micro-batches (each is a round of the token
        dispatcher's collectives)."""
        if self.ep == 1:
            return
        counts = torch.tensor([len(micros), -len(micros)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.ep_group)
        if int(counts[0]) != -int(counts[1]):
            raise ValueError(f"{self.name}: megatron.expert_model_parallel_size={self.ep} needs the same number of "
                             f"micro-batches on every EP rank (here {len(micros)}, up to {int(counts[0])} on another): "
                             "token budgets (actor.ppo_max_token_len_per_device, *log_prob_max_token_len_per_device) "
                             "split the ranks' rows differently. Fix: set those to 0 (fixed micro-batch sizes)")

    def forward_micros(self, micros: list[DataProto], response_width: int, temperature: float,
                       with_entropy: bool) -> list[dict[str, torch.Tensor]]:
        self._check_micro_count(micros)
        if self.pp == 1:
            return super().forward_micros(micros, response_width, temperature, with_entropy)
        outputs: list[dict[str, torch.Tensor]] = []

        def collect(output, micro, span):
            outputs.append({k: v.cpu() for k, v in self._outputs(output, span, temperature, with_entropy).items()})
            return output.new_zeros(()), torch.zeros((), dtype=torch.int), {}

        self._pipeline(micros, response_width, collect, forward_only=True)
        return self._from_last_stage(outputs)

    def accumulate_gradients(self, micros: list[DataProto], response_width: int, loss_fn: LossFn, agg: dict,
                             temperature: float, with_entropy: bool) -> list[LossOutput]:
        """PP > 1: the same loss functions and normalisers, the micro-batches through the pipeline schedule.
        Each micro-batch's loss is already its share of the global mini-batch loss (the base loop's
        `backward(loss * world)` then divides by the world again: the same gradient)."""
        self._check_micro_count(micros)
        if self.pp == 1:
            return super().accumulate_gradients(micros, response_width, loss_fn, agg, temperature, with_entropy)
        results: list[LossOutput] = []

        def loss(output, micro, span):
            out = loss_fn(self._outputs(output, span, temperature, with_entropy), micro, agg)
            results.append(LossOutput(float(out.loss.detach()), out.terms, out.stats))
            return out.loss, torch.zeros((), dtype=torch.int), {}

        self._pipeline(micros, response_width, loss, forward_only=False)
        # A loss function that counts on the way (PolicyObjective's on-policy drift |rollout - old|) ran
        # on the last stage only: its counters are copied to the other stages, so that what the role
        # reduces over the ranks afterwards is the same on every rank (and no rank skips a collective).
        counters = {k: v for k, v in getattr(loss_fn, "__dict__", {}).items() if type(v) in (int, float)}
        results, counters = self._from_last_stage((results, counters))
        if not self.last_stage:
            vars(loss_fn).update(counters)
        return results

    def backward(self, loss: torch.Tensor) -> None:
        # `loss` is this group's share of the global loss times the world size; every rank of a TP group
        # holds the same loss, and the DP groups' gradients are summed in clip_norm.
        (loss / world_size()).backward()

    def clip_norm(self, max_norm: float) -> float:
        named = {n: p for n, p in self.params.items() if p.grad is not None}
        if self.sp:  # replicated norms under sequence parallelism: each TP rank saw its slice of the sequence
            for p in named.values():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=self.tp_group)
        if self.embedding_group is not None:  # tied embeddings under PP: first stage's + last stage's gradient
            shared = named.get("embedding.word_embeddings.weight", named.get("output_layer.weight"))
            dist.all_reduce(shared.grad, group=self.embedding_group)
        experts = {n for n in named if self.ep > 1 and is_expert(n)}
        for name, p in named.items():
            group = self.expert_dp_group if name in experts else self.dp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in named.items():
            if name in experts:
                expert_squares += p.grad.detach().double().pow(2).sum()
            elif not self._is_tied_copy(name) and (self.tp_rank == 0 or is_tensor_parallel(name)):
                squares += p.grad.detach().double().pow(2).sum()
        if self.mp_group is not None:  # TP shards and PP stages
            dist.all_reduce(squares, group=self.mp_group)
        if experts:  # each EP rank's own experts (TP shards, PP stages): over expert TP x EP x PP
            dist.all_reduce(expert_squares, group=self.expert_mp_group)
        total = float((squares + expert_squares).sqrt())
        coef = min(max_norm / (total + 1e-6), 1.0)
        for p in named.values():
            p.grad.mul_(coef)
        return total

    def _gathered(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The TP shards of one parameter (or of its optimizer state), in TP-rank order."""
        if self.tp == 1 or not is_tensor_parallel(name):
            return [tensor.detach()]
        shards = [torch.empty_like(tensor) for _ in range(self.tp)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=self.tp_group)
        return shards

    def _over_ep(self, shards: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """One local expert's TP shards on every EP rank (EP-rank order): [[shards of EP rank 0], ...]."""
        gathered = []
        for shard in shards:
            pieces = [torch.empty_like(shard) for _ in range(self.ep)]
            dist.all_gather(pieces, shard.contiguous(), group=self.ep_group)
            gathered.append(pieces)
        return [[pieces[e] for pieces in gathered] for e in range(self.ep)]

    def _iter_hf(self, local: Callable[[nn.Parameter], torch.Tensor], dtype: torch.dtype | None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors of `local(param)` for every parameter of every stage, in plan order:
        the owner stage gathers the TP shards and converts, then (PP > 1) broadcasts each tensor over the
        pipeline group, one at a time."""
        params = self.params
        for stage, name, offset, metas in self.plan:
            if stage == self.pp_rank and self.ep > 1 and is_expert(name):  # every EP rank's expert of this index
                per_ep = self._over_ep(self._gathered(name, local(params[name])))
                per = self.arch.num_experts // self.ep
                pairs = [pair for e, shards in enumerate(per_ep)
                         for pair in megatron_to_hf(name, shards, self.arch, offset, expert_offset=e * per)]
            elif stage == self.pp_rank:
                pairs = megatron_to_hf(name, self._gathered(name, local(params[name])), self.arch, offset)
            else:
                pairs = [(hf_name, torch.empty(meta.shape, dtype=meta.dtype, device=self.device))
                         for hf_name, meta in metas]
            for hf_name, full in pairs:
                if self.pp > 1:
                    full = full.contiguous()
                    dist.broadcast(full, src=self.pp_ranks[stage], group=self.pp_group)
                full = full.to(dtype) if dtype is not None and full.is_floating_point() else full
                yield hf_name, full
                if hf_name == "model.embed_tokens.weight" and self.arch.tie_embeddings:
                    yield "lm_head.weight", full  # (as the HF model's state dict lists it)

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors, one Megatron parameter gathered at a time (every rank iterates)."""
        return self._iter_hf(lambda p: p.detach(), dtype)

    # ------------------------------------------------------------------ checkpoints (checkpoint.py's layout)
    def save_state(self, out_dir: str, tokenizer_source: str | None = None) -> None:
        out = Path(out_dir)
        weights = {n: t.cpu() for n, t in self.iter_full_weights()}
        state: dict[str, dict] = {}
        # Adam's moments exist for every parameter after the first step (all of them get gradients)
        if all_reduce_max(int(any(p not in self.optimizer.state for p in self.params.values()))) == 0:
            step = next(iter(self.optimizer.state.values()))["step"]
            for key in ADAM_STATE_KEYS:
                for hf_name, tensor in self._iter_hf(lambda p, key=key: self.optimizer.state[p][key], None):
                    state.setdefault(hf_name, {})[key] = tensor.cpu()
            for entry in state.values():
                entry["step"] = step.clone()
        if self.arch.tie_embeddings:
            state.pop("lm_head.weight", None)
        names = {id(p): n for n, p in self.params.items()}
        mine = [[hf for p in group["params"] if not self._is_tied_copy(names[id(p)])
                 for hf, _ in self._hf_of(names[id(p)])] for group in self.optimizer.param_groups]
        stages = [mine]
        if self.pp > 1:  # (the groups' parameters of every stage, in stage order)
            stages = [None] * self.pp
            dist.all_gather_object(stages, mine, group=self.pp_group)
        groups = []
        for index, group in enumerate(self.optimizer.param_groups):  # (the critic: backbone, then the value head)
            hf_names = [hf for stage in stages for hf in stage[index] if hf in state]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": hf_names})
        optim_state = {"state": state, "param_groups": groups}
        rank = global_rank()
        if rank == 0:
            if self.arch.tie_embeddings:
                weights.pop("lm_head.weight", None)
            write_hf_folder(out, weights, self.model.config, tokenizer_source)
            torch.save(optim_state, out / OPTIMIZER_FILE)
        barrier()
        save_rank_state(self, out)

    def load_state(self, in_dir: str) -> dict:
        src = Path(in_dir)
        names = list(self.params)
        load_local_state(self.params, hf_to_megatron(_read_hf_state(str(src)), self.arch, self.tp_rank, self.tp,
                                                     names=names, layer_offset=self.layer_offset,
                                                     ep_rank=self.ep_rank, ep=self.ep))
        saved = torch.load(src / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
        params = self.params
        moments = {key: {n: s[key] for n, s in saved["state"].items() if key in s} for key in ADAM_STATE_KEYS}
        local = {key: hf_to_megatron(moments[key], self.arch, self.tp_rank, self.tp, names=names,
                                     layer_offset=self.layer_offset, ep_rank=self.ep_rank, ep=self.ep)
                 for key in ADAM_STATE_KEYS if moments[key]}
        for name, p in params.items():
            if not local or name not in local["exp_avg"]:
                continue
            hf_first = "model.embed_tokens.weight" if self._is_tied_copy(name) else self._hf_of(name)[0][0]
            if hf_first not in saved["state"] and name == "output_layer.weight":
                hf_first = "model.embed_tokens.weight"  # (a tied checkpoint saved the embedding's state only)
            self.optimizer.state[p] = {"step": saved["state"][hf_first]["step"].clone().float(),
                                       **{key: local[key][name].to(p.device) for key in ADAM_STATE_KEYS}}
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"{src / OPTIMIZER_FILE} has {len(saved['param_groups'])} parameter groups; this "
                             f"{self.name} has {len(self.optimizer.param_groups)}")
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        return load_rank_state(self, src)
