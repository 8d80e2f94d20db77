"""The actor role: the policy under training and (colocated, the hybrid engine) its rollout engine.

- `ActorRolloutWorker`: trainer engine + rollout engine in one process, sharing its devices. After
  each update the trainer's weights stream into the engine (no disk).
- `ActorWorker`: the actor without an engine (disaggregated placement); its rank 0 hosts the
  broadcast group (workers/weight_broadcast.py) and sends the full weights to the rollout pool
  (`workers/roles/rollout.py`) after each update.

Under LoRA (`model.lora.rank > 0`) the actor is also the reference policy: `compute_ref_log_prob`
runs its own model with the adapters disabled, and no ref role is started. Weight sync then streams
the merged weights (base names, any engine), or with `model.lora.weight_sync=adapter` only the
adapter tensors into an engine that applies the adapters itself.

Each public method is declared with its dispatch mode; the driver calls the group as one object.
"""

from __future__ import annotations

import os
import time

import ray
import torch

from rlframe.algos.plugins import register_from_config
from rlframe.controller import Dispatch, register
from rlframe.controller.worker_host import find_free_port
from rlframe.protocol import DataProto
from rlframe.workers.distributed import all_reduce_sum, rank, seed_everything
from rlframe.workers.engine import build_engine
from rlframe.workers.engine.lora import merged_weight_view, plain_config
from rlframe.workers.faults import install_stack_dump_handler, maybe_inject_fault
from rlframe.workers.hf_folder import write_hf_folder
from rlframe.workers.objectives import PolicyObjective
from rlframe.workers.rollout.base import generate_sequences
from rlframe.workers.rollout.factory import build_rollout_engine, tensor_parallel_group
from rlframe.workers.settings import ActorSettings
from rlframe.workers.weight_broadcast import (WeightSender, checksums_of, compare_checksums, make_process_group,
                                             specs_from_wire, specs_to_wire, tensor_checksum, weight_spec)

SKIP_LOAD_ENV = "RLFRAME_DEBUG_SKIP_WEIGHT_LOAD"  # "1": syncs stream past the engine (a skipped sync, made on purpose)


