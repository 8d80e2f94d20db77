"""The Megatron-core training engine (`actor.strategy=megatron`): tensor, pipeline, sequence, context and
expert parallelism for the actor, the reference policy and the critic (dense and MoE models).

    engine = MegatronEngine(settings, profile, name="actor")   # via build_engine(...)

Same interface and the same update loop as the FSDP engine (`base.TrainingEngine`, the loss functions
of rlframe/algos): what changes is the model.

- The HF checkpoint (Llama / Qwen2 family, Qwen2-MoE, Mixtral; anything else is a ValueError naming the architecture) is
  converted into a Megatron-core `GPTModel` built with the transformer-engine-free local layer spec
  (`model.py`; `convert.py`: fused QKV and gate/up, TP shards, layers renumbered per pipeline stage). Core
  attention is torch's SDPA (`attention.py`) with our padding + causal mask, which is what runs on
  CPU over gloo (the CPU profile, megatron-core's CUDA-only allocations redirected by `shims.py`) and on
  GPU without transformer-engine. Process groups: `parallel.py`.
- The ranks of one model replica (TP x PP: Megatron's model-parallel group) first exchange their
  data-parallel chunks (as Ulysses does, `gather_rows`), so the driver dispatches exactly as for FSDP
  and every rank of a replica holds the same rows; each returns its own rows' results.
- Tensor parallelism: groups of `tp` consecutive ranks (Megatron's parallel_state). Logits are
  all-gathered over the vocabulary-parallel LM head (`model.py`), so log-probs and entropies go
  through the same functions as FSDP's.
- Pipeline parallelism (`pipeline_model_parallel_size`, must divide the layers): each stage builds its
  part of the GPTModel (the first the embedding, the last the final norm + LM head or the critic's value
  head, `num_layers / pp` layers each). A mini-batch's micro-batches go through megatron-core's 1F1B
  schedule (`get_forward_backward_func`; forward_only for log-probs, entropy and values), each trimmed to
  its own padding (`variable_seq_lengths`: shapes travel ahead of activations). The last stage applies
  the same loss function to each micro-batch; `calculate_per_token_loss` stops the schedule from
  rescaling it, since it already is the micro-batch's share of the global loss. Outputs and loss values
  are broadcast from the last stage over the pipeline group. Tied embeddings (SmolLM2): megatron-core's own tying
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
  residuals hold 1 / TP of the sequence. The norms' gradients are then partial sums (`model.py`:
  `SequenceParallelRMSNorm`), which the engine all-reduces over TP before the norm and the step. Micro-batches
  are padded on the right to a multiple of TP.
- Context parallelism (`megatron.context_parallel_size`, `attention.py`): each (padded) sequence is cut
  into 2 x CP load-balanced chunks (`cp_positions`), whose queries attend to every chunk's keys / values,
  all-gathered over the CP group; RoPE from the global columns. The per-token log-probs / entropy / values
  of the rank's columns are gathered the same way (`GatherChunks`, backward: its own columns), so every CP rank computes the same loss through the same loss
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
  `linear_fc1`, down -> `linear_fc2`, the shared expert and its gate -> `mlp.shared_experts`), routed as
  HF routes (`model.py`). Expert parallelism (`megatron.expert_model_parallel_size`): the EP ranks are
  data-parallel ranks holding `experts / EP` experts each; micro-batches are padded to the EP group's
  largest (rows, columns) since the dispatcher all-gathers equal token counts; expert gradients already
  sum over the EP group's rows (the dispatcher's backward) and are all-reduced over the expert-data-parallel
  group only; the gradient norm adds the experts' squares over expert TP x EP x PP. Weight sync and
  checkpoints gather each local expert over EP and emit the checkpoint's per-expert HF names (what vLLM
  loads). megatron-core 0.16.1's router gating without transformer-engine and its router's CUDA move are
  patched (`shims.py`). megatron-core refuses MoE x TP without
  sequence parallelism in training (validated).

Not here (config validation says so before any worker starts):
- ring attention: CP all-gathers the whole key/value sequence on every rank (memory O(S) for K/V per
  layer, activations and logits O(S / CP)); TE's p2p ring exchange is not reproduced.
- MoE: dense layers among MoE ones (Qwen2-MoE's decoder_sparse_step / mlp_only_layers), Mixtral's router
  jitter, grouped GEMM, the alltoall / flex dispatchers, EP x CP; the HF rollout engine (transformers holds
  fused expert tensors, the sync streams per-expert names: refused, use vLLM).
- virtual pipeline stages (interleaving); megatron-core's selective recompute (`model.gradient_checkpointing`
  recomputes whole layers with torch's checkpoint, `recomputed`).

PPO's critic (`head="value"`): the GPT body with a value head (`model.py: MegatronValueModel`, its own LR),
saved under the same names as the FSDP critic's.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterator
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
from rlframe.workers.engine.megatron.attention import GatherChunks, cp_positions
from rlframe.workers.engine.megatron.convert import (GPTArch, hf_to_megatron, is_expert, is_tensor_parallel,
                                                     megatron_to_hf)
from rlframe.workers.engine.megatron.model import (MegatronCausalLM, MegatronValueModel, build_gpt, load_local_state,
                                                   read_hf_state, recomputed)
from rlframe.workers.engine.megatron.parallel import import_megatron, init_model_parallel, replica_row_group
from rlframe.workers.engine.megatron.settings import MegatronSettings
from rlframe.workers.hf_folder import write_hf_folder
from rlframe.workers.sequence_parallel import SequenceParallelGroup, gather_rows
from rlframe.workers.settings import EngineSettings

logger = logging.getLogger(__name__)

# Megatron's TP linear layers warn on every backward that CUDA_DEVICE_MAX_CONNECTIONS=1 would speed up
# their async all-reduce (a CUDA setting; meaningless on CPU): silenced.
warnings.filterwarnings("ignore", message="When using async grad allreduce")
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


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
        parallel_state = import_megatron()[0]
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
            self.row_group = replica_row_group(parallel_state.get_data_parallel_rank())
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
                layer.forward = recomputed(layer.forward)
        if self.value_head:
            self.model = MegatronValueModel(gpt, hf_config, arch).to(self.device)
        else:
            self.model = MegatronCausalLM(gpt, hf_config, arch, self.tp_group if self.tp > 1 else None, self.tp)
        self.arch = arch
        hf_state = read_hf_state(settings.model_path)
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
        V) of this rank's columns, gathered over the CP group into column order (`GatherChunks`, backward:
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
            whole = GatherChunks.apply(local, self.cp_group, 1, False)
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
        load_local_state(self.params, hf_to_megatron(read_hf_state(str(src)), self.arch, self.tp_rank, self.tp,
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
