"""The FSDP2 training engine: an HF model sharded with `fully_shard`, trained with AdamW.

One class for every role that trains or scores with a model: the actor and the reference policy
(`head="causal_lm"`: log-probs and entropy of the response tokens, packed and Ulysses-parallel
when asked) and PPO's critic (`head="value"`: a value per response position). With `optim=None`
the model is frozen (the reference policy). On one CPU rank FSDP is skipped (it would only copy).

With `settings.lora` (rank > 0) the causal LM gets LoRA adapters before sharding (`lora.py`): the
base is frozen, the optimizer holds the adapters only, `iter_full_weights` yields the merged
weights under the base model's names, `adapters_disabled()` gives the base model (the reference
policy) and checkpoints hold the adapters. QLoRA's 4-bit base (GPU) is replicated rather than
sharded (FSDP2 cannot shard bitsandbytes' packed weights): its adapter gradients are averaged with
one all-reduce per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.engine.base import MODEL_INPUTS, TrainingEngine
from rlframe.workers.engine import lora as lora_lib
from rlframe.workers.engine.checkpoint import load_engine_state, save_engine_state
from rlframe.workers.engine.hf_model import (TopKRequest, build_causal_lm, forward_response_log_probs,
                                             iter_full_weights, needs_sharding, shard_model)
from rlframe.workers.engine.value_model import build_value_model, forward_response_values
from rlframe.workers.sequence_parallel import SequenceParallelGroup, gather_rows
from rlframe.workers.settings import EngineSettings, OptimSettings


def use_remove_padding(setting: str, profile: DeviceProfile) -> bool:
    """auto: packed rows unless attention is eager (models outside transformers' attention interface)."""
    setting = str(setting).lower()
    return profile.attn_implementation != "eager" if setting == "auto" else setting == "true"


# The top-k ids of one model that the other model's forward scores (distillation): the teacher's (read by the
# student's training forward) and the student's (read by the teacher, reverse_kl_student_topk).
TOPK_ID_KEYS = ("teacher_topk_ids", "student_topk_ids")


class FSDPEngine(TrainingEngine):
    def __init__(self, settings: EngineSettings, profile: DeviceProfile, name: str = "actor"):
        self.settings, self.profile, self.name = settings, profile, name
        self.device = torch.device(profile.device)
        train = settings.optim is not None
        self.value_head = settings.head == "value"
        self.lora = settings.lora if settings.lora.enabled and not self.value_head else None
        qlora = self.lora is not None and self.lora.load_in_4bit
        if self.value_head:
            self.sp, self.packed = None, False
            self.model = build_value_model(settings.model_path, profile, trust_remote_code=settings.trust_remote_code,
                                           gradient_checkpointing=settings.gradient_checkpointing and train)
        else:
            # Ulysses: the ranks of an SP group train on the union of their chunks, each on 1/P of every row.
            sp_size = settings.sequence_parallel_size
            self.sp = SequenceParallelGroup.create(sp_size) if sp_size > 1 else None
            self.packed = use_remove_padding(settings.use_remove_padding, profile) or self.sp is not None
            # fp32 master weights; on GPU, FSDP's mixed precision computes in bf16.
            # (Under LoRA the frozen base needs no fp32 master: bf16 on GPU; peft keeps the adapters in fp32.)
            master_dtype = torch.float32 if ((train and self.lora is None) or not profile.is_gpu) else profile.dtype
            build = lora_lib.build_qlora_base if qlora else build_causal_lm
            vision = {"freeze_vision_tower": True} if settings.freeze_vision_tower else {}  # (VLMs only)
            self.model = build(settings.model_path, profile, **({} if qlora else {"dtype": master_dtype}), **vision,
                               packed=self.packed, gradient_checkpointing=settings.gradient_checkpointing and train,
                               trust_remote_code=settings.trust_remote_code, sequence_parallel=self.sp is not None)
            if self.lora is not None:  # adapters before sharding; the base is frozen from here on
                self.peft_config = lora_lib.apply_lora(self.model, self.lora, settings.model_path)
            if self.sp is not None and self.model.config.num_attention_heads % self.sp.size:
                raise ValueError(f"actor.ulysses_sequence_parallel_size={self.sp.size} must divide the model's "
                                 f"{self.model.config.num_attention_heads} attention heads")
        if profile.is_gpu and not settings.offload_params and not qlora:  # (QLoRA loads onto its GPU)
            self.model.to(self.device)
        self.sharded = needs_sharding(profile) and not qlora
        self.replicated_grads = qlora and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if self.sharded:
            shard_model(self.model, profile, offload_params=settings.offload_params)
        # With offload_params FSDP2 keeps parameters, gradients and so the optimizer state on the host and
        # steps there: moving the state to the GPU for the step would mix devices in AdamW.
        self.offload_optimizer = settings.offload_optimizer and profile.is_gpu and not settings.offload_params
        self.optimizer_steps = self.consecutive_skips = 0
        if not train:
            self.model.eval()
            self.model.requires_grad_(False)
            self.optimizer = self.scheduler = None
            return
        self.model.train()
        self.optimizer = torch.optim.AdamW(self._param_groups(settings.optim), lr=settings.optim.lr,
                                           betas=tuple(settings.optim.betas), weight_decay=settings.optim.weight_decay)
        warmup = max(settings.optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    def _param_groups(self, optim: OptimSettings):
        """One group; a value head gets its own LR (it starts at zero and must reach the reward scale).
        Frozen parameters (the base under LoRA) get no optimizer state."""
        if not self.value_head:
            return [p for p in self.model.parameters() if p.requires_grad]
        head = list(self.model.value_head.parameters())
        head_ids = {id(p) for p in head}
        return [{"params": [p for p in self.model.parameters() if id(p) not in head_ids], "lr": optim.lr},
                {"params": head, "lr": optim.head_lr or optim.lr}]

    # ------------------------------------------------------------------ the interface
    def forward_micro(self, micro: DataProto, response_width: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> dict[str, torch.Tensor]:
        inputs = {k: micro.batch[k].to(self.device) for k in MODEL_INPUTS}
        if self.value_head:
            return {"values": forward_response_values(self.model, **inputs, response_width=response_width)}
        topk = self.topk_request(micro)
        log_probs, entropy = forward_response_log_probs(self.model, **inputs, response_width=response_width,
                                                        temperature=temperature, with_entropy=with_entropy,
                                                        packed=self.packed, sp=self.sp,
                                                        multi_modal_inputs=micro.non_tensor_batch.get("multi_modal_inputs"),
                                                        topk=topk)
        out = {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}
        return out if topk is None else {**out, **topk.out}

    def topk_request(self, micro: DataProto) -> TopKRequest | None:
        """Distillation (settings.top_k > 0): this model's own top-k, and its log-probs at the other model's top-k
        ids when the micro-batch carries them (TOPK_ID_KEYS); None otherwise."""
        if self.settings.top_k <= 0:
            return None
        keys = set(micro.batch.keys())
        return TopKRequest(k=self.settings.top_k, gather={key: micro.batch[key] for key in TOPK_ID_KEYS if key in keys})

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_norm(self, max_norm: float) -> float:
        if self.replicated_grads:
            _average_gradients(self.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        return float(grad_norm)

    @property
    def sequence_parallel_size(self) -> int:
        return self.sp.size if self.sp is not None else 1

    def gather_sequence_parallel(self, data: DataProto) -> tuple[DataProto, slice]:
        return gather_rows(data, self.sp) if self.sp is not None else (data, slice(0, len(data)))

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors; under LoRA the merged weights W + (alpha / r) B A."""
        if self.lora is not None:
            return lora_lib.iter_merged_weights(self.model, dtype=dtype)
        return iter_full_weights(self.model, dtype=dtype)

    # ------------------------------------------------------------------ LoRA only
    def iter_adapter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter tensors (A, B) under the model's state-dict keys: adapter-only weight sync."""
        self._require_lora("iter_adapter_weights")
        return lora_lib.iter_adapter_weights(self.model, dtype=dtype)

    @contextmanager
    def adapters_disabled(self):
        """The frozen base model, for the reference log-probs under LoRA (no second model in memory)."""
        self._require_lora("adapters_disabled")
        with lora_lib.adapters_disabled(self.model):
            yield

    def _require_lora(self, what: str) -> None:
        if self.lora is None:
            raise RuntimeError(f"{self.name}: {what} needs LoRA adapters (model.lora.rank > 0)")

    def save_state(self, out_dir: str, tokenizer_source: str | None = None) -> None:
        self.reload()
        save_engine_state(self, out_dir, tokenizer_source=tokenizer_source)
        self.offload()

    def load_state(self, in_dir: str) -> dict:
        self.reload()
        info = load_engine_state(self, in_dir)
        self.offload()
        return info

    # ------------------------------------------------------------------ offload (GPU)
    def offload(self) -> None:
        if self.offload_optimizer and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))

    def reload(self) -> None:
        if self.offload_optimizer and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, self.device)


def _average_gradients(model: torch.nn.Module) -> None:
    """Replicated (unsharded) trainable parameters: grad <- sum over ranks / world size, in place."""
    world = torch.distributed.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            torch.distributed.all_reduce(param.grad)
            param.grad.div_(world)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
