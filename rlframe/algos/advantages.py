"""Advantage estimators: from rewards (and values) to per-token advantages.

Shapes: B sequences, T response tokens.

    token_level_rewards  [B, T]  the reward of each response token (outcome rewards sit on the
                                 last response token; a KL penalty may be spread over all tokens)
    response_mask        [B, T]  1 for real response tokens (bool or float)
    group_index          [B]     numpy array of hashable ids (str uid or int); samples that share
                                 an id are the n samples of one prompt
    values               [B, T]  critic values (GAE only)
    baseline_rewards     [B]     reward of a baseline response, e.g. the greedy one (ReMax only)

Every estimator has the same signature and returns `(advantages, returns)`, both [B, T] and
zero outside the mask. `returns` is what a critic would regress on; the critic-free estimators
return the advantages there (nothing reads them).

    estimator = get_advantage_estimator("grpo")
    advantages, returns = estimator(rewards, mask, uids, config=AdvantageConfig())

The "outcome reward" of a sequence is the sum of its token rewards: r_i = sum_t R[i, t] * m[i, t].

Each registry entry also says what its estimator needs from the step before it runs
(`EstimatorNeeds`: a critic's values, groups of n >= 2 samples, a greedy baseline, multi-turn
rollouts); the configuration checks and the driver ask `estimator_needs(name)`, never the name.

Unscorable samples (`scorable` [B] bool, False where an LLM judge gave no usable verdict: rlframe/reward/judge.py)
are left out of every estimator by the registry's wrapper: the estimator runs on the scorable rows only (so a
group's mean and std, RLOO's leave-one-out mean, OPO's length-weighted baseline and a batch whitening are
computed without them), and an unscorable row gets advantage 0 (returns: its values where a critic gave them,
else 0), whatever the estimator.

    advantages, returns = estimator(rewards, mask, uids, config=AdvantageConfig(), scorable=scorable)

Register your own with `@register_advantage_estimator("name", needs=EstimatorNeeds(...))`, or load it
from a file through `rlframe.algos.plugins.register_from_config` (a `needs` attribute on the function).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Protocol

import numpy as np
import torch

from rlframe.algos.utils import masked_whiten


@dataclass
class AdvantageConfig:
    """Knobs shared by the estimators (each estimator reads only the ones it needs).

    gamma:       discount factor (gae, reinforce_plus_plus).
    lam:         GAE lambda (gae).
    norm_by_std: grpo divides by the group std; "drgrpo" ignores this and never divides.
    eps:         added to the std before dividing (grpo).
    whiten:      after any estimator, whiten the advantages over the whole batch with the mask
                 (PPO with "gae" usually sets this to True; reinforce_plus_plus* always whiten).
    turn_gamma:  discount per model turn, not per token (grpo_turn).
    """

    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6
    whiten: bool = False
    turn_gamma: float = 1.0


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_index: np.ndarray | None = None,
        *,
        config: AdvantageConfig,
        values: torch.Tensor | None = None,
        baseline_rewards: torch.Tensor | None = None,
        scorable: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the step before it runs (all False: rewards and the mask only).

    critic:          values from a critic (`values`): the value model is started and trained (PPO's gae).
    groups:          n >= 2 samples per prompt (`group_index`): its baseline comes from the other samples
                     of the prompt; with one sample every advantage is 0.
    greedy_baseline: the reward of one greedy response per prompt (`baseline_rewards`), from the same
                     weights that sampled the batch (ReMax).
    multi_turn:      multi-turn rollouts: it credits the model turns of a response (grpo_turn).
    """

    critic: bool = False
    groups: bool = False
    greedy_baseline: bool = False
    multi_turn: bool = False


NEED_NAMES = tuple(f.name for f in fields(EstimatorNeeds))
NO_NEEDS = EstimatorNeeds()

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, needs: EstimatorNeeds = NO_NEEDS
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make `fn` available as `get_advantage_estimator(name)`, needing `needs`.

    The registry holds a wrapped copy that honours `config.whiten` and zeroes the result outside
    the mask, whatever the estimator itself does; the decorated function itself is unchanged.
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = _with_common_postprocessing(fn, needs)
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look an estimator up by name; the error lists the registered names."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        available = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise KeyError(
            f"unknown advantage estimator {name!r}; available: {available}. "
            "Register a new one with @register_advantage_estimator or a plugin file."
        ) from None
    return estimator


def estimator_needs(name: str) -> EstimatorNeeds:
    """What the registered estimator `name` needs (its registry entry's `needs`; KeyError naming the
    registered ones if there is none). An entry put into ADVANTAGE_ESTIMATORS by hand needs nothing."""
    return getattr(get_advantage_estimator(name), "needs", NO_NEEDS)


