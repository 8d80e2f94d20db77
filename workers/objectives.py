"""The losses the roles hand to `TrainingEngine.train_step`: one micro-batch's outputs -> LossOutput.

All arithmetic lives in `rlframe.algos`; these only pick the batch fields and name the metrics.
"""

from __future__ import annotations

import torch

from rlframe.algos import PolicyLossConfig, agg_loss, compute_value_loss, get_policy_loss, kl_penalty
from rlframe.algos.distillation import (DistillationInputs, get_distillation_loss, reverse_kl_advantage,
                                        topk_overlap)
from rlframe.algos.utils import masked_mean
from rlframe.algos.off_policy import truncated_is_weights
from rlframe.protocol import DataProto
from rlframe.workers.engine.base import LossOutput
from rlframe.workers.settings import PolicyLossSettings


class PolicyObjective:
    """policy loss (+ kl_loss_coef * KL(pi || ref)) (- entropy_coeff * entropy), for the actor.

    On-policy (no `old_log_probs` in the batch: one epoch, one mini-batch) the old log-probs are the
    current forward's, detached; the engine/trainer gap `|rollout_log_probs - old|` is summed on the way.
    With `tis_cap` (an off-policy correction) each token's policy-gradient term is weighted by
    min(exp(old - rollout_log_probs), tis_cap) (rlframe/algos/off_policy.py).
    """

    def __init__(self, settings: PolicyLossSettings, on_policy: bool):
        self.settings = settings
        self.on_policy = on_policy
        self.policy_loss = get_policy_loss(settings.policy_loss)
        self.loss_config = PolicyLossConfig(clip_ratio_low=settings.clip_ratio_low,
                                            clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c)
        self.drift_sum = self.drift_tokens = 0.0

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        cfg = self.settings
        log_prob, entropy = outputs["log_probs"], outputs.get("entropy")
        device = log_prob.device
        mask = micro.batch["response_mask"].to(device)
        if self.on_policy:
            old_log_prob = log_prob.detach()
            if "rollout_log_probs" in micro.batch.keys():
                drift = (micro.batch["rollout_log_probs"].to(device) - old_log_prob).abs() * mask
                self.drift_sum += float(drift.sum())
                self.drift_tokens += float(mask.sum())
        else:
            old_log_prob = micro.batch["old_log_probs"].to(device)
        pg_agg, tis_metrics = agg, {}
        if cfg.tis_cap is not None:
            weights, tis_metrics = truncated_is_weights(old_log_prob, micro.batch["rollout_log_probs"].to(device), mask,
                                                        cfg.tis_cap)
            pg_agg = {**agg, "weights": weights}
        advantages = micro.batch["advantages"].to(device)
        distill = cfg.distill_mode is not None
        if distill and cfg.distill_mode == "k1":  # the reverse KL per token as a dense advantage
            advantages = reverse_kl_advantage(advantages, old_log_prob, micro.batch["teacher_log_prob"].to(device),
                                              mask, cfg.distill_coef, cfg.distill_use_task_reward)
        pg_loss, pg_metrics = self.policy_loss(old_log_prob, log_prob, advantages, mask,
                                               config=self.loss_config, agg=pg_agg)
        pg_metrics.update(tis_metrics)
        loss, terms = pg_loss, {}
        if distill:
            loss, distill_terms, distill_stats = self.distillation(loss, outputs, micro, mask, agg)
            terms.update(distill_terms)
            pg_metrics.update(distill_stats)
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro.batch["ref_log_prob"].to(device), cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            terms["actor/kl_loss"] = kl_loss.item()
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, **agg)
            loss = loss - cfg.entropy_coeff * entropy_loss
            terms["actor/entropy"] = entropy_loss.item()
        terms["actor/pg_loss"] = pg_loss.item()
        return LossOutput(loss, terms, {key if key.startswith("distill/") else f"actor/{key}": float(value)
                                        for key, value in pg_metrics.items()})

    def distillation(self, pg_loss: torch.Tensor, outputs: dict[str, torch.Tensor], micro: DataProto,
                     mask: torch.Tensor, agg: dict) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """The distillation term (modes other than k1: coef * agg_loss(per-token loss); the policy-gradient loss
        kept only with distill_use_task_reward) and the per-step distillation statistics."""
        cfg, device = self.settings, mask.device
        batch = micro.batch
        teacher_log_prob = batch["teacher_log_prob"].to(device)
        log_prob = outputs["log_probs"]
        inputs = DistillationInputs(
            log_prob=log_prob, teacher_log_prob=teacher_log_prob,
            teacher_topk_log_probs=batch["teacher_topk_log_probs"].to(device),
            student_at_teacher_topk=outputs.get("at_teacher_topk_ids"),
            # the student's log-probs at the top-k ids of its forward before the teacher's pass (the teacher scored
            # those; after an optimiser step its top-k of this forward may differ)
            student_topk_log_probs=outputs.get("at_student_topk_ids"),
            teacher_at_student_topk=(batch["teacher_at_student_topk"].to(device)
                                     if "teacher_at_student_topk" in batch.keys() else None))
        gap = (log_prob.detach() - teacher_log_prob)
        stats = {"distill/reverse_kl": masked_mean(gap, mask).item(),
                 "distill/reverse_kl_k3": masked_mean(torch.exp(-gap) - 1.0 + gap, mask).item(),
                 "distill/teacher_log_prob": masked_mean(teacher_log_prob, mask).item(),
                 "distill/teacher_topk_mass": masked_mean(torch.exp(inputs.teacher_topk_log_probs).sum(-1), mask).item()}
        if "topk_log_probs" in outputs:
            stats["distill/student_topk_mass"] = masked_mean(
                torch.exp(outputs["topk_log_probs"].detach()).sum(-1), mask).item()
            stats["distill/topk_overlap"] = masked_mean(
                topk_overlap(outputs["topk_ids"], batch["teacher_topk_ids"].to(device)), mask).item()
        if inputs.student_at_teacher_topk is not None:
            stats["distill/student_mass_on_teacher_topk"] = masked_mean(
                torch.exp(inputs.student_at_teacher_topk.detach()).sum(-1), mask).item()
        if cfg.distill_mode == "k1":
            return pg_loss, {}, stats
        per_token = get_distillation_loss(cfg.distill_mode)(inputs, beta=cfg.distill_beta)
        distill_loss = agg_loss(per_token, mask, **agg)
        loss = cfg.distill_coef * distill_loss + (pg_loss if cfg.distill_use_task_reward else 0.0 * pg_loss)
        return loss, {"distill/loss": distill_loss.item()}, stats


class ValueObjective:
    """The clipped value regression of PPO's critic onto `returns`."""

    def __init__(self, cliprange_value: float):
        self.cliprange_value = cliprange_value

    def __call__(self, outputs: dict[str, torch.Tensor], micro: DataProto, agg: dict) -> LossOutput:
        values = outputs["values"]
        device = values.device
        loss, metrics = compute_value_loss(values, micro.batch["values"].to(device), micro.batch["returns"].to(device),
                                           micro.batch["response_mask"].to(device), self.cliprange_value, agg=agg)
        return LossOutput(loss, {"critic/vf_loss": float(loss.detach())},
                          {f"critic/{key}": float(value) for key, value in metrics.items()})
