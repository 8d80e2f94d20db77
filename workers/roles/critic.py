"""The critic role of PPO: `compute_values` and `update_critic`, data-parallel over the group's ranks.

Its engine is the same trainer engine as the actor's with a value head (`head="value"`,
workers/engine/value_model.py); the update is the engine's shared loop with the clipped value loss.
"""

from __future__ import annotations

import time

import torch

from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.engine import build_engine
from rlframe.workers.objectives import ValueObjective
from rlframe.workers.settings import CriticSettings


class CriticWorker:
    def __init__(self, settings: CriticSettings):
        self.settings = settings
        self.profile = settings.engine.device.profile()
        self.engine = build_engine(settings.engine, self.profile, name="critic")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        values = self.engine.forward(data, self.settings.forward)["values"]
        return DataProto.from_dict(tensors={"values": values * data.batch["response_mask"].to(torch.float32)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        start = time.perf_counter()
        self.engine.reload()
        metrics = self.engine.train_step(data, self.settings.loop, ValueObjective(self.settings.cliprange_value),
                                         seed=self.settings.seed + int(data.meta_info.get("step", 0)))
        self.engine.offload()
        metrics["timing/critic_update_rank0"] = time.perf_counter() - start
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> dict:
        """Value model (backbone + head), optimizer, scheduler and counters into `out_dir` (a collective)."""
        start = time.perf_counter()
        self.engine.save_state(out_dir)
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, in_dir: str) -> dict:
        start = time.perf_counter()
        info = self.engine.load_state(in_dir)
        return {**info, "seconds": time.perf_counter() - start}
