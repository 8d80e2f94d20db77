"""The Megatron-core trainer engine (`actor.strategy=megatron`): tensor parallelism for the actor and the
reference policy.

    engine = MegatronEngine(settings, profile, name="actor")   # via build_engine(...)

Same interface and the same update loop as the FSDP engine (`base.TrainerEngine`, the loss functions
of rlframe/algos): what changes is the model.

- The HF checkpoint (Llama / Qwen2 family; anything else is a ValueError naming the architecture) is
  converted into a Megatron-core `GPTModel` built with the transformer-engine-free local layer spec
  (`megatron_convert.py`: fused QKV and gate/up, TP shards). Core attention is torch's SDPA
  (`SDPACoreAttention`) with our padding + causal mask, which is what runs on CPU over gloo (the CPU
  profile) and on GPU without transformer-engine.
- Tensor parallelism: the world is split into groups of `tp` consecutive ranks (Megatron's
  parallel_state); the ranks of a group first exchange their data-parallel chunks (as Ulysses does,
  `gather_rows`), so the driver dispatches exactly as for FSDP and every rank of a group computes
  the same loss on the union of the chunks. Logits are all-gathered over the vocabulary-parallel LM
  head (`_GatherVocab`), so log-probs and entropies go through the same functions as FSDP's.
- Loss normalisation: the base loop normalises by the global token / sequence counts (counted once per
  TP group: `sequence_parallel_size` reports `tp` as the number of ranks that hold each row) and
  calls `backward(loss * world)`; we backpropagate `loss / world` and sum the gradients over the
  data-parallel group, which gives the gradient of the global mini-batch loss (TP 1 vs 2 and 1 vs 2
  micro-batches are the same update: tests/test_megatron.py).
- Gradient norm: squares of TP-sharded gradients summed over the TP group, replicated ones (norms)
  counted once; clipped as torch's clip_grad_norm_ does. AdamW on each rank's shards is the same as on
  the full tensors (elementwise).
- `iter_full_weights` gathers each parameter's TP shards (one parameter at a time) and yields HF
  names and layouts: weight sync to vLLM, `save_hf`, and checkpoints. Checkpoints use the FSDP
  engine's layout (`checkpoint.py`: full weights + Adam moments under HF names), so they export with
  `python -m rlframe.export` and resume at another TP size or on the FSDP engine.

Not here (config validation says so before any worker starts): pipeline parallelism (PP > 1),
context and expert parallelism, Megatron's sequence parallelism.

PPO's critic (`head="value"`): the same GPT body without its LM head (embedding -> decoder with the
final norm) and the value head of `value_model.py` (`Linear(hidden, 1)`, zero-initialised, replicated
over TP, its own LR), saved under the same names as the FSDP critic's.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.distributed import barrier, rank as global_rank, world_size
from rlframe.workers.engine.base import TrainerEngine
from rlframe.workers.engine.checkpoint import OPTIMIZER_FILE, load_rank_state, save_rank_state
from rlframe.workers.engine.hf_model import LOGIT_CHUNK, trim_padding_columns
from rlframe.workers.engine.megatron_convert import GPTArch, hf_to_megatron, is_tensor_parallel, megatron_to_hf
from rlframe.workers.hf_folder import write_hf_folder
from rlframe.workers.sequence_parallel import SequenceParallelGroup, gather_rows
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

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention takes padded rows with a mask only")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.size(1) != q.size(1):
            repeat = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                               scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def attention_mask_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] padding mask -> [b, 1, s, s] bool, True where a query may NOT attend (causal + padding).

    Every position may attend to itself, so padding queries (whose outputs are never read) get no
    all-masked row (SDPA would give NaN there)."""
    s = attention_mask.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    allowed |= torch.eye(s, dtype=torch.bool, device=attention_mask.device).unsqueeze(0)
    return (~allowed).unsqueeze(1)


