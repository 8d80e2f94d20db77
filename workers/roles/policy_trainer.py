"""The policy trained by supervised and preference objectives: SFT and DPO (and its relatives).

`PolicyTrainerWorker` is the actor role (`ActorRolloutWorker`: the same trainer engine, rollout
engine for validation and pair sampling, checkpoints, export) with two more update primitives:

    update_sft(batch)   # -sum m_t log p(y_t) / tokens over the loss mask (response or all tokens)
    update_dpo(batch)   # rows 2i (chosen) and 2i+1 (rejected) share a prompt; ref_logps [2P] given
                        # (the reference's summed or length-normalised log-probs, computed once);
                        # kto: unpaired rows with kto_label; rrhf: groups of group_size rows with rank_score
    compute_nll(batch)  # per-row NLL sums and token counts at temperature 1 (validation loss)

The arithmetic of both objectives is `rlframe.algos.preference`; the engine runs the update loop
(global loss normalisation, guarded steps) exactly as for RL.

Pairs must stay together in one micro-batch: the engine orders fixed-count micro-batches by length,
so a DPO step is one micro-batch per mini-batch per rank (`dpo_loop`), unshuffled; the driver
shuffles whole pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlframe.algos.preference import kto_loss, preference_loss, rrhf_loss, sequence_log_probs, sft_loss
from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.engine.base import LossOutput
from rlframe.workers.roles.actor_rollout import ActorRolloutWorker
from rlframe.workers.settings import ActorSettings, ForwardSettings, UpdateLoop


@dataclass(frozen=True)
class PreferenceSettings:
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo (rlframe/algos/preference.py)
    beta: float = 0.1
    gamma: float = 0.5  # simpo's target margin
    label_smoothing: float = 0.0
    length_normalize: bool = False  # mean instead of summed token log-probs per response
    desirable_weight: float = 1.0  # kto: w_D
    undesirable_weight: float = 1.0  # kto: w_U
    group_size: int = 0  # rrhf: replies per prompt (rows of a group are consecutive)


class SFTObjective:
    """NLL of the response_mask tokens (the loss mask), aggregated against the global token count."""

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        log_probs = outputs["log_probs"]
        mask = micro.batch["response_mask"].to(log_probs.device)
        loss = sft_loss(log_probs, mask, agg)
        return LossOutput(loss, {"sft/loss": float(loss.detach())})


class PreferenceObjective:
    """A preference loss over the pairs of the micro-batch (rows 2i chosen, 2i+1 rejected), summed
    and divided by the number of pairs in the whole mini-batch (all ranks)."""

    def __init__(self, settings: PreferenceSettings):
        self.settings = settings

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        s = self.settings
        log_probs = outputs["log_probs"]
        mask = micro.batch["response_mask"].to(log_probs.device)
        if len(micro) % 2:
            raise ValueError(f"a DPO micro-batch has {len(micro)} rows: pairs (chosen, rejected) must stay together")
        seq = sequence_log_probs(log_probs, mask, s.length_normalize)
        ref_chosen = ref_rejected = None
        if "ref_logps" in micro.batch.keys():  # the reference's sequence log-probs, same normalisation
            ref = micro.batch["ref_logps"].to(log_probs.device)
            ref_chosen, ref_rejected = ref[0::2], ref[1::2]
        losses, stats = preference_loss(seq[0::2], seq[1::2], ref_chosen, ref_rejected, loss_type=s.loss_type,
                                        beta=s.beta, gamma=s.gamma, label_smoothing=s.label_smoothing)
        pairs_in_mini = agg["num_seqs"] / 2.0
        loss = losses.sum() / pairs_in_mini
        chosen, rejected = stats["chosen_rewards"], stats["rejected_rewards"]
        return LossOutput(loss, {"dpo/loss": float(loss.detach())}, {
            "dpo/rewards_chosen": float(chosen.mean()), "dpo/rewards_rejected": float(rejected.mean()),
            "dpo/reward_accuracy": float((chosen > rejected).float().mean()),
            "dpo/reward_margin": float((chosen - rejected).mean()),
            "dpo/logps_chosen": float(seq[0::2].detach().mean()), "dpo/logps_rejected": float(seq[1::2].detach().mean())})


class KTOObjective:
    """KTO over unpaired rows (kto_label 1 desirable / 0 not; ref_logps given), mean over the mini-batch's rows."""

    def __init__(self, settings: PreferenceSettings):
        self.settings = settings

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        s = self.settings
        log_probs = outputs["log_probs"]
        device = log_probs.device
        seq = sequence_log_probs(log_probs, micro.batch["response_mask"].to(device), s.length_normalize)
        desirable = micro.batch["kto_label"].to(device).bool()
        losses, stats = kto_loss(seq, micro.batch["ref_logps"].to(device), desirable, beta=s.beta,
                                 desirable_weight=s.desirable_weight, undesirable_weight=s.undesirable_weight)
        loss = losses.sum() / agg["num_seqs"]
        rewards, detached = stats["rewards"], seq.detach()
        good, bad = rewards[desirable], rewards[~desirable]
        return LossOutput(loss, {"dpo/loss": float(loss.detach())}, {
            "dpo/kl": float(stats["kl"]), "dpo/rewards_chosen": float(good.mean()) if good.numel() else 0.0,
            "dpo/rewards_rejected": float(bad.mean()) if bad.numel() else 0.0,
            "dpo/logps_chosen": float(detached[desirable].mean()) if good.numel() else 0.0,
            "dpo/logps_rejected": float(detached[~desirable].mean()) if bad.numel() else 0.0})


