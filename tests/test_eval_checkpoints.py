"""checkpoints=all (rlframe/evaluation/checkpoints.py): a run directory with 3 real checkpoint folders (written
by the trainer's checkpoint protocol, each holding a different tiny model) -> 3 rows through one engine, the
table and the curve; the starting model as step 0; a missing step named in one line."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from conftest import REPO_ROOT, build_tiny_model_dir
from rlframe.eval import EvalUsageError, main as eval_main


@pytest.fixture(scope="module")
def three_checkpoint_run(tmp_path_factory, tiny_model_dir):
    """A run directory: config.yaml (the tiny model, 4 arithmetic validation prompts, HF engine) and
    checkpoints step_1..step_3, each a complete checkpoint (manifest) whose actor is a differently seeded model."""
    from rlframe.config import RLConfig, RewardFunctionConfig
    from rlframe.trainer.checkpoint import begin_save, finish_save

    run_dir = tmp_path_factory.mktemp("run3")
    cfg = RLConfig()
    cfg.model.path = str(tiny_model_dir)
    cfg.data.arithmetic.n_train, cfg.data.arithmetic.n_val, cfg.data.val_max_samples = 8, 8, 4
    cfg.data.max_response_length, cfg.rollout.engine = 8, "hf"
    cfg.reward.functions = [RewardFunctionConfig(path=str(REPO_ROOT / "reward_fns" / "math.py"))]
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    (run_dir / "config.yaml").write_text(text)
    for step in (1, 2, 3):
        tmp = begin_save(run_dir, step)
        build_tiny_model_dir(tmp / "actor", seed=step)
        finish_save(tmp, step, {"step": step}, text, keep=0)
    return run_dir


def test_every_checkpoint_one_row_and_the_curve(three_checkpoint_run):
    run_dir = three_checkpoint_run
    metrics = eval_main([f"run={run_dir}", "checkpoints=all", "n=2", "temperature=1.0", "bootstrap=100"])
    rows = metrics["checkpoints"]
    assert [row["step"] for row in rows] == [1, 2, 3]
    saved = json.loads((run_dir / "eval_checkpoints.json").read_text())
    assert [r["model"] for r in saved["rows"]] == ["step_1", "step_2", "step_3"]
    assert saved["settings"]["engine"] == "hf" and saved["settings"]["n"] == 2 and saved["settings"]["prompts"] == 4
    assert all(r["metrics"]["accuracy_ci_low"] <= r["metrics"]["accuracy"] <= r["metrics"]["accuracy_ci_high"]
               for r in saved["rows"])
    table = (run_dir / "eval_checkpoints.md").read_text()
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "step" not in
            line.split("|")[1]] == ["1", "2", "3"]
    svg = (run_dir / "eval_checkpoints.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 3  # the curve and its interval's two edges
    samples = [json.loads(line) for line in (run_dir / "eval_checkpoints_samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == [1, 2, 3] and len(samples) == 3 * 4 * 2


def test_starting_model_as_step_zero_and_a_missing_step(three_checkpoint_run, tmp_path):
    """Step 3's responses, from the engine built on the starting model with step 3's weights streamed in, are
    those of an engine built on step 3 itself (sampled with the same seed; greedy, the random models all
    answer blank lines)."""
    run_dir = three_checkpoint_run
    metrics = eval_main([f"run={run_dir}", "checkpoints=0,3", "temperature=1.0", "bootstrap=100"])
    assert [row["step"] for row in metrics["checkpoints"]] == [0, 3]
    samples = [json.loads(line) for line in (run_dir / "eval_checkpoints_samples.jsonl").read_text().splitlines()]
    reloaded = [r["response"] for r in samples if r["step"] == 3]
    assert reloaded != [r["response"] for r in samples if r["step"] == 0]  # other weights, other answers
    eval_main([f"run={run_dir}", f"model={run_dir / 'checkpoints' / 'step_3'}", "temperature=1.0",
               f"out={tmp_path / 'fresh.jsonl'}"])
    fresh = [json.loads(line)["response"] for line in (tmp_path / "fresh.jsonl").read_text().splitlines()]
    assert fresh == reloaded
    with pytest.raises(EvalUsageError, match=r"error: checkpoints=7: no checkpoint step_7 .* \(saved steps: 1, 2, 3\)"):
        eval_main([f"run={run_dir}", "checkpoints=7"])