# ------------------------------------------------------------------------------------ the model
class MegatronCausalLM(nn.Module):
    """The Megatron GPTModel with the HF config attached (roles write `model.config` next to exported weights)."""

    def __init__(self, gpt: nn.Module, hf_config, arch: GPTArch, tp_group=None, tp: int = 1):
        super().__init__()
        self.gpt, self.config, self.arch, self.tp_group, self.tp = gpt, hf_config, arch, tp_group, tp

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The HF-named view of the weights: global shapes and dtypes on the meta device (no data, no
        collective), in `iter_full_weights` order. It is what the disaggregated broadcast plans its
        buckets from (`merged_weight_view`); the weights themselves come from `iter_full_weights`."""
        view = {}
        for name, param in self.gpt.named_parameters():
            shard = torch.empty(param.shape, dtype=param.dtype, device="meta")
            for hf_name, full in megatron_to_hf(name, [shard] * (self.tp if is_tensor_parallel(name) else 1),
                                                self.arch):
                view[hf_name] = full
                if hf_name == "model.embed_tokens.weight" and self.arch.tie_embeddings:
                    view["lm_head.weight"] = full
        return view

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [b, s, V] (the TP shards of the LM head gathered)."""
        logits = self.gpt(input_ids=input_ids, position_ids=position_ids,
                          attention_mask=attention_mask_for(attention_mask))
        if self.tp_group is not None:
            logits = _GatherVocab.apply(logits, self.tp_group)
        return logits[..., : self.arch.vocab_size]