def _with_common_postprocessing(estimator: AdvantageEstimator, needs: EstimatorNeeds) -> AdvantageEstimator:
    def run(token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None,
            scorable=None):
        if scorable is not None and not bool(torch.as_tensor(scorable).all()):
            return without_unscorable(run, token_level_rewards, response_mask, group_index, config, values,
                                      baseline_rewards, torch.as_tensor(scorable, dtype=torch.bool))
        advantages, returns = estimator(
            token_level_rewards,
            response_mask,
            group_index,
            config=config,
            values=values,
            baseline_rewards=baseline_rewards,
        )
        mask = response_mask.to(advantages.dtype)
        if config.whiten:
            advantages = masked_whiten(advantages, mask)
        return advantages * mask, returns * mask.to(returns.dtype)

    run.__name__ = getattr(estimator, "__name__", "advantage_estimator")
    run.__doc__ = estimator.__doc__
    run.needs = needs
    return run


def without_unscorable(run, token_level_rewards, response_mask, group_index, config, values, baseline_rewards,
                       scorable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`run` (a registered estimator) on the scorable rows only; the unscorable rows get advantage 0 and, as
    returns, their values (a critic is not pulled anywhere by a row nobody scored) or 0.

        keep = scorable;  A[keep], G[keep] = estimator(R[keep], m[keep], groups[keep], ...);  A[~keep] = 0

    A group left with one scorable sample has no baseline: its advantage is 0, as any group of one."""
    if scorable.shape != (token_level_rewards.shape[0],):
        raise ValueError(f"scorable has shape {tuple(scorable.shape)}; the batch has {token_level_rewards.shape[0]} rows")
    keep = torch.nonzero(scorable, as_tuple=True)[0]
    advantages = torch.zeros_like(token_level_rewards)
    returns = torch.zeros_like(token_level_rewards) if values is None else (
        values.to(token_level_rewards.dtype) * response_mask.to(token_level_rewards.dtype))
    if keep.numel() == 0:
        return advantages, returns
    rows = keep.cpu().numpy()
    kept_advantages, kept_returns = run(
        token_level_rewards[keep], response_mask[keep],
        None if group_index is None else np.asarray(group_index, dtype=object)[rows], config=config,
        values=None if values is None else values[keep],
        baseline_rewards=None if baseline_rewards is None else baseline_rewards.reshape(-1)[keep])
    advantages[keep] = kept_advantages.to(advantages.dtype)
    returns[keep] = kept_returns.to(returns.dtype)
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# helpers


def outcome_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """r_i = sum_t R[i, t] * m[i, t]  ->  [B]."""
    return (token_level_rewards * response_mask.to(token_level_rewards.dtype)).sum(dim=-1)


def group_ids_to_inverse(group_index, batch_size: int) -> torch.Tensor:
    """Map arbitrary hashable ids to 0..G-1 (order of first appearance) -> LongTensor [B]."""
    if group_index is None:
        raise ValueError(
            "this advantage estimator needs `group_index` (one id per sample; the n samples of a "
            "prompt share an id). Pass the batch's uid array."
        )
    ids = list(np.asarray(group_index, dtype=object).reshape(-1))
    if len(ids) != batch_size:
        raise ValueError(f"group_index has {len(ids)} entries but the batch has {batch_size} rows")
    first_seen: dict = {}
    inverse = [first_seen.setdefault(group_id, len(first_seen)) for group_id in ids]
    return torch.tensor(inverse, dtype=torch.long)


def group_statistics(scores: torch.Tensor, group_index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group unbiased std, group size), each [B].

    std uses Bessel's correction like `torch.std` (sum (r - mean)^2 / (n - 1)); a group of
    one sample has std 0.
    """
    inverse = group_ids_to_inverse(group_index, scores.shape[0]).to(scores.device)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sizes = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    means = sums / sizes
    squared_errors = (scores - means[inverse]) ** 2
    sse = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, squared_errors)
    stds = torch.sqrt(sse / (sizes - 1).clamp_min(1.0))
    return means[inverse], stds[inverse], sizes[inverse]


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = R_t + gamma * G_{t+1}, walking backwards over the tokens.

    Masked positions contribute no reward and are skipped: the return carried from the right
    passes through them unchanged (so interior masked tokens, e.g. tool output, do not break the
    discounting chain, and right padding simply contributes 0).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    return returns


# ----------------------------------------------------------------------------------------------
# estimators


