"""The DeepSpeed ZeRO engine (`actor.strategy=deepspeed`, workers/engine/deepspeed/) on CPU over gloo.

- the config section: translation into DeepSpeed's config, unknown and unhonoured keys rejected by name;
- one update at ZeRO-2 and ZeRO-3 equals the FSDP engine's (log-probs, losses, grad norm, weights)
  with 2 micro-batches on 1 rank and with 2 ranks (our global loss normalisation drives the
  accumulation, not DeepSpeed's gradient-accumulation count);
- checkpoints: save, update, load, update again gives the same update; the checkpoint also resumes
  on the FSDP engine (same layout);
- DeepSpeedCPUAdam (optimizer offload) steps like torch's AdamW;
- DeepSpeed's communication layer starts without compiling its shared-memory all-reduce op.

The equality runs go through real worker groups (Ray actors with a gloo process group), as in
tests/test_actor_data_parallel.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlframe.config import ConfigError, RLConfig, validate_config
from rlframe.device import DeviceProfile
from rlframe.workers.engine.deepspeed.engine import deepspeed_config
from rlframe.workers.engine.deepspeed.settings import DeepSpeedSettings
from test_actor_data_parallel import assert_same_update, synthetic_batch

pytest.importorskip("deepspeed")

CPU = DeviceProfile("cpu", torch.float32, "gloo", "sdpa", "hf", False)
GPU = DeviceProfile("cuda", torch.bfloat16, "nccl", "flash_attention_2", "vllm", True)


# ------------------------------------------------------------------------------------ config
def test_config_translation_zero2_cpu():
    config = deepspeed_config(DeepSpeedSettings(zero_stage=2, reduce_bucket_size=1000), CPU, train=True, grad_clip=0.5)
    zero = config["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1000 and "offload_optimizer" not in zero
    assert config["managed_gradient_accumulation"] is False  # our loop owns the accumulation boundary
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is False  # fp32 on CPU (the device profile's dtype)


def test_config_translation_zero3_offload_gpu():
    ds = DeepSpeedSettings(zero_stage=3, stage3_prefetch_bucket_size=123)
    config = deepspeed_config(ds, GPU, train=True, offload_params=True, offload_optimizer=True)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_prefetch_bucket_size"] == 123
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}


def test_config_translation_frozen_reference():
    # a frozen model has only parameters to shard: ZeRO-3 partitions them, below that no ZeRO at all
    assert deepspeed_config(DeepSpeedSettings(zero_stage=2), CPU, train=False)["zero_optimization"] == {"stage": 0}
    frozen3 = deepspeed_config(DeepSpeedSettings(zero_stage=3), CPU, train=False)
    assert frozen3["zero_optimization"]["stage"] == 3 and "managed_gradient_accumulation" not in frozen3
    offloaded = deepspeed_config(DeepSpeedSettings(zero_stage=2), GPU, train=False, offload_params=True)
    assert offloaded["zero_optimization"]["offload_param"]["device"] == "cpu"  # OpenRLHF's ref_reward_offload


def test_openrlhf_keys_reach_the_engine_settings(tiny_model_dir):
    from rlframe.main import compose_config
    from rlframe.trainer.worker_settings import actor_settings, critic_settings, ref_settings

    cfg = compose_config(["recipe=grpo_math_deepspeed", f"model.path={tiny_model_dir}", "deepspeed.zero_stage=3",
                          "deepspeed.adam_offload=true", "deepspeed.offload=true", "deepspeed.ref_reward_offload=true",
                          "deepspeed.reduce_bucket_size=1234"])
    actor = actor_settings(cfg, str(tiny_model_dir)).engine
    assert actor.strategy == "deepspeed" and actor.section.zero_stage == 3
    assert actor.section.reduce_bucket_size == 1234
    assert actor.offload_optimizer and actor.offload_params
    ref = ref_settings(cfg, str(tiny_model_dir)).engine
    assert ref.strategy == "deepspeed" and ref.offload_params and not ref.offload_optimizer
    critic = critic_settings(cfg, str(tiny_model_dir)).engine
    assert critic.strategy == "deepspeed" and critic.offload_optimizer


def test_unknown_deepspeed_key_is_named(tiny_model_dir):
    from rlframe.main import UsageError, compose_config

    with pytest.raises(UsageError, match="zero_stagee"):
        compose_config(["recipe=grpo_math_deepspeed", f"model.path={tiny_model_dir}", "deepspeed.zero_stagee=3"])


def deepspeed_cfg(model_dir, **deepspeed) -> RLConfig:
    cfg = RLConfig()
    cfg.model.path = str(model_dir)
    cfg.actor.strategy = "deepspeed"
    for key, value in deepspeed.items():
        setattr(cfg.deepspeed, key, value)
    return cfg


def problems(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    return str(error.value)


def test_validation_rejects_what_the_engine_does_not_honour(tiny_model_dir):
    validate_config(deepspeed_cfg(tiny_model_dir, zero_stage=3, offload=True, adam_offload=True))  # fine
    message = problems(deepspeed_cfg(tiny_model_dir, zero_stage=1, zpg=2, deepspeed_enable_sleep=True))
    assert "deepspeed.zero_stage: 1 is not supported" in message and "Fix: deepspeed.zero_stage=2 or 3" in message
    assert "deepspeed.zpg: ZeRO++ hierarchical partitioning is not implemented" in message
    assert "deepspeed.deepspeed_enable_sleep:" in message
    assert "deepspeed.offload: parameter offload needs" in problems(deepspeed_cfg(tiny_model_dir, offload=True))
    cfg = deepspeed_cfg(tiny_model_dir)
    cfg.actor.ulysses_sequence_parallel_size, cfg.actor.world_size = 2, 2
    assert "actor.ulysses_sequence_parallel_size: Ulysses" in problems(cfg)


def test_optimizer_offload_without_its_extension_is_a_config_error(tiny_model_dir, tmp_path, monkeypatch):
    # No compiled cpu_adam in this (empty) extensions folder and no compiler to build one.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no_ops"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    message = problems(deepspeed_cfg(tiny_model_dir, adam_offload=True))
    assert "deepspeed.adam_offload: optimizer offload steps with DeepSpeedCPUAdam" in message
    assert "no C++ compiler ('/nonexistent/c++')" in message and "Fix:" in message


def test_gather_buckets_bound_the_elements_gathered_at_once():
    from rlframe.workers.engine.deepspeed.engine import _buckets

    entries = [(name, torch.empty(n)) for name, n in [("a", 30), ("b", 50), ("c", 100), ("d", 10), ("e", 10)]]
    assert [[n for n, _ in b] for b in _buckets(entries, 80)] == [["a", "b"], ["c"], ["d", "e"]]
    assert [[n for n, _ in b] for b in _buckets(entries, 1000)] == [["a", "b", "c", "d", "e"]]


# ------------------------------------------------------------------------------------ compiled ops
def test_the_communication_layer_skips_the_shared_memory_op():
    """Once skipped (the engine does it before DeepSpeed's communication layer starts), DeepSpeed's own loader of
    its shared-memory all-reduce op builds nothing, so no rank compiles it."""
    from rlframe.workers.engine.deepspeed.ops import _import_deepspeed, skip_shared_memory_comm_op

    _import_deepspeed(CPU)  # (DeepSpeed's CPU accelerator, as the CPU workers use)
    from deepspeed.comm.torch import build_shm_op

    skip_shared_memory_comm_op()
    assert build_shm_op() is None


def test_cpu_adam_steps_like_torch_adamw():
    from rlframe.workers.engine.deepspeed.ops import CPU_ADAM_OP, build_ops

    build_ops([CPU_ADAM_OP])  # (compiled once per machine, under a file lock)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(300, 70, generator=g), torch.randn(513, generator=g)]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    cpu_adam = DeepSpeedCPUAdam(ours, adamw_mode=True, **kwargs)
    adamw = torch.optim.AdamW(theirs, **kwargs)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in start]
        for params, optimizer in ((ours, cpu_adam), (theirs, adamw)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            optimizer.step()
    for a, b in zip(ours, theirs):
        assert not torch.equal(a.detach(), start[0] if a.shape == start[0].shape else start[1])
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ equality
def actor_config(model_dir, world_size: int, micro: int, strategy: str = "deepspeed", packed: str = "false",
                 gradient_checkpointing: bool = False, **deepspeed) -> RLConfig:
    """The update of tests/test_actor_data_parallel.py: 8 sequences, one optimiser step, KL loss."""
    cfg = RLConfig()
    cfg.rollout.engine = "hf"
    cfg.rollout.n = 2
    cfg.actor.strategy = strategy
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size = 4  # x n=2 -> 8 sequences: the whole batch, one optimiser step
    cfg.actor.ppo_micro_batch_size_per_device = micro
    cfg.actor.optim.lr = 1e-3
    cfg.actor.shuffle = False
    cfg.actor.use_remove_padding = packed
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.model.gradient_checkpointing = gradient_checkpointing
    for key, value in deepspeed.items():
        setattr(cfg.deepspeed, key, value)
    return cfg


def start_actor(cfg: RLConfig, model_dir):
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    settings = dataclasses.replace(actor_settings(cfg, str(model_dir)), rollout=None)  # no rollout engine needed
    pool = ResourcePool([cfg.actor.world_size], cpus_per_bundle=1, name=f"ds{cfg.actor.world_size}")
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": settings})}, default_timeout_s=300)
    return pool, group, group.role("actor_rollout")


def update_once(cfg: RLConfig, model_dir, out_dir):
    """(metrics, saved weights, log-probs) of compute_log_prob + one update_actor in a worker group."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    batch = synthetic_batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    pool, group, actor = start_actor(cfg, model_dir)
    try:
        log_probs = actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]
        metrics = actor.update_actor(batch).meta_info["metrics"]
        actor.save_hf(str(out_dir))
    finally:
        group.shutdown()
        pool.remove()
    return metrics, load_file(str(out_dir / "model.safetensors")), log_probs