class RankingObjective:
    """RRHF over groups of `group_size` consecutive rows (rank_score given): hinge ranking + the best's NLL,
    divided by the mini-batch's number of groups."""

    def __init__(self, settings: PreferenceSettings):
        self.settings = settings

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        log_probs = outputs["log_probs"]
        device = log_probs.device
        size = self.settings.group_size
        if size < 2 or len(micro) % size:
            raise ValueError(f"a ranking micro-batch has {len(micro)} rows: groups of {size} must stay together")
        seq = sequence_log_probs(log_probs, micro.batch["response_mask"].to(device), length_normalize=True)
        group = torch.arange(len(micro), device=device) // size
        total, stats = rrhf_loss(seq, micro.batch["rank_score"].to(device), group)
        loss = total / (agg["num_seqs"] / size)
        groups = len(micro) / size
        return LossOutput(loss, {"rft/loss": float(loss.detach())}, {
            "rft/rank_loss": float(stats["rank_loss"]) / groups, "rft/nll_best": float(stats["nll_best"]) / groups})


def preference_objective(settings: PreferenceSettings):
    """kto: unpaired rows; rrhf: ranked groups; the other losses: chosen/rejected pairs."""
    if settings.loss_type == "kto":
        return KTOObjective(settings)
    if settings.loss_type == "rrhf":
        return RankingObjective(settings)
    return PreferenceObjective(settings)


def dpo_loop(loop: UpdateLoop, rows_per_step: int) -> UpdateLoop:
    """One unshuffled micro-batch per mini-batch: the engine keeps a micro-batch's rows in order."""
    return replace(loop, mini_batch_size=rows_per_step, micro_batch_size=rows_per_step, max_tokens_per_micro_batch=0,
                   shuffle=False, epochs=1)


class PolicyTrainerWorker(ActorRolloutWorker):
    """The actor with SFT and DPO updates (see the module docstring)."""

    def __init__(self, settings: ActorSettings, preference: PreferenceSettings | None = None):
        super().__init__(settings)
        self.preference = preference or PreferenceSettings()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_sft(self, data: DataProto) -> DataProto:
        step = int(data.meta_info.get("step", 0))
        self.rollout_sleep()
        self.engine.reload()
        metrics = self.engine.train_step(data, self.settings.loop, SFTObjective(), seed=self.settings.seed + step)
        self.engine.offload()
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_dpo(self, data: DataProto) -> DataProto:
        """One optimiser step over this rank's pairs (all of them in one micro-batch)."""
        step = int(data.meta_info.get("step", 0))
        self.rollout_sleep()
        self.engine.reload()
        metrics = self.engine.train_step(data, dpo_loop(self.settings.loop, len(data)),
                                         preference_objective(self.preference), seed=self.settings.seed + step)
        self.engine.offload()
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_nll(self, data: DataProto) -> DataProto:
        """Per row: the summed NLL of the response_mask tokens and their count (temperature 1)."""
        settings = ForwardSettings(micro_batch_size=self.settings.log_prob.micro_batch_size, temperature=1.0)
        log_probs = self.engine.forward(data, settings)["log_probs"]
        mask = data.batch["response_mask"].to(log_probs.dtype)
        return DataProto.from_dict(tensors={"nll_sum": -(log_probs * mask).sum(-1), "nll_tokens": mask.sum(-1)})


__all__ = ["KTOObjective", "PolicyTrainerWorker", "PreferenceSettings", "PreferenceObjective", "RankingObjective",
           "SFTObjective", "dpo_loop", "preference_objective"]
