"""Loss aggregation, policy losses and logit helpers against hand-computed numbers."""

import math

import pytest
import torch

from rlframe.algos import (
    AGG_MODES,
    POLICY_LOSS_DEFAULTS,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    log_probs_from_logits,
    policy_loss_config,
    policy_loss_defaults,
)

# ----------------------------------------------------------------------------------------------
# agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LOSS_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is fully masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty rows
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # 7 / (2 rows * T=3)
    ],
)
def test_agg_loss_local_defaults(mode, expected):
    assert agg_loss(LOSS, LOSS_MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_explicit_normalisers():
    assert agg_loss(LOSS, LOSS_MASK, "token-mean", num_tokens=10).item() == pytest.approx(0.7)
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-mean", num_seqs=11).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", num_seqs=4, horizon=7).item() == pytest.approx(0.25)
    assert agg_loss(LOSS, LOSS_MASK, "token-mean", num_tokens=torch.tensor(14.0)).item() == pytest.approx(0.5)


def test_agg_loss_all_masked_is_zero_and_unknown_mode():
    for mode in AGG_MODES:
        assert agg_loss(LOSS, torch.zeros(3, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, LOSS_MASK, "mean")


def _make_batch(seed=0, batch=8, length=5):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2, 5, 3])[:batch]  # row 3 is fully masked
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    old_log_prob = -torch.rand(batch, length, generator=generator) * 2
    log_prob = old_log_prob + 0.3 * torch.randn(batch, length, generator=generator)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, length).contiguous()
    return old_log_prob, log_prob, advantages, mask


def _global_agg(mode, mask):
    return {
        "mode": mode,
        "num_tokens": mask.sum().item(),
        "num_seqs": (mask.sum(-1) > 0).sum().item(),
        "horizon": mask.shape[1],
    }


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_split_gives_same_gradient(mode, loss_name):
    old_log_prob, log_prob, advantages, mask = _make_batch()
    wide = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3} if loss_name == "gspo" else {}  # to see gradients
    config = policy_loss_config(loss_name, **wide)
    loss_fn = get_policy_loss(loss_name)
    agg = _global_agg(mode, mask)

    gradients = []
    for num_micro_batches in (1, 2, 4):
        leaf = log_prob.clone().requires_grad_(True)
        total = 0.0
        for rows in torch.arange(8).chunk(num_micro_batches):
            loss, _ = loss_fn(old_log_prob[rows], leaf[rows], advantages[rows], mask[rows], config=config, agg=agg)
            loss.backward()
            total += loss.item()
        gradients.append((total, leaf.grad.clone()))

    full_loss, full_grad = gradients[0]
    assert full_grad.abs().sum() > 0
    for total, grad in gradients[1:]:
        assert total == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
        assert torch.allclose(grad, full_grad, atol=1e-7)

    # with the default (local) normalisers and one micro-batch we get the same full-batch loss
    local_loss, _ = loss_fn(old_log_prob, log_prob, advantages, mask, config=config, agg={"mode": mode})
    assert local_loss.item() == pytest.approx(full_loss, rel=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_data_parallel_ranks_sum_gradients(mode):
    """Two simulated ranks, two micro-batches each, a shared parameter: sum of rank gradients."""
    old_log_prob, _, advantages, mask = _make_batch(seed=1)
    features = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(2))
    theta = torch.tensor([0.3, -0.2, 0.1])

    def log_prob_of(parameters, rows):
        return old_log_prob[rows] + features[rows] @ parameters

    agg = _global_agg(mode, mask)
    loss_fn = get_policy_loss("vanilla")
    config = PolicyLossConfig()

    reference = theta.clone().requires_grad_(True)
    loss, _ = loss_fn(old_log_prob, log_prob_of(reference, slice(None)), advantages, mask, config=config, agg=agg)
    loss.backward()

    summed = torch.zeros(3)
    for rank_rows in torch.arange(8).chunk(2):
        replica = theta.clone().requires_grad_(True)  # each rank holds its own copy of the parameters
        for rows in rank_rows.chunk(2):
            micro_loss, _ = loss_fn(
                old_log_prob[rows], log_prob_of(replica, rows), advantages[rows], mask[rows], config=config, agg=agg
            )
            micro_loss.backward()
        summed += replica.grad  # all-reduce SUM
    assert reference.grad.abs().sum() > 0
    assert torch.allclose(summed, reference.grad, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# vanilla PPO

# old_log_prob = 0 so ratio = exp(log_prob); last column is masked and holds wild values.
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 100.0], [5.0, 1.1, 1.0, 100.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0], [-1.0, -1.0, 2.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


def test_vanilla_ppo_hand_computed():
    log_prob = RATIOS.log().requires_grad_(True)
    loss, metrics = get_policy_loss("vanilla")(
        torch.zeros(2, 4), log_prob, ADVANTAGES, MASK, config=PolicyLossConfig(), agg={"mode": "token-mean"}
    )
    # per token (clip range [0.8, 1.2], dual clip c = 3):
    #   A= 1, r=1.5: max(-1.5, -1.2) = -1.2  (clipped)
    #   A= 1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  (clipped)
    #   A=-1, r=5  : max( 5.0,  1.2) =  5 -> min(5, 3) = 3  (dual clip)
    #   A=-1, r=1.1: 1.1
    #   A= 2, r=1  : -2
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 1.1 - 2.0) / 6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 6)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 6)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 5.0 + 1.1 + 1.0) / 6)
    expected_kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(5.0) + math.log(1.1)) / 6
    assert metrics["ppo_kl"] == pytest.approx(expected_kl, rel=1e-5)
    loss.backward()
    # d/dlog_prob of -A*r is -A*r on unclipped tokens, 0 on clipped ones; / 6 tokens
    expected_grad = torch.tensor([[0.0, -0.5, 0.0, 0.0], [0.0, 1.1, -2.0, 0.0]]) / 6
    assert torch.allclose(log_prob.grad, expected_grad, atol=1e-6)


