"""Stage recipes honour trainer.total_steps: a cap on the steps their epochs (rft: rounds) give, with one note;
0 (what the shipped stage recipes set) leaves the count to the epochs; an RL run refuses 0 with the key to use.

Before, `recipe=sft_math trainer.total_steps=1` ran 16 steps (dpo_math 6, rm_math 8): the stage replaced the
step count with its epochs' without a word.
"""

from __future__ import annotations

import pytest

from conftest import read_metrics, run_tiny

from rlframe.config import ConfigError, validate_config
from rlframe.main import compose_config
from rlframe.stages.common import capped_steps

STAGE_RECIPES = {"sft_math": "sft", "dpo_math": "dpo", "rm_math": "rm", "pt_text": "pt", "rft_math": "rft"}


@pytest.mark.parametrize("recipe", sorted(STAGE_RECIPES))
def test_shipped_stage_recipes_leave_the_count_to_their_epochs(recipe):
    cfg = compose_config([f"recipe={recipe}"])
    assert cfg.stage == STAGE_RECIPES[recipe] and cfg.trainer.total_steps == 0
    assert capped_steps(cfg, 16, "sft.epochs=1 x 16", "sft.epochs") == 16


def test_total_steps_caps_a_stage_with_one_note(capsys):
    cfg = compose_config(["recipe=sft_math", "trainer.total_steps=1"])
    assert capped_steps(cfg, 16, "sft.epochs=1 x 16", "sft.epochs") == 1
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and "trainer.total_steps=1 caps sft's 16 steps (sft.epochs=1 x 16)" in out
    cfg.trainer.total_steps = 40  # more than the data gives: the data's count, and the key that gives more
    assert capped_steps(cfg, 16, "sft.epochs=1 x 16", "sft.epochs") == 16
    assert "Fix: raise sft.epochs" in capsys.readouterr().out


def test_an_rl_run_refuses_zero_steps_naming_the_key():
    cfg = compose_config(["recipe=grpo_math", "trainer.total_steps=0"])
    with pytest.raises(ConfigError, match=r"trainer.total_steps: 0 means .*Fix: trainer.total_steps=20"):
        validate_config(cfg)
    cfg = compose_config(["recipe=grpo_math", "trainer.total_steps=0", "trainer.total_epochs=1"])
    validate_config(cfg)  # epochs give the count


def test_sft_math_trains_exactly_total_steps(tiny_model_dir, tmp_path):
    """~20 s: the recipe in its own process on the tiny model (not slow-marked: CI must see a stage ignore it)."""
    from rlframe.trainer.metric_glossary import unknown_metrics

    # 32 rows / 8 per step = 4 steps per epoch; trainer.total_steps=2 (run_tiny's) caps them at 2
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "sft_math", "data.arithmetic.n_train=32", "sft.batch_size=8",
                               "sft.micro_batch_size=4", "sft.max_length=256", "rollout.engine=hf", "sft.epochs=1")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2]
    assert "note: trainer.total_steps=2 caps sft's 4 steps (sft.epochs=1 x 4)" in result.stdout
    assert (run_dir / "hf_model" / "config.json").exists()
    assert unknown_metrics(key for m in metrics for key in m) == []
