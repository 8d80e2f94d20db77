"""End to end through the CLI, 2 steps on the tiny random-init Llama: PPO (critic), DAPO, RLOO,
REINFORCE++, ReMax. These prove the dataflow and the metrics of each algorithm, not learning."""

from __future__ import annotations

import math

import pytest

from conftest import REPO_ROOT, TINY_RUN_OVERRIDES, read_metrics, run_main, run_tiny

TINY = [*TINY_RUN_OVERRIDES, "rollout.engine=hf", "trainer.export_hf=false"]

def _run(tmp_path, tiny_model_dir, recipe: str, *extra: str) -> tuple[list[dict], str]:
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, recipe, "rollout.engine=hf", "trainer.export_hf=false", *extra)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert "val/reward_mean" in metrics[0] and "val/reward_mean" in metrics[-1]
    return metrics, result.stdout


def _finite(step: dict, *keys: str) -> None:
    for key in keys:
        assert key in step, f"step {step['step']} lacks {key}: {sorted(step)}"
        assert math.isfinite(step[key]), f"{key}={step[key]} at step {step['step']}"


PARITY_REWARD = "reward.functions=[{path: " + str(REPO_ROOT / "tests" / "reward_fns" / "length_parity.py") + \
    ", name: compute_score}]"  # varies on any model, so the critic has something to regress on


def test_ppo_critic_gae_kl_in_reward_warmup_two_ranks(tmp_path, tiny_model_dir):
    metrics, stdout = _run(tmp_path, tiny_model_dir, "ppo_math", PARITY_REWARD, "actor.world_size=2",
                           "actor.ppo_micro_batch_size_per_device=2", "critic.ppo_micro_batch_size_per_device=2",
                           "trainer.critic_warmup=1", "algorithm.use_kl_in_reward=true",
                           "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01",
                           "algorithm.kl_ctrl.horizon=100")
    assert "+Ref+Critic" in stdout and "sharded=True" in stdout
    warmup, trained = metrics[1], metrics[2]
    for step in (warmup, trained):
        _finite(step, "critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean",
                "reward/kl_penalty", "reward/kl_coef", "timing/values", "timing/update_critic")
        assert step["critic/grad_norm"] > 0
    # warm-up step: the critic trains, the actor does not move
    assert "actor/pg_loss" not in warmup and "timing/update" not in warmup
    _finite(trained, "actor/pg_loss", "actor/grad_norm", "timing/update", "weight_sync/seconds")
    # the first values come from a zero-initialised head; after one critic step they are not all zero
    assert warmup["critic/vpred_mean"] == pytest.approx(0.0, abs=1e-6)
    assert trained["critic/vpred_mean"] != 0.0


def test_dapo_dynamic_sampling_overlong(tmp_path, tiny_model_dir):
    metrics, _ = _run(tmp_path, tiny_model_dir, "dapo_math", "algorithm.overlong_buffer.len=4", PARITY_REWARD, "rollout.n=4",
                      "actor.ppo_micro_batch_size_per_device=8")
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "dynamic_sampling/rounds", "dynamic_sampling/kept_frac",
                "reward/overlong_penalty", "reward/overlong_frac")
        assert step["dynamic_sampling/rounds"] >= 1
        assert "actor/kl_loss" not in step  # no KL, no reference model


def test_dapo_dynamic_sampling_cap_message(tmp_path, tiny_model_dir):
    # the math reward on a random model is 0 everywhere: every group agrees, the cap is hit
    run_dir = tmp_path / "run"
    result = run_main(["recipe=dapo_math", *TINY, f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}",
                       "algorithm.dynamic_sampling.max_attempts=2", "algorithm.overlong_buffer.enable=false",
                       "trainer.val_before_train=false"], cwd=tmp_path)
    assert result.returncode != 0
    assert "dynamic sampling: after 2 rollout rounds only 0 of 4 prompts" in result.stderr + result.stdout


def test_rloo_kl_in_reward(tmp_path, tiny_model_dir):
    metrics, stdout = _run(tmp_path, tiny_model_dir, "rloo_math")
    assert "+Ref" in stdout and "Critic" not in stdout
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "reward/kl_penalty", "reward/kl_coef",
                "rollout/logprob_abs_diff")


def test_reinforce_plus_plus(tmp_path, tiny_model_dir):
    metrics, _ = _run(tmp_path, tiny_model_dir, "reinforce_pp_math")
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "reward/kl_penalty", "critic/advantages/mean")


def test_remax_greedy_baseline_no_reference(tmp_path, tiny_model_dir):
    metrics, stdout = _run(tmp_path, tiny_model_dir, "grpo_math", "algorithm.adv_estimator=remax",
                           "algorithm.use_kl_loss=false")
    assert "+Ref" not in stdout  # no KL anywhere: the reference model is never started
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "reward/greedy_baseline_mean", "timing/rollout_greedy")


def test_ppo_checkpoint_holds_critic_and_resumes(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    common = ["recipe=ppo_math", *TINY, PARITY_REWARD, f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}",
              "trainer.save_every=1", "trainer.val_before_train=false", "algorithm.use_kl_in_reward=true",
              "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=10"]
    first = run_main([*common, "trainer.total_steps=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-6000:]
    assert (run_dir / "checkpoints" / "step_1" / "critic").is_dir()
    second = run_main([*common, "trainer.total_steps=2"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-6000:]
    assert "resumed from" in second.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    # the adaptive beta continues from the checkpoint, not from kl_coef
    assert metrics[1]["reward/kl_coef"] != pytest.approx(0.001, abs=0.0)
    _finite(metrics[1], "critic/vf_loss", "actor/pg_loss")
