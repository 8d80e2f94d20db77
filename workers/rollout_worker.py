"""The two roles of disaggregated placement (trainer.placement=disaggregated).

- `RolloutWorker`: a rollout engine (vLLM or HF) on devices of its own, one per rank of the rollout
  pool; the pool's size (rollout.world_size) need not match the trainer's. It generates exactly as
  the colocated `ActorRolloutWorker` does (the same method, the same per-step seeding) and receives
  new weights by broadcast from the trainer.
- `ActorWorker`: the trainer side, an `ActorRolloutWorker` without an engine; its rank 0 hosts the
  broadcast group (workers/weight_broadcast.py) and sends the full weights after each update.

The driver forms the group with `weight_sync_address` / `weight_spec` / `init_weight_sync` on both
sides at once (rlframe/controller/placement.py) and calls `broadcast_weights` + `receive_weights`
together after each update.
"""

from __future__ import annotations

import os
import time

import ray
import torch

from rlframe.controller import Dispatch, register
from rlframe.controller.worker_host import find_free_port
from rlframe.workers.fsdp_workers import ActorRolloutWorker, _profile, _rank, _seed_everything, _tokenizer_ids
from rlframe.workers.model import iter_full_weights
from rlframe.workers.weight_broadcast import (WeightReceiver, WeightSender, make_process_group, specs_from_wire,
                                              specs_to_wire, weight_spec)


def build_rollout_engine(cfg: dict, model_path: str, profile, rank: int):
    """The configured engine for this process (as ActorRolloutWorker builds it)."""
    rollout, data, trust = cfg["rollout"], cfg["data"], cfg["model"]["trust_remote_code"]
    eos_ids, pad_id = _tokenizer_ids(model_path, trust)
    if profile.rollout_engine == "vllm":
        from rlframe.workers.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(
            model_path, profile, max_model_len=data["max_prompt_length"] + data["max_response_length"],
            seed=cfg["trainer"]["seed"] + rank, pad_token_id=pad_id,
            gpu_memory_utilization=rollout["gpu_memory_utilization"], cpu_kv_cache_gib=rollout["cpu_kv_cache_gib"],
            enable_prefix_caching=rollout["enable_prefix_caching"], enable_chunked_prefill=rollout["enable_chunked_prefill"],
            max_num_batched_tokens=rollout["max_num_batched_tokens"],
            enable_sleep_mode=False,  # nothing else shares these devices
            enforce_eager=rollout["enforce_eager"], trust_remote_code=trust)
    from rlframe.workers.rollout.hf_rollout import HFRollout

    return HFRollout(model_path, profile, eos_token_ids=eos_ids, pad_token_id=pad_id, trust_remote_code=trust)


class RolloutWorker:
    """One rollout engine of the disaggregated rollout pool."""

    def __init__(self, cfg: dict, model_path: str):
        self.cfg = cfg
        self.profile = _profile(cfg)
        _seed_everything(cfg["trainer"]["seed"] + _rank())
        self.rollout = build_rollout_engine(cfg, model_path, self.profile, _rank())
        self.rollout_engine = self.profile.rollout_engine
        self.receiver: WeightReceiver | None = None

    # Generation is the colocated worker's own method: same sampling settings, same per-step seeds.
    generate_sequences = ActorRolloutWorker.generate_sequences

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {"rank": _rank(), "pid": os.getpid(), "engine": self.rollout_engine, "device": self.profile.device,
                "dtype": str(self.profile.dtype), "node_id": ray.get_runtime_context().get_node_id()}

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, specs: list,
                         bucket_bytes: int) -> None:
        """Join the broadcast group as rank 1 + this engine's rank."""
        group = make_process_group(host, port, 1 + _rank(), world_size, backend,
                                   timeout_s=self.cfg["trainer"]["timeouts"]["weight_sync"])
        self.receiver = WeightReceiver(group, specs_from_wire(specs), device=self.profile.device,
                                       bucket_bytes=bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict:
        start = time.perf_counter()
        # HF copies bucket by bucket; vLLM reloads (and repacks) the whole model in one call.
        stats = self.receiver.receive(self.rollout.load_weights, per_bucket=self.rollout_engine != "vllm")
        return {**stats, "seconds": time.perf_counter() - start}


class ActorWorker(ActorRolloutWorker):
    """The actor without a rollout engine; rank 0 broadcasts the weights to the rollout pool."""

    def __init__(self, cfg: dict, model_path: str):
        super().__init__(cfg, model_path, with_rollout=False)
        self.sender: WeightSender | None = None

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {**super().describe(), "node_id": ray.get_runtime_context().get_node_id()}

    @register(Dispatch.ONE_TO_ALL)
    def weight_sync_address(self) -> tuple[str, int] | None:
        """Rank 0: where the broadcast group meets (this node, a free port)."""
        return (ray.util.get_node_ip_address(), find_free_port()) if _rank() == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def weight_spec(self) -> list | None:
        """Rank 0: names, global shapes and wire dtypes of the weights, in broadcast order."""
        return specs_to_wire(weight_spec(self.actor.model.state_dict(), self.profile.dtype)) if _rank() == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, specs: list,
                         bucket_bytes: int) -> None:
        if _rank() == 0:
            group = make_process_group(host, port, 0, world_size, backend,
                                       timeout_s=self.cfg["trainer"]["timeouts"]["weight_sync"])
            self.sender = WeightSender(group, specs_from_wire(specs), device=self.profile.device,
                                       bucket_bytes=bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def broadcast_weights(self) -> dict:
        """Every rank unshards (a collective of the trainer group); rank 0 sends."""
        start = time.perf_counter()
        weights = iter_full_weights(self.actor.model, dtype=self.profile.dtype)
        if self.sender is None:
            for _ in weights:
                pass
            return {"tensors": 0, "buckets": 0, "bytes": 0}
        with torch.no_grad():
            stats = self.sender.send(weights)
        return {**stats, "seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict:
        raise RuntimeError("disaggregated placement: weights reach the engines by broadcast_weights (the driver "
                           "calls it with the rollout group's receive_weights)")
