"""The pre-flight memory plan (rlframe/memory_plan.py) on hand-computed cases, its refusal, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlframe.config import ConfigError
from rlframe.main import compose_config
from rlframe.memory_plan import (GIB, ModelShape, check_memory, cpu_kv_cache_gib, fixes_that_fit, memory_problems,
                                 plan_memory)

SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def test_parameter_counts_match_the_published_sizes():
    # SmolLM2-135M: 49152*576 (tied) + 30 * (2*576*576 + 2*576*192 + 3*576*1536 + 2*576) + 576
    assert ModelShape.from_hf_config(SMOLLM2_135M).params == 134_515_008
    # Qwen2.5-7B: 2*152064*3584 + 28 * (2*3584^2 + 2*3584*512 + 3584 + 2*512 + 3*3584*18944 + 2*3584) + 3584
    assert ModelShape.from_hf_config(QWEN25_7B).params == 7_615_616_512


def test_cpu_kv_cache_is_what_the_engine_can_fill_at_most_the_configured_size():
    tiny = ModelShape.from_hf_config({"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
                                      "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 300})
    # 256 sequences x ceil(272 / 128) = 3 blocks of 128 tokens x 2 (K, V) x 2 layers x 2 heads x 64 x 4 bytes
    assert cpu_kv_cache_gib(1.0, tiny, 272) == 256 * 384 * 2 * 2 * 2 * 64 * 4 / 2**30 == 0.1875
    assert cpu_kv_cache_gib(0.1, tiny, 272) == 0.1  # the configured size caps it
    # TP 2: 512 sequences over two ranks holding one KV head each: the same bytes per rank
    assert cpu_kv_cache_gib(1.0, tiny, 272, tp=2) == 0.1875
    # TP 4 over 2 KV heads: each rank keeps a whole head (replicated), for 1024 sequences
    assert cpu_kv_cache_gib(1.0, tiny, 272, tp=4) == 0.375
    # SmolLM2-135M (the main job): 256 x 512 x 2 x 30 x 3 x 64 x 4 = 5.6 GiB would fit: the configured 1 GiB stands
    assert cpu_kv_cache_gib(1.0, ModelShape.from_hf_config(SMOLLM2_135M), 512) == 1.0
    # latent or linear attention is not one K and V per layer and token: the configured size
    latent = ModelShape.from_hf_config({**SMOLLM2_135M, "kv_lora_rank": 512})
    assert not latent.plain_attention and cpu_kv_cache_gib(1.0, latent, 16) == 1.0


def toy_config(*overrides):
    return compose_config(["recipe=grpo_math", "trainer.device=cpu", *overrides])


# 2^27 parameters: 0.5 GiB in fp32, 0.25 GiB in bf16; one layer of 2^24 (vocab*hidden = 2^20 ... see below)
TOY = ModelShape(params=2**27, layers=4, hidden=256, intermediate=512, vocab=4096, heads=4, kv_heads=4, head_dim=64)


def test_gpu_colocated_plan_by_hand():
    cfg = toy_config("actor.world_size=4", "actor.ppo_micro_batch_size_per_device=2",
                     "actor.log_prob_micro_batch_size_per_device=2", "data.max_prompt_length=96",
                     "data.max_response_length=32", "rollout.gpu_memory_utilization=0.5")
    plan = plan_memory(cfg, TOY, gpu=True, capacity_gib=8.0)
    (device,) = plan.devices
    items = {(i.role, i.what.split(" (")[0]): i.gib for i in device.items}
    P, W = 2**27, 4
    assert items[("actor", "fp32 master weights")] == pytest.approx(4 * P / W / GIB)  # 0.125
    assert items[("actor", "fp32 gradients")] == pytest.approx(4 * P / W / GIB)
    assert items[("actor", "AdamW moments")] == pytest.approx(8 * P / W / GIB)  # 0.25
    assert items[("ref", "bf16 weights")] == pytest.approx(2 * P / W / GIB)  # 0.0625
    layer = (P - 4096 * 256) // 4  # parameters of one decoder layer
    assert items[("actor", "FSDP-gathered layers")] == pytest.approx(2 * layer * 2 / GIB)
    tokens = 2 * (96 + 32)  # micro-batch of 2 sequences
    per_token_layer = 10 * 256 + 5 * 256 + 4 * 512
    assert items[("actor", "activations for backward")] == pytest.approx(4 * tokens * per_token_layer * 2 / GIB)
    assert items[("actor", "fp32 logits + log-softmax")] == pytest.approx(2 * (2 * 32) * 4096 * 4 / GIB)
    assert items[("rollout", "vLLM weights")] == pytest.approx(2 * P / GIB)  # 0.25, TP 1
    assert items[("rollout", "vLLM KV cache + buffers")] == pytest.approx(0.5 * 8.0 - 2 * P / GIB)
    # generation: resident trainer state (actor weights + Adam, ref weights) + the engine's 50% of 8 GiB
    assert device.phase_gib("generation") == pytest.approx((4 * P / W + 8 * P / W + 2 * P / W) / GIB + 4.0)
    # update: resident + gradients + the actor's pass (gathered layers, activations, logits); the engine sleeps
    actor_pass = items[("actor", "FSDP-gathered layers")] + items[("actor", "activations for backward")] \
        + items[("actor", "fp32 logits + log-softmax")]
    assert items[("ref", "fp32 logits, forward")] == pytest.approx(2 * (2 * 32) * 4096 * 4 / GIB)
    assert device.phase_gib("update") == pytest.approx((4 * P / W + 8 * P / W + 2 * P / W + 4 * P / W) / GIB + actor_pass)
    assert device.peak[0] == "generation" and device.fits()


def test_a_plan_that_does_not_fit_names_role_device_estimate_and_a_fix_that_fits():
    cfg = toy_config("actor.world_size=1", "actor.ppo_micro_batch_size_per_device=16")
    shape = ModelShape.from_hf_config(QWEN25_7B)
    plan = plan_memory(cfg, shape, gpu=True, capacity_gib=80.0)
    assert not plan.fits()
    fixes = fixes_that_fit(cfg, shape, gpu=True, capacity_gib=80.0)
    (problem,) = memory_problems(plan, fixes)
    assert "GPU of the colocated pool" in problem and "the actor's" in problem and "80.0 GiB" in problem
    assert f"{plan.devices[0].peak[1]:.1f} GiB" in problem
    if fixes:  # each suggestion, applied, must fit (a single 7B actor on one 80 GiB GPU may not fit at all)
        assert "Fix: " + " or ".join(fixes) in problem
    else:
        assert "more devices" in problem
    # the same model sharded over 8 GPUs with checkpointing fits
    cfg8 = toy_config("actor.world_size=8", "model.gradient_checkpointing=true", "actor.ppo_micro_batch_size_per_device=4")
    assert plan_memory(cfg8, shape, gpu=True, capacity_gib=80.0).fits()


def test_suggested_fixes_make_the_plan_fit():
    long = ["actor.world_size=8", "actor.ppo_micro_batch_size_per_device=4", "data.max_prompt_length=1024",
            "data.max_response_length=8192"]
    cfg = toy_config(*long)
    shape = ModelShape.from_hf_config(QWEN25_7B)
    assert not plan_memory(cfg, shape, gpu=True, capacity_gib=80.0).fits()
    fixes = fixes_that_fit(cfg, shape, gpu=True, capacity_gib=80.0)
    assert fixes
    overrides = [o for fix in fixes[-1:] for o in fix.split()]
    fixed = toy_config(*long, *overrides)
    assert plan_memory(fixed, shape, gpu=True, capacity_gib=80.0).fits()


def test_cpu_plan_sums_the_processes_of_a_node(tiny_model_dir):
    one = plan_memory(toy_config(), ModelShape.from_hf_config(SMOLLM2_135M), gpu=False, capacity_gib=24.0)
    two = plan_memory(toy_config("actor.world_size=2"), ModelShape.from_hf_config(SMOLLM2_135M), gpu=False,
                      capacity_gib=24.0)
    (node1,), (node2,) = one.devices, two.devices
    # every rank has its own runtime, weights, Adam, engine: the second process adds nearly a first one's
    assert node2.phase_gib("generation") > 1.8 * (node1.phase_gib("generation") - 1.5)


def test_refused_before_any_worker_starts(tiny_model_dir, capsys):
    cfg = compose_config(["recipe=grpo_math", f"model.path={tiny_model_dir}", "trainer.device=cpu",
                          "trainer.device_memory_gib=1"])
    with pytest.raises(ConfigError, match=r"RAM of a node .* would need .* GiB .* more than 92% of its 1.0 GiB"):
        check_memory(cfg, str(tiny_model_dir))
    assert "memory plan (cpu" in capsys.readouterr().out
    cfg.trainer.memory_check = "warn"
    check_memory(cfg, str(tiny_model_dir))
    assert "warning: memory plan" in capsys.readouterr().out


def test_plan_command_prints_the_table_without_starting_anything(tmp_path):
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    out = subprocess.run([sys.executable, "-m", "rlframe.plan", "recipe=grpo_math", f"model.path={model}",
                          "trainer.device=cuda", "trainer.device_memory_gib=80", "actor.world_size=8",
                          "trainer.devices_per_node=8", "model.gradient_checkpointing=true"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model 7.62 B params, 28 layers" in out.stdout
    assert "GPU of the colocated pool" in out.stdout and "-> fits" in out.stdout


def test_offload_params_keeps_weights_gradients_and_adam_off_the_gpu():
    cfg = toy_config("actor.world_size=4", "actor.offload_params=true", "actor.offload_optimizer=true",
                     "algorithm.use_kl_loss=false")
    (device,) = plan_memory(cfg, TOY, gpu=True, capacity_gib=8.0).devices
    resident = [i for i in device.items if i.role == "actor" and not i.transient and i.phases]
    assert resident == []  # nothing of the actor stays on the device between or during phases
    passes = sum(i.gib for i in device.items if i.role == "actor" and "update" in i.phases)
    assert device.phase_gib("update") == pytest.approx(passes)


def test_suggested_fixes_skip_settings_already_made():
    cfg = toy_config("actor.world_size=1", "model.gradient_checkpointing=true", "actor.ppo_micro_batch_size_per_device=16")
    fixes = fixes_that_fit(cfg, ModelShape.from_hf_config(QWEN25_7B), gpu=True, capacity_gib=80.0)
    assert not any("gradient_checkpointing" in fix for fix in fixes)


def test_audio_encoder_parameters_match_the_tiny_qwen2_audio():
    import torch  # noqa: F401  (transformers' model classes)
    from transformers import Qwen2AudioForConditionalGeneration

    from rlframe.models.tiny_audio import build_tokenizer, tiny_audio_config

    config = tiny_audio_config(build_tokenizer())
    shape = ModelShape.from_hf_config(config.to_dict())
    # d 32, ffn 64, 2 layers, 128 mel bins, 1500 positions (30 s), text hidden 64:
    # convolutions 128*3*32 + 32 + 3*32*32 + 32 and the position table 1500*32 = 63424;
    # a layer 4*32^2 + 3*32 (attention) + 4*32 (norms) + 2*32*64 + 64 + 32 (MLP) = 8512, two: 17024;
    # the final norm 64; the projector 32*64 + 64 = 2112
    assert shape.audio_params == 63424 + 17024 + 64 + 2112 == 82624
    assert (shape.audio_hidden, shape.audio_ffn, shape.audio_layers, shape.audio_positions) == (32, 64, 2, 1500)
    assert shape.audio_tokens_per_window == 750  # 30 s: (1500 - 2) // 2 + 1
    model = Qwen2AudioForConditionalGeneration(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert shape.audio_params == count(model.model.audio_tower) + count(model.model.multi_modal_projector) == 80512 + 2112
    assert shape.params == count(model)  # the language model (its LM head apart from the embedding) + the audio encoder


AUDIO_TOY = ModelShape(params=2**27, layers=4, hidden=256, intermediate=512, vocab=4096, heads=4, kv_heads=4,
                       head_dim=64, audio_params=41024, audio_hidden=32, audio_ffn=64, audio_layers=2,
                       audio_positions=200)


def test_audio_encoder_activations_by_hand():
    def audio_item(*overrides):
        cfg = toy_config("actor.world_size=1", "actor.ppo_micro_batch_size_per_device=2", "data.max_response_length=32",
                         *overrides)
        (device,) = plan_memory(cfg, AUDIO_TOY, gpu=False, capacity_gib=64.0).devices
        (item,) = [i for i in device.items if i.what.startswith("audio encoder activations")]
        return item

    # per audio: 200 positions x (2 layers x (8*32 + 2*64) + 6*32) = 200 x 960 = 192000 elements, fp32 on CPU
    per_audio = 200 * (2 * (8 * 32 + 2 * 64) + 6 * 32)
    assert AUDIO_TOY.audio_activation_elements_per_audio() == per_audio == 192_000
    # 96 prompt tokens hold ceil(96 / 100) = 1 window per sequence; a micro-batch of 2 sequences: 2 audios
    item = audio_item("data.max_prompt_length=96")
    assert item.gib == pytest.approx(2 * per_audio * 4 / GIB) and "<= 2 audios" in item.what
    assert item.phases == ("update",) and item.transient
    # 250 prompt tokens: ceil(250 / 100) = 3 windows per sequence, 6 audios
    assert audio_item("data.max_prompt_length=250").gib == pytest.approx(6 * per_audio * 4 / GIB)
    # a text model has no such item
    (device,) = plan_memory(toy_config(), TOY, gpu=False, capacity_gib=64.0).devices
    assert not any("audio" in i.what for i in device.items)