@register_advantage_estimator("gae", needs=EstimatorNeeds(critic=True))
def compute_gae_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """Generalised Advantage Estimation (Schulman et al., 2016), for PPO with a critic.

        delta_t = R_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V

    past the last response token V = 0 and A = 0. Masked positions are skipped: the next value and
    next advantage carry through them from the right unchanged.
    """
    if values is None:
        raise ValueError("the 'gae' estimator needs `values` from the critic (compute_values)")
    gamma, lam = config.gamma, config.lam
    mask = response_mask.to(token_level_rewards.dtype)
    values = values.to(token_level_rewards.dtype)
    advantages = torch.zeros_like(token_level_rewards)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = m * values[:, t] + (1 - m) * next_value
        next_advantage = m * advantage + (1 - m) * next_advantage
        advantages[:, t] = advantage
    returns = advantages + values
    return advantages * mask, returns * mask


@register_advantage_estimator("grpo", needs=EstimatorNeeds(groups=True))
def compute_grpo_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """GRPO (Shao et al., 2024): outcome reward normalised within its group.

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     if config.norm_by_std
        A_i =  r_i - mean_g(r)                          otherwise

    broadcast over the response tokens. std_g is the unbiased std (torch.std default, as verl).
    A group of one sample gets A = 0 (no baseline to compare with); a group whose rewards are all
    equal gets A = 0 too.
    """
    scores = outcome_rewards(token_level_rewards, response_mask)
    mean, std, size = group_statistics(scores, group_index)
    advantage = scores - mean
    if config.norm_by_std:
        advantage = advantage / (std + config.eps)
    advantage = torch.where(size > 1, advantage, torch.zeros_like(advantage))
    advantages = advantage[:, None] * response_mask.to(scores.dtype)
    return advantages, advantages


def model_turn_index(response_mask: torch.Tensor) -> torch.Tensor:
    """The model turn of every response token -> LongTensor [B, T]: the k-th run of consecutive mask tokens
    is turn k (0-based; in a multi-turn response the runs are separated by tool or environment tokens,
    which are unmasked); -1 outside the mask."""
    inside = response_mask > 0
    before = torch.zeros_like(inside[:, :1])
    starts = inside & ~torch.cat([before, inside[:, :-1]], dim=1)
    turn = starts.long().cumsum(dim=-1) - 1
    return torch.where(inside, turn, torch.full_like(turn, -1))


@register_advantage_estimator("grpo_turn", needs=EstimatorNeeds(groups=True, multi_turn=True))
def compute_turn_grpo_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """Turn-level GRPO for multi-turn rollouts: each model turn is credited with its own return, and
    compared with the same turn of the other samples of its prompt.

        r[i, k] = sum of R[i, t] over the tokens t of model turn k  (turn k = the k-th run of mask tokens)
        G[i, k] = r[i, k] + turn_gamma * G[i, k + 1]
        A[i, t] = (G[i, k] - mean_{j in g(i), j has a turn k}(G[j, k])) / (std_{...}(G[j, k]) + eps),  t in turn k

    (no std division without config.norm_by_std). A turn no other sample of the group reached gets
    A = 0, as a group of one does in grpo. With turn_gamma = 1 and every reward on the last token, turn 0
    gets exactly grpo's advantage; later turns are baselined against the samples that also got that
    far. With per-turn rewards (rollout.multi_turn.turn_rewards=per_turn) and turn_gamma = 0, each
    attempt is judged by its own result: a wrong first answer is not reinforced because a retry
    succeeded. returns = G[i, k] on the tokens of turn k.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    batch_size = token_level_rewards.shape[0]
    turn = model_turn_index(response_mask)
    num_turns = int(turn.max()) + 1 if turn.numel() else 0
    if num_turns <= 0:
        zeros = torch.zeros_like(token_level_rewards)
        return zeros, zeros
    turns_of_row = turn.max(dim=-1).values + 1  # [B]
    slot = torch.arange(batch_size, device=turn.device)[:, None] * num_turns + turn.clamp_min(0)
    turn_rewards = torch.zeros(batch_size * num_turns, dtype=mask.dtype, device=mask.device).index_add_(
        0, slot.reshape(-1), (token_level_rewards * mask).reshape(-1)).reshape(batch_size, num_turns)
    returns = discounted_returns(turn_rewards, torch.ones_like(turn_rewards), config.turn_gamma)  # [B, turns]
    rows, ks = torch.nonzero(torch.arange(num_turns, device=turn.device)[None, :] < turns_of_row[:, None], as_tuple=True)
    prompt_group = group_ids_to_inverse(group_index, batch_size).to(turn.device)
    same_turn_groups = (prompt_group[rows] * num_turns + ks).cpu().numpy()
    reached = returns[rows, ks]
    mean, std, size = group_statistics(reached, same_turn_groups)
    advantage = reached - mean
    if config.norm_by_std:
        advantage = advantage / (std + config.eps)
    advantage = torch.where(size > 1, advantage, torch.zeros_like(advantage))
    per_turn = torch.zeros_like(returns)
    per_turn[rows, ks] = advantage
    gather_at = turn.clamp_min(0)
    advantages = torch.gather(per_turn, 1, gather_at) * mask
    return advantages, torch.gather(returns, 1, gather_at) * mask


@register_advantage_estimator("drgrpo", needs=EstimatorNeeds(groups=True))
def compute_drgrpo_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """Dr. GRPO (Liu et al., 2025): GRPO without the std division.

        A_i = r_i - mean_g(r)      (group of one -> 0)

    Pair with loss aggregation "seq-mean-token-sum-norm" to also drop the length normalisation.
    """
    no_std = AdvantageConfig(gamma=config.gamma, lam=config.lam, norm_by_std=False, eps=config.eps, whiten=False)
    return compute_grpo_advantage(token_level_rewards, response_mask, group_index, config=no_std)


@register_advantage_estimator("rloo", needs=EstimatorNeeds(groups=True))
def compute_rloo_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """REINFORCE leave-one-out (Ahmadian et al., 2024).

        A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g(r))

    over the n samples of the group; a group of one sample gets A = 0.
    """
    scores = outcome_rewards(token_level_rewards, response_mask)
    mean, _, size = group_statistics(scores, group_index)
    advantage = size / (size - 1).clamp_min(1.0) * (scores - mean)
    advantage = torch.where(size > 1, advantage, torch.zeros_like(advantage))
    advantages = advantage[:, None] * response_mask.to(scores.dtype)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """REINFORCE++ (Hu, 2025): discounted return-to-go, whitened over the whole batch.

        G_t = R_t + gamma * G_{t+1}                (masked tokens skipped, see discounted_returns)
        A   = (G - mean(G)) / sqrt(var(G) + 1e-8)  (mean/var over all unmasked tokens of the batch)

    returns = G (not whitened).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = discounted_returns(token_level_rewards, mask, config.gamma)
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns * mask


