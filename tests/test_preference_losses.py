"""DPO, IPO, SimPO, ORPO, KTO, RRHF, Bradley-Terry and the SFT loss against numbers computed by hand."""

import math

import pytest
import torch

from rlframe.algos.preference import (bradley_terry_loss, kto_loss, preference_loss, rrhf_loss, sequence_log_probs,
                                      sft_loss)

T = torch.tensor


def test_sequence_log_probs_sum_and_length_normalised():
    lp, mask = T([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]), T([[1, 1, 0], [1, 0, 0]])
    assert sequence_log_probs(lp, mask).tolist() == [-3.0, -4.0]
    assert sequence_log_probs(lp, mask, length_normalize=True).tolist() == [-1.5, -4.0]


def test_dpo_sigmoid_by_hand():
    # r_w = -1 - (-2) = 1, r_l = -3 - (-2) = -1; beta (r_w - r_l) = 0.5 * 2 = 1 -> log(1 + e^-1)
    losses, stats = preference_loss(T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0]), loss_type="sigmoid", beta=0.5)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-1)))  # 0.3132617
    assert stats["chosen_rewards"].item() == pytest.approx(0.5)
    assert stats["rejected_rewards"].item() == pytest.approx(-0.5)


def test_dpo_label_smoothing_by_hand():
    losses, _ = preference_loss(T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0]), beta=0.5, label_smoothing=0.1)
    # 0.9 log(1 + e^-1) + 0.1 log(1 + e^1)
    assert losses.item() == pytest.approx(0.9 * 0.31326169 + 0.1 * 1.31326169, rel=1e-6)


def test_dpo_equal_policy_and_reference_gives_log2():
    losses, _ = preference_loss(T([-5.0, -1.0]), T([-2.0, -7.0]), T([-5.0, -1.0]), T([-2.0, -7.0]), beta=0.3)
    assert losses.tolist() == pytest.approx([math.log(2)] * 2)


def test_ipo_by_hand():
    # r_w - r_l = 2; beta 0.5: (2 - 1)^2 = 1; beta 0.25: (2 - 2)^2 = 0
    args = (T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0]))
    assert preference_loss(*args, loss_type="ipo", beta=0.5)[0].item() == pytest.approx(1.0)
    assert preference_loss(*args, loss_type="ipo", beta=0.25)[0].item() == pytest.approx(0.0)


def test_simpo_is_reference_free_by_hand():
    # beta (pi_w - pi_l) - gamma = 2 * 2 - 1 = 3 -> log(1 + e^-3)
    losses, stats = preference_loss(T([-1.0]), T([-3.0]), None, None, loss_type="simpo", beta=2.0, gamma=1.0)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-3)))  # 0.0485874
    assert stats["chosen_rewards"].item() == pytest.approx(-2.0)


def test_reference_losses_need_the_reference():
    with pytest.raises(ValueError, match="reference"):
        preference_loss(T([-1.0]), T([-3.0]), None, None, loss_type="sigmoid")
    with pytest.raises(ValueError, match="unknown preference loss"):
        preference_loss(T([-1.0]), T([-3.0]), None, None, loss_type="kto")


def test_orpo_by_hand():
    # mean log-probs log 0.5 and log 0.25: odds 1 and 1/3, log odds ratio log 3; s(log 3) = 3/4
    # loss = NLL(chosen) - beta log s(log 3) = log 2 - 0.1 log 0.75
    losses, stats = preference_loss(T([math.log(0.5)]), T([math.log(0.25)]), None, None, loss_type="orpo", beta=0.1)
    assert losses.item() == pytest.approx(math.log(2) - 0.1 * math.log(0.75))  # 0.7219155
    assert stats["chosen_rewards"].item() == pytest.approx(0.1 * math.log(0.5))


def test_kto_by_hand():
    # r = pi - ref = [1, 0, -1]; mean 0 -> z0 = 0; beta 1
    losses, stats = kto_loss(T([-1.0, -2.0, -3.0]), T([-2.0, -2.0, -2.0]), T([1, 1, 0]), beta=1.0, undesirable_weight=2.0)
    s1 = 1 / (1 + math.exp(-1))
    assert losses.tolist() == pytest.approx([1 - s1, 0.5, 2 * (1 - s1)])  # 0.2689, 0.5, 0.5379
    assert stats["kl"].item() == 0.0
    # r = [1, 2]: z0 = 1.5; beta 2: desirable 1 - s(2 (1 - 1.5)), undesirable 1 - s(2 (1.5 - 2))
    losses, stats = kto_loss(T([-1.0, -1.0]), T([-2.0, -3.0]), T([True, False]), beta=2.0)
    assert losses.tolist() == pytest.approx([1 - 1 / (1 + math.e)] * 2)  # 0.7311 each
    assert stats["kl"].item() == pytest.approx(1.5)
    # a negative mean reward is clamped: z0 = max(0, -1) = 0
    assert kto_loss(T([-3.0]), T([-2.0]), T([1]))[1]["kl"].item() == 0.0


def test_rrhf_by_hand():
    # group 0: p = [-1, -2, -0.5], q = [1, 0, 0.5]: only (q_0 > q_2, p_2 > p_0) is out of order: 0.5;
    # best is row 0: NLL 1. Group 1: tied scores, no ranking term; best = its first row: NLL 3.
    total, stats = rrhf_loss(T([-1.0, -2.0, -0.5, -3.0, -1.0]), T([1.0, 0.0, 0.5, 0.0, 0.0]), T([0, 0, 0, 1, 1]))
    assert total.item() == pytest.approx(0.5 + 1.0 + 3.0)
    assert stats["rank_loss"].item() == pytest.approx(0.5) and stats["nll_best"].item() == pytest.approx(4.0)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = T([-2.0], requires_grad=True), T([-2.0], requires_grad=True)
    preference_loss(chosen, rejected, T([-2.0]), T([-2.0]), beta=1.0)[0].sum().backward()
    # d/dx -log s(x) at 0 = -0.5; x = chosen - rejected
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_bradley_terry_by_hand():
    assert bradley_terry_loss(T([1.5]), T([0.5])).item() == pytest.approx(math.log(1 + math.exp(-1)))
    assert bradley_terry_loss(T([1.5]), T([0.5]), margin=1.0).item() == pytest.approx(math.log(2))


def test_sft_loss_token_mean_and_mask_by_hand():
    lp, mask = T([[-1.0, -2.0], [-4.0, -9.0]]), T([[1, 1], [1, 0]])  # the -9 is masked out (a prompt token)
    agg = {"mode": "token-mean", "num_tokens": 3.0, "num_seqs": 2.0, "horizon": 2}
    assert sft_loss(lp, mask, agg).item() == pytest.approx(7 / 3)
    agg["mode"] = "seq-mean-token-mean"  # (1.5 + 4) / 2
    assert sft_loss(lp, mask, agg).item() == pytest.approx(2.75)
