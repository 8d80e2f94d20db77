"""Advantage estimators against hand-computed numbers (see the comments for the arithmetic)."""

import math

import numpy as np
import pytest
import torch

from rlframe.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    get_advantage_estimator,
    masked_mean,
    masked_var,
    masked_whiten,
    register_advantage_estimator,
)

# Six sequences, T = 3. Outcome reward sits on the last real token of each row.
#   group "a": rewards 1, 0          (size 2)
#   group "b": rewards 0, 1, 2       (size 3; lengths 1, 2, 3)
#   group "c": reward 5              (size 1)
MASK = torch.tensor(
    [
        [1, 1, 0],
        [1, 1, 1],
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1],
        [1, 1, 0],
    ],
    dtype=torch.float32,
)
SCORES = [1.0, 0.0, 0.0, 1.0, 2.0, 5.0]
GROUPS = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)


def outcome_token_rewards(scores=SCORES, mask=MASK):
    rewards = torch.zeros_like(mask)
    for row, score in enumerate(scores):
        last = int(mask[row].sum()) - 1
        rewards[row, last] = score
    # junk after the end of the response must be ignored
    rewards = rewards + 100.0 * (1 - mask)
    return rewards


def per_row(advantages):
    """The advantage of each row, after checking it is constant on the mask and 0 outside."""
    values = []
    for row in range(advantages.shape[0]):
        valid = MASK[row].bool()
        assert torch.all(advantages[row][~valid] == 0)
        row_values = advantages[row][valid]
        assert torch.allclose(row_values, row_values[0].expand_as(row_values))
        values.append(row_values[0].item())
    return values


def run(name, **kwargs):
    config = kwargs.pop("config", AdvantageConfig())
    rewards = kwargs.pop("rewards", outcome_token_rewards())
    mask = kwargs.pop("mask", MASK)
    groups = kwargs.pop("groups", GROUPS)
    return get_advantage_estimator(name)(rewards, mask, groups, config=config, **kwargs)


def test_grpo_hand_computed():
    advantages, returns = run("grpo")
    # a: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071 -> +-0.5 / 0.7071
    # b: mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1        -> -1, 0, 1
    # c: group of one                                           -> 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [a, -a, -1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0]
    assert per_row(advantages) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(advantages, returns)


def test_grpo_int_group_ids_and_all_equal_rewards():
    rewards = outcome_token_rewards(scores=[3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    advantages, _ = run("grpo", rewards=rewards, groups=np.array([7, 7, 8, 8, 8, 9]))
    assert torch.all(advantages == 0)  # zero std: (r - mean) = 0, no NaN


def test_drgrpo_and_grpo_without_std():
    expected = [0.5, -0.5, -1.0, 0.0, 1.0, 0.0]
    advantages, _ = run("drgrpo")
    assert per_row(advantages) == pytest.approx(expected)
    advantages, _ = run("grpo", config=AdvantageConfig(norm_by_std=False))
    assert per_row(advantages) == pytest.approx(expected)


# Four multi-turn trajectories of one prompt, T = 7: model turns are runs of mask tokens, separated by
# environment tokens (mask 0). Per-turn rewards sit on each turn's last token.
#   row 0: turn 0 wrong (0), turn 1 right (1.5)
#   row 1: turn 0 right (2.0)
#   row 2: turns 0, 1 wrong, turn 2 right (1.15)
#   row 3: turns 0, 1 wrong (0, 0)
TURN_MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0],
                          [1, 1, 1, 0, 0, 0, 0],
                          [1, 0, 1, 0, 1, 0, 0],
                          [1, 1, 0, 1, 1, 0, 0]], dtype=torch.float32)
TURN_REWARDS = torch.zeros(4, 7)
TURN_REWARDS[0, 5], TURN_REWARDS[1, 2], TURN_REWARDS[2, 4] = 1.5, 2.0, 1.15


