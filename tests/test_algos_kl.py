"""KL estimators and coefficient controllers against hand-computed numbers."""

import math

import pytest
import torch

from rlframe.algos import AdaptiveKLController, FixedKLController, build_kl_controller, kl_penalty

# p = policy log-prob, q = reference log-prob; p - q = [0.5, -0.5, 0]
P = torch.tensor([[0.0, -1.0, -2.0]])
Q = torch.tensor([[-0.5, -0.5, -2.0]])


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [0.5, -0.5, 0.0]),
        (("abs",), [0.5, 0.5, 0.0]),
        (("k2", "mse"), [0.125, 0.125, 0.0]),
        # q - p = [-0.5, 0.5, 0]: exp(-0.5) + 0.5 - 1, exp(0.5) - 0.5 - 1, 0
        (("k3", "low_var_kl"), [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]),
    ],
)
def test_kl_kinds(kinds, expected):
    for kind in kinds:
        kl = kl_penalty(P, Q, kind)
        assert kl.shape == P.shape
        assert kl[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_k3_is_clamped():
    log_prob = torch.tensor([0.0, 30.0, 0.0])
    ref_log_prob = torch.tensor([30.0, 0.0, 3.0])
    kl = kl_penalty(log_prob, ref_log_prob, "k3")
    # q - p = 30 -> clamped to 20 -> exp(20) - 21 -> clamped to 10
    # q - p = -30 -> clamped to -20 -> exp(-20) + 19 -> clamped to 10
    # q - p = 3 -> exp(3) - 4 = 16.09 -> clamped to 10
    assert kl.tolist() == pytest.approx([10.0, 10.0, 10.0])
    assert torch.isfinite(kl).all()
    small = kl_penalty(torch.tensor([0.0]), torch.tensor([1.0]), "k3")
    assert small.item() == pytest.approx(math.exp(1) - 2)


def test_k3_gradient_is_finite_when_clamped():
    log_prob = torch.tensor([0.0, 50.0], requires_grad=True)
    kl_penalty(log_prob, torch.tensor([50.0, 0.0]), "k3").sum().backward()
    assert torch.isfinite(log_prob.grad).all()


def test_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(P, Q, "k4")


def test_fixed_controller():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_controller():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # error = clip(9/6 - 1, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 256 / 10000)
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.value == pytest.approx(0.1 * 1.00512)
    # at the target nothing changes
    controller.update(current_kl=6.0, n_steps=256)
    assert controller.value == pytest.approx(0.1 * 1.00512)
    # error = clip(6.3/6 - 1) = 0.05 (inside the clip) -> * (1 + 0.05 * 2000 / 10000)
    controller.update(current_kl=6.3, n_steps=2000)
    assert controller.value == pytest.approx(0.1 * 1.00512 * 1.01)
    # error = clip(3/6 - 1) = -0.2 -> * (1 - 0.2 * 1000 / 10000)
    controller.update(current_kl=3.0, n_steps=1000)
    assert controller.value == pytest.approx(0.1 * 1.00512 * 1.01 * 0.98)


def test_build_kl_controller():
    assert isinstance(build_kl_controller("fixed", 0.01), FixedKLController)
    adaptive = build_kl_controller("adaptive", 0.01, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.01
    with pytest.raises(ValueError, match="target_kl and horizon"):
        build_kl_controller("adaptive", 0.01)
    with pytest.raises(ValueError, match="fixed"):
        build_kl_controller("pid", 0.01)
