"""The driver steps that differ between algorithms (PPO's KL in the reward, DAPO's dynamic sampling).

Each is a short function of the batch and the config, called from the RL step (trainer/rl_trainer.py) or
the rollout source; the arithmetic lives in `rlframe.algos` (informative_groups, kl_penalized_rewards).
DAPO's overlong shaping is part of the scoring (trainer/scorer.py).
"""

from __future__ import annotations

import numpy as np
import torch

from rlframe.algos import build_kl_controller, informative_groups
from rlframe.algos.kl import kl_penalized_rewards
from rlframe.config import RLConfig
from rlframe.protocol import DataProto


def make_kl_controller(cfg: RLConfig):
    """The reward-KL coefficient controller, or None when the KL is not in the reward."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    ctrl = cfg.algorithm.kl_ctrl
    return build_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)


def token_level_rewards(batch: DataProto, kl_ctrl, kind: str = "k1") -> dict[str, float]:
    """token_level_rewards = scores (- beta * KL(old policy || ref) with the KL in the reward), in place.

    With the KL: reward/kl_penalty (mean per-token KL), reward/kl_coef (beta) and critic/rewards/mean
    (the mean over responses of the summed token rewards, next to critic/score/mean).
    """
    scores = batch.batch["token_level_scores"]
    if kl_ctrl is None:
        batch.batch["token_level_rewards"] = scores
        return {}
    beta = kl_ctrl.value
    rewards, mean_kl = kl_penalized_rewards(scores, batch.batch["old_log_probs"], batch.batch["ref_log_prob"],
                                            batch.batch["response_mask"], beta, kind)
    batch.batch["token_level_rewards"] = rewards
    kl_ctrl.update(float(mean_kl), n_steps=len(batch))
    return {"reward/kl_penalty": float(mean_kl), "reward/kl_coef": beta,
            "critic/rewards/mean": float(rewards.sum(-1).mean())}


def keep_informative(batch: DataProto) -> DataProto:
    """Dynamic sampling: only the rows of groups whose outcome scores differ.

    The scores before overlong shaping, as in DAPO (a group all right or all wrong is dropped, whatever
    the lengths of its responses). With an LLM judge, a group is judged by its scorable rows (column
    `scorable`): one whose scorable rows agree is dropped, whatever its unscorable rows scored.
    """
    scores = batch.batch["outcome_scores"] if "outcome_scores" in batch else batch.batch["token_level_scores"].sum(-1)
    uids = batch.non_tensor_batch["uid"]
    if "scorable" in batch:  # an LLM judge's unscorable rows: a group is informative by its scorable rows only
        scorable = batch.batch["scorable"].numpy()
        informative = set(uids[scorable][informative_groups(uids[scorable], scores.numpy()[scorable])])
        keep = np.array([uid in informative for uid in uids], dtype=bool)
    else:
        keep = informative_groups(uids, scores.numpy())
    return batch[np.nonzero(keep)[0]]


def concat_rollouts(parts: list[DataProto], pad_token_id: int) -> DataProto:
    """Concatenate rollout batches whose (left-padded) prompt widths differ: pad all to the widest."""
    width = max(p.batch["prompts"].size(1) for p in parts)
    padded = []
    for part in parts:
        extra = width - part.batch["prompts"].size(1)
        if extra:
            part = part.select()  # a shallow copy: do not change the caller's batch
            part.batch["prompts"] = torch.nn.functional.pad(part.batch["prompts"], (extra, 0), value=pad_token_id)
            part.batch["input_ids"] = torch.nn.functional.pad(part.batch["input_ids"], (extra, 0), value=pad_token_id)
            for key in ("attention_mask", "position_ids"):
                part.batch[key] = torch.nn.functional.pad(part.batch[key], (extra, 0), value=0)
        padded.append(part)
    return DataProto.concat(padded)
