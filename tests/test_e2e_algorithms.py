"""End to end through the CLI, 2 steps on the tiny random-init Llama: PPO (critic), DAPO, RLOO,
REINFORCE++, ReMax. These prove the dataflow and the metrics of each algorithm, not learning.

The RLOO, REINFORCE++ and DAPO checks run on their recipes' own cases in tests/test_recipes.py (one run per
recipe in CI, not two): RECIPE_CASES below gives each the overrides its checks need and the check itself.
PPO's cases here differ from ppo_math's recipe case (2 ranks, a critic warm-up step, a resume)."""

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


PPO_TWO_RANKS = [PARITY_REWARD, "actor.world_size=2", "actor.ppo_micro_batch_size_per_device=2",
                 "critic.ppo_micro_batch_size_per_device=2", "trainer.critic_warmup=1", "trainer.save_every=2",
                 "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01",
                 "algorithm.kl_ctrl.horizon=10"]


def test_ppo_critic_gae_kl_in_reward_warmup_two_ranks_then_resume(tmp_path, tiny_model_dir):
    metrics, stdout = _run(tmp_path, tiny_model_dir, "ppo_math", *PPO_TWO_RANKS)
    assert "actor_rollout+ref+critic" in stdout and "sharded=True" in stdout
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

    # the checkpoint holds the critic and the adaptive KL controller: one more step resumed from it
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "step_2" / "critic").is_dir()
    resumed = run_main(["recipe=ppo_math", *TINY, *PPO_TWO_RANKS, f"model.path={tiny_model_dir}",
                        f"trainer.run_dir={run_dir}", "trainer.total_steps=3"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'}" in resumed.stdout
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    _finite(metrics[3], "critic/vf_loss", "actor/pg_loss")
    # the adaptive beta continues from the checkpoint, not from kl_coef
    assert metrics[3]["reward/kl_coef"] != pytest.approx(0.001, abs=0.0)


def check_dapo_dynamic_sampling_overlong(metrics: list[dict], stdout: str) -> None:
    # the overlong buffer covers the whole response (16 tokens): every response of L >= 1 tokens gets
    # 0.5 * -L / 16 < 0, at the limit (L = 16) the full -0.5
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "dynamic_sampling/rounds", "dynamic_sampling/kept_frac",
                "reward/overlong_penalty", "reward/overlong_frac")
        assert step["dynamic_sampling/rounds"] >= 1
        assert "actor/kl_loss" not in step  # no KL, no reference model
        # groups dropped in the first round (kept_frac < 1) were replaced by more rounds until the batch was full
        assert 0 < step["dynamic_sampling/kept_frac"] <= 1
        assert step["dynamic_sampling/kept_frac"] == 1 or step["dynamic_sampling/rounds"] >= 2
        # the overlong penalty reached every response, the full -0.5 at the limit and less below it
        assert step["reward/overlong_frac"] == 1.0
        assert -0.5 <= step["reward/overlong_penalty"] < 0
    # the even-indexed prompts' groups all agree (the reward is a constant there, whatever the lengths): dropped
    assert any(step["dynamic_sampling/kept_frac"] < 1 for step in metrics[1:])
    # validation reports both: the reward functions' score and the score training uses (overlong-shaped)
    for step in (metrics[0], metrics[-1]):
        assert step["val/score_mean"] < step["val/reward_mean"]


def test_dapo_dynamic_sampling_cap_message(tmp_path, tiny_model_dir):
    # the math reward on a random model is 0 everywhere: every group agrees, the cap is hit
    run_dir = tmp_path / "run"
    result = run_main(["recipe=dapo_math", *TINY, f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}",
                       "algorithm.dynamic_sampling.max_attempts=2", "algorithm.overlong_buffer.enable=false",
                       "trainer.val_before_train=false"], cwd=tmp_path)
    assert result.returncode != 0
    assert "dynamic sampling: after 2 rollout rounds only 0 of 4 prompts" in result.stderr + result.stdout


