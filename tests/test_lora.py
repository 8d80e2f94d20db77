"""LoRA on the FSDP engine (workers/engine/lora.py), in one process, on the tiny random Llama.

The actor role runs as a plain object (no Ray): adapters over a frozen base, the reference policy
as the same model with adapters disabled, merged and adapter-only weight sync into the HF engine,
adapter checkpoints and their export, and the configuration errors raised before any worker starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import CPU_DEVICE, run_main
from test_actor_data_parallel import synthetic_batch

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def lora_actor(model_dir, *, rank=4, lr=1e-2, packed="true", gradient_checkpointing=False, rollout_sync=None,
               use_kl_loss=True, seed=0, **lora):
    """The actor role with LoRA adapters (rank 0: full fine-tuning), as a plain object.

    rollout_sync: None (no rollout engine), "merged" or "adapter" (an HF engine fed that way)."""
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings, LoraSettings,
                                         OptimSettings, PolicyLossSettings, RolloutSettings, SamplingSettings,
                                         UpdateLoop)

    lora_settings = LoraSettings(rank=rank, alpha=2.0 * rank, **lora)
    device = DeviceRequest(**CPU_DEVICE)
    engine = EngineSettings(model_path=str(model_dir), device=device, use_remove_padding=packed,
                            gradient_checkpointing=gradient_checkpointing, optim=OptimSettings(lr=lr),
                            lora=lora_settings)
    rollout = None
    if rollout_sync is not None:
        rollout = RolloutSettings(model_path=str(model_dir), device=device, max_model_len=64,
                                  train=SamplingSettings(max_new_tokens=8),
                                  lora=lora_settings if rollout_sync == "adapter" else None)
    return ActorRolloutWorker(ActorSettings(
        engine=engine, loop=UpdateLoop(mini_batch_size=8, micro_batch_size=4, shuffle=False),
        loss=PolicyLossSettings(use_kl_loss=use_kl_loss, kl_loss_coef=0.1), log_prob=ForwardSettings(),
        rollout=rollout, seed=seed))


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    from transformers import AutoConfig

    return synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)


def response_log_probs(model, batch) -> torch.Tensor:
    from rlframe.workers.engine.hf_model import forward_response_log_probs

    with torch.no_grad():
        log_probs, _ = forward_response_log_probs(model.eval(), **{k: batch.batch[k] for k in MODEL_INPUTS},
                                                  response_width=batch.batch["responses"].size(1))
    return log_probs


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# ------------------------------------------------------------------ the model and its update
@pytest.mark.parametrize("packed", ["true", "false"])
def test_adapters_disabled_log_probs_equal_base_model_exactly(tiny_model_dir, batch, packed):
    """After updates have moved the adapters, the reference log-probs (adapters disabled) are the
    base model's, bit for bit: the same engine code on a model built without LoRA."""
    from rlframe.workers.roles.ref import RefWorker
    from rlframe.workers.settings import DeviceRequest, EngineSettings, ForwardSettings, RefSettings

    actor = lora_actor(tiny_model_dir, packed=packed)
    for _ in range(2):
        actor.update_actor(batch)
    ref = actor.compute_ref_log_prob(batch).batch["ref_log_prob"]
    base = RefWorker(RefSettings(engine=EngineSettings(model_path=str(tiny_model_dir), device=DeviceRequest(**CPU_DEVICE),
                                                       use_remove_padding=packed), log_prob=ForwardSettings()))
    expected = base.compute_ref_log_prob(batch).batch["ref_log_prob"]
    assert torch.equal(ref, expected)
    adapted = actor.compute_log_prob(batch).batch["old_log_probs"]
    mask = batch.batch["response_mask"].bool()
    assert (adapted - ref)[mask].abs().max() > 1e-3  # the adapters did move the policy away from the base


