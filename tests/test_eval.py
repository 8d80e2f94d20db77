"""rlframe/eval.py without a model: pass@k against hand-computed values, the command line's errors.
(The end-to-end check -- eval reproducing a run's final validation -- is in tests/test_report.py.)"""

from __future__ import annotations

import pytest

from rlframe.eval import EvalUsageError, build_config, parse_args, pass_at_k


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2) = 3/6 miss
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong: every k-subset has a right one
    assert pass_at_k(8, 8, 8) == 1.0


def test_command_line_errors(tmp_path):
    with pytest.raises(EvalUsageError, match="did you mean model"):
        parse_args(["modle=x"])
    with pytest.raises(EvalUsageError, match="data=<file"):
        build_config(parse_args(["model=smollm2-135m-instruct", "reward=reward_fns/math.py"]))
    with pytest.raises(EvalUsageError, match="not found"):
        build_config(parse_args(["model=m", f"data={tmp_path}/nope.parquet", "reward=reward_fns/math.py"]))
    with pytest.raises(EvalUsageError, match="no config.yaml"):
        build_config(parse_args([f"run={tmp_path}"]))
    (tmp_path / "v.jsonl").write_text("")
    cfg, model, files, run_dir = build_config(parse_args(
        ["model=m", f"data={tmp_path}/*.jsonl", "reward=reward_fns/math.py:compute_score", "temperature=1.0",
         "max_samples=5", "engine=hf"]))
    assert files == [str(tmp_path / "v.jsonl")] and run_dir is None and model == "m"
    assert (cfg.reward.functions[0].path, cfg.reward.functions[0].name) == ("reward_fns/math.py", "compute_score")
    assert (cfg.rollout.val_temperature, cfg.data.val_max_samples, cfg.rollout.engine) == (1.0, 5, "hf")
