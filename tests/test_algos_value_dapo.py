"""Clipped value loss, overlong reward shaping and dynamic-sampling group filter, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlframe.algos.dapo import informative_groups, overlong_penalty
from rlframe.algos.value import compute_value_loss


def test_value_loss_clipped_by_hand():
    # one sequence, three tokens, last one masked
    values = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, -1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: V=1, clip(V, -0.5, 0.5)=0.5; (1-2)^2=1, (0.5-2)^2=2.25 -> max 2.25 (clipped term wins)
    # token 1: V=0, clip=0; (0+1)^2=1, (0+1)^2=1 -> 1 (tie: not counted as clipped)
    # token-mean over 2 tokens: 0.5 * (2.25 + 1) / 2 = 0.8125
    loss, metrics = compute_value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.8125)
    assert metrics["vf_clipfrac"] == pytest.approx(0.5)
    assert metrics["vpred_mean"] == pytest.approx(0.5)


def test_value_loss_clip_pessimistic_never_below_unclipped():
    torch.manual_seed(0)
    values, old, returns = torch.randn(3, 4, 5).unbind(0)
    mask = torch.ones(4, 5)
    clipped, _ = compute_value_loss(values, old, returns, mask, cliprange_value=0.1)
    plain, _ = compute_value_loss(values, old, returns, mask, cliprange_value=None)
    assert clipped.item() >= plain.item()
    assert plain.item() == pytest.approx(0.5 * (values - returns).square().mean().item(), rel=1e-6)


def test_value_loss_gradient_zero_when_clipped_side_wins():
    values = torch.tensor([[1.0]], requires_grad=True)
    loss, _ = compute_value_loss(values, torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.5)
    loss.backward()
    assert values.grad.item() == 0.0  # the clipped term (constant in V beyond the range) is the max


def test_value_loss_micro_batch_split_invariance():
    torch.manual_seed(1)
    values, old, returns = torch.randn(3, 8, 6).unbind(0)
    mask = (torch.rand(8, 6) > 0.3).float()
    mask[3] = 0  # a fully masked row
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        agg = {"mode": mode, "num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum()),
               "horizon": 6}
        whole, _ = compute_value_loss(values, old, returns, mask, 0.2, agg=agg)
        parts = sum(compute_value_loss(v, o, r, m, 0.2, agg=agg)[0]
                    for v, o, r, m in zip(values.split(3), old.split(3), returns.split(3), mask.split(3)))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-5)


def test_value_loss_all_masked_is_zero():
    loss, metrics = compute_value_loss(torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), 0.2)
    assert loss.item() == 0.0 and metrics["vf_clipfrac"] == 0.0


def test_overlong_penalty_by_hand():
    # L_max = 10, buffer 4: no penalty up to 6, linear to -1 at 10, -1 beyond
    lengths = torch.tensor([0, 6, 7, 8, 10, 11])
    penalty = overlong_penalty(lengths, max_response_length=10, buffer_len=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_overlong_penalty_bad_buffer():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 10, 0)
    with pytest.raises(ValueError, match="longer than"):
        overlong_penalty(torch.tensor([1]), 10, 11)


def test_informative_groups():
    uids = np.array(["a", "a", "b", "b", "c", "d", "d"], dtype=object)
    scores = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1e-9]
    # a: differ -> keep; b: all equal -> drop; c: group of one -> drop; d: equal within atol -> drop
    assert informative_groups(uids, scores).tolist() == [True, True, False, False, False, False, False]
    assert informative_groups(uids, np.zeros(7)).sum() == 0
    with pytest.raises(ValueError):
        informative_groups(uids, [1.0])


def test_kl_penalized_rewards_by_hand():
    from rlframe.algos.kl import kl_penalized_rewards

    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # k1 = p - q: row 0 -> [0.5, -1.0, (masked)], row 1 -> [1.0, masked, masked]
    rewards, mean_kl = kl_penalized_rewards(scores, log_prob, ref, mask, beta=0.1, kind="k1")
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.1, 0.0, -0.1, 0.0, 0.0])
    # per sequence: (0.5 - 1.0) / 2 = -0.25 and 1.0 / 1 -> mean 0.375
    assert mean_kl.item() == pytest.approx(0.375)