def test_vanilla_clip_higher_and_no_dual_clip():
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    log_prob = RATIOS.log()
    loss, metrics = get_policy_loss("vanilla")(torch.zeros(2, 4), log_prob, ADVANTAGES, MASK, config=config)
    # first token now max(-1.5, -1.28) = -1.28 and the r=5 token is no longer capped at 3
    # (max(5, 1.28) = 5)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 5.0 + 1.1 - 2.0) / 6)
    assert metrics["pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(
            torch.zeros(2, 4), log_prob, ADVANTAGES, MASK, config=PolicyLossConfig(clip_ratio_c=1.0)
        )


# ----------------------------------------------------------------------------------------------
# GSPO


def test_gspo_hand_computed():
    old_log_prob = torch.zeros(2, 3)
    log_prob = torch.tensor([[0.1, 0.3, 5.0], [0.0, -0.4, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss, metrics = get_policy_loss("gspo")(
        old_log_prob, log_prob, advantages, mask, config=policy_loss_config("gspo"), agg={"mode": "seq-mean-token-mean"}
    )
    # row 0: s = exp(0.2) = 1.2214 > 1 + 4e-4 -> clipped: loss -1.0004, no gradient
    # row 1: s = exp(-0.2) = 0.8187 < 1 - 3e-4 -> max(-0.8187, -0.9997) = -0.8187 (unclipped)
    s1 = math.exp(-0.2)
    assert loss.item() == pytest.approx((-1.0004 - s1) / 2, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.2) + s1) / 2, rel=1e-6)
    loss.backward()
    # d/dlog_prob_t of -A * s_i,t is -A * s_i; / (n_i = 2) / (2 sequences)
    expected = torch.tensor([[0.0, 0.0, 0.0], [-s1 / 4, -s1 / 4, 0.0]])
    assert torch.allclose(log_prob.grad, expected, atol=1e-6)


def test_gspo_token_form_matches_sequence_form_gradient():
    """With seq-mean-token-mean the straight-through token form gives grad of the sequence objective."""
    old_log_prob, log_prob, advantages, mask = _make_batch(seed=3)
    config = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05)
    token_leaf = log_prob.clone().requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(
        old_log_prob, token_leaf, advantages, mask, config=config, agg={"mode": "seq-mean-token-mean"}
    )
    loss.backward()

    seq_leaf = log_prob.clone().requires_grad_(True)
    lengths = mask.sum(-1)
    non_empty = lengths > 0
    seq_ratio = torch.exp(((seq_leaf - old_log_prob) * mask).sum(-1) / lengths.clamp_min(1))
    seq_advantage = advantages[:, 0]
    per_seq = torch.maximum(-seq_advantage * seq_ratio, -seq_advantage * seq_ratio.clamp(0.95, 1.05))
    reference = per_seq[non_empty].mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(token_leaf.grad, seq_leaf.grad, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# CISPO


def test_cispo_hand_computed():
    old_log_prob = torch.tensor([[-1.0, -1.0, -1.0]])
    ratios = torch.tensor([[2.0, 0.5, 1.0]])
    log_prob = (old_log_prob + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("cispo")(
        old_log_prob, log_prob, advantages, mask, config=policy_loss_config("cispo"), agg={"mode": "token-mean"}
    )
    # weights: min(2, 1.28) = 1.28, 0.5 (no lower bound); l = -w * A * log_prob
    lp = log_prob.detach()[0]
    expected = (-1.28 * 1.0 * lp[0] - 0.5 * -1.0 * lp[1]) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # gradient flows through every token, scaled by the (detached) weight: -w * A / 2
    assert torch.allclose(log_prob.grad, torch.tensor([[-1.28 / 2, 0.5 / 2, 0.0]]))

    # an optional lower bound: max(0.5, 1 - 0.2) = 0.8
    with_low = policy_loss_config("cispo", clip_ratio_low=0.2)
    log_prob.grad = None
    loss, _ = get_policy_loss("cispo")(old_log_prob, log_prob, advantages, mask, config=with_low)
    loss.backward()
    assert torch.allclose(log_prob.grad, torch.tensor([[-1.28 / 2, 0.8 / 2, 0.0]]))


def test_vanilla_needs_a_lower_bound():
    with pytest.raises(ValueError, match="clip_ratio_low"):
        get_policy_loss("vanilla")(torch.zeros(2, 4), RATIOS.log(), ADVANTAGES, MASK,
                                   config=PolicyLossConfig(clip_ratio_low=None))


# ----------------------------------------------------------------------------------------------
# published defaults


def test_each_loss_has_its_published_defaults():
    assert policy_loss_defaults("vanilla") == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                                               "loss_agg_mode": "token-mean"}
    # GSPO: the paper's sequence-ratio range and per-sequence objective; it has no dual clip
    assert policy_loss_defaults("gspo") == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                                            "loss_agg_mode": "seq-mean-token-mean"}
    # CISPO: no lower bound on the weight, an upper one; token-mean over the batch; no dual clip
    assert policy_loss_defaults("cispo") == {"clip_ratio_low": None, "clip_ratio_high": 0.28,
                                             "loss_agg_mode": "token-mean"}
    assert set(POLICY_LOSS_DEFAULTS) == {"vanilla", "gspo", "cispo"}
    # a user's loss gets a whole PolicyLossConfig: vanilla's numbers
    assert policy_loss_defaults("my_loss") == policy_loss_defaults("vanilla")
    # a copy: the table cannot be changed through it
    policy_loss_defaults("gspo")["clip_ratio_low"] = 1.0
    assert POLICY_LOSS_DEFAULTS["gspo"]["clip_ratio_low"] == 3e-4


