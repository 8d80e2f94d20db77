"""The algorithm keys of the configuration: each policy loss's published defaults, keys a loss ignores,
estimators that need a group. Checked before any worker starts (rlframe.config.validate_config)."""

import pytest

from rlframe.config import ConfigError, RLConfig, apply_algorithm_defaults, policy_loss_options, validate_config
from rlframe.main import compose_config

LOSS_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode")


def loss_options(cfg: RLConfig) -> tuple:
    return tuple(getattr(cfg.actor, key) for key in LOSS_KEYS)


def config(policy_loss: str = "vanilla", **actor) -> RLConfig:
    cfg = RLConfig()
    cfg.actor.policy_loss = policy_loss
    for key, value in actor.items():
        setattr(cfg.actor, key, value)
    return cfg


def problems(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    return str(error.value)


@pytest.mark.parametrize("policy_loss, expected", [
    ("vanilla", (0.2, 0.2, 3.0, "token-mean")),
    ("gspo", (3e-4, 4e-4, None, "seq-mean-token-mean")),  # no dual clip: clip_ratio_c is not read
    ("cispo", (None, 0.28, None, "token-mean")),  # no lower bound on the weight, no dual clip
])
def test_auto_becomes_the_losses_published_defaults(policy_loss, expected):
    cfg = config(policy_loss)
    assert loss_options(cfg) == ("auto",) * 4
    assert tuple(policy_loss_options(cfg.actor).values()) == expected
    assert loss_options(cfg) == ("auto",) * 4  # policy_loss_options changes nothing
    assert loss_options(apply_algorithm_defaults(cfg)) == expected
    assert loss_options(apply_algorithm_defaults(cfg)) == expected  # idempotent
    validate_config(cfg)  # and valid


def test_explicit_values_are_kept_and_null_turns_dual_clip_off():
    cfg = apply_algorithm_defaults(config(clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode="seq-mean-token-sum"))
    assert loss_options(cfg) == (0.2, 0.28, None, "seq-mean-token-sum")
    validate_config(cfg)
    cfg = apply_algorithm_defaults(config("cispo", clip_ratio_low=0.5, clip_ratio_high=4.0))
    assert loss_options(cfg) == (0.5, 4.0, None, "token-mean")
    validate_config(cfg)


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_a_key_the_loss_ignores_is_an_error(policy_loss):
    message = problems(config(policy_loss, clip_ratio_c=3.0))
    assert f"actor.clip_ratio_c: the {policy_loss} policy loss ignores it" in message
    assert "Fix: remove actor.clip_ratio_c" in message
    validate_config(config(policy_loss, clip_ratio_c=None))  # null is "none" and harmless


def test_bad_values_name_the_key():
    message = problems(config(clip_ratio_low=1.5, clip_ratio_high="wide", clip_ratio_c=1.0, loss_agg_mode="mean"))
    for key in LOSS_KEYS:
        assert f"actor.{key}:" in message
    assert "null to turn the dual clip off" in message
    # vanilla and gspo need a lower bound; cispo may go without
    assert "actor.clip_ratio_low: None" in problems(config(clip_ratio_low=None))
    assert "actor.clip_ratio_low: None" in problems(config("gspo", clip_ratio_low=None))
    validate_config(config("cispo", clip_ratio_low=None))
    assert "actor.clip_ratio_high: True" in problems(config(clip_ratio_high=True))  # a bool is no number


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_two_samples(estimator):
    cfg = RLConfig()
    cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.ppo_micro_batch_size_per_device = estimator, 1, 4
    assert f"rollout.n: {estimator} compares samples of one prompt" in problems(cfg)
    cfg.rollout.n = 2
    validate_config(cfg)


def test_grpo_turn_needs_multi_turn_rollouts_and_a_turn_discount_in_range():
    cfg = RLConfig()
    cfg.algorithm.adv_estimator = "grpo_turn"
    assert "algorithm.adv_estimator: grpo_turn credits the model turns of multi-turn rollouts" in problems(cfg)
    cfg.algorithm.adv_estimator, cfg.algorithm.turn_gamma = "grpo", 1.5
    assert "algorithm.turn_gamma: 1.5: must be in [0, 1]" in problems(cfg)


def test_remax_and_reinforce_plus_plus_run_with_one_sample():
    for estimator in ("remax", "reinforce_plus_plus"):
        cfg = RLConfig()
        cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.ppo_micro_batch_size_per_device = estimator, 1, 4
        validate_config(cfg)


def test_recipes_and_command_line():
    # the main job: vanilla PPO's defaults (exactly on-policy there, so the clip range never acts)
    assert loss_options(compose_config(["recipe=grpo_math"])) == (0.2, 0.2, 3.0, "token-mean")
    assert loss_options(compose_config(["recipe=dapo_math"])) == (0.2, 0.28, 3.0, "token-mean")  # clip-higher
    gspo = compose_config(["recipe=grpo_math", "actor.policy_loss=gspo"])
    assert loss_options(gspo) == (3e-4, 4e-4, None, "seq-mean-token-mean")
    no_dual_clip = compose_config(["recipe=ppo_math", "actor.clip_ratio_c=null"])
    assert loss_options(no_dual_clip) == (0.2, 0.2, None, "token-mean")
    validate_config(no_dual_clip)
    ignored = compose_config(["recipe=grpo_math", "actor.policy_loss=cispo", "actor.clip_ratio_c=5"])
    assert "actor.clip_ratio_c: the cispo policy loss ignores it" in problems(ignored)