def _check_kl_in_reward(metrics: list[dict], kl_coef: float) -> tuple[dict, dict]:
    """rewards = scores - beta * KL(policy that sampled || ref): 0 before the first update, not after it."""
    first, second = metrics[1], metrics[2]
    for step in (first, second):
        _finite(step, "reward/kl_penalty", "reward/kl_coef", "critic/rewards/mean", "critic/score/mean")
        assert step["reward/kl_coef"] == pytest.approx(kl_coef)  # fixed beta
    # step 1 samples with the initial policy, which is the reference: no penalty yet
    assert first["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert first["critic/rewards/mean"] == pytest.approx(first["critic/score/mean"], abs=1e-5)
    # after one update the penalty is in the reward
    assert abs(second["reward/kl_penalty"]) > 1e-6
    assert abs(second["critic/score/mean"] - second["critic/rewards/mean"]) > 1e-5
    return first, second


def check_rloo_kl_in_reward(metrics: list[dict], stdout: str) -> None:
    # parity reward: advantages differ from 0, so the policy moves away from the reference at step 1;
    # seq-mean-token-mean: the loss is the mean over responses of -A_i (ratio 1: one epoch, one mini-batch)
    assert "x actor_rollout+ref on nodes" in stdout
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "reward/kl_penalty", "reward/kl_coef",
                "rollout/logprob_abs_diff")
        # leave-one-out advantages sum to 0 within each group (KL penalty included): so does the loss
        assert step["actor/pg_loss"] == pytest.approx(0.0, abs=1e-5)
    _check_kl_in_reward(metrics, 0.05)


def check_reinforce_plus_plus(metrics: list[dict], stdout: str) -> None:
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "actor/grad_norm", "reward/kl_penalty", "critic/advantages/mean")
        # returns-to-go whitened over all tokens of the batch: their token mean is 0
        assert step["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-5)
    _, second = _check_kl_in_reward(metrics, 0.05)
    # k2 = 0.5 (log p - log p_ref)^2 >= 0: the penalty lowers the reward, by beta * n_i * (row's mean KL)
    # summed over a response of 1..max tokens
    drop = second["critic/score/mean"] - second["critic/rewards/mean"]
    assert second["reward/kl_penalty"] > 0 and drop > 0
    assert 0.05 * second["reward/kl_penalty"] * 0.99 <= drop <= 0.05 * second["reward/kl_penalty"] * 16 * 1.01


HALF_CONSTANT_REWARD = "reward.functions=[{path: " + str(REPO_ROOT / "tests" / "reward_fns" / "half_constant.py") + \
    ", name: compute_score}]"

# recipe -> (the overrides its check needs beyond tests/test_recipes.py's TINY_SIZES, the check(metrics, stdout))
RECIPE_CASES = {
    "rloo_math": ([PARITY_REWARD, "algorithm.kl_ctrl.kl_coef=0.05", "actor.optim.lr=1e-4",
                   "actor.loss_agg_mode=seq-mean-token-mean"], check_rloo_kl_in_reward),
    "reinforce_pp_math": ([PARITY_REWARD, "algorithm.kl_ctrl.kl_coef=0.05", "actor.optim.lr=1e-4"],
                          check_reinforce_plus_plus),
    # on HF generate: the random model's vLLM samples all run to the length limit, so every group's parity agrees
    "dapo_math": ([HALF_CONSTANT_REWARD, "rollout.engine=hf", "rollout.n=4", "algorithm.overlong_buffer.len=16",
                   "actor.ppo_micro_batch_size_per_device=8"], check_dapo_dynamic_sampling_overlong),
}


def test_remax_greedy_baseline_no_reference(tmp_path, tiny_model_dir):
    # parity reward: the samples and the greedy response score 0 or 1. seq-mean-token-mean and an exactly
    # on-policy update (ratio 1): the loss is the mean over responses of -A_i = -(r_i - b_i)
    metrics, stdout = _run(tmp_path, tiny_model_dir, "grpo_math", "algorithm.adv_estimator=remax",
                           "algorithm.use_kl_loss=false", PARITY_REWARD, "actor.loss_agg_mode=seq-mean-token-mean")
    assert "x actor_rollout on nodes" in stdout  # no KL anywhere: the reference model is never started
    for step in metrics[1:]:
        _finite(step, "actor/pg_loss", "reward/greedy_baseline_mean", "timing/rollout_greedy")
        assert 0 <= step["reward/greedy_baseline_mean"] <= 1
        # each sample's advantage is its reward minus its prompt's greedy reward (n samples per prompt)
        expected = -(step["critic/score/mean"] - step["reward/greedy_baseline_mean"])
        assert step["actor/pg_loss"] == pytest.approx(expected, abs=1e-5)
