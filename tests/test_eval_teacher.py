"""rlframe.eval teacher=: the per-token reverse KL to a teacher and the teacher's log-prob, on a tiny model.

Hand-computed means first; then real evaluations (HF generate, the teacher role's forward engines in-process):
the model as its own teacher gives KL < 1e-6 (fp32), another tiny teacher KL > 0, a teacher with another tokenizer
is refused naming both folders, and teacher=run takes the run's teacher.path.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, build_tiny_model_dir
from rlframe.eval import EvalUsageError, build_config, main, parse_args
from rlframe.evaluation.teacher import TeacherScores, teacher_extras


def test_teacher_means_hand_computed():
    model = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, 0.0]])
    teacher = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1's last position is padding: never counted
    scores = TeacherScores.of(model, teacher, mask)
    np.testing.assert_allclose(scores.reverse_kl, [(0.5 + 0.0 - 1.0) / 3, (0.5 - 0.5) / 2])
    np.testing.assert_allclose(scores.teacher_log_prob, [-5.5 / 3, -1.0])
    np.testing.assert_allclose(scores.model_log_prob, [-2.0, -1.0])
    np.testing.assert_allclose(scores.tokens, [3, 2])
    # token-weighted over both responses (and two passes of the same): sum over the 5 tokens / 5
    extras = teacher_extras([scores, scores])
    assert extras["teacher_reverse_kl"] == pytest.approx(-0.5 / 5)
    assert extras["teacher_log_prob_mean"] == pytest.approx(-7.5 / 5)
    assert extras["teacher_model_log_prob_mean"] == pytest.approx(-8.0 / 5)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from rlframe.data.arithmetic import generate_arithmetic_dataset

    return generate_arithmetic_dataset(tmp_path_factory.mktemp("sums"), n_train=1, n_val=3)[1]


def evaluate(model, data, teacher, out, *extra):
    return main([f"model={model}", f"data={data}", f"reward={REPO_ROOT / 'tests' / 'length_reward.py'}",
                 f"teacher={teacher}", "engine=hf", "max_response_length=12", "n=2", "temperature=1.0", "bootstrap=10",
                 f"out={out}", *extra])


def test_model_as_its_own_teacher_then_another_teacher(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "self.jsonl"
    metrics = evaluate(tiny_model_dir, data_file, tiny_model_dir, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * metrics["prompts"] and abs(metrics["teacher_reverse_kl"]) < 1e-6, metrics
    assert metrics["teacher_log_prob_mean"] == pytest.approx(metrics["teacher_model_log_prob_mean"], abs=1e-6)
    assert metrics["teacher_log_prob_mean"] < 0
    for row in rows:
        assert abs(row["teacher_reverse_kl"]) < 1e-6 and row["teacher_log_prob"] == pytest.approx(row["model_log_prob"])

    other = build_tiny_model_dir(tmp_path / "other_teacher", seed=1)  # the same tokenizer, other weights
    out = tmp_path / "other.jsonl"
    against = evaluate(tiny_model_dir, data_file, other, out)
    rows2 = [json.loads(line) for line in out.read_text().splitlines()]
    assert against["teacher_reverse_kl"] > 0.01, against
    # the same seeds sample the same responses; the model's own log-probs do not depend on the teacher
    assert [r["response"] for r in rows2] == [r["response"] for r in rows]
    assert against["teacher_model_log_prob_mean"] == pytest.approx(metrics["teacher_model_log_prob_mean"], abs=1e-6)
    for row in rows2:  # per response: KL = model log-prob - teacher log-prob (means over the same tokens)
        assert row["teacher_reverse_kl"] == pytest.approx(row["model_log_prob"] - row["teacher_log_prob"], abs=1e-9)


def test_teacher_with_another_tokenizer_is_refused(tiny_model_dir, data_file, tmp_path):
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher_other_tokenizer"
    shutil.copytree(tiny_model_dir, teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<an_extra_token>"])
    tokenizer.save_pretrained(teacher)
    with pytest.raises(EvalUsageError) as raised:
        evaluate(tiny_model_dir, data_file, teacher, tmp_path / "x.jsonl")
    message = str(raised.value)
    assert str(teacher) in message and str(tiny_model_dir) in message and "vocabulary" in message, message
    with pytest.raises(EvalUsageError, match="not a model folder"):
        evaluate(tiny_model_dir, data_file, tmp_path / "nowhere", tmp_path / "x.jsonl")


def test_teacher_run_takes_the_runs_teacher(tmp_path, data_file):
    args = ["data=" + str(data_file), "reward=reward_fns/math.py"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("teacher:\n  path: /models/the_teacher\n  backend: url\n  url: http://x:1/v1\n")
    cfg, *_ = build_config(parse_args([f"run={run}", "teacher=run", *args]))
    assert (cfg.teacher.path, cfg.teacher.backend, cfg.teacher.url) == ("/models/the_teacher", "fsdp", None)
    cfg, *_ = build_config(parse_args([f"run={run}", *args]))
    assert cfg.teacher.path is None  # not asked: the run's teacher stays out of the evaluation
    (run / "config.yaml").write_text("trainer:\n  seed: 3\n")
    with pytest.raises(EvalUsageError, match="has no teacher.path"):
        build_config(parse_args([f"run={run}", "teacher=run", *args]))
    with pytest.raises(EvalUsageError, match="teacher=run: needs run="):
        build_config(parse_args(["model=m", "teacher=run", *args]))
