"""Padding-free (packed) forward gives the same response log-probs, entropies and gradients as the
padded one, with transformers' own SDPA masking and with rlframe's VARLEN_SDPA attention."""

import pytest
import torch

from rlframe.workers.attention import VARLEN_SDPA, packed_layout, register_varlen_attention
from rlframe.workers.engine.hf_model import forward_response_log_probs

BATCH, PROMPT, RESPONSE = 4, 7, 6
PROMPT_LENGTHS, RESPONSE_LENGTHS = [7, 3, 5, 1], [6, 2, 4, 1]


def _inputs(vocab_size):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (BATCH, PROMPT + RESPONSE), generator=g)
    attention_mask = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.long)
    for b, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        attention_mask[b, PROMPT - p: PROMPT + r] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _load(path, attn_implementation):
    from transformers import AutoModelForCausalLM

    if attn_implementation == VARLEN_SDPA:
        register_varlen_attention()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)


def test_packed_layout_hand_case():
    # sequences of 2, 3 and 1 tokens -> grid of 3 x 3 slots
    slots, num_sequences, longest = packed_layout(torch.tensor([0, 1, 0, 1, 2, 0]))
    assert (num_sequences, longest) == (3, 3)
    assert slots.tolist() == [0, 1, 3, 4, 5, 6]


@pytest.mark.parametrize("packed_attention", ["sdpa", VARLEN_SDPA])
def test_packed_equals_padded(tiny_model_dir, packed_attention):
    padded_model = _load(tiny_model_dir, "sdpa").eval()
    packed_model = _load(tiny_model_dir, packed_attention).eval()
    input_ids, attention_mask, position_ids = _inputs(padded_model.config.vocab_size)
    with torch.no_grad():
        padded = forward_response_log_probs(padded_model, input_ids, attention_mask, position_ids, RESPONSE,
                                            temperature=0.7, with_entropy=True)
        packed = forward_response_log_probs(packed_model, input_ids, attention_mask, position_ids, RESPONSE,
                                            temperature=0.7, with_entropy=True, packed=True)
    response_mask = attention_mask[:, PROMPT:].float()
    # Reference straight from the full logits of each row on its own (no trimming, no logits_to_keep).
    expected = torch.zeros(BATCH, RESPONSE)
    for b, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        ids = input_ids[b: b + 1, PROMPT - p: PROMPT + r]
        with torch.no_grad():
            logits = padded_model(input_ids=ids).logits[0, p - 1: p + r - 1] / 0.7
        expected[b, :r] = torch.log_softmax(logits, -1).gather(-1, ids[0, p:, None])[:, 0]
    torch.testing.assert_close(padded[0] * response_mask, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a * response_mask, b, rtol=1e-4, atol=1e-5)
    assert (packed[0][response_mask == 1] < 0).all()


def test_varlen_attention_gradients_equal_padded(tiny_model_dir):
    padded_model = _load(tiny_model_dir, "sdpa")
    packed_model = _load(tiny_model_dir, VARLEN_SDPA)
    input_ids, attention_mask, position_ids = _inputs(padded_model.config.vocab_size)
    weights = torch.linspace(0.5, 1.5, BATCH * RESPONSE).view(BATCH, RESPONSE) * attention_mask[:, PROMPT:]
    for model, packed in ((padded_model, False), (packed_model, True)):
        log_probs, _ = forward_response_log_probs(model, input_ids, attention_mask, position_ids, RESPONSE,
                                                  packed=packed)
        (log_probs * weights).sum().backward()
    compared = 0
    for (name, a), (_, b) in zip(padded_model.named_parameters(), packed_model.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
            compared += 1
    assert compared > 10
