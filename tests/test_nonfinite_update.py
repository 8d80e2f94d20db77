"""A non-finite loss skips the optimiser step (weights untouched); too many skips in a row stop the
run with the micro-batch where the loss first went non-finite."""

import pytest
import torch

from conftest import plain_actor


def test_nonfinite_updates_are_skipped_then_stop_naming_the_micro_batch(tiny_model_dir):
    from test_actor_data_parallel import synthetic_batch

    actor = plain_actor(tiny_model_dir, lr=1e-3, mini_batch_size=8, micro_batch_size=4, shuffle=False,
                        max_consecutive_skips=2)
    model = actor.engine.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = synthetic_batch(model.config.vocab_size)
    # micro-batches group rows by length (real tokens 9, 9, 11, 7, 11, 9, 9, 9): rows 0, 1, 3, 5 go first
    batch.batch["advantages"][0] = float("nan")

    metrics = actor.update_actor(batch).meta_info["metrics"]
    assert metrics["actor/skipped_updates"] == 1.0
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), before[name]), name

    with pytest.raises(FloatingPointError, match=r"2 optimiser steps in a row.*mini-batch 0, micro-batch 0 \(rows \[0, 1, 3, 5\]"):
        actor.update_actor(batch)


def test_critic_stops_after_repeated_nonfinite_updates(tiny_model_dir):
    """trainer.max_consecutive_skipped_updates holds for the critic too (the engine's guarded step)."""
    from conftest import plain_critic
    from test_critic import _batch

    critic = plain_critic(tiny_model_dir, lr=1e-3, mini_batch_size=4, micro_batch_size=2, max_consecutive_skips=2)
    model = critic.engine.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = _batch()
    data.batch["values"] = critic.compute_values(data).batch["values"]
    data.batch["returns"] = torch.full((4, 4), 0.5) * data.batch["response_mask"]
    data.batch["returns"][1, 0] = float("nan")
    metrics = critic.update_critic(data).meta_info["metrics"]
    assert metrics["critic/skipped_updates"] == 1.0
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), before[name]), name
    with pytest.raises(FloatingPointError, match=r"critic: gradient norm was nan for 2 optimiser steps in a row.*"
                                                 r"Fix: lower critic.optim.lr"):
        critic.update_critic(data)
