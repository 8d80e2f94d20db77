"""Pipeline parallelism in the Megatron-core engine (`megatron.pipeline_model_parallel_size`) on CPU over gloo.

The tiny random Llama of conftest.py (2 layers, tied embeddings) split over 2 pipeline stages of one layer
each (stage 0: embedding + layer 0; stage 1: layer 1, final norm and its copy of the tied LM head),
micro-batches through megatron-core's 1F1B schedule (`get_forward_backward_func`), against the FSDP engine
on the same HF weights and batch, with the tolerances of tests/test_megatron.py (`assert_same_as_fsdp`):
log-probs and entropy atol 1e-5 / rtol 1e-4, losses and grad norm rel 1e-4, updated weights (streamed
back under HF names from both stages) atol 1e-5 / rtol 1e-4 (2e-5 with TP=2).

- PP=2, 4 micro-batches: log-probs, one update (loss, grad norm, weights), and the log-probs AFTER the
  update (the last stage's LM head copy moved exactly as the first stage's embedding: they stay tied);
  then save, update, load, update again gives the same update, and the checkpoint resumes at PP=1;
- PP=2 with 1 micro-batch: the same update (1 vs 4 micro-batches through the pipeline);
- TP=2 x PP=2 on 4 ranks (slow), PP=2 x DP=2 (slow), the critic at PP=2 (slow, in test_megatron.py beside its TP=2 twin), a 4-layer untied Llama
  at PP=2 (2 layers per stage, the LM head its own weight; slow), and `rlframe.main` end to end at PP=2
  with the disaggregated weight broadcast (slow).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron import (actor_config, assert_same_as_fsdp, assert_same_weights, grpo_two_steps,  # noqa: E402
                           opposite_advantages, plain_actor, start_actor, tiny_batch, update)
# test_megatron's module fixtures (FSDP references), reached by name through `request.getfixturevalue`
from test_megatron import fsdp_reference  # noqa: E402,F401


@pytest.fixture(scope="module")
def fsdp_after_update(tiny_model_dir):
    """The FSDP engine's log-probs after its one update (fsdp_reference's): what a tied LM head gives."""
    actor = plain_actor(actor_config(tiny_model_dir, 1, 8, strategy="fsdp"), tiny_model_dir)
    batch = tiny_batch(tiny_model_dir)
    actor.update_actor(batch)
    return actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]


def pp_update(tiny_model_dir, tmp_path, world_size: int, micro: int, tp: int = 1, pp: int = 2, checkpoint=None):
    """(update()'s tuple, log-probs after the update[, continued / resumed metrics]) on a Megatron worker group."""
    batch = tiny_batch(tiny_model_dir)
    pool, group, actor = start_actor(actor_config(tiny_model_dir, world_size, micro, tp=tp, pp=pp), tiny_model_dir,
                                     f"megatron_tp{tp}_pp{pp}_m{micro}")
    extra = {}
    try:
        described = actor.describe()
        assert described[0]["strategy"] == "megatron"
        first = update(actor, batch, tmp_path / "first")
        after = actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]
        if checkpoint is not None:
            second = opposite_advantages(batch)
            actor.save_checkpoint(str(checkpoint))
            extra["continued"] = actor.update_actor(second).meta_info["metrics"]
            actor.save_hf(str(tmp_path / "continued"))
            assert actor.load_checkpoint(str(checkpoint))[0]["optimizer_steps"] == 1
            extra["resumed"] = actor.update_actor(second).meta_info["metrics"]
            actor.save_hf(str(tmp_path / "resumed"))
    finally:
        group.shutdown()
        pool.remove()
    return first, after, extra


def test_pp2_update_equals_fsdp_and_checkpoint_resumes(ray_session, tiny_model_dir, tmp_path, request,
                                                      fsdp_after_update):
    """PP=2 on 2 ranks, 4 micro-batches through the pipeline: FSDP's log-probs, update and post-update
    log-probs (tied head kept tied); the checkpoint resumes at PP=2 and at PP=1 (another layout)."""
    from safetensors.torch import load_file

    checkpoint = tmp_path / "checkpoint"
    first, after, extra = pp_update(tiny_model_dir, tmp_path, world_size=2, micro=2, checkpoint=checkpoint)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), first)
    torch.testing.assert_close(after, fsdp_after_update, rtol=1e-4, atol=1e-5)
    continued, resumed = extra["continued"], extra["resumed"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-6), key
    continued_weights = load_file(str(tmp_path / "continued" / "model.safetensors"))
    assert_same_weights(continued_weights, load_file(str(tmp_path / "resumed" / "model.safetensors")))
    # the same checkpoint (HF names, Adam moments under HF names) on one rank without a pipeline
    single = plain_actor(actor_config(tiny_model_dir, 1, 4), tiny_model_dir)
    single.load_checkpoint(str(checkpoint))
    on_one = single.update_actor(opposite_advantages(tiny_batch(tiny_model_dir))).meta_info["metrics"]
    single.save_hf(str(tmp_path / "on_one"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert on_one[key] == pytest.approx(continued[key], rel=1e-4), key
    assert_same_weights(continued_weights, load_file(str(tmp_path / "on_one" / "model.safetensors")), 1e-4, 1e-5)


@pytest.mark.slow  # (~30 s; the 4-micro-batch test above runs in CI)
def test_pp2_one_micro_batch_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    """1 micro-batch through the pipeline (no steady 1F1B phase): the same update as 4 micro-batches and FSDP."""
    first, _, _ = pp_update(tiny_model_dir, tmp_path, world_size=2, micro=8)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), first)


@pytest.mark.slow
def test_tp2_pp2_four_ranks_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request, fsdp_after_update):
    """TP=2 x PP=2 on 4 ranks (one model replica): TP shards on each stage, the pipeline between them."""
    first, after, _ = pp_update(tiny_model_dir, tmp_path, world_size=4, micro=2, tp=2)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), first, weight_atol=2e-5)
    torch.testing.assert_close(after, fsdp_after_update, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_pp2_with_data_parallel_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    """PP=2 x DP=2 on 4 ranks: two pipelines, gradients summed over the data-parallel group."""
    first, _, _ = pp_update(tiny_model_dir, tmp_path, world_size=4, micro=2)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), first)


@pytest.mark.slow
def test_grpo_two_steps_on_megatron_pp2(tmp_path, tiny_model_dir):
    """`python -m rlframe.main recipe=grpo_math_megatron` at PP=2 (TP=1) on 2 ranks, one HF rollout engine fed
    by the bucketed broadcast (its plan: the model's weight view, every stage's tensors): the log-prob
    agreement on every step shows the engine holds both stages' trained weights; the checkpoint exports."""
    grpo_two_steps(tmp_path, tiny_model_dir, "disaggregated", tp=1, pp=2)


@pytest.mark.slow
def test_four_layer_untied_pp2_equals_fsdp(ray_session, tmp_path_factory, tmp_path):
    """4 layers, untied LM head: stage 1 numbers global layers 2, 3 as its local 0, 1, and holds lm_head."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers_tokenizer import build_tokenizer

    model_dir = tmp_path_factory.mktemp("four_layer_llama")
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    start = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" in start
    reference = update(plain_actor(actor_config(model_dir, 1, 8, strategy="fsdp"), model_dir), tiny_batch(model_dir),
                       tmp_path / "fsdp")
    first, _, _ = pp_update(model_dir, tmp_path, world_size=2, micro=2)
    assert_same_as_fsdp(reference, first, start=start)
