"""The losses the roles hand to `TrainingEngine.train_step`: one micro-batch's outputs -> LossOutput.

All arithmetic lives in `rlframe.algos`; these only pick the batch fields and name the metrics.
"""

from __future__ import annotations

import torch

from rlframe.algos import PolicyLossConfig, agg_loss, compute_value_loss, get_policy_loss, kl_penalty
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
        pg_loss, pg_metrics = self.policy_loss(old_log_prob, log_prob, micro.batch["advantages"].to(device), mask,
                                               config=self.loss_config, agg=pg_agg)
        pg_metrics.update(tis_metrics)
        loss, terms = pg_loss, {}
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
        return LossOutput(loss, terms, {f"actor/{key}": float(value) for key, value in pg_metrics.items()})


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
