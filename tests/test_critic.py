"""The critic as a plain object (no Ray, one process): value alignment, zero start, learning, head LR."""

from __future__ import annotations

import torch

from conftest import plain_critic
from rlframe.protocol import DataProto


def _batch(prompt_width=5, response_width=4, rows=4, vocab=50):
    torch.manual_seed(0)
    prompts = torch.randint(3, vocab, (rows, prompt_width))
    prompt_mask = torch.ones(rows, prompt_width, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    responses = torch.randint(3, vocab, (rows, response_width))
    response_mask = torch.ones(rows, response_width)
    response_mask[1, 2:] = 0  # a short response
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask})


def test_critic_starts_at_zero_learns_returns_and_keeps_alignment(tiny_model_dir):
    role = plain_critic(tiny_model_dir, lr=1e-4, head_lr=1e-2, mini_batch_size=4, micro_batch_size=2, epochs=1,
                        cliprange_value=0.0)
    critic = role.engine

    def compute_values(data):
        return role.compute_values(data).batch["values"]

    def update(data, step):
        data.meta_info["step"] = step
        return role.update_critic(data).meta_info["metrics"]

    data = _batch()
    values = compute_values(data)
    assert values.shape == (4, 4) and torch.count_nonzero(values) == 0  # zero-initialised head
    data.batch["values"] = values
    data.batch["returns"] = torch.full((4, 4), 0.5) * data.batch["response_mask"]
    losses = [update(data, step)["critic/vf_loss"] for step in range(30)]
    assert losses[-1] < 0.2 * losses[0]
    assert critic.optimizer_steps == 30
    after = compute_values(data)
    mask = data.batch["response_mask"].bool()
    assert (after[mask] - 0.5).abs().mean() < 0.1
    assert torch.count_nonzero(after[~mask]) == 0  # masked positions stay 0
    # alignment: the value of response token t depends only on the tokens before it
    changed = data[[2]]
    changed.batch["input_ids"][0, -1] = (changed.batch["input_ids"][0, -1] + 1) % 50
    v_changed = compute_values(changed)
    assert torch.allclose(v_changed[0], after[2], atol=1e-5)
    # the head has its own learning rate
    assert [g["lr"] for g in critic.optimizer.param_groups] == [1e-4, 1e-2]