class MegatronValueModel(nn.Module):
    """The GPT body (embedding, decoder with its final norm; no LM head) + a scalar value head: values [b, s]."""

    def __init__(self, gpt: nn.Module, hf_config, arch: GPTArch):
        super().__init__()
        self.gpt, self.config, self.arch = gpt, hf_config, arch
        gpt.output_layer = None  # (untied checkpoints: the LM head is not part of the value model)
        self.value_head = nn.Linear(arch.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        rope = self.gpt.rotary_pos_emb(hidden.size(0))
        hidden = self.gpt.decoder(hidden_states=hidden, attention_mask=attention_mask_for(attention_mask),
                                  rotary_pos_emb=rope)
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


def init_model_parallel(tp: int, pp: int = 1, cp: int = 1) -> None:
    """Megatron's process groups over our (gloo / nccl) world; once per process (actor and ref share them)."""
    parallel_state = _import_megatron()[0]
    if not dist.is_initialized():  # a plain object in a test process: a one-rank group
        from rlframe.controller.worker_host import find_free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"this process already runs Megatron with (TP, PP)={have}, asked for {(tp, pp)}")
        return
    if dist.get_world_size() % (tp * pp * cp):
        raise ValueError(f"world size {dist.get_world_size()} is not divisible by TP x PP x CP = {tp * pp * cp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp)


def build_gpt(arch: GPTArch, tp: int, profile: DeviceProfile, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An empty GPTModel for this TP rank (local layer spec, SDPA core attention)."""
    _, GPTModel, get_gpt_layer_local_spec, TransformerConfig = _import_megatron()
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, params_dtype=dtype,
        use_cpu_initialization=not profile.is_gpu, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, sequence_parallel=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.padded_vocab(tp),
                   max_sequence_length=arch.max_position_embeddings, pre_process=True, post_process=True,
                   parallel_output=True, share_embeddings_and_output_weights=arch.tie_embeddings,
                   position_embedding_type="rope", rotary_base=int(arch.rope_theta)
                   if float(arch.rope_theta).is_integer() else arch.rope_theta)
    if not profile.is_gpu:
        # megatron-core 0.16's RotaryEmbedding.get_emb moves its inv_freq to CUDA on first use: on CPU
        # the same embedding without that move.
        gpt.rotary_pos_emb.get_emb = types.MethodType(_rope_emb_in_place, gpt.rotary_pos_emb)
    return gpt.to(profile.device)


def _rope_emb_in_place(rope, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb on the device inv_freq is on ([s, 1, 1, dim], halves not interleaved)."""
    if rope.rotary_interleaved:
        raise NotImplementedError("interleaved RoPE on CPU")
    freqs = rope.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


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
class MegatronEngine(TrainerEngine):
    def __init__(self, settings: EngineSettings, profile: DeviceProfile, name: str = "actor"):
        from transformers import AutoConfig

        mg = settings.megatron
        if mg.pipeline_model_parallel_size != 1 or mg.context_parallel_size != 1:
            raise ValueError(f"{name}: megatron pipeline / context parallelism is not implemented. "
                             "Fix: megatron.pipeline_model_parallel_size=1 and megatron.context_parallel_size=1")
        if settings.sequence_parallel_size > 1:
            raise ValueError(f"{name}: Ulysses sequence parallelism runs on the fsdp engine only. "
                             "Fix: actor.ulysses_sequence_parallel_size=1")
        self.settings, self.profile, self.name = settings, profile, name
        self.device = torch.device(profile.device)
        if settings.gradient_checkpointing:
            logger.warning("%s: model.gradient_checkpointing is not applied by the megatron engine (Megatron's "
                           "activation recompute is not wired here); activations are kept", name)
        hf_config = AutoConfig.from_pretrained(settings.model_path, trust_remote_code=settings.trust_remote_code)
        arch = GPTArch.from_hf(hf_config)  # ValueError naming an unsupported architecture
        self.tp = mg.tensor_model_parallel_size
        init_model_parallel(self.tp)
        parallel_state = _import_megatron()[0]
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.row_group = SequenceParallelGroup(self.tp_group, self.tp, self.tp_rank) if self.tp > 1 else None
        torch.manual_seed(0)  # (perform_initialization=False: the values are all overwritten below)
        gpt = build_gpt(arch, self.tp, profile)
        self.value_head = settings.head == "value"
        if self.value_head:
            self.model = MegatronValueModel(gpt, hf_config, arch).to(self.device)
        else:
            self.model = MegatronCausalLM(gpt, hf_config, arch, self.tp_group if self.tp > 1 else None, self.tp)
        self.arch = arch
        hf_state = _read_hf_state(settings.model_path)
        # (a critic built from a causal LM has no value head on disk: it stays at zero)
        names = [n for n in self.params if n in self._gpt_names or n in hf_state]
        load_local_state({n: self.params[n] for n in names},
                         hf_to_megatron(hf_state, arch, self.tp_rank, self.tp, names=names))
        self.sharded = self.tp > 1 or self.dp > 1
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
            head = list(self.model.value_head.parameters())
            groups = [{"params": [p for p in self.model.gpt.parameters()], "lr": optim.lr},
                      {"params": head, "lr": optim.head_lr or optim.lr}]
        else:
            groups = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = max(optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """Megatron names (the GPT's) and `value_head.*` (the critic's head) -> this rank's parameters."""
        named = dict(self.model.gpt.named_parameters())
        if self.value_head:
            named.update({f"value_head.{n}": p for n, p in self.model.value_head.named_parameters()})
        return named

    @property
    def _gpt_names(self) -> set[str]:
        return {n for n, _ in self.model.gpt.named_parameters()}

    # ------------------------------------------------------------------ the interface
    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that hold each row (the TP group): the loop counts normalisers once per group."""
        return self.tp

    def gather_sequence_parallel(self, data: DataProto) -> tuple[DataProto, slice]:
        return gather_rows(data, self.row_group) if self.row_group is not None else (data, slice(0, len(data)))

    def forward_micro(self, micro: DataProto, response_width: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> dict[str, torch.Tensor]:
        from rlframe.algos import entropy_from_logits, log_probs_from_logits

        input_ids, attention_mask, position_ids = (micro.batch[k].to(self.device) for k in
                                                   ("input_ids", "attention_mask", "position_ids"))
        start, end = trim_padding_columns(attention_mask, response_width)
        prompt_width = input_ids.size(1) - response_width
        pad = response_width - (end - prompt_width)
        if self.value_head:  # V before each response token: the previous column's hidden state
            values = self.model(input_ids[:, start:end], position_ids[:, start:end], attention_mask[:, start:end])
            values = values[:, prompt_width - start - 1: end - start - 1]
            return {"values": torch.nn.functional.pad(values, (0, pad)) if pad else values}
        logits = self.model(input_ids[:, start:end], position_ids[:, start:end], attention_mask[:, start:end])
        # logits at column c predict the token at column c + 1
        response_logits = logits[:, prompt_width - 1 - start: end - 1 - start]
        if temperature != 1.0:
            response_logits = response_logits / temperature
        targets = input_ids[:, prompt_width:end]
        out = {"log_probs": log_probs_from_logits(response_logits, targets, chunk_size=LOGIT_CHUNK)}
        if with_entropy:
            out["entropy"] = entropy_from_logits(response_logits, chunk_size=LOGIT_CHUNK)
        return {k: torch.nn.functional.pad(v, (0, pad)) if pad else v for k, v in out.items()}

    def backward(self, loss: torch.Tensor) -> None:
        # `loss` is this group's share of the global loss times the world size; every rank of a TP group
        # holds the same loss, and the DP groups' gradients are summed in clip_norm.
        (loss / world_size()).backward()

    def clip_norm(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=self.dp_group)
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        names = {id(p): n for n, p in self.params.items()}
        for p in params:
            if self.tp_rank == 0 or is_tensor_parallel(names[id(p)]):
                squares += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        total = float(squares.sqrt())
        coef = min(max_norm / (total + 1e-6), 1.0)
        for p in params:
            p.grad.mul_(coef)
        return total

    def _gathered(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The TP shards of one parameter (or of its optimizer state), in TP-rank order."""
        if self.tp == 1 or not is_tensor_parallel(name):
            return [tensor.detach()]
        shards = [torch.empty_like(tensor) for _ in range(self.tp)]
        dist.all_gather(shards, tensor.detach().contiguous(), group=self.tp_group)
        return shards

    def _iter_hf(self, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            for hf_name, full in megatron_to_hf(name, self._gathered(name, tensor), self.arch):
                full = full.to(dtype) if dtype is not None and full.is_floating_point() else full
                yield hf_name, full
                if hf_name == "model.embed_tokens.weight" and self.arch.tie_embeddings:
                    yield "lm_head.weight", full  # (as the HF model's state dict lists it)

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors, one Megatron parameter gathered at a time (every rank iterates)."""
        return self._iter_hf(self.params.items(), dtype)

    # ------------------------------------------------------------------ checkpoints (checkpoint.py's layout)
    def save_state(self, out_dir: str, tokenizer_source: str | None = None) -> None:
        out = Path(out_dir)
        weights = {n: t.cpu() for n, t in self.iter_full_weights()}
        state: dict[str, dict] = {}
        for key in ADAM_STATE_KEYS:
            moments = ((n, self.optimizer.state[p][key]) for n, p in self.params.items()
                       if p in self.optimizer.state)
            for hf_name, tensor in self._iter_hf(moments, None):
                state.setdefault(hf_name, {})[key] = tensor.cpu()
        for name, p in self.params.items():
            if p in self.optimizer.state:
                step = self.optimizer.state[p]["step"]
                for hf_name, _ in megatron_to_hf(name, [p.detach()] * (self.tp if is_tensor_parallel(name) else 1),
                                                 self.arch):
                    state.setdefault(hf_name, {})["step"] = step.clone()
        if self.arch.tie_embeddings:
            state.pop("lm_head.weight", None)
        names = {id(p): n for n, p in self.params.items()}
        groups = []
        for group in self.optimizer.param_groups:  # (the critic: backbone, then the value head with its LR)
            hf_names = [hf for p in group["params"] for hf, _ in megatron_to_hf(
                names[id(p)], [p.detach()] * (self.tp if is_tensor_parallel(names[id(p)]) else 1), self.arch)
                if hf in state]
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
                                                     names=names))
        saved = torch.load(src / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
        params = self.params
        moments = {key: {n: s[key] for n, s in saved["state"].items() if key in s} for key in ADAM_STATE_KEYS}
        local = {key: hf_to_megatron(moments[key], self.arch, self.tp_rank, self.tp, names=names)
                 for key in ADAM_STATE_KEYS if moments[key]}
        for name, p in params.items():
            if not local or name not in local["exp_avg"]:
                continue
            hf_first = megatron_to_hf(name, [p.detach()] * (self.tp if is_tensor_parallel(name) else 1), self.arch)[0][0]
            self.optimizer.state[p] = {"step": saved["state"][hf_first]["step"].clone().float(),
                                       **{key: local[key][name].to(p.device) for key in ADAM_STATE_KEYS}}
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"{src / OPTIMIZER_FILE} has {len(saved['param_groups'])} parameter groups; this "
                             f"{self.name} has {len(self.optimizer.param_groups)}")
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        return load_rank_state(self, src)

