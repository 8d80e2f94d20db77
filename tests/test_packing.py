"""Padding-free (packed) forward gives the same response log-probs and entropies as the padded one."""

import torch

from rlframe.workers.model import forward_response_log_probs


def test_packed_equals_padded(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    batch, prompt, response = 4, 7, 6
    prompt_lengths, response_lengths = [7, 3, 5, 1], [6, 2, 4, 1]
    input_ids = torch.randint(3, model.config.vocab_size, (batch, prompt + response), generator=g)
    attention_mask = torch.zeros(batch, prompt + response, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        attention_mask[b, prompt - p: prompt + r] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = forward_response_log_probs(model, input_ids, attention_mask, position_ids, response,
                                            temperature=0.7, with_entropy=True)
        packed = forward_response_log_probs(model, input_ids, attention_mask, position_ids, response,
                                            temperature=0.7, with_entropy=True, packed=True)
    response_mask = attention_mask[:, prompt:].float()
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a * response_mask, b, rtol=1e-4, atol=1e-5)
    assert (packed[0][response_mask == 1] < 0).all()
