"""The run report (rlframe/report.py): built from metrics.jsonl, written at the end of a run, and opened
in headless Chromium (Debian's `chromium`; .ci/run installs it) to check the plots render without
console errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import read_metrics, run_tiny
from rlframe.report import build_report, main as report_main, write_report


def fake_run(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "val/reward_mean": 0.2, "val/accuracy": 0.25, "timing/validation": 3.0}]
    for step in (1, 2, 3):
        lines.append({"step": step, "critic/score/mean": 0.1 * step, "critic/accuracy": 0.1 * step,
                      "response_length/mean": 20 + step, "actor/kl_loss": 0.01 * step, "actor/entropy": 1.0 / step,
                      "actor/pg_clipfrac": 0.0, "rollout/logprob_abs_diff": 1e-5, "timing/rollout": 10.0,
                      "timing/update": 5.0, "timing/step": 15.5, "perf/generated_tokens_per_s": 100.0})
    lines.append({"step": 3, "val/reward_mean": 0.5, "val/accuracy": 0.5})
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"step": 4, "critic/sco'  # a line cut by a crash
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "validation_samples.jsonl").write_text(
        json.dumps({"step": 0, "response": "old", "ground_truth": "1", "score": 0.0}) + "\n"
        + json.dumps({"step": 3, "response": "<script>alert(1)</script> \\boxed{4}", "ground_truth": "4",
                      "score": 1.0}) + "\n")
    return run_dir


def test_report_from_metrics(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    html = build_report(run_dir)
    for title in ("Reward", "Accuracy", "Response length", "KL", "Entropy", "Clip fractions",
                  "Rollout vs trainer log-prob gap", "Throughput", "Time per step by phase"):
        assert f">{title}" in html, title
    assert "Memory" not in html  # not logged: no empty chart
    assert "0.2000 (step 0) &rarr; 0.5000 (step 3)" in html
    assert "&lt;script&gt;alert(1)" in html and "<script>alert" not in html  # responses are escaped
    assert ">old<" not in html  # only the last validation's samples
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched
    path = write_report(run_dir)
    assert path == run_dir / "report.html" and path.read_text() == html
    with pytest.raises(SystemExit, match="metrics.jsonl not found"):
        report_main([str(tmp_path / "nowhere")])


def test_report_shows_the_doctor_and_the_gates_that_fired(tmp_path):
    from rlframe.doctor.result import CheckResult, write_doctor_json

    run_dir = fake_run(tmp_path / "run")
    assert "no doctor.json" in build_report(run_dir) and "no gate fired" in build_report(run_dir)
    write_doctor_json(run_dir, [CheckResult("live", "weight_sync", "fail", "12 of 21 <differ>", "load the weights"),
                                CheckResult("data", "train_rows", "pass", "64 rows")], ["recipe=grpo_math"], 12.0)
    (run_dir / "gates.jsonl").write_text(json.dumps(
        {"name": "logprob_gap", "step": 2, "metric": "rollout/logprob_abs_diff", "value": 0.5, "threshold": 0.001,
         "cause": "a weight sync that did not land", "action": "warn"}) + "\n")
    html = build_report(run_dir)
    assert "1 pass, 0 warn, 1 fail, 0 skipped (12.0 s)" in html
    assert "live/weight_sync" in html and "12 of 21 &lt;differ&gt;" in html and "load the weights" in html
    assert "<td class='num'>2</td><td>logprob_gap (warn)</td><td>rollout/logprob_abs_diff</td>" in html
    assert "a weight sync that did not land" in html


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def open_in_chromium(url: str, tmp_path) -> tuple[str, list[str]]:
    """The page's DOM after load, and the console messages Chromium logged."""
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, tiny_model_dir):
    """A 2-step run on the tiny model, its command line written the verl way."""
    tmp_path = tmp_path_factory.mktemp("two_step_run")
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math", "actor_rollout_ref.rollout.n=2",
                               "trainer.total_training_steps=2", "trainer.test_freq=-1",
                               "rollout.engine=hf")  # (vLLM: the main job's check, README)
    assert "note: actor_rollout_ref.rollout.n=2 -> rollout.n=2" in result.stdout
    assert {m["step"] for m in read_metrics(run_dir)} == {0, 1, 2}
    return run_dir, result