@pytest.fixture(scope="module")
def fsdp_reference(tiny_model_dir, tmp_path_factory):
    """The FSDP engine as a plain object in this process (world size 1, one micro-batch, padded): the metrics, saved
    weights and log-probs of its one update, computed once for both ZeRO stages."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    out = tmp_path_factory.mktemp("fsdp_reference")
    cfg = actor_config(tiny_model_dir, world_size=1, micro=8, strategy="fsdp")
    actor = ActorRolloutWorker(dataclasses.replace(actor_settings(cfg, str(tiny_model_dir)), rollout=None))
    batch = synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    log_probs = actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]
    metrics = actor.update_actor(batch).meta_info["metrics"]
    actor.save_hf(str(out))
    return metrics, load_file(str(out / "model.safetensors")), log_probs


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_update_equals_fsdp_at_1_and_2_ranks(ray_session, tiny_model_dir, tmp_path, zero_stage,
                                             fsdp_reference):
    # 1 rank, 2 micro-batches (padded rows)
    # (a small gather bucket: ZeRO-3 streams the weights in several gathers, the tied embedding alone)
    one_rank = update_once(actor_config(tiny_model_dir, world_size=1, micro=4, zero_stage=zero_stage,
                                        gather_bucket_size=40_000), tiny_model_dir, tmp_path / "ws1")
    assert_same_update(fsdp_reference, one_rank)
    # 2 ranks x 2 micro-batches, packed rows (VARLEN_SDPA) and gradient checkpointing
    two_ranks = update_once(actor_config(tiny_model_dir, world_size=2, micro=2, packed="true",
                                         gradient_checkpointing=True, zero_stage=zero_stage,
                                         gather_bucket_size=40_000),
                            tiny_model_dir, tmp_path / "ws2")
    assert_same_update(fsdp_reference, two_ranks)


# ------------------------------------------------------------------------------------ checkpoints
def opposite_advantages(batch):
    """A second update that differs from the first (the advantages negated)."""
    other = batch[list(range(len(batch)))]
    other.batch["advantages"] = -other.batch["advantages"]
    return other


def assert_same_weights(first: dict, second: dict, rtol=1e-5, atol=1e-6):
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("zero_stage,adam_offload", [(3, False), (2, True)], ids=["zero3", "zero2-cpu-adam"])
def test_checkpoint_round_trip_and_resume_on_fsdp(ray_session, tiny_model_dir, tmp_path, zero_stage, adam_offload):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    batch = synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    second = opposite_advantages(batch)
    checkpoint = tmp_path / "checkpoint"
    cfg = actor_config(tiny_model_dir, world_size=2, micro=2, zero_stage=zero_stage, adam_offload=adam_offload,
                       gather_bucket_size=40_000)
    pool, group, actor = start_actor(cfg, tiny_model_dir)
    try:
        assert actor.describe()[0]["strategy"] == "deepspeed"
        actor.update_actor(batch)  # optimizer state (Adam moments, step 1) worth saving
        actor.save_checkpoint(str(checkpoint))
        continued = actor.update_actor(second).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "continued"))
        assert actor.load_checkpoint(str(checkpoint))[0]["optimizer_steps"] == 1
        resumed = actor.update_actor(second).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "resumed"))
    finally:
        group.shutdown()
        pool.remove()
    continued_weights = load_file(str(tmp_path / "continued" / "model.safetensors"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-6), key
    assert_same_weights(continued_weights, load_file(str(tmp_path / "resumed" / "model.safetensors")))
    # The checkpoint is in the FSDP engine's layout: it resumes there too (one plain process).
    fsdp_cfg = actor_config(tiny_model_dir, world_size=1, micro=8, strategy="fsdp")
    fsdp = ActorRolloutWorker(dataclasses.replace(actor_settings(fsdp_cfg, str(tiny_model_dir)), rollout=None))
    fsdp.load_checkpoint(str(checkpoint))
    on_fsdp = fsdp.update_actor(second).meta_info["metrics"]
    fsdp.save_hf(str(tmp_path / "on_fsdp"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert on_fsdp[key] == pytest.approx(continued[key], rel=1e-4), key
    assert_same_weights(continued_weights, load_file(str(tmp_path / "on_fsdp" / "model.safetensors")), 1e-4, 1e-5)


# ------------------------------------------------------------------------------------ end to end
def test_grpo_two_steps_on_deepspeed_zero3(tmp_path, tiny_model_dir):
    """`python -m rlframe.main recipe=grpo_math_deepspeed` at ZeRO-3: the actor and the reference policy
    on DeepSpeed, HF rollout; weight sync proven by log-probs, and the checkpoint exports."""
    import json
    import math
    import subprocess
    import sys

    from conftest import read_metrics, run_tiny

    reward = Path(__file__).parent / "length_reward.py"  # varies per response: the weights really move
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math_deepspeed", "rollout.engine=hf",
                               "deepspeed.zero_stage=3", "deepspeed.gather_bucket_size=40000", "trainer.save_every=2",
                               "actor.optim.lr=1e-3",
                               f"reward.functions=[{{path:{reward}}}]")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for step in metrics[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "timing/weight_sync"):
            assert math.isfinite(step[key]), key
        # the rollout engine holds the weights the DeepSpeed engine trained: their log-probs agree
        assert step["rollout/logprob_abs_diff"] < 1e-3
        assert step["actor/grad_norm"] > 1e-3
    assert metrics[2]["actor/kl_loss"] > 0  # the reference policy (also on DeepSpeed) differs after step 1
    assert "val/reward_mean" in json.loads((run_dir / "summary.json").read_text())["val_after"]
    export = subprocess.run([sys.executable, "-m", "rlframe.export", str(run_dir), str(tmp_path / "export")],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.isfinite(exported(torch.tensor([[5, 6, 7]])).logits).all()


# ------------------------------------------------------------------------------------ the critic
def critic_role(model_dir, strategy: str, world_size: int, micro: int, **deepspeed):
    from rlframe.trainer.worker_settings import critic_settings

    cfg = actor_config(model_dir, world_size=world_size, micro=micro, strategy=strategy, **deepspeed)
    cfg.actor.ppo_mini_batch_size = 2  # x n=2 -> 4 sequences: the whole batch
    cfg.critic.ppo_micro_batch_size_per_device = micro
    cfg.critic.cliprange_value = 0.0
    cfg.trainer.max_consecutive_skipped_updates = 2
    return critic_settings(cfg, str(model_dir))


def critic_batch():
    from test_critic import _batch

    data = _batch()
    data.batch["values"] = torch.zeros(4, 4)  # the zero-initialised head's values
    data.batch["returns"] = torch.tensor([0.5, -0.2, 1.0, 0.1]).unsqueeze(1) * data.batch["response_mask"]
    return data


def test_critic_update_equals_fsdp_then_nonfinite_updates_skip_and_stop(ray_session, tiny_model_dir):
    """The value head (its own LR group) at ZeRO-3 on 2 ranks updates like the FSDP critic; a NaN
    return skips the step (values unchanged) and two in a row stop, as on FSDP."""
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.workers.roles.critic import CriticWorker

    fsdp = CriticWorker(critic_role(tiny_model_dir, "fsdp", world_size=1, micro=4))
    expected = fsdp.update_critic(critic_batch()).meta_info["metrics"]
    expected_values = fsdp.compute_values(critic_batch()).batch["values"]

    settings = critic_role(tiny_model_dir, "deepspeed", world_size=2, micro=1, zero_stage=3)
    pool = ResourcePool([2], cpus_per_bundle=1, name="ds_critic")
    group = WorkerGroup(pool, {"critic": (CriticWorker, {"settings": settings})}, default_timeout_s=300)
    try:
        critic = group.role("critic")
        assert critic.compute_values(critic_batch()).batch["values"].abs().max() == 0  # the head starts at zero
        metrics = critic.update_critic(critic_batch()).meta_info["metrics"]
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-4), key
        values = critic.compute_values(critic_batch()).batch["values"]
        torch.testing.assert_close(values, expected_values, rtol=1e-4, atol=1e-6)
        assert values.abs().max() > 0
        broken = critic_batch()
        broken.batch["returns"][1, 0] = float("nan")
        assert critic.update_critic(broken).meta_info["metrics"]["critic/skipped_updates"] == 1.0
        torch.testing.assert_close(critic.compute_values(critic_batch()).batch["values"], values, rtol=0, atol=0)
        with pytest.raises(Exception, match=r"critic: gradient norm was (nan|inf) for 2 optimiser steps in a row"):
            critic.update_critic(broken)
    finally:
        group.shutdown()
        pool.remove()
