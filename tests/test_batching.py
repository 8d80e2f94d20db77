"""Dynamic micro-batches by token budget and token balancing across data-parallel ranks."""

import random

import pytest
import torch

from rlframe.algos.batching import balanced_equal_size_partition, split_by_token_budget
from conftest import plain_actor
from rlframe.protocol import DataProto
from rlframe.workers.engine.base import micro_batch_indices


def test_split_by_token_budget_hand_case():
    lengths = [5, 3, 8, 2, 7]
    groups = split_by_token_budget(lengths, max_tokens=10)
    # first-fit decreasing: 8 -> [8]; 7 -> [7]; 5 -> [5]; 3 -> [7,3]; 2 -> [8,2]
    assert sorted(groups) == sorted([[2, 3], [1, 4], [0]])
    assert sorted(i for g in groups for i in g) == list(range(5))


def test_split_by_token_budget_respects_budget_and_oversized_rows():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(20, 120)
        groups = split_by_token_budget(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert sum(lengths[i] for i in g) <= budget or len(g) == 1
    assert split_by_token_budget([100, 1], 10) == [[0], [1]]
    with pytest.raises(ValueError):
        split_by_token_budget([1], 0)


def test_balanced_partition_equal_counts_and_spread_bound():
    rng = random.Random(1)
    for _ in range(500):
        parts = rng.choice([2, 4, 8])
        lengths = [rng.randint(1, 500) for _ in range(parts * rng.randint(1, 10))]
        groups = balanced_equal_size_partition(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert {len(g) for g in groups} == {len(lengths) // parts}
        totals = [sum(lengths[i] for i in g) for g in groups]
        assert max(totals) - min(totals) <= max(lengths)
    # hand case: contiguous chunks would give [100+90, 2+1]; balanced gives equal-ish
    assert sorted(sum([100, 90, 2, 1][i] for i in g) for g in balanced_equal_size_partition([100, 90, 2, 1], 2)) == [92, 101]


def test_fixed_count_micro_batches_group_rows_of_similar_length():
    # real tokens per row 5, 1, 4, 2 -> by length rows 1, 3, 2, 0 -> micro-batches {1, 3} and {0, 2}
    mask = torch.tensor([[1] * 5, [1] + [0] * 4, [1] * 4 + [0], [1] * 2 + [0] * 3])
    data = DataProto.from_dict({"attention_mask": mask})
    assert micro_batch_indices(data, micro_batch_size=2) == [[1, 3], [0, 2]]
    assert micro_batch_indices(data, micro_batch_size=3) == [[1, 2, 3], [0]]


def _batch(vocab):
    from test_actor_data_parallel import synthetic_batch

    return synthetic_batch(vocab)


@pytest.mark.parametrize("max_tokens", [12, 30])
def test_dynamic_micro_batches_give_same_update_as_fixed(tiny_model_dir, max_tokens):
    def gradients(settings):
        # The gradient of the (single) mini-batch, as the optimiser step sees it. Compare gradients, not
        # Adam-updated weights: Adam turns float-level noise in near-zero gradients into lr-sized steps.
        torch.manual_seed(0)
        actor = plain_actor(tiny_model_dir, **settings)
        model, seen = actor.engine.model, {}
        actor.engine.optimizer.register_step_pre_hook(
            lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
        metrics = actor.update_actor(_batch(model.config.vocab_size)).meta_info["metrics"]
        assert all(p.grad is None for p in model.parameters()), "gradients are freed after the update"
        return metrics, seen

    common = dict(lr=1e-3, mini_batch_size=8, shuffle=False, use_kl_loss=True, kl_loss_coef=0.1)
    fixed_metrics, fixed = gradients(dict(micro_batch_size=8, **common))
    dyn_metrics, dynamic = gradients(dict(micro_batch_size=8, max_tokens_per_micro_batch=max_tokens, **common))
    assert fixed_metrics["actor/grad_norm"] == pytest.approx(dyn_metrics["actor/grad_norm"], rel=1e-4)
    assert fixed_metrics["actor/pg_loss"] == pytest.approx(dyn_metrics["actor/pg_loss"], rel=1e-4, abs=1e-7)
    for name in fixed:
        torch.testing.assert_close(fixed[name], dynamic[name], rtol=1e-4, atol=1e-7)