@pytest.mark.skipif(chromium() is None, reason="Debian's chromium is not installed (.ci/run installs it with apt-get; "
                                               "this machine could not)")
def test_report_of_a_two_step_run_renders_in_chromium(tmp_path, two_step_run):
    # The console check can fail: a page with an error is caught.
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('broken page')</script></body></html>")
    _, console = open_in_chromium(bad.as_uri(), tmp_path)
    assert any("broken page" in line for line in console), console

    # The run wrote its report into the run directory.
    run_dir, result = two_step_run
    assert f"report: {run_dir / 'report.html'}" in result.stdout
    dom, console = open_in_chromium((run_dir / "report.html").as_uri(), tmp_path)
    assert console == [], console
    assert 'data-charts-rendered="' in dom, dom[:2000]
    drawn, total = dom.split('data-charts-rendered="', 1)[1].split('"', 1)[0].split("/")
    assert int(total) >= 8 and drawn == total, (drawn, total)
    assert "<td>" in dom.split("Sample rollouts", 1)[1]  # the samples table has rows

    # and the command line regenerates it
    (run_dir / "report.html").unlink()
    subprocess.run([sys.executable, "-m", "rlframe.report", str(run_dir)], check=True, timeout=120)
    assert (run_dir / "report.html").is_file()


def test_eval_reproduces_the_final_validation(tmp_path, two_step_run):
    """python -m rlframe.eval on the run's exported model: the same greedy responses, reward and accuracy."""
    run_dir, _ = two_step_run
    done = subprocess.run([sys.executable, "-m", "rlframe.eval", f"run={run_dir}", f"out={tmp_path / 'eval.jsonl'}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("metrics: "))[9:])
    final = read_metrics(run_dir)[-1]
    assert metrics["prompts"] == 8 and metrics["n"] == 1
    assert (metrics["reward_mean"], metrics["accuracy"]) == (final["val/reward_mean"], final["val/accuracy"])
    assert metrics["response_length"] == final["val/response_length"]
    validated = [json.loads(line) for line in (run_dir / "validation_samples.jsonl").read_text().splitlines()]
    validated = [row["response"] for row in validated if row["step"] == 2]
    evaluated = [json.loads(line)["response"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert validated and evaluated[:len(validated)] == validated  # token for token


def test_report_shows_the_checkpoint_evaluation_and_validation_bands(tmp_path):
    """eval_checkpoints.json (rlframe.eval checkpoints=all) becomes a curve and one table row per checkpoint;
    logged validation intervals are drawn on the accuracy chart."""
    run_dir = fake_run(tmp_path / "run")
    assert "Evaluation over checkpoints" not in build_report(run_dir)
    rows = [{"step": step, "model": f"step_{step}", "path": f"/x/step_{step}",
             "metrics": {"accuracy": acc, "accuracy_ci_low": acc - 0.1, "accuracy_ci_high": acc + 0.1,
                         "pass@4": acc + 0.2, "pass@4_ci_low": acc, "pass@4_ci_high": acc + 0.3}}
            for step, acc in ((1, 0.25), (2, 0.5))]
    (run_dir / "eval_checkpoints.json").write_text(json.dumps({"settings": {"engine": "hf", "n": 4}, "rows": rows}))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 3, "val/accuracy_ci_low": 0.3, "val/accuracy_ci_high": 0.7}) + "\n")
    html = build_report(run_dir)
    assert ">Evaluation over checkpoints: accuracy" in html and "engine=hf, n=4" in html
    assert html.count("<td>step_") == 2 and "0.5 [0.4, 0.6]" in html
    assert "validation 95% CI low" in html
