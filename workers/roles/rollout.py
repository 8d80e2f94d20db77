"""The standalone rollout role of disaggregated placement (trainer.placement=disaggregated).

`RolloutWorker`: a rollout engine (vLLM or HF) on devices of its own, one per rank of the rollout
pool; the pool's size (rollout.world_size) need not match the trainer's. It generates exactly as
the colocated actor does and receives new weights by broadcast from the actor's rank 0
(`ActorWorker` in workers/roles/actor_rollout.py): the driver forms the group with
`weight_sync_address` / `weight_spec` / `init_weight_sync` on both sides at once and calls
`broadcast_weights` + `receive_weights` together after each update.
"""

from __future__ import annotations

import os
import time

import numpy as np
import ray

from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.distributed import rank as _rank, seed_everything
from rlframe.workers.rollout.base import generate_sequences
from rlframe.workers.rollout.factory import build_rollout_engine, tensor_parallel_group
from rlframe.workers.settings import RolloutSettings
from rlframe.workers.weight_broadcast import WeightReceiver, make_process_group, specs_from_wire


class RolloutWorker:
    """One rollout engine of the disaggregated rollout pool."""

    def __init__(self, settings: RolloutSettings, weight_sync_timeout_s: float = 600.0, shares_devices: bool = False):
        """`shares_devices`: the engine shares its devices with other roles (an LLM judge's engine beside the
        trainer), so it may sleep between uses (`sleep`); an engine of the disaggregated pool never sleeps."""
        self.settings = settings
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.profile = settings.device.profile()
        seed_everything(settings.seed + _rank())
        self.tp = tensor_parallel_group(settings)  # ranks sharing one engine (rollout.tensor_parallel_size)
        start = time.perf_counter()
        self.rollout = build_rollout_engine(settings, self.profile, _rank(), shares_devices=shares_devices)
        self.startup_times = {"engine_init": time.perf_counter() - start}  # the start-up profile (WorkerHost.init_roles)
        self.rollout_engine = self.profile.rollout_engine
        self.receiver: WeightReceiver | None = None
        self.policy_version = 0  # the actor updates behind the weights held (0: the initial model)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """As the colocated actor generates: same sampling settings, same per-step seeds. Each sample
        records `policy_version`, the version of the weights that generated it."""
        def generate(batch: DataProto) -> DataProto:
            return generate_sequences(self.rollout, self.settings, batch, _rank())

        out = generate(prompts) if self.tp is None else self.tp.generate(prompts, generate)
        out.non_tensor_batch["policy_version"] = np.full(len(out), self.policy_version, dtype=np.int64)
        return out

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {"rank": _rank(), "pid": os.getpid(), "engine": self.rollout_engine, "device": self.profile.device,
                "dtype": str(self.profile.dtype), "node_id": ray.get_runtime_context().get_node_id()}

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self) -> dict:
        """Release the engine's memory until its next generation, keeping its weights (an engine used now and then,
        e.g. an LLM judge's between steps): the KV cache (on GPU, vLLM's level-1 sleep also moves the weights to host
        memory); the next generate_sequences wakes it. An engine without sleep (HF generate) stays as it is."""
        if hasattr(self.rollout, "sleep"):
            self.rollout.sleep(discard_weights=False)
        return {"asleep": sorted(getattr(self.rollout, "asleep_tags", ()))}

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, specs: list,
                         bucket_bytes: int) -> None:
        """Join the broadcast group as rank 1 + this engine's rank."""
        group = make_process_group(host, port, 1 + _rank(), world_size, backend,
                                   timeout_s=self.weight_sync_timeout_s)
        self.receiver = WeightReceiver(group, specs_from_wire(specs), device=self.profile.device,
                                       bucket_bytes=bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def load_staged_weights(self, staged: list, policy_version: int) -> dict:
        """Load the weights the actor staged in the object store (`staged`: [ref]), queued behind the generations
        sent before it: the samples generated after it record `policy_version`."""
        start = time.perf_counter()
        loaded = self.rollout.load_weights(iter(ray.get(staged[0])))
        self.policy_version = int(policy_version)
        return {"loaded": loaded, "seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, policy_version: int | None = None) -> dict:
        """Load the broadcast weights; `policy_version`: theirs (the actor updates behind them), when known."""
        start = time.perf_counter()
        # HF copies bucket by bucket; vLLM reloads (and repacks) the whole model in one call.
        stats = self.receiver.receive(self.rollout.load_weights, per_bucket=self.rollout_engine != "vllm")
        if policy_version is not None:
            self.policy_version = int(policy_version)
        return {**stats, "seconds": time.perf_counter() - start}