def test_one_update_changes_only_adapter_parameters(tiny_model_dir, batch):
    actor = lora_actor(tiny_model_dir)
    model = actor.engine.model
    adapter_numel = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
    optimized = [p for group in actor.engine.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == adapter_numel  # the optimizer holds the adapters only
    assert adapter_numel < 0.2 * sum(p.numel() for p in model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = actor.update_actor(batch).meta_info["metrics"]
    assert metrics["actor/grad_norm"] > 0
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the update changed nothing"
    assert all(is_adapter_key(k) for k in changed), sorted(k for k in changed if not is_adapter_key(k))
    # B starts at zero, so the first step moves B (A's gradient is B^T (...) = 0): every B moved.
    assert changed == {k for k in before if ".lora_B." in k}


def test_gradient_checkpointing_gives_the_same_adapter_update(tiny_model_dir, batch):
    results = []
    for checkpointing in (False, True):
        actor = lora_actor(tiny_model_dir, gradient_checkpointing=checkpointing)
        actor.update_actor(batch)
        actor.update_actor(batch)
        results.append({k: v.clone() for k, v in actor.engine.model.state_dict().items() if is_adapter_key(k)})
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-6)


def test_merged_weights_reproduce_the_adapter_model(tiny_model_dir, batch):
    """iter_full_weights under LoRA: W + (alpha/r) B A under the base names; a plain HF model loading
    them gives the trainer's log-probs (fp32: to 1e-5)."""
    from transformers import AutoModelForCausalLM

    actor = lora_actor(tiny_model_dir)
    for _ in range(2):
        actor.update_actor(batch)
    merged = dict(actor.engine.iter_full_weights())
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    mask = batch.batch["response_mask"].bool()
    trainer = actor.compute_log_prob(batch).batch["old_log_probs"]
    torch.testing.assert_close(response_log_probs(plain, batch)[mask], trainer[mask], rtol=0, atol=1e-5)


# ------------------------------------------------------------------ weight sync into the HF engine
def generated_batch(actor, batch):
    from rlframe.protocol import DataProto

    width = batch.batch["prompts"].size(1)
    prompts = DataProto.from_dict(tensors={"input_ids": batch.batch["prompts"],
                                           "attention_mask": batch.batch["attention_mask"][:, :width],
                                           "position_ids": batch.batch["position_ids"][:, :width]})
    return actor.generate_sequences(prompts)


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_weight_sync_engine_and_trainer_agree(tiny_model_dir, batch, sync):
    """After updates and a sync, the HF engine's sampling log-probs equal the trainer's on the same
    tokens (the full-sync level: fp32 rounding); adapter sync moves only A and B."""
    from rlframe.workers.engine.lora import merged_weight_view

    actor = lora_actor(tiny_model_dir, rollout_sync=sync)
    for _ in range(2):
        actor.update_actor(batch)
    stats = actor.sync_weights()
    model = actor.engine.model
    full_bytes = sum(t.numel() * t.element_size() for t in merged_weight_view(model).values())
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_adapter_key(n))
    assert stats["weight_sync/bytes"] == (adapter_bytes if sync == "adapter" else full_bytes)
    out = generated_batch(actor, batch)
    mask = out.batch["response_mask"]
    trainer = actor.compute_log_prob(out).batch["old_log_probs"]
    gap = float(((trainer - out.batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum())
    assert gap < 1e-4
    # and the engine holds the update (not the base): its log-probs differ from the reference's
    ref = actor.compute_ref_log_prob(out).batch["ref_log_prob"]
    assert float(((ref - out.batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum()) > 1e-3


# ------------------------------------------------------------------ checkpoints and export
def test_adapter_checkpoint_resumes_and_exports(tiny_model_dir, batch, tmp_path):
    """A checkpoint holds the adapters + their optimizer state (no base weights); a fresh actor
    resumes from it bit for bit; the export writes a peft folder and, with --merge, a plain HF model:
    both load in transformers and reproduce the trainer's log-probs (to 1e-5)."""
    from transformers import AutoModelForCausalLM

    from rlframe.export import export_checkpoint
    from rlframe.trainer import checkpoint as ckpt

    actor = lora_actor(tiny_model_dir)
    actor.update_actor(batch)
    actor.update_actor(batch)
    tmp = ckpt.begin_save(tmp_path, 2)
    actor.save_checkpoint(str(tmp / "actor"))
    saved = ckpt.finish_save(tmp, 2, {"step": 2}, "", keep=0)
    files = {p.name for p in (saved.path / "actor").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= files
    assert "model.safetensors" not in files
    adapter_bytes = (saved.path / "actor" / "adapter_model.safetensors").stat().st_size
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert adapter_bytes < 0.2 * model_bytes

    resumed = lora_actor(tiny_model_dir, seed=1)
    resumed.load_checkpoint(str(saved.path / "actor"))
    mask = batch.batch["response_mask"].bool()
    trainer = actor.compute_log_prob(batch).batch["old_log_probs"]
    assert torch.equal(resumed.compute_log_prob(batch).batch["old_log_probs"], trainer)
    # the optimizer state came back too: the next update is the same
    actor.update_actor(batch)
    resumed.update_actor(batch)
    assert torch.equal(resumed.compute_log_prob(batch).batch["old_log_probs"],
                       actor.compute_log_prob(batch).batch["old_log_probs"])

    adapter_dir = export_checkpoint(saved.path, tmp_path / "adapter")
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "optimizer.pt").exists()
    from_adapter = AutoModelForCausalLM.from_pretrained(adapter_dir)  # transformers' peft integration
    torch.testing.assert_close(response_log_probs(from_adapter, batch)[mask], trainer[mask], rtol=0, atol=1e-5)

    merged_dir = tmp_path / "merged"
    result = subprocess.run([sys.executable, "-m", "rlframe.export", str(saved.path), str(merged_dir), "--merge"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    torch.testing.assert_close(response_log_probs(merged, batch)[mask], trainer[mask], rtol=0, atol=1e-5)

    from rlframe.eval import resolve_model  # `python -m rlframe.eval model=<checkpoint>` evaluates the merged model

    evaluated = AutoModelForCausalLM.from_pretrained(resolve_model(str(saved.path), tmp_path / "eval"), dtype=torch.float32)
    torch.testing.assert_close(response_log_probs(evaluated, batch)[mask], trainer[mask], rtol=0, atol=1e-5)


def test_adapter_key_names_round_trip():
    from rlframe.workers.engine.lora import from_peft_key, to_peft_key

    key = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert to_peft_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert from_peft_key(to_peft_key(key)) == key


# ------------------------------------------------------------------ QLoRA without CUDA
def test_qlora_on_cpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.lora\.load_in_4bit: .*no CUDA GPU.*Fix: model\.lora\.load_in_4bit=false"):
        lora_actor(tiny_model_dir, load_in_4bit=True)


# ------------------------------------------------------------------ configuration
def lora_config(model_dir, **lora):
    from rlframe.config import RLConfig

    cfg = RLConfig()
    cfg.model.path = str(model_dir)
    cfg.trainer.device = "cpu"
    cfg.model.lora.rank = 8
    for key, value in lora.items():
        setattr(cfg.model.lora, key, value)
    return cfg


def config_problems(cfg) -> str:
    from rlframe.config import ConfigError, validate_config

    try:
        validate_config(cfg)
    except ConfigError as error:
        return str(error)
    return ""


def test_valid_lora_config_passes(tiny_model_dir):
    assert config_problems(lora_config(tiny_model_dir)) == ""
    assert config_problems(lora_config(tiny_model_dir, target_modules=["q_proj", "v_proj"],
                                       exclude_modules=["layers.0.self_attn.q_proj"])) == ""


@pytest.mark.parametrize("lora, strategy, key, expected", [
    ({"target_modules": ["q_proj", "qq_proj"]}, "fsdp", "model.lora.target_modules", "'qq_proj' matches no module"),
    ({"target_modules": ["embed_tokens"]}, "fsdp", "model.lora.target_modules", "'embed_tokens' is not a linear layer"),
    ({"target_modules": ".*attn_q"}, "fsdp", "model.lora.target_modules", "matches no linear layer"),
    ({"exclude_modules": ["mlp.nothing"]}, "fsdp", "model.lora.exclude_modules", "'mlp.nothing' matches no module"),
    ({"load_in_4bit": True}, "fsdp", "model.lora.load_in_4bit", "no CUDA GPU"),
    ({"rank": -1}, "fsdp", "model.lora.rank", "must be >= 0"),
    ({"weight_sync": "deltas"}, "fsdp", "model.lora.weight_sync", "not one of merged, adapter"),
    ({}, "megatron", "actor.strategy", "does not implement LoRA"),
])
def test_bad_lora_config_names_the_key(tiny_model_dir, lora, strategy, key, expected):
    cfg = lora_config(tiny_model_dir, **lora)
    cfg.actor.strategy = strategy
    problems = config_problems(cfg)
    line = next((p for p in problems.splitlines() if p.strip().startswith(f"- {key}:") and expected in p), None)
    assert line is not None, problems
    assert expected in line and ("Fix:" in line or "must" in line or "not one of" in line), line


def test_bad_lora_config_stops_the_cli_before_any_worker(tiny_model_dir, tmp_path):
    result = run_main(["recipe=grpo_math", f"model.path={tiny_model_dir}", "model.lora.rank=8",
                       "model.lora.target_modules=[q_proj,qq_proj]", "model.lora.load_in_4bit=true",
                       "trainer.device=cpu"], cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "model.lora.target_modules: 'qq_proj' matches no module" in result.stderr
    assert "model.lora.load_in_4bit:" in result.stderr
    assert "workers:" not in result.stdout and len(result.stderr.strip().splitlines()) < 25


def test_lora_starts_no_reference_role(tiny_model_dir):
    """With KL and LoRA the reference policy is the actor (adapters disabled): no ref role."""
    from rlframe.trainer.launch import trainer_roles

    cfg = lora_config(tiny_model_dir)
    cfg.rollout.engine = "hf"
    assert cfg.algorithm.use_kl_loss
    assert "ref" not in trainer_roles(cfg, str(tiny_model_dir), with_rollout=True)
    cfg.model.lora.rank = 0
    assert "ref" in trainer_roles(cfg, str(tiny_model_dir), with_rollout=True)
