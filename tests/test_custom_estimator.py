"""A user's estimator from a file (examples/custom_estimator): registered by config, used end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, read_metrics, run_main
from rlframe.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, get_advantage_estimator
from rlframe.algos.plugins import register_configured_plugins

EXAMPLE = REPO_ROOT / "examples" / "custom_estimator" / "my_estimator.py"


def test_configured_estimator_registers_and_computes_by_hand():
    ADVANTAGE_ESTIMATORS.pop("median_baseline", None)
    register_configured_plugins({"custom_estimator": {"path": str(EXAMPLE), "name": "median_baseline"},
                                 "custom_policy_loss": {"path": None, "name": None}})
    estimator = get_advantage_estimator("median_baseline")
    rewards = torch.zeros(4, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 5.0, 2.0])  # outcome reward on the last token
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    uids = np.array(["a", "a", "a", "b"], dtype=object)
    advantages, _ = estimator(rewards, mask, uids, config=AdvantageConfig())
    # group a: scores 1, 0, 5 -> median 1 -> A = 0, -1, 4; group b: row 3's reward is masked -> score 0, A = 0
    assert advantages.tolist() == [[0.0, 0.0], [-1.0, -1.0], [4.0, 4.0], [0.0, 0.0]]


def test_config_accepts_only_configured_names():
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    cfg = compose_config(["recipe=examples/custom_estimator/median_baseline.yaml"])
    validate_config(cfg)
    assert cfg.algorithm.custom_estimator.path == str(EXAMPLE)
    ADVANTAGE_ESTIMATORS.pop("median_baseline", None)  # as in a fresh process
    cfg = compose_config(["recipe=grpo_math", "algorithm.adv_estimator=median_baseline"])
    with pytest.raises(ConfigError, match="algorithm.custom_estimator"):
        validate_config(cfg)


def test_custom_estimator_two_steps_end_to_end(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    result = run_main(["recipe=examples/custom_estimator/median_baseline.yaml", f"model.path={tiny_model_dir}",
                       f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "data.arithmetic.n_train=32",
                       "data.arithmetic.n_val=4", "data.val_max_samples=4", "data.max_prompt_length=256",
                       "data.max_response_length=8", "rollout.n=2", "rollout.engine=hf", "trainer.num_cpus=4",
                       "trainer.export_hf=false", "algorithm.use_kl_loss=false"], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-6000:]
    for step in read_metrics(run_dir)[1:]:
        assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["critic/advantages/mean"])
