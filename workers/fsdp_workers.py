"""Role classes that run inside Ray actors (or as plain objects, without Ray).

- `ActorRolloutWorker`: the policy under training (FSDP) and its rollout engine (vLLM or HF) in
  one process, the hybrid engine. After each update the trainer's weights stream into the engine.
- `RefWorker`: the frozen reference policy for the KL term.

Each public method is declared with its dispatch mode; the driver calls the group as one object.
They receive the resolved config as a plain dict (`cfg`), never the trainer.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from rlframe.algos.plugins import register_configured_plugins
from rlframe.controller import Dispatch, register
from rlframe.device import detect_profile
from rlframe.protocol import DataProto
from rlframe.workers.actor import PolicyModel, UpdateSettings
from rlframe.workers.checkpointing import load_policy, save_policy
from rlframe.workers.faults import install_stack_dump_handler, maybe_inject_fault
from rlframe.workers.model import iter_full_weights
from rlframe.workers.rollout.base import SamplingSettings


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _profile(cfg: dict):
    return detect_profile(cfg["trainer"]["device"], cfg["model"]["dtype"], cfg["model"]["attn_implementation"],
                          cfg["rollout"]["engine"])


def _use_remove_padding(cfg: dict, profile) -> bool:
    setting = str(cfg["actor"]["use_remove_padding"]).lower()
    return profile.attn_implementation != "eager" if setting == "auto" else setting == "true"


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _tokenizer_ids(model_path: str, trust_remote_code: bool) -> tuple[list[int], int]:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    eos = {tokenizer.eos_token_id}
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    except OSError:
        pass
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return sorted(e for e in eos if e is not None), pad


class ActorRolloutWorker:
    """The actor (training) and the rollout engine, sharing one process and its devices."""

    def __init__(self, cfg: dict, model_path: str, with_rollout: bool = True):
        self.cfg = cfg
        self.model_path = model_path
        self.profile = _profile(cfg)
        actor, algo, rollout, data = cfg["actor"], cfg["algorithm"], cfg["rollout"], cfg["data"]
        world = _world_size()
        _seed_everything(cfg["trainer"]["seed"] + _rank())
        install_stack_dump_handler()  # SIGUSR1 -> stacks, for the driver's deadline reports
        self.settings = UpdateSettings(
            lr=actor["optim"]["lr"], weight_decay=actor["optim"]["weight_decay"], betas=tuple(actor["optim"]["betas"]),
            warmup_steps=actor["optim"]["warmup_steps"], grad_clip=actor["optim"]["grad_clip"],
            mini_batch_size=actor["ppo_mini_batch_size"] * rollout["n"] // world,
            micro_batch_size=actor["ppo_micro_batch_size_per_device"], epochs=actor["ppo_epochs"],
            shuffle=actor["shuffle"], policy_loss=actor["policy_loss"], clip_ratio_low=actor["clip_ratio_low"],
            clip_ratio_high=actor["clip_ratio_high"], clip_ratio_c=actor["clip_ratio_c"],
            loss_agg_mode=actor["loss_agg_mode"], entropy_coeff=actor["entropy_coeff"],
            use_kl_loss=algo["use_kl_loss"], kl_loss_coef=algo["kl_loss_coef"], kl_loss_type=algo["kl_loss_type"],
            max_consecutive_skips=cfg["trainer"].get("max_consecutive_skipped_updates", 3),
            max_tokens_per_micro_batch=actor["ppo_max_token_len_per_device"])
        trust = cfg["model"]["trust_remote_code"]
        register_configured_plugins(algo)  # a user's policy loss file (algorithm.custom_policy_loss)
        self.actor = PolicyModel(model_path, self.profile, train=self.settings,
                                 gradient_checkpointing=cfg["model"]["gradient_checkpointing"],
                                 offload_params=actor["offload_params"], offload_optimizer=actor["offload_optimizer"],
                                 trust_remote_code=trust, packed=_use_remove_padding(cfg, self.profile),
                                 sequence_parallel_size=actor["ulysses_sequence_parallel_size"])
        if not with_rollout:  # disaggregated placement: the engines live in their own worker group
            self.rollout, self.rollout_engine = None, "none"
            return
        eos_ids, pad_id = _tokenizer_ids(model_path, trust)
        max_len = data["max_prompt_length"] + data["max_response_length"]
        if self.profile.rollout_engine == "vllm":
            from rlframe.workers.rollout.vllm_rollout import VLLMRollout

            self.rollout = VLLMRollout(
                model_path, self.profile, max_model_len=max_len, seed=cfg["trainer"]["seed"] + _rank(),
                pad_token_id=pad_id, gpu_memory_utilization=rollout["gpu_memory_utilization"],
                cpu_kv_cache_gib=rollout["cpu_kv_cache_gib"], enable_prefix_caching=rollout["enable_prefix_caching"],
                enable_chunked_prefill=rollout["enable_chunked_prefill"],
                max_num_batched_tokens=rollout["max_num_batched_tokens"], enable_sleep_mode=rollout["enable_sleep_mode"],
                enforce_eager=rollout["enforce_eager"], trust_remote_code=trust)
        else:
            from rlframe.workers.rollout.hf_rollout import HFRollout

            self.rollout = HFRollout(model_path, self.profile, eos_token_ids=eos_ids, pad_token_id=pad_id,
                                     trust_remote_code=trust)
        self.rollout_engine = self.profile.rollout_engine

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {"rank": _rank(), "pid": os.getpid(), "engine": self.rollout_engine, "device": self.profile.device,
                "dtype": str(self.profile.dtype), "sharded": self.actor.sharded}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = prompts.meta_info
        rollout = self.cfg["rollout"]
        validate = meta.get("validate", False)
        greedy = meta.get("greedy", False)  # one greedy sample per prompt (ReMax's baseline)
        temperature = 0.0 if greedy else rollout["val_temperature"] if validate else rollout["temperature"]
        plain = validate or greedy
        sampling = SamplingSettings(
            max_new_tokens=self.cfg["data"]["max_response_length"], temperature=temperature,
            top_p=1.0 if plain else rollout["top_p"], top_k=-1 if plain else rollout["top_k"])
        if not plain and "step" in meta:  # the same samples for a step and DP rank, whatever the placement
            torch.manual_seed(self.cfg["trainer"]["seed"] * 1_000_003 + int(meta["step"]) * 1_009 + _rank())
        start = time.perf_counter()
        out = self.rollout.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        out.meta_info["timing/generate_rank0"] = elapsed
        out.meta_info["perf/generated_tokens"] = float(out.batch["response_mask"].sum())
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        log_probs, entropy = self.actor.compute_log_prob(
            data, self.cfg["actor"]["log_prob_micro_batch_size_per_device"],
            temperature=self.cfg["rollout"]["temperature"], with_entropy=True,
            max_tokens=self.cfg["actor"]["log_prob_max_token_len_per_device"])
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropy": entropy})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update on this rank's share; returns the (globally reduced) metrics in meta_info."""
        maybe_inject_fault("update_actor", int(data.meta_info.get("step", 0)), _rank())
        self.rollout_sleep()
        self.actor.load_optimizer_state()
        metrics = self.actor.update(data, temperature=self.cfg["rollout"]["temperature"],
                                    seed=self.cfg["trainer"]["seed"] + int(data.meta_info.get("step", 0)))
        self.actor.offload_optimizer_state()
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict:
        """Stream the trainer's weights into the rollout engine (no disk); returns the seconds taken."""
        start = time.perf_counter()
        n = self.rollout.load_weights(iter_full_weights(self.actor.model, dtype=self.profile.dtype))
        return {"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/tensors": n}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> dict:
        """Weights, optimizer, scheduler, counters and RNG states into `out_dir` (a collective)."""
        start = time.perf_counter()
        self.actor.load_optimizer_state()
        save_policy(self.actor, out_dir, model_path=self.model_path)
        self.actor.offload_optimizer_state()
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, in_dir: str) -> dict:
        """Restore `save_checkpoint`'s state, then stream the weights into the rollout engine."""
        start = time.perf_counter()
        self.actor.load_optimizer_state()
        info = load_policy(self.actor, in_dir)
        self.actor.offload_optimizer_state()
        if self.rollout is not None:  # (disaggregated: the driver broadcasts to the engines afterwards)
            self.rollout.load_weights(iter_full_weights(self.actor.model, dtype=self.profile.dtype))
        return {**info, "seconds": time.perf_counter() - start}

    def rollout_sleep(self) -> None:
        sleep = getattr(self.rollout, "sleep", None)
        if sleep is not None:
            sleep()

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> str:
        """Write the actor as an HF model folder (safetensors + config + tokenizer).

        Every rank takes part in gathering the shards; rank 0 writes.
        """
        return self._save_hf(out_dir)

    def _save_hf(self, out_dir: str) -> str:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        state = dict(iter_full_weights(self.actor.model))
        if _rank() == 0:
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(self.actor.model.config)
            plain.load_state_dict({k: v.cpu() for k, v in state.items()}, strict=False, assign=True)
            plain.tie_weights()  # assign=True unties shared tensors (embeddings / lm_head)
            plain.save_pretrained(out_dir, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)
        if dist.is_initialized():
            dist.barrier()
        return out_dir


class RefWorker:
    """The frozen reference policy: log-probs for the KL term."""

    def __init__(self, cfg: dict, model_path: str):
        self.cfg = cfg
        self.profile = _profile(cfg)
        self.ref = PolicyModel(model_path, self.profile, train=None, trust_remote_code=cfg["model"]["trust_remote_code"],
                               packed=_use_remove_padding(cfg, self.profile),
                               sequence_parallel_size=cfg["actor"]["ulysses_sequence_parallel_size"])

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        log_probs, _ = self.ref.compute_log_prob(data, self.cfg["actor"]["log_prob_micro_batch_size_per_device"],
                                                 temperature=self.cfg["rollout"]["temperature"],
                                                 max_tokens=self.cfg["actor"]["log_prob_max_token_len_per_device"])
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})