def test_policy_loss_config_from_defaults():
    assert policy_loss_config("vanilla") == PolicyLossConfig() == PolicyLossConfig(0.2, 0.2, 3.0)
    assert policy_loss_config("gspo") == PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None)
    assert policy_loss_config("cispo", clip_ratio_high=0.5) == PolicyLossConfig(None, 0.5, None)


def test_policy_loss_registry():
    assert {"vanilla", "gspo", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(KeyError, match="available: cispo, gspo"):
        get_policy_loss("ppo2")


# ----------------------------------------------------------------------------------------------
# log-probs and entropy


def test_log_probs_from_logits_matches_log_softmax_and_chunks():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=generator) * 5
    labels = torch.randint(0, 11, (2, 7), generator=generator)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(log_probs_from_logits(logits, labels), expected, atol=1e-5)
    assert torch.allclose(log_probs_from_logits(logits, labels, chunk_size=3), expected, atol=1e-5)
    half = log_probs_from_logits(logits.bfloat16(), labels)
    assert half.dtype == torch.float32
    # gradients flow
    leaf = logits.clone().requires_grad_(True)
    log_probs_from_logits(leaf, labels, chunk_size=4).sum().backward()
    assert torch.allclose(leaf.grad.sum(-1), torch.zeros(2, 7), atol=1e-5)  # d/dz of log softmax sums to 0


def test_log_probs_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax = [0.25, 0.75]
    result = log_probs_from_logits(logits, torch.tensor([1]))
    assert result.item() == pytest.approx(math.log(0.75))


def test_entropy_from_logits():
    uniform = torch.zeros(3, 8)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(8)] * 3)
    two_point = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two_point).item() == pytest.approx(expected, rel=1e-6)
    huge = torch.tensor([[1e4, 0.0, -1e4]])  # nearly one-hot: entropy 0, no NaN
    assert entropy_from_logits(huge).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(2, 5, 13)
    reference = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=3), reference, atol=1e-5)
