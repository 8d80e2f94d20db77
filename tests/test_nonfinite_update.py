"""A non-finite loss skips the optimiser step (weights untouched); too many skips in a row stop the
run with the micro-batch where the loss first went non-finite."""

import pytest
import torch

from rlframe.device import detect_profile
from rlframe.workers.actor import PolicyModel, UpdateSettings


def test_nonfinite_updates_are_skipped_then_stop_naming_the_micro_batch(tiny_model_dir):
    from test_actor_data_parallel import synthetic_batch

    settings = UpdateSettings(lr=1e-3, mini_batch_size=8, micro_batch_size=4, shuffle=False, max_consecutive_skips=2)
    policy = PolicyModel(str(tiny_model_dir), detect_profile("cpu", rollout_engine="hf"), train=settings)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    batch = synthetic_batch(policy.model.config.vocab_size)
    # micro-batches group rows by length (real tokens 9, 9, 11, 7, 11, 9, 9, 9): rows 0, 1, 3, 5 go first
    batch.batch["advantages"][0] = float("nan")

    metrics = policy.update(batch)
    assert metrics["actor/skipped_updates"] == 1.0
    for name, value in policy.model.named_parameters():
        assert torch.equal(value.detach(), before[name]), name

    with pytest.raises(FloatingPointError, match=r"2 optimiser steps in a row.*mini-batch 0, micro-batch 0 \(rows \[0, 1, 3, 5\]"):
        policy.update(batch)
