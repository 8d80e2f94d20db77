"""The DeepSpeed ZeRO training engine (`actor.strategy=deepspeed`): the backend OpenRLHF users know.

    engine = DeepSpeedEngine(settings, profile, name="actor")   # via build_engine(...)

Same interface and the same update loop as the FSDP engine (`base.TrainingEngine`); what changes is
who shards and steps:

- ZeRO stage 2 (optimizer state and gradients partitioned over the data-parallel ranks) or 3
  (parameters too, gathered layer by layer in forward and backward). AdamW: torch's fused kernel;
  with `offload_optimizer`, ZeRO-Offload: the optimizer state and step on the CPU with
  DeepSpeedCPUAdam. `offload_params` (ZeRO-3): ZeRO-Infinity's parameters on the CPU. bf16 with fp32 master weights on GPU, fp32 on
  CPU (the device profile's dtype).
- Gradient accumulation is ours, not DeepSpeed's: `managed_gradient_accumulation=false` makes every
  `backward` only accumulate (the reduction happens in `step`), and `backward(..., scale_wrt_gas=False)`
  keeps DeepSpeed from dividing by its accumulation count. The loss arrives already normalised by the
  global mini-batch and multiplied by the world size; DeepSpeed averages over ranks, which leaves the
  gradient of the global mini-batch loss, as with FSDP (tests/test_deepspeed.py checks 1 vs 2
  micro-batches and 1 vs 2 ranks).
- DeepSpeed owns the optimizer step (`guarded_step`): it reduces the gradients, computes the global
  norm before clipping, clips to `optim.grad_clip`, and skips a step whose norm is not finite
  without stepping the LR schedule; we count the skips exactly as the base class does.
- `iter_full_weights` gathers ZeRO-3 parameters a bucket at a time (`deepspeed.gather_bucket_size`), never
  the whole model on one rank. Checkpoints use the layout of `checkpoint.py` (full fp32 master
  weights in HF names, the optimizer state keyed by parameter name, per-rank scheduler / counters /
  RNG), so `python -m rlframe.export` reads them and a run can resume on either engine.

The frozen reference policy runs through a DeepSpeed engine without an optimizer: ZeRO-3
partitioned parameters at stage 3 (inference, as OpenRLHF does), the plain module otherwise.

Its settings are the config's `deepspeed:` section (`settings.py`, which also holds its checks); the
compiled C++ ops it loads are built by `ops.py`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.distributed import barrier, rank
from rlframe.workers.engine.base import MODEL_INPUTS, TrainingEngine
from rlframe.workers.engine.checkpoint import OPTIMIZER_FILE, load_rank_state, save_rank_state
from rlframe.workers.engine.deepspeed.ops import (CPU_ADAM_OP, _import_deepspeed, build_ops,
                                                  skip_shared_memory_comm_op)
from rlframe.workers.engine.deepspeed.settings import SUPPORTED_ZERO_STAGES, DeepSpeedSettings
from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs
from rlframe.workers.engine.value_model import build_value_model, forward_response_values
from rlframe.workers.hf_folder import WEIGHTS_FILE, write_hf_folder
from rlframe.workers.settings import EngineSettings, OptimSettings

logger = logging.getLogger(__name__)

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# What torch's AdamW (the FSDP engine) and DeepSpeedCPUAdam share of a param group's settings.
ADAMW_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


# ---------------------------------------------------------------------------------------- config
def deepspeed_config(ds: DeepSpeedSettings, profile: DeviceProfile, *, train: bool, grad_clip: float = 1.0,
                     offload_params: bool = False, offload_optimizer: bool = False) -> dict:
    """The DeepSpeed config dict for one engine (pure: config translation is tested without DeepSpeed).

    Batch sizes are nominal (1 x 1 x world): the update loop, not DeepSpeed, decides what a
    micro-batch and a mini-batch are, and `managed_gradient_accumulation=false` makes `step()` the
    only accumulation boundary. A frozen model (the reference policy) runs without ZeRO below
    stage 3 (only stage 3 partitions parameters, all it has), unless its parameters go to the CPU.
    """
    if ds.zero_stage not in SUPPORTED_ZERO_STAGES:
        raise ValueError(f"deepspeed.zero_stage={ds.zero_stage} is not supported (stages "
                         f"{', '.join(map(str, SUPPORTED_ZERO_STAGES))}). Fix: deepspeed.zero_stage=2 or 3")
    if profile.dtype == torch.float16:
        raise ValueError("model.dtype=float16 is not supported by the deepspeed engine (loss scaling would skip "
                         "steps). Fix: model.dtype=bfloat16 (GPU) or float32")
    stage = ds.zero_stage if train else (3 if ds.zero_stage == 3 or offload_params else 0)
    pin = profile.is_gpu  # page-locked host memory only means something next to a GPU
    zero: dict = {"stage": stage}
    if stage >= 2:
        zero.update(overlap_comm=ds.overlap_comm, contiguous_gradients=ds.contiguous_gradients,
                    reduce_bucket_size=ds.reduce_bucket_size)
    if stage == 2:
        zero.update(allgather_bucket_size=ds.allgather_bucket_size, reduce_scatter=True)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
                    stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
                    stage3_max_live_parameters=ds.stage3_max_live_parameters,
                    stage3_max_reuse_distance=ds.stage3_max_reuse_distance, sub_group_size=ds.sub_group_size)
        if offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if train and offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    bf16 = profile.dtype == torch.bfloat16
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16, **({"check_grad_overflow": True} if bf16 else {})},
        "steps_per_print": 2**62,  # no progress lines of DeepSpeed's own
        "wall_clock_breakdown": False,
    }
    if train:
        config.update(managed_gradient_accumulation=False, gradient_clipping=grad_clip,
                      # torch AdamW without offload; DeepSpeedCPUAdam with it (what ZeRO-Offload expects)
                      zero_allow_untested_optimizer=True)
        if ds.grad_accum_dtype is not None:
            config["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    return config


# ------------------------------------------------------------------------------------ engine
class DeepSpeedEngine(TrainingEngine):
    def __init__(self, settings: EngineSettings, profile: DeviceProfile, name: str = "actor"):
        if settings.sequence_parallel_size > 1:
            raise ValueError(f"{name}: Ulysses sequence parallelism runs on the fsdp engine only. "
                             "Fix: actor.ulysses_sequence_parallel_size=1 or actor.strategy=fsdp")
        self.settings, self.profile, self.name = settings, profile, name
        self.ds_settings = settings.section or DeepSpeedSettings()  # the config's deepspeed section
        self.device = torch.device(profile.device)
        train = settings.optim is not None
        ds_config = deepspeed_config(self.ds_settings, profile, train=train,
                                     grad_clip=settings.optim.grad_clip if train else 0.0,
                                     offload_params=settings.offload_params,
                                     offload_optimizer=settings.offload_optimizer)
        deepspeed = _import_deepspeed(profile)
        if train and settings.offload_optimizer:
            build_ops([CPU_ADAM_OP])
        skip_shared_memory_comm_op()
        _init_distributed(deepspeed)

        self.value_head = settings.head == "value"
        from rlframe.workers.engine.fsdp.engine import use_remove_padding

        self.packed = not self.value_head and use_remove_padding(settings.use_remove_padding, profile)
        checkpointing = settings.gradient_checkpointing and train
        with _zero3_construction(ds_config):  # ZeRO-3: each rank loads only its partition
            if self.value_head:
                model = build_value_model(settings.model_path, profile, trust_remote_code=settings.trust_remote_code,
                                          gradient_checkpointing=checkpointing)
            else:
                model = build_causal_lm(settings.model_path, profile, dtype=torch.float32, packed=self.packed,
                                        gradient_checkpointing=checkpointing,
                                        trust_remote_code=settings.trust_remote_code)
        self.sharded = True  # (describe(): DeepSpeed always wraps the model)
        self.optimizer_steps = self.consecutive_skips = 0
        # DeepSpeed binds the GPU numbered LOCAL_RANK unless told; the worker host already bound ours
        # (Ray may show this process only its own GPU, as device 0).
        where = SimpleNamespace(device_rank=torch.cuda.current_device()) if profile.is_gpu else None
        if not train:
            model.eval()
            model.requires_grad_(False)
            self.ds, *_ = deepspeed.initialize(args=where, model=model, config=ds_config)
            self.optimizer = self.scheduler = None
        else:
            model.train()
            client_optimizer = self._build_optimizer(model, settings.optim, settings.offload_optimizer)
            warmup = max(settings.optim.warmup_steps, 0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                client_optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                args=where, model=model, optimizer=client_optimizer, lr_scheduler=scheduler, config=ds_config)
        self.model = self.ds.module
        self.call_model = _through_engine(self.ds)

    def _build_optimizer(self, model: torch.nn.Module, optim: OptimSettings, offload: bool) -> torch.optim.Optimizer:
        """AdamW: DeepSpeed's vectorised CPU Adam (AdamW mode) for ZeRO-Offload, which expects it; else
        torch's fused kernel (examples/benchmark/cpu_adam.py: on CPU tensors both step ~5x faster than
        torch's default per-tensor loop, e.g. 115 vs 630 ms for SmolLM2-135M's 135M parameters)."""
        groups = self._param_groups(model, optim)
        kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "weight_decay": optim.weight_decay}
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        return torch.optim.AdamW(groups, fused=True, **kwargs)

    def _param_groups(self, model: torch.nn.Module, optim: OptimSettings) -> list[dict]:
        """One group; a value head gets its own LR (it starts at zero and must reach the reward scale)."""
        if not self.value_head:
            return [{"params": [p for p in model.parameters() if p.requires_grad]}]
        head_ids = {id(p) for p in model.value_head.parameters()}
        return [{"params": [p for p in model.parameters() if id(p) not in head_ids], "lr": optim.lr},
                {"params": list(model.value_head.parameters()), "lr": optim.head_lr or optim.lr}]

    # ------------------------------------------------------------------ the interface
    def forward_micro(self, micro: DataProto, response_width: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> dict[str, torch.Tensor]:
        inputs = {k: micro.batch[k].to(self.device) for k in MODEL_INPUTS}
        if self.value_head:
            return {"values": forward_response_values(self.call_model, **inputs, response_width=response_width)}
        log_probs, entropy = forward_response_log_probs(self.call_model, **inputs, response_width=response_width,
                                                        temperature=temperature, with_entropy=with_entropy,
                                                        packed=self.packed)
        return {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs, "entropy": entropy}

    def backward(self, loss: torch.Tensor) -> None:
        # Our loss is already this rank's share of the global mini-batch loss (x world size).
        self.ds.backward(loss, scale_wrt_gas=False)

    def clip_norm(self, max_norm: float) -> float:
        raise NotImplementedError("DeepSpeed clips inside its own step: DeepSpeedEngine.guarded_step")

    def guarded_step(self, first_bad: str | None = None) -> float:
        """DeepSpeed's step: reduce, global norm (before clipping), clip, and skip a non-finite update
        (no LR step either); the skip is counted as in the base class (stop after N in a row)."""
        self.ds.step()
        grad_norm = self.ds.get_global_grad_norm()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        if not self.ds.was_step_applied():
            self.count_skipped_step(grad_norm, first_bad)
            return grad_norm
        self.consecutive_skips = 0
        self.optimizer_steps += 1
        return grad_norm

    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in `state_dict` order; ZeRO-3 gathers a bucket of parameters at a time."""
        for name, tensor in self._iter_gathered(master=False):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, tensor

    # ------------------------------------------------------------------ checkpoints (checkpoint.py's layout)
    def save_state(self, out_dir: str, tokenizer_source: str | None = None) -> None:
        """Full fp32 master weights + optimizer state by parameter name (rank 0 writes) and each rank's own file."""
        out, me = Path(out_dir), rank()
        weights: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        step = torch.tensor(float(self._adam_step()))
        param_names = {id(p): n for n, p in self.model.named_parameters()}
        for name, tensor, param in self._iter_gathered(master=True, with_params=True):
            weights[name] = tensor
            if param is not None and param_names.get(id(param)) == name:
                moments = {key: _full_optimizer_state(param, key) for key in ADAM_STATE_KEYS}
                if me == 0:
                    state[name] = {"step": step.clone(), **{k: v.cpu() for k, v in moments.items()}}
        if me == 0:
            # DeepSpeed's groups hold flat partitions; the names come from the groups we built it with.
            groups = []
            for group, ours in zip(self.optimizer.param_groups, self._param_groups(self.model, self.settings.optim)):
                ids = {id(p) for p in ours["params"]}
                groups.append({**{k: group[k] for k in ADAMW_GROUP_KEYS if k in group},
                               "params": [n for n, p in self.model.named_parameters() if id(p) in ids]})
            write_hf_folder(out, weights, self.model.config, tokenizer_source)
            torch.save({"state": state, "param_groups": groups}, out / OPTIMIZER_FILE)
        barrier()
        save_rank_state(self, out)

    def load_state(self, in_dir: str) -> dict:
        """Restore `save_state`'s (or the FSDP engine's) checkpoint; every rank calls."""
        from safetensors.torch import load_file

        src = Path(in_dir)
        weights = load_file(str(src / WEIGHTS_FILE))
        optim_state = torch.load(src / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
        named = dict(self.model.named_parameters())
        for bucket in _buckets(list(named.items()), self.ds_settings.gather_bucket_size):
            self._set_weights(bucket, weights)
        for name, param in named.items():
            for key in ADAM_STATE_KEYS:
                _set_full_optimizer_state(param, optim_state["state"][name][key], key)
        for name, buffer in self.model.named_buffers():
            if name in weights:
                buffer.copy_(weights[name])
        steps = {float(s["step"]) for s in optim_state["state"].values()}
        self._set_adam_step(int(max(steps)) if steps else 0)
        for group, saved in zip(self.optimizer.param_groups, optim_state["param_groups"]):
            group["lr"] = saved["lr"]
        return load_rank_state(self, src)

    # ------------------------------------------------------------------ helpers
    def _iter_gathered(self, master: bool, with_params: bool = False):
        """(name, full tensor[, param]) for every state-dict entry, gathering ZeRO-3 partitions in buckets.

        master=True: the fp32 master copy held by the optimizer (checkpoints); else the module's
        weights (bf16 on GPU). Tied weights appear under each of their names, as in `state_dict`.
        """
        entries = list(self.model.state_dict(keep_vars=True).items())
        for bucket in _buckets(entries, self.ds_settings.gather_bucket_size):
            params = list({id(t): t for _, t in bucket if _is_zero3(t)}.values())  # (tied weights: once)
            with _gathered(params):
                for name, tensor in bucket:
                    is_param = isinstance(tensor, torch.nn.Parameter)
                    if master and is_param and self.optimizer is not None and tensor.requires_grad:
                        full = _full_fp32_param(tensor)
                    elif _is_zero3(tensor):  # (a copy: the gathered storage is freed after the bucket)
                        full = tensor.detach().clone()
                    else:
                        full = tensor.detach()
                    yield (name, full, tensor if is_param else None) if with_params else (name, full)

    def _set_weights(self, bucket: list[tuple[str, torch.nn.Parameter]], weights: dict[str, torch.Tensor]) -> None:
        """Set the module's weights (all ranks; ZeRO-3 re-partitions from rank 0) and the fp32 master copies."""
        from deepspeed.utils import safe_set_full_fp32_param

        params = [p for _, p in bucket if _is_zero3(p)]
        with _gathered(params, modifier_rank=0):
            for name, param in bucket:
                param.data.copy_(weights[name].to(param.device).view_as(param.data))
        for name, param in bucket:
            safe_set_full_fp32_param(param, weights[name].to(torch.float32))

    def _inner_states(self) -> list[dict]:
        """The per-tensor states of the optimizer DeepSpeed steps (on its flat fp32 partitions)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return [s for s in inner.state.values() if "step" in s]

    def _adam_step(self) -> int:
        states = self._inner_states()
        return int(max(float(s["step"]) for s in states)) if states else 0

    def _set_adam_step(self, step: int) -> None:
        for state in self._inner_states():
            state["step"] = (torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else step)


# ------------------------------------------------------------------------------ small helpers
def _init_distributed(deepspeed) -> None:
    """DeepSpeed's communication layer over our process group (a one-rank gloo group for a plain object)."""
    if not dist.is_initialized():
        from rlframe.controller.worker_host import find_free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it to pick the device
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)


