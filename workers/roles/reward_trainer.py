"""The reward model under training: a scalar head over an LM backbone, trained with Bradley-Terry.

    update_rm(pairs)        # rows 2i (chosen) and 2i+1 (rejected): -log s(r_w - r_l - margin)
    compute_scores(rows)    # r(x, y) per row
    save_reward_model(dir)  # an HF sequence-classification folder (num_labels=1) that the
                            # reward-model worker (workers/roles/reward_model.py) loads unchanged

The model is the critic's value model (`workers/engine/value_model.py`: backbone + Linear(hidden, 1),
on any trainer engine with head="value"); rows are laid out so that the value of the one 'response'
position is the head over the hidden state of the text's last non-pad token, which is the token an
HF `...ForSequenceClassification` reads. The head's bias is never trained (the Bradley-Terry loss
depends on score differences only, so its gradient is exactly zero) and is dropped on export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.algos.preference import bradley_terry_loss
from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.distributed import rank, seed_everything
from rlframe.workers.engine import build_engine
from rlframe.workers.engine.base import LossOutput
from rlframe.workers.hf_folder import write_hf_folder
from rlframe.workers.roles.policy_trainer import dpo_loop
from rlframe.workers.settings import EngineSettings, ForwardSettings, UpdateLoop


@dataclass(frozen=True)
class RewardTrainerSettings:
    engine: EngineSettings  # head="value"
    margin: float = 0.0
    forward: ForwardSettings = ForwardSettings()
    seed: int = 0


class BradleyTerryObjective:
    def __init__(self, margin: float):
        self.margin = margin

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        scores = outputs["values"][:, 0]
        chosen, rejected = scores[0::2], scores[1::2]
        losses = bradley_terry_loss(chosen, rejected, self.margin)
        loss = losses.sum() / (agg["num_seqs"] / 2.0)
        return LossOutput(loss, {"rm/loss": float(loss.detach())}, {
            "rm/accuracy": float((chosen > rejected).float().mean()),
            "rm/margin": float((chosen - rejected).detach().mean()),
            "rm/chosen_score": float(chosen.detach().mean()), "rm/rejected_score": float(rejected.detach().mean())})


class RewardTrainerWorker:
    def __init__(self, settings: RewardTrainerSettings):
        self.settings = settings
        seed_everything(settings.seed + rank())
        self.profile = settings.engine.device.profile()
        self.engine = build_engine(settings.engine, self.profile, name="rm")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_rm(self, data: DataProto) -> DataProto:
        """One optimiser step over this rank's pairs (all in one micro-batch: pairs stay together)."""
        self.engine.reload()
        metrics = self.engine.train_step(data, dpo_loop(UpdateLoop(), len(data)), BradleyTerryObjective(self.settings.margin),
                                         seed=self.settings.seed + int(data.meta_info.get("step", 0)))
        self.engine.offload()
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_scores(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"rm_scores": self.engine.forward(data, self.settings.forward)["values"][:, 0]})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> dict:
        self.engine.save_state(out_dir, tokenizer_source=self.settings.engine.model_path)
        return {}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, in_dir: str) -> dict:
        return self.engine.load_state(in_dir)

    @register(Dispatch.ONE_TO_ALL)
    def save_reward_model(self, out_dir: str, pad_token_id: int) -> str:
        """An HF `<Arch>ForSequenceClassification` folder, num_labels=1 (every rank gathers; rank 0 writes)."""
        state = {}
        for name, tensor in self.engine.iter_full_weights():
            if name == "value_head.weight":
                state["score.weight"] = tensor
            elif name != "value_head.bias":
                state[name] = tensor
        if rank() == 0:
            import copy

            config = copy.deepcopy(self.engine.model.config)
            base = (config.architectures or ["LlamaForCausalLM"])[0]
            for suffix in ("ForCausalLM", "Model"):
                if base.endswith(suffix):
                    base = base[: -len(suffix)]
                    break
            config.architectures = [f"{base}ForSequenceClassification"]
            config.num_labels = 1
            config.pad_token_id = pad_token_id
            config.tie_word_embeddings = False
            write_hf_folder(out_dir, state, config, self.settings.engine.model_path)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out_dir


__all__ = ["RewardTrainerWorker", "RewardTrainerSettings", "BradleyTerryObjective"]
