"""docs/results.md stays true: the main job's row holds its deterministic figures; the table writer
(examples/benchmark/recipes_table.py) builds rows from a run's metrics.jsonl and keeps the rows it did not
re-run; validation's intervals (rlframe/trainer/validation.py) sit beside unchanged values."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "examples" / "benchmark"))
import recipes_table  # noqa: E402

# The main job (`python -m rlframe.main recipe=grpo_math`) is deterministic: docs/benchmarks.md.
MAIN_JOB = {"reward": "0.2109 -> 0.4922", "accuracy": ("0.2344", "0.5469")}


def test_the_main_jobs_row_matches_its_deterministic_figures():
    rows = recipes_table.existing_rows(REPO_ROOT / "docs" / "results.md")
    assert "grpo_math" in rows, "docs/results.md has no grpo_math row"
    cells = [cell.strip() for cell in rows["grpo_math"].split("|")[1:-1]]
    assert cells[0] == "`grpo_math`" and cells[1] == "rl" and cells[2] == "14"  # the recipe as shipped
    assert cells[3] == MAIN_JOB["reward"], cells[3]
    before, after = cells[4].split(" -> ")
    assert before.split(" [")[0] == MAIN_JOB["accuracy"][0] and after.split(" [")[0] == MAIN_JOB["accuracy"][1], cells[4]


def test_rows_from_a_run_directory_and_kept_rows(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 0, "val/reward_mean": 0.1, "val/accuracy": 0.25, "val/accuracy_ci_low": 0.1,
              "val/accuracy_ci_high": 0.4},
             {"step": 1, "critic/score/mean": 0.3},
             {"step": 2, "val/reward_mean": 0.5, "val/accuracy": 0.5, "val/accuracy_ci_low": 0.3,
              "val/accuracy_ci_high": 0.7}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (run / "config.yaml").write_text("stage: sft\nmodel:\n  path: x\n")
    row = recipes_table.row_of("sft_math", run, 125.0, ["trainer.total_steps=2"], "abc1234")
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[:4] == ["`sft_math` (trainer.total_steps=2)", "sft", "2", "0.1000 -> 0.5000"]
    assert cells[4] == "0.2500 [0.1000, 0.4000] -> 0.5000 [0.3000, 0.7000]"
    assert cells[5:7] == ["2.1 min", "abc1234"]
    out = tmp_path / "results.md"
    recipes_table.write_results({"grpo_math": "| `grpo_math` | rl | 14 | a | b | c | d | e |"}, out,
                                notes=["- `grpo_math`: figures recorded elsewhere"])
    out.write_text(out.read_text() + "\n## Other figures\n\nkept.\n")
    rows = recipes_table.existing_rows(out)
    rows["sft_math"] = row
    recipes_table.write_results(rows, out)
    assert out.read_text().endswith("\n## Other figures\n\nkept.\n")  # a later section kept
    assert list(recipes_table.existing_rows(out)) == ["grpo_math", "sft_math"]  # the old row kept
    assert recipes_table.existing_notes(out) == ["- `grpo_math`: figures recorded elsewhere"]  # and its note


def test_validation_intervals_beside_unchanged_values():
    from rlframe.evaluation.stats import bootstrap_interval
    from rlframe.trainer.validation import validation_intervals

    accuracy = np.array([1.0, 0.0, np.nan, 1.0, 1.0])
    rewards = np.array([1.0, 0.0, 0.2, 0.9, 1.0])
    out = validation_intervals(accuracy, rewards, seed=0)
    assert sorted(out) == ["val/accuracy_ci_high", "val/accuracy_ci_low", "val/reward_mean_ci_high",
                           "val/reward_mean_ci_low"]
    # the NaN row (no function scored it) is left out, as val/accuracy's nanmean leaves it out
    assert (out["val/accuracy_ci_low"], out["val/accuracy_ci_high"]) == bootstrap_interval(np.array([1, 0, 1, 1.0]))
    assert out["val/accuracy_ci_low"] <= np.nanmean(accuracy) <= out["val/accuracy_ci_high"]
    assert out["val/reward_mean_ci_low"] <= rewards.mean() <= out["val/reward_mean_ci_high"]


def test_validation_by_generation_logs_the_intervals(tmp_path):
    from test_algos_driver_steps import PER_SAMPLE, scorer_of, validate

    from rlframe.config import RLConfig

    cfg = RLConfig()
    metrics, _, _ = validate(cfg, scorer_of(cfg, tmp_path, PER_SAMPLE), [2, 4, 8, 8], ["a", "b", "a", "a"])
    assert metrics["val/accuracy"] == 0.75  # as before (tests/test_algos_driver_steps.py)
    assert metrics["val/accuracy_ci_low"] <= 0.75 <= metrics["val/accuracy_ci_high"]
    assert metrics["val/accuracy_ci_low"] < metrics["val/accuracy_ci_high"]
    assert pytest.approx(metrics["val/reward_mean"]) == 0.75
