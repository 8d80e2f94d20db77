"""`python -m rlframe.eval harness=...` (rlframe/evaluation/harness.py): a small local task written in
lm-eval's own task YAML (its data a local jsonl: no dataset hub here) run on the tiny model through lm-eval's
HF backend, in the eval table's form; a task that is not there offline is a one-line error naming it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rlframe.eval import EvalUsageError, main as eval_main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm_eval is not installed (the `eval` extra: pip install 'rlframe[eval]')")

TASK = """task: rlframe_tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "What is {{{{a}}}} + {{{{b}}}}? Answer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = [{"a": a, "b": b, "choices": [str(a + b), str(a + b + 1), str(a + b + 2)], "label": 0}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (6, 3)]]
    data = folder / "sums.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    (folder / "rlframe_tiny_sums.yaml").write_text(TASK.format(data=data))
    return folder


def test_a_local_lm_eval_task_on_the_tiny_model(local_task, tiny_model_dir):
    metrics = eval_main([f"model={tiny_model_dir}", "harness=rlframe_tiny_sums", f"harness_include={local_task}",
                         "seed=1"])
    rows = {(row["task"], row["metric"]): row for row in metrics["harness"]}
    acc = rows[("rlframe_tiny_sums", "acc")]
    assert 0.0 <= acc["value"] <= 1.0 and acc["value"] * 6 == pytest.approx(round(acc["value"] * 6))  # k of 6
    assert acc["ci_low"] <= acc["value"] <= acc["ci_high"] and acc["stderr"] >= 0.0
    assert metrics["backend"] == "hf" and metrics["seed"] == 1


def test_a_task_not_found_offline_is_one_line(local_task, tiny_model_dir):
    with pytest.raises(EvalUsageError) as error:
        eval_main([f"model={tiny_model_dir}", "harness=rlframe_no_such_task", f"harness_include={local_task}"])
    first = str(error.value).splitlines()[0]
    assert first.startswith("error: harness=rlframe_no_such_task: task rlframe_no_such_task not found among "
                            "lm-eval's built-in tasks or harness_include="), first
    with pytest.raises(EvalUsageError, match=r"error: harness_include=.*nowhere: not a folder"):
        eval_main([f"model={tiny_model_dir}", "harness=x", f"harness_include={local_task / 'nowhere'}"])