def turn_values(advantages):
    """{(row, turn): value}, after checking each turn's tokens share one value and unmasked tokens are 0."""
    from rlframe.algos.advantages import model_turn_index

    turns, values = model_turn_index(TURN_MASK), {}
    assert torch.all(advantages[TURN_MASK == 0] == 0)
    for row in range(4):
        for k in range(int(turns[row].max()) + 1):
            tokens = advantages[row][turns[row] == k]
            assert torch.allclose(tokens, tokens[0].expand_as(tokens))
            values[(row, k)] = tokens[0].item()
    return values


def test_model_turn_index():
    from rlframe.algos.advantages import model_turn_index

    assert model_turn_index(TURN_MASK).tolist() == [[0, 0, -1, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1],
                                                    [0, -1, 1, -1, 2, -1, -1], [0, 0, -1, 1, 1, -1, -1]]


def test_grpo_turn_without_discount_hand_computed():
    groups = np.array(["p"] * 4, dtype=object)
    advantages, returns = run("grpo_turn", rewards=TURN_REWARDS, mask=TURN_MASK, groups=groups,
                              config=AdvantageConfig(turn_gamma=1.0))
    values = turn_values(advantages)
    # turn 0: G = the whole return 1.5, 2, 1.15, 0 -> exactly grpo's advantage
    grpo, _ = run("grpo", rewards=TURN_REWARDS, mask=TURN_MASK, groups=groups)
    assert [values[(row, 0)] for row in range(4)] == pytest.approx(grpo[:, 0].tolist(), rel=1e-6)
    # turn 1, reached by rows 0, 2, 3: G = 1.5, 1.15, 0; mean 0.88333, unbiased std
    # sqrt((0.61667^2 + 0.26667^2 + 0.88333^2) / 2) = 0.78475 -> 0.78582, 0.33981, -1.12563
    std = math.sqrt((0.61667**2 + 0.26667**2 + 0.88333**2) / 2)
    assert [values[(0, 1)], values[(2, 1)], values[(3, 1)]] == pytest.approx(
        [0.61667 / std, 0.26667 / std, -0.88333 / std], rel=1e-4)
    # turn 2: only row 2 got there -> no baseline -> 0
    assert values[(2, 2)] == 0.0
    assert turn_values(returns)[(0, 0)] == pytest.approx(1.5) and turn_values(returns)[(2, 1)] == pytest.approx(1.15)


def test_grpo_turn_each_attempt_judged_by_its_own_result():
    groups = np.array(["p"] * 4, dtype=object)
    advantages, returns = run("grpo_turn", rewards=TURN_REWARDS, mask=TURN_MASK, groups=groups,
                              config=AdvantageConfig(turn_gamma=0.0))
    values = turn_values(advantages)
    # turn 0: r = 0, 2, 0, 0: mean 0.5, std 1 -> -0.5, 1.5, -0.5, -0.5 (row 0's wrong first answer is
    # pushed down although its retry succeeded; grpo would push it up)
    assert [values[(row, 0)] for row in range(4)] == pytest.approx([-0.5, 1.5, -0.5, -0.5], rel=1e-5)
    # turn 1: r = 1.5, 0, 0 (rows 0, 2, 3): mean 0.5, std sqrt((1 + 0.25 + 0.25) / 2) = 0.86603
    assert [values[(0, 1)], values[(2, 1)], values[(3, 1)]] == pytest.approx(
        [1 / 0.86603, -0.5 / 0.86603, -0.5 / 0.86603], rel=1e-4)
    assert values[(2, 2)] == 0.0
    assert turn_values(returns)[(2, 0)] == 0.0 and turn_values(returns)[(2, 2)] == pytest.approx(1.15)
    # turns are grouped per prompt: the same rows split over two prompts never share a baseline
    split, _ = run("grpo_turn", rewards=TURN_REWARDS, mask=TURN_MASK, groups=np.array(["p", "p", "q", "q"], dtype=object),
                   config=AdvantageConfig(turn_gamma=0.0, norm_by_std=False))
    values = turn_values(split)
    assert [values[(row, 0)] for row in range(4)] == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert values[(0, 1)] == 0.0 and values[(2, 1)] == 0.0 and values[(3, 1)] == 0.0  # alone at turn 1 in "p"; 0 == 0 in "q"