@contextmanager
def _zero3_construction(ds_config: dict):
    """Stage 3: transformers builds the model inside deepspeed.zero.Init, each rank loading only its
    partition (the config must stay referenced while it does); a no-op below stage 3."""
    if ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        del keep_alive  # later from_pretrained calls in this process (the rollout engine) load normally


def _through_engine(ds_engine):
    """Call the model through the DeepSpeed engine (its forward hooks prepare the backward) while
    showing the model's own signature (hf_model looks for `logits_to_keep` in it)."""

    @functools.wraps(ds_engine.module.forward)
    def forward(*args, **kwargs):
        return ds_engine(*args, **kwargs)

    class _Call:
        def __call__(self, *args, **kwargs):
            return ds_engine(*args, **kwargs)

    call = _Call()
    call.forward = forward
    call.config = ds_engine.module.config  # hf_model reads the model's config (e.g. is it vision-language)
    return call


def _is_zero3(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


@contextmanager
def _gathered(params: list, modifier_rank: int | None = None):
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


def _numel(tensor: torch.Tensor) -> int:
    return tensor.ds_numel if _is_zero3(tensor) else tensor.numel()


def _buckets(entries: list[tuple[str, torch.Tensor]], max_numel: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive entries of at most `max_numel` elements in all (a larger tensor alone)."""
    buckets: list[list] = [[]]
    size = 0
    for name, tensor in entries:
        if buckets[-1] and size + _numel(tensor) > max_numel:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += _numel(tensor)
    return [b for b in buckets if b]


def _full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    return full.detach().cpu().view(param.ds_shape if _is_zero3(param) else param.shape)


def _full_optimizer_state(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """(ZeRO-3 hands it back flat.)"""
    from deepspeed.utils import safe_get_full_optimizer_state

    full = safe_get_full_optimizer_state(param, key)
    return full.detach().cpu().view(param.ds_shape if _is_zero3(param) else param.shape)


def _set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(param, value.to(torch.float32), key)
