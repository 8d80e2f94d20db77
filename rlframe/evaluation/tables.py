"""An evaluation's results as a flat metrics dict (the `metrics:` line), a markdown table, and a curve over steps.

Table columns: the method; its score (what the method answers with: accuracy, or maj@n for self-consistency)
with the 95% bootstrap interval over prompts; the gain over the plain policy (per-prompt differences,
bootstrapped: a paired interval); pass@k / maj@k / mean@k for each k; the spread over sampling seeds
(sd, with repeats > 1). The seeds and the number of prompts and samples are written under the table.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rlframe.evaluation.stats import Estimate

RATES = ("accuracy", "pass@", "mean@", "maj@")  # metric names that get an interval
OWN_NOTES = ("judge_", "teacher_")  # extras with a note of their own under the table (the rest: self-check's)


def _is_rate(key: str) -> bool:
    return key == "accuracy" or key.startswith(RATES[1:])


def gain(result, plain, seed: int, resamples: int) -> Estimate:
    """result's score minus plain's accuracy, per prompt, bootstrapped over prompts (paired)."""
    return Estimate.of(result.per_prompt[result.headline] - plain.per_prompt["accuracy"], seed, resamples)


def flat_metrics(results: dict, prompts: int, n: int, seed: int = 0, resamples: int = 1000) -> dict[str, float]:
    """{key: value}: plain's metrics under their own names (reward_mean, accuracy, response_length, pass@k,
    mean@k, maj@k; `<key>_ci_low` / `<key>_ci_high` for the rates; `<key>_seed_std` with several seeds),
    every other method's under `<method>/`: the same values, an interval on its headline metric, and its
    `score` and `gain` over plain (with the gain's paired interval)."""
    plain = results["plain"]
    out: dict[str, float] = {}
    for name, result in results.items():
        prefix = "" if name == "plain" else f"{name}/"
        keys = list(result.per_prompt)
        if name != "plain":
            keys = [result.headline] + [k for k in keys if k != result.headline]
        for key in keys:
            out[prefix + key] = float(np.mean(result.per_prompt[key]))
            if _is_rate(key) and (name == "plain" or key == result.headline):
                estimate = result.estimate(key, seed, resamples)
                out[prefix + key + "_ci_low"], out[prefix + key + "_ci_high"] = estimate.low, estimate.high
            if len(result.seeds) > 1:
                out[prefix + key + "_seed_std"] = result.spread(key).std
        if name != "plain":
            out[prefix + "score"] = out[prefix + result.headline]
            estimate = gain(result, plain, seed, resamples)
            out[prefix + "gain"], out[prefix + "gain_ci_low"], out[prefix + "gain_ci_high"] = (
                estimate.mean, estimate.low, estimate.high)
        out.update({f"{prefix}{key}": value for key, value in result.extra.items()})
    out.update({"prompts": float(prompts), "n": float(n), "seeds": ",".join(str(s) for s in plain.seeds),
                "bootstrap_resamples": float(resamples)})
    return out


def method_table(results: dict, ks: list[int], prompts: int, n: int, seed: int = 0, resamples: int = 1000,
                 label: str = "method") -> list[str]:
    """The markdown table (lines) of the methods of one model."""
    plain = results["plain"]
    repeats = len(plain.seeds) > 1
    head = [label, "score [95% CI]", "gain vs plain [95% CI]"]
    for k in ks:
        head += [f"pass@{k}", f"maj@{k}", f"mean@{k}"]
    head += ["reward", "length"] + (["seed sd"] if repeats else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, result in results.items():
        score = result.estimate(result.headline, seed, resamples)
        cells = [name if result.headline == "accuracy" else f"{name} ({result.headline})", score.fmt(3),
                 "—" if name == "plain" else gain(result, plain, seed, resamples).fmt(3)]
        for k in ks:
            cells += [result.estimate(f"{m}@{k}", seed, resamples).fmt(3) for m in ("pass", "maj", "mean")]
        cells += [f"{np.mean(result.per_prompt['reward_mean']):.4f}",
                  f"{np.mean(result.per_prompt['response_length']):.1f}"]
        if repeats:
            cells.append(f"{result.spread(result.headline).std:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    extras = "; ".join(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.extra.items() if not k.startswith(OWN_NOTES))
                       for name, r in results.items() if any(not k.startswith(OWN_NOTES) for k in r.extra))
    judged = "; ".join(f"{name}: judge score {r.extra['judge_score_mean']:.3f}, unscorable "
                       f"{r.extra['judge_unscorable_rate']:.3f}" for name, r in results.items() if "judge_score_mean" in r.extra)
    taught = "; ".join(f"{name}: reverse KL {r.extra['teacher_reverse_kl']:.4g} per token, teacher log-prob "
                       f"{r.extra['teacher_log_prob_mean']:.4f}" for name, r in results.items()
                       if "teacher_reverse_kl" in r.extra)
    lines.append("")
    lines.append(f"{prompts} prompts x {n} samples; seeds {', '.join(str(s) for s in plain.seeds)}; intervals: "
                 f"percentile bootstrap over prompts ({resamples} resamples, seed {seed})"
                 + (f"; self-check revisions {extras}" if extras else "") + (f"; LLM judge {judged}" if judged else "")
                 + (f"; teacher {taught}" if taught else ""))
    return lines


def checkpoint_table(rows: list[dict], ks: list[int]) -> list[str]:
    """rows [{step, model, metrics}] -> the markdown table of a run's checkpoints (plain policy)."""
    head = ["step", "model", "accuracy [95% CI]"] + [f"{m}@{k}" for k in ks for m in ("pass", "maj", "mean")]
    head += ["reward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        m = row["metrics"]

        def cell(key: str) -> str:
            return f"{m[key]:.3f} [{m[key + '_ci_low']:.3f}, {m[key + '_ci_high']:.3f}]"

        cells = [str(row["step"]), row["model"], cell("accuracy")]
        cells += [cell(f"{name}@{k}") for k in ks for name in ("pass", "maj", "mean")]
        cells.append(f"{m['reward_mean']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def checkpoint_curve(rows: list[dict], key: str = "accuracy") -> str:
    """An SVG line chart of `key` over the steps with its interval as dashed lines (the report's chart style)."""
    from rlframe.report import line_chart

    steps = [float(row["step"]) for row in rows]
    lines = [(key, list(zip(steps, [row["metrics"][key] for row in rows])), False),
             ("95% CI low", list(zip(steps, [row["metrics"][key + "_ci_low"] for row in rows])), True),
             ("95% CI high", list(zip(steps, [row["metrics"][key + "_ci_high"] for row in rows])), True)]
    return line_chart(f"Evaluation over checkpoints: {key}", lines)


def write_checkpoint_outputs(rows: list[dict], ks: list[int], out_dir: Path, settings: dict) -> list[Path]:
    """eval_checkpoints.{json,md,svg} in out_dir: the rows, the table and the curve."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "eval_checkpoints.json", out_dir / "eval_checkpoints.md", out_dir / "eval_checkpoints.svg"]
    paths[0].write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    note = ", ".join(f"{k}={v}" for k, v in settings.items())
    paths[1].write_text("\n".join(["# Evaluation over checkpoints", "", f"One engine and one setting for every "
                                   f"row: {note}.", ""] + checkpoint_table(rows, ks)) + "\n")
    paths[2].write_text(checkpoint_curve(rows) + "\n")
    return paths


def write_samples(path: Path, results: dict, n: int, fields: dict | None = None, mode: str = "w") -> None:
    """Every response of every method with its reward, one json line each: {method, prompt_index, sample,
    response, ground_truth, score, acc, answer; with judge= judge, judge_score; with teacher= teacher_reverse_kl,
    teacher_log_prob, model_log_prob}, plain's first (in row order), then each other method's
    (with its prompt when the method changed it). self_consistency adds no responses: it votes on plain's.
    `fields` are added to every row (checkpoints=: the step); mode "a" appends."""
    with open(path, mode) as f:
        for name, result in results.items():
            samples = result.samples
            if name == "self_consistency":
                continue
            for i, text in enumerate(samples.texts):
                row = {**(fields or {}), "method": name, "prompt_index": i // n, "sample": i % n, "response": text,
                       "ground_truth": samples.truths[i], "score": float(samples.scores[i]),
                       "acc": float(samples.accuracy[i]), "answer": samples.answers[i]}
                if name in ("cot", "self_check"):
                    row["prompt"] = samples.raw_prompts[i]
                if samples.judge_scores is not None:  # judge=: the judge's reply, its score (null: unscorable)
                    value = float(samples.judge_scores[i])
                    row["judge"], row["judge_score"] = samples.judge_replies[i], None if value != value else value
                if samples.teacher is not None:  # teacher=: the response's means over its tokens (temperature 1)
                    t = samples.teacher
                    row.update(teacher_reverse_kl=float(t.reverse_kl[i]), teacher_log_prob=float(t.teacher_log_prob[i]),
                               model_log_prob=float(t.model_log_prob[i]))
                f.write(json.dumps(row) + "\n")