def test_rloo_hand_computed():
    advantages, _ = run("rloo")
    # a: 1 - 0 = 1, 0 - 1 = -1;  b: 0 - 1.5, 1 - 1, 2 - 0.5;  c: 0
    assert per_row(advantages) == pytest.approx([1.0, -1.0, -1.5, 0.0, 1.5, 0.0])


def test_opo_length_weighted_baseline():
    advantages, _ = run("opo")
    # a: lengths 2, 3 -> b = (2*1 + 3*0) / 5 = 0.4
    # b: lengths 1, 2, 3 -> b = (0 + 2*1 + 3*2) / 6 = 4/3
    expected = [0.6, -0.4, -4 / 3, 1 - 4 / 3, 2 - 4 / 3, 0.0]
    assert per_row(advantages) == pytest.approx(expected, rel=1e-6)


def test_remax_subtracts_baseline_rewards():
    baseline = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 6.0])
    advantages, _ = run("remax", baseline_rewards=baseline, groups=None)
    assert per_row(advantages) == pytest.approx([0.5, -0.5, -1.0, 0.0, 1.0, -1.0])
    with pytest.raises(ValueError, match="baseline_rewards"):
        run("remax", groups=None)


def test_remax_with_kl_in_reward_uses_return_to_go():
    # token rewards = outcome on the last token - a KL penalty on every token; junk past the mask
    rewards = torch.tensor([[-0.1, -0.2, 1.0 - 0.3], [-0.05, 0.95, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    baseline = torch.tensor([0.5, 1.0])
    advantages, returns = get_advantage_estimator("remax")(rewards, mask, None, config=AdvantageConfig(),
                                                           baseline_rewards=baseline)
    # row 0: return-to-go 0.4, 0.5, 0.7 (-0.1 - 0.2 + 0.7, -0.2 + 0.7, 0.7) minus 0.5
    # row 1: return-to-go 0.9, 0.95 minus 1.0; the masked token gets 0
    expected = torch.tensor([[-0.1, 0.0, 0.2], [-0.1, -0.05, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.equal(returns, advantages)
    # gamma is not ReMax's: the same advantages with any gamma
    discounted = AdvantageConfig(gamma=0.5)
    again, _ = get_advantage_estimator("remax")(rewards, mask, None, config=discounted, baseline_rewards=baseline)
    assert torch.allclose(again, expected, atol=1e-6)


def test_reinforce_plus_plus_baseline_whitens_centred_scores():
    advantages, returns = run("reinforce_plus_plus_baseline")
    # centred scores per row: 0.5, -0.5, -1, 0, 1, 0 ; broadcast over the 13 masked tokens
    centred = [0.5, -0.5, -1.0, 0.0, 1.0, 0.0]
    lengths = [2, 3, 1, 2, 3, 2]
    tokens = np.repeat(centred, lengths)
    mean, std = tokens.mean(), tokens.std(ddof=1)
    expected = [(c - mean) / math.sqrt(std**2 + 1e-8) for c in centred]
    assert per_row(advantages) == pytest.approx(expected, rel=1e-5)
    assert masked_mean(advantages, MASK).item() == pytest.approx(0.0, abs=1e-6)


def test_reinforce_plus_plus_discounted_returns_then_whitened():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 50.0], [1.0, 5.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    config = AdvantageConfig(gamma=0.5)
    advantages, returns = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, config=config)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1: padding ignored: G1 = 3, G0 = 0 + 0.5*3 = 1.5
    # row 2: the masked middle token is skipped: G2 = 2, G0 = 1 + 0.5*2 = 2
    expected_returns = torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0], [2.0, 0.0, 2.0]])
    assert torch.allclose(returns, expected_returns)
    valid = np.array([1.5, 1.0, 2.0, 1.5, 3.0, 2.0, 2.0])  # mean 13/7
    whitened = (valid - valid.mean()) / math.sqrt(valid.var(ddof=1) + 1e-8)
    assert torch.allclose(advantages[mask.bool()], torch.tensor(whitened, dtype=torch.float32), atol=1e-6)
    assert torch.all(advantages[~mask.bool()] == 0)


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 sits on padding: ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    gae = get_advantage_estimator("gae")

    # gamma = lam = 1: A_t = sum of rewards to go - V_t
    advantages, returns = gae(rewards, mask, config=AdvantageConfig(), values=values)
    assert torch.allclose(advantages, torch.tensor([[0.5, 0.4, 0.3], [0.8, 0.6, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))

    # gamma = 0.9, lam = 0.5 (gamma * lam = 0.45)
    #   row 0: d2 = 1 - 0.7 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03; d0 = 0.9*0.6 - 0.5 = 0.04
    #          A2 = 0.3; A1 = 0.03 + 0.45*0.3 = 0.165; A0 = 0.04 + 0.45*0.165 = 0.11425
    #   row 1: d1 = 1 - 0.4 = 0.6; d0 = 0.9*0.4 - 0.2 = 0.16; A1 = 0.6; A0 = 0.16 + 0.45*0.6 = 0.43
    config = AdvantageConfig(gamma=0.9, lam=0.5)
    advantages, returns = gae(rewards, mask, config=config, values=values)
    expected = torch.tensor([[0.11425, 0.165, 0.3], [0.43, 0.6, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, (expected + values) * mask, atol=1e-6)

    with pytest.raises(ValueError, match="values"):
        gae(rewards, mask, config=config)


def test_gae_skips_interior_masked_tokens():
    # a masked token in the middle (e.g. tool output) is skipped as if it were not there
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 3.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, _ = get_advantage_estimator("gae")(rewards, mask, config=AdvantageConfig(), values=values)
    # A2 = 1 - 0.7 = 0.3; A0 = 0 + 0.7 - 0.5 + 0.3 = 0.5
    assert torch.allclose(advantages, torch.tensor([[0.5, 0.0, 0.3]]))


def test_fully_masked_row_gets_zero_and_no_nan():
    mask = MASK.clone()
    mask[1] = 0  # the second sample of group "a" has no tokens: its outcome reward is 0
    for name in ["grpo", "drgrpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]:
        advantages, returns = run(name, mask=mask)
        assert torch.isfinite(advantages).all(), name
        assert torch.all(advantages[1] == 0), name
        assert torch.all(returns[1] == 0), name


def test_everything_masked_gives_zeros():
    mask = torch.zeros(2, 3)
    rewards = torch.ones(2, 3)
    for name in ["grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]:
        advantages, _ = get_advantage_estimator(name)(rewards, mask, np.array([0, 0]), config=AdvantageConfig())
        assert torch.equal(advantages, torch.zeros(2, 3)), name


def test_whiten_option_and_bool_mask():
    advantages, _ = run("rloo", config=AdvantageConfig(whiten=True), mask=MASK.bool())
    assert masked_mean(advantages, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(advantages, MASK).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.all(advantages[~MASK.bool()] == 0)


def test_group_index_errors():
    with pytest.raises(ValueError, match="group_index"):
        run("grpo", groups=None)
    with pytest.raises(ValueError, match="5 entries"):
        run("grpo", groups=GROUPS[:5])


def test_registry():
    assert {"gae", "grpo", "grpo_turn", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo"} <= set(
        ADVANTAGE_ESTIMATORS
    )
    with pytest.raises(KeyError, match="available: .*grpo"):
        get_advantage_estimator("nope")

    @register_advantage_estimator("test_constant_one")
    def constant(token_level_rewards, response_mask, group_index=None, *, config, values=None, baseline_rewards=None):
        ones = torch.ones_like(token_level_rewards)
        return ones, ones

    try:
        advantages, _ = run("test_constant_one")
        assert torch.equal(advantages, MASK)  # zeroed outside the mask by the registry wrapper
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant_one")(constant)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant_one")


def test_masked_helpers():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # (1 + 0 + 1) / 2
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    whitened = masked_whiten(values, mask)
    assert whitened[mask.bool()].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0
    assert masked_var(values, torch.zeros(2, 3)).item() == 0.0


# ------------------------------------------------------------------ unscorable samples (an LLM judge's failed verdicts)
# Seven sequences, T = 2, outcome reward on the last token; U marks an unscorable row (reward 5, never read):
#   group "a": rewards 1, 0, U, 1   -> scorable 1, 0, 1: mean 2/3, unbiased std sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
#   group "b": rewards 0, 1, U      -> scorable 0, 1: mean 1/2, std sqrt(1/2)
#   group "c": rewards 1, U... only one scorable -> no baseline: 0
U_SCORES = [1.0, 0.0, 5.0, 1.0, 0.0, 1.0, 5.0, 1.0, 5.0]
U_GROUPS = np.array(["a", "a", "a", "a", "b", "b", "b", "c", "c"], dtype=object)
U_SCORABLE = torch.tensor([True, True, False, True, True, True, False, True, False])
U_MASK = torch.ones(9, 2)


def test_unscorable_rows_are_left_out_of_the_group_baseline_with_advantage_zero():
    rewards = outcome_token_rewards(U_SCORES, U_MASK)
    grpo = get_advantage_estimator("grpo")
    advantages, _ = grpo(rewards, U_MASK, U_GROUPS, config=AdvantageConfig(eps=0.0), scorable=U_SCORABLE)
    s3, s2 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = [(1 / 3) / s3, (-2 / 3) / s3, 0.0, (1 / 3) / s3, -0.5 / s2, 0.5 / s2, 0.0, 0.0, 0.0]
    assert advantages[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(advantages[:, 0], advantages[:, 1])  # broadcast over the tokens
    # without the mask the unscorable reward 5 would be in group a's baseline: mean 7/4, so row 0 would be negative
    unmasked, _ = grpo(rewards, U_MASK, U_GROUPS, config=AdvantageConfig(eps=0.0))
    assert unmasked[0, 0] < 0 < advantages[0, 0]
    # RLOO: r_i - mean of the OTHER scorable samples of its group: a: 1 - 1/2, 0 - 1, 1 - 1/2; b: 0 - 1, 1 - 0
    rloo, _ = get_advantage_estimator("rloo")(rewards, U_MASK, U_GROUPS, config=AdvantageConfig(), scorable=U_SCORABLE)
    assert rloo[:, 0].tolist() == pytest.approx([0.5, -1.0, 0.0, 0.5, -1.0, 1.0, 0.0, 0.0, 0.0])
    # all scorable: exactly the estimator without a mask
    every = torch.ones(9, dtype=torch.bool)
    assert torch.equal(grpo(rewards, U_MASK, U_GROUPS, config=AdvantageConfig(), scorable=every)[0],
                       grpo(rewards, U_MASK, U_GROUPS, config=AdvantageConfig())[0])


def test_unscorable_rows_with_a_critic_and_a_batch_whitening():
    rewards = outcome_token_rewards(U_SCORES, U_MASK)
    values = torch.full((9, 2), 0.25)
    gae = get_advantage_estimator("gae")
    advantages, returns = gae(rewards, U_MASK, None, config=AdvantageConfig(), values=values, scorable=U_SCORABLE)
    # a scorable row: delta_1 = r - 0.25, A_1 = r - 0.25, A_0 = 0 + 0.25 - 0.25 + A_1 = r - 0.25 (gamma = lam = 1)
    assert advantages[0].tolist() == pytest.approx([0.75, 0.75]) and advantages[1].tolist() == pytest.approx([-0.25, -0.25])
    assert advantages[2].tolist() == [0.0, 0.0] and returns[2].tolist() == [0.25, 0.25]  # value target = its value
    # REINFORCE++: whitened over the scorable tokens only (the 5s would shift the batch mean)
    rpp, _ = get_advantage_estimator("reinforce_plus_plus")(rewards, U_MASK, None, config=AdvantageConfig(),
                                                           scorable=U_SCORABLE)
    assert float(rpp[U_SCORABLE].mean()) == pytest.approx(0.0, abs=1e-6) and rpp[~U_SCORABLE].abs().sum() == 0
    with pytest.raises(ValueError, match="scorable has shape"):
        gae(rewards, U_MASK, None, config=AdvantageConfig(), values=values, scorable=U_SCORABLE[:3])
