"""A user's own advantage estimator, in a plain Python file outside the package.

Point a run at it, no package edits:

    python -m rlframe.main recipe=grpo_math \
        algorithm.custom_estimator.path=examples/custom_estimator/my_estimator.py \
        algorithm.custom_estimator.name=median_baseline \
        algorithm.adv_estimator=median_baseline

or use the recipe next to this file: `recipe=examples/custom_estimator/median_baseline.yaml`.

The driver registers `median_baseline` before any worker starts. The signature is the one every
estimator in rlframe/algos/advantages.py has; return (advantages, returns), both [B, T]. The registry
zeroes the result outside the mask and applies algorithm.whiten_advantages for you.
"""

import numpy as np
import torch


def median_baseline(token_level_rewards, response_mask, group_index=None, *, config, values=None,
                    baseline_rewards=None):
    """A_i = r_i - median_g(r): a group baseline that one lucky sample cannot drag (robust GRPO).

    r_i = sum_t R[i, t] (the outcome reward); g = the samples of the same prompt (same group_index).
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    ids = np.asarray(group_index, dtype=object)
    baseline = torch.empty_like(scores)
    for group in set(ids.tolist()):
        members = torch.as_tensor(np.nonzero(ids == group)[0])
        baseline[members] = scores[members].median()
    advantages = (scores - baseline)[:, None] * response_mask
    return advantages, advantages


# What the driver must provide (rlframe.algos.EstimatorNeeds): groups of rollout.n > 1 samples per prompt,
# so that a run with rollout.n=1 is refused before any worker starts.
median_baseline.needs = {"groups": True}