class ActorRolloutWorker:
    """The actor (training) and the rollout engine, sharing one process and its devices."""

    synced_checksums: tuple[dict | None, dict | None] = (None, None)  # (trainer, engine) after the last checked sync
    streamed_shapes: dict = {}  # name -> shape of what the last sync streamed

    def __init__(self, settings: ActorSettings):
        self.settings = settings
        seed_everything(settings.seed + rank())
        install_stack_dump_handler()  # SIGUSR1 -> stacks, for the driver's deadline reports
        self.profile = settings.engine.device.profile()
        loss = settings.loss
        if loss.custom_loss_path:  # a user's policy loss file (algorithm.custom_policy_loss)
            register_from_config("policy_loss", loss.custom_loss_path, loss.custom_loss_name)
        start = time.perf_counter()
        self.engine = build_engine(settings.engine, self.profile, name="actor")
        self.startup_times = {"model_load": time.perf_counter() - start}  # the start-up profile (WorkerHost.init_roles)
        self.tp = None if settings.rollout is None else tensor_parallel_group(settings.rollout)
        if settings.rollout is not None:
            start = time.perf_counter()
            self.rollout = build_rollout_engine(settings.rollout, self.profile, rank(), shares_devices=True)
            self.startup_times["engine_init"] = time.perf_counter() - start
        else:
            self.rollout = None

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {"rank": rank(), "pid": os.getpid(), "engine": self.profile.rollout_engine if self.rollout else "none",
                "device": self.profile.device, "dtype": str(self.profile.dtype),
                "strategy": self.settings.engine.strategy, "sharded": self.engine.sharded,
                "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        def generate(batch: DataProto) -> DataProto:
            return generate_sequences(self.rollout, self.settings.rollout, batch, rank())

        out = generate(prompts) if self.tp is None else self.tp.generate(prompts, generate)
        # The driver says when the next use of the engine is a weight load (an update follows this
        # generation): then the engine may drop its weights instead of copying them to host memory.
        self.rollout_sleep(discard_weights=bool(prompts.meta_info.get("update_follows", False)))  # the KV cache is not needed again until the next generation
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.forward(data, self.settings.log_prob, with_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_student_topk(self, data: DataProto) -> DataProto:
        """Distillation over the student's top-k (reverse_kl_student_topk): the ids of its top-k per response
        position, [B, R, K] (the teacher then scores them; engine top_k > 0)."""
        out = self.engine.forward(data, self.settings.log_prob)
        return DataProto.from_dict(tensors={"student_topk_ids": out["topk_ids"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """LoRA only: the reference policy is the frozen base, i.e. this model with its adapters disabled."""
        with self.engine.adapters_disabled():
            out = self.engine.forward(data, self.settings.log_prob)
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update on this rank's share; returns the (globally reduced) metrics in meta_info."""
        step = int(data.meta_info.get("step", 0))
        maybe_inject_fault("update_actor", step, rank())
        loop, loss = self.settings.loop, self.settings.loss
        # On-policy shortcut: with one epoch and one mini-batch, every forward runs before the only
        # optimiser step, so the current log-probs ARE the old log-probs (no extra pass needed).
        on_policy = "old_log_probs" not in data.batch.keys()
        if on_policy and (loop.epochs != 1 or loop.mini_batch_size < len(data)):
            raise ValueError(
                "update without old_log_probs is only exact for one epoch and one mini-batch (epochs="
                f"{loop.epochs}, mini-batch {loop.mini_batch_size * self.engine.sequence_parallel_size} < batch "
                f"{len(data) * self.engine.sequence_parallel_size}). "
                "Fix: compute old log-probs first (actor.skip_old_log_prob_when_on_policy=false).")
        self.rollout_sleep()
        objective = PolicyObjective(loss, on_policy)
        self.engine.reload()
        metrics = self.engine.train_step(data, loop, objective, seed=self.settings.seed + step,
                                         temperature=self.settings.log_prob.temperature,
                                         with_entropy=loss.entropy_coeff != 0)
        self.engine.offload()
        if on_policy and objective.drift_tokens:
            metrics["rollout/logprob_abs_diff"] = (all_reduce_sum(objective.drift_sum)
                                                   / max(all_reduce_sum(objective.drift_tokens), 1.0))
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self, checksum: bool = False) -> dict:
        """Stream the trainer's weights into the rollout engine (no disk); returns the seconds taken. With
        `checksum`, also what the sync did to the engine (`weight_sync/check`: workers/weight_broadcast.py's
        compare_checksums of the trainer's streamed weights and the engine's after the load, and its seconds)."""
        start = time.perf_counter()
        previous_engine = self.synced_checksums[1] if checksum else None
        if checksum and previous_engine is None and not getattr(self.rollout, "weights_discarded", False):
            previous_engine = self.rollout.weight_checksums(self._weight_shapes())  # the first sync: from the folder
        n, nbytes, trainer_sums = self._load_into_rollout(checksum)
        out = {"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/tensors": n, "weight_sync/bytes": nbytes}
        if checksum:
            check_start = time.perf_counter()
            engine_sums = self.rollout.weight_checksums(self.streamed_shapes)
            report = compare_checksums(trainer_sums, engine_sums, self.synced_checksums[0], previous_engine)
            self.synced_checksums = (trainer_sums, engine_sums)
            out["weight_sync/check"] = {**report, "seconds": time.perf_counter() - check_start}
        return out

    def _weights_to_sync(self):
        """Full (or, under LoRA, merged) weights; or the adapter tensors alone when the engine applies the
        adapters itself (model.lora.weight_sync=adapter). Returns (the iterator, the engine's load method)."""
        if self.settings.rollout.lora is not None:
            return self.engine.iter_adapter_weights(dtype=self.profile.dtype), self.rollout.load_adapter
        return self.engine.iter_full_weights(dtype=self.profile.dtype), self.rollout.load_weights

    def _load_into_rollout(self, checksum: bool = False) -> tuple[int, int, dict]:
        """Stream `_weights_to_sync` into the engine. Returns (tensors, bytes streamed, and with `checksum` each
        streamed tensor's sampled checksum). RLFRAME_DEBUG_SKIP_WEIGHT_LOAD=1 (tests, `python -m rlframe.doctor`'s
        own checks) streams them past the engine instead: it keeps the weights (or adapter) it had."""
        counter = _ByteCounter(checksum)
        weights, load = self._weights_to_sync()
        if os.environ.get(SKIP_LOAD_ENV) == "1":
            n = sum(1 for _ in counter.count(weights))
        else:
            n = load(counter.count(weights), checksum=checksum)
        self.streamed_shapes = counter.shapes
        return n, counter.bytes, counter.checksums

    def _weight_shapes(self) -> dict:
        """name -> shape of what a sync streams (no gather: global shapes)."""
        if self.settings.rollout.lora is not None:
            return {key: tuple(t.shape) for key, t in self.engine.model.state_dict().items() if "lora_" in key}
        return {name: tuple(t.shape) for name, t in merged_weight_view(self.engine.model).items()}

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> dict:
        """{"trainer": the sampled checksums of what a sync would stream now, "engine": of what the engine holds}
        (`python -m rlframe.doctor`; every rank iterates the trainer's full weights: a collective)."""
        trainer = checksums_of(self._weights_to_sync()[0])
        return {"trainer": trainer, "engine": self.rollout.weight_checksums(self._weight_shapes())}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> dict:
        """Weights, optimizer, scheduler, counters and RNG states into `out_dir` (a collective)."""
        start = time.perf_counter()
        self.engine.save_state(out_dir, tokenizer_source=self.settings.engine.model_path)
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, in_dir: str) -> dict:
        """Restore `save_checkpoint`'s state, then stream the weights into the rollout engine."""
        start = time.perf_counter()
        info = self.engine.load_state(in_dir)
        if self.rollout is not None:  # (disaggregated: the driver broadcasts to the engines afterwards)
            _, _, trainer_sums = self._load_into_rollout(checksum=True)  # the next sync compares with these
            self.synced_checksums = (trainer_sums, self.rollout.weight_checksums(self.streamed_shapes))
        return {**info, "seconds": time.perf_counter() - start}

    def rollout_sleep(self, discard_weights: bool = False) -> None:
        sleep = getattr(self.rollout, "sleep", None)
        if sleep is not None:
            sleep(discard_weights=discard_weights)

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> str:
        """Write the actor as an HF model folder (every rank gathers its shards; rank 0 writes)."""
        state = dict(self.engine.iter_full_weights())
        if rank() == 0:
            write_hf_folder(out_dir, state, plain_config(self.engine.model.config), self.settings.engine.model_path)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out_dir


class ActorWorker(ActorRolloutWorker):
    """The actor without a rollout engine; rank 0 broadcasts the weights to the rollout pool."""

    def __init__(self, settings: ActorSettings):
        super().__init__(settings)
        self.sender: WeightSender | None = None

    @register(Dispatch.ONE_TO_ALL)
    def weight_sync_address(self) -> tuple[str, int] | None:
        """Rank 0: where the broadcast group meets (this node, a free port)."""
        return (ray.util.get_node_ip_address(), find_free_port()) if rank() == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def weight_spec(self) -> list | None:
        """Rank 0: names, global shapes and wire dtypes of the weights, in broadcast order."""
        view = merged_weight_view(self.engine.model)  # under LoRA: the merged weights' base names
        return specs_to_wire(weight_spec(view, self.profile.dtype)) if rank() == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, specs: list,
                         bucket_bytes: int) -> None:
        if rank() == 0:
            group = make_process_group(host, port, 0, world_size, backend, timeout_s=self.settings.weight_sync_timeout_s)
            self.sender = WeightSender(group, specs_from_wire(specs), device=self.profile.device,
                                       bucket_bytes=bucket_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def broadcast_weights(self) -> dict:
        """Every rank unshards (a collective of the trainer group); rank 0 sends."""
        start = time.perf_counter()
        weights = self.engine.iter_full_weights(dtype=self.profile.dtype)
        if self.sender is None:
            for _ in weights:
                pass
            return {"tensors": 0, "buckets": 0, "bytes": 0}
        with torch.no_grad():
            stats = self.sender.send(weights)
        return {**stats, "seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def stage_weights(self) -> list:
        """Every rank unshards; rank 0 puts a CPU copy of the full weights into Ray's object store and returns
        [its ref] (other ranks: []). The engines load it when they reach it (trainer.max_staleness >= 2): the
        trainer does not wait for them to finish generating."""
        weights = self.engine.iter_full_weights(dtype=self.profile.dtype)
        if rank() != 0:
            for _ in weights:
                pass
            return []
        with torch.no_grad():
            return [ray.put([(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights])]

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict:
        raise RuntimeError("disaggregated placement: weights reach the engines by broadcast_weights (the driver "
                           "calls it with the rollout group's receive_weights)")


class _ByteCounter:
    """Counts the bytes of the (name, tensor) pairs streamed through `count` (with `checksum`, records each
    one's sampled checksum and shape too)."""

    def __init__(self, checksum: bool = False) -> None:
        self.bytes, self.checksum = 0, checksum
        self.checksums: dict[str, tuple[float, float]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def count(self, weights):
        for name, tensor in weights:
            self.bytes += tensor.numel() * tensor.element_size()
            if self.checksum:
                self.checksums[name], self.shapes[name] = tensor_checksum(tensor), tuple(tensor.shape)
            yield name, tensor


__all__ = ["ActorRolloutWorker", "ActorWorker"]