@register_advantage_estimator("reinforce_plus_plus_baseline", needs=EstimatorNeeds(groups=True))
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch.

        a_i    = r_i - mean_g(r)                    (group of one -> 0)
        A[i,t] = whiten(a_i * m[i,t])               over all unmasked tokens of the batch
    """
    mask = response_mask.to(token_level_rewards.dtype)
    scores = outcome_rewards(token_level_rewards, mask)
    mean, _, _ = group_statistics(scores, group_index)
    centred = (scores - mean)[:, None] * mask
    advantages = masked_whiten(centred, mask) * mask
    return advantages, advantages


@register_advantage_estimator("remax", needs=EstimatorNeeds(greedy_baseline=True))
def compute_remax_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """ReMax (Li et al., 2023): the reward of a greedy response is the baseline.

        A[i, t] = sum_{s >= t} R[i, s] - b_i      (return-to-go, undiscounted; b = baseline_rewards, [B])

    With an outcome reward only (on the last token) this is r_i - b_i on every token; with the KL in
    the reward, token t also carries the KL penalty of itself and of the tokens after it (never the
    ones before). b is the greedy response's score; `gamma` is not used.
    """
    if baseline_rewards is None:
        raise ValueError("the 'remax' estimator needs `baseline_rewards` (rewards of the greedy responses)")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = discounted_returns(token_level_rewards, mask, gamma=1.0)
    advantages = (returns - baseline_rewards.to(returns.dtype).reshape(-1, 1)) * mask
    return advantages, advantages


@register_advantage_estimator("opo", needs=EstimatorNeeds(groups=True))
def compute_opo_advantage(
    token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None
):
    """On-Policy RL with Optimal reward baseline (Hao et al., 2025): length-weighted group baseline.

        b_g = sum_{j in g} l_j r_j / sum_{j in g} l_j      (l_j = number of response tokens)
        A_i = r_i - b_g

    A group of one sample gets A = 0 (b = r). A group whose lengths are all 0 gets A = 0.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    scores = outcome_rewards(token_level_rewards, mask)
    lengths = mask.sum(dim=-1)
    inverse = group_ids_to_inverse(group_index, scores.shape[0]).to(scores.device)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, lengths * scores)
    total_length = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, lengths)
    baseline = (weighted / total_length.clamp_min(1.0))[inverse]
    advantage = torch.where(total_length[inverse] > 0, scores - baseline, torch.zeros_like(scores))
    advantages = advantage[:, None] * mask
    return advantages, advantages
