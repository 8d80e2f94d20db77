"""Run folders read back for the page: status, progress, curves, samples, the log tail, the report.

Everything here reads what a run writes (rlframe/trainer/run_dir.py's owner.json and lock, metrics.jsonl,
timeline.jsonl, validation_samples.jsonl, summary.json, report.html; rlframe/report.py's readers) and
nothing else, so a run started from a terminal shows the same as one the board launched.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlframe.board.preview import run_dir_problem
from rlframe.report import read_jsonl_rows, read_samples

# (curve title, [(metric key, label)]): the page's live plots.
CURVES: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("critic/score/mean", "train"), ("val/reward_mean", "validation")]),
    ("accuracy", [("critic/accuracy", "train"), ("val/accuracy", "validation")]),
    ("kl", [("actor/kl_loss", "KL loss"), ("actor/ppo_kl", "PPO KL")]),
    ("response_length", [("response_length/mean", "train mean"), ("val/response_length", "validation")]),
    ("logprob_gap", [("rollout/logprob_abs_diff", "|logp rollout - logp trainer|")]),
    ("throughput", [("perf/generated_tokens_per_s", "generated tokens/s"),
                    ("perf/actor_train_tokens_per_s", "trained tokens/s")]),
    ("memory", [("perf/peak_mem_gib/generate_sequences", "generation GiB"),
                ("perf/peak_mem_gib/update_actor", "update GiB")]),
]
PHASES = ("rollout", "reward", "ref_log_prob", "advantage", "update", "weight_sync", "validation")
RUN_COLUMNS = ["run", "status", "step", "reward", "val accuracy", "started", "folder"]


def read_steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: {key: value}} (later lines of a step win); {} before the first line."""
    steps: dict[int, dict[str, float]] = {}
    for record in read_jsonl_rows(Path(run_dir) / "metrics.jsonl"):
        if "step" not in record:
            continue
        values = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        steps.setdefault(int(record["step"]), {}).update(values)
    return dict(sorted(steps.items()))


def curve_frame(steps: dict[int, dict[str, float]], title: str, run: str = "") -> pd.DataFrame:
    """One plot's points as a long table (step, value, series) for gr.LinePlot."""
    lines = dict(CURVES)[title]
    rows = [{"step": step, "value": m[key], "series": f"{run} {label}".strip()}
            for key, label in lines for step, m in steps.items() if key in m and math.isfinite(m[key])]
    return points(rows)


def points(rows: list[dict]) -> pd.DataFrame:
    """Numeric step and value columns even when empty (the plot takes an empty object column as categories)."""
    return pd.DataFrame(rows, columns=["step", "value", "series"]).astype({"step": "int64", "value": "float64",
                                                                           "series": "str"})


def compare_frame(run_dirs: list[Path], key: str) -> pd.DataFrame:
    """Several runs' `key` on one plot (series = run name)."""
    rows = []
    for run_dir in run_dirs:
        for step, m in read_steps(run_dir).items():
            if key in m and math.isfinite(m[key]):
                rows.append({"step": step, "value": m[key], "series": Path(run_dir).name})
    return points(rows)


def metric_table(steps: dict[int, dict[str, float]], last: int = 8) -> pd.DataFrame:
    """The last steps' headline figures, one row per step."""
    keys = [("critic/score/mean", "reward"), ("critic/accuracy", "accuracy"), ("val/reward_mean", "val reward"),
            ("val/accuracy", "val accuracy"), ("actor/kl_loss", "kl"), ("response_length/mean", "length"),
            ("timing/step", "step s")]
    rows = [{"step": step, **{label: round(m[key], 4) for key, label in keys if key in m}}
            for step, m in list(steps.items())[-last:]]
    return pd.DataFrame(rows, columns=["step", *[label for _, label in keys]])


def total_steps(run_dir: Path) -> int | None:
    import yaml

    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        return int(config["trainer"]["total_steps"]) or None  # 0: a stage recipe's own count, not known yet
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


@dataclass
class Progress:
    step: int
    total: int | None
    eta_s: float | None
    phases: dict[str, float]  # the last step's seconds per phase

    def line(self) -> str:
        of = f"/{self.total}" if self.total else ""
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None else ""
        times = "  ".join(f"{p} {s:.1f}s" for p, s in self.phases.items())
        return f"step {self.step}{of}{eta}" + (f"  |  {times}" if times else "")


def progress(run_dir: Path, steps: dict[int, dict[str, float]] | None = None) -> Progress:
    """The last finished step, the ETA (mean step time x steps left) and the last step's phase times."""
    steps = read_steps(run_dir) if steps is None else steps
    trained = {s: m for s, m in steps.items() if s > 0}
    step = max(trained, default=0)
    total = total_steps(run_dir)
    times = [m["timing/step"] for m in trained.values() if "timing/step" in m]
    eta = (sum(times) / len(times)) * max(total - step, 0) if times and total else None
    last = trained.get(step, {})
    phases = {p: last[f"timing/{p}"] for p in PHASES if f"timing/{p}" in last}
    return Progress(step, total, eta, phases)


def status(run_dir: Path, exit_code: int | None = None, alive: bool = False) -> str:
    """running | shutting down | finished | stopped (a signal; resumable) | failed (exit N) | killed or crashed
    | not started. `exit_code` and `alive`: what the board sees of its own process, when it launched the run."""
    run_dir = Path(run_dir)
    if run_dir_problem(run_dir):
        return "running"
    if alive:
        return "shutting down (the folder is released; the process is ending)"
    if (run_dir / "summary.json").exists():
        return "finished"
    if exit_code in (130, 143):
        return "stopped"
    if exit_code not in (None, 0):
        return f"failed (exit {exit_code})"
    try:
        owner = json.loads((run_dir / "owner.json").read_text())
    except (OSError, ValueError):
        return "not started"
    if owner.get("ended") is None:
        return "killed or crashed"
    return "stopped" if (run_dir / "checkpoints").is_dir() or read_steps(run_dir) else "ended"


def list_runs(root: Path, exit_codes: dict[str, int | None] | None = None) -> pd.DataFrame:
    """Every run folder under `root` (a folder with owner.json or metrics.jsonl), newest first."""
    exit_codes = exit_codes or {}
    rows = []
    folders = [p for p in Path(root).glob("*") if (p / "owner.json").exists() or (p / "metrics.jsonl").exists()]
    for run_dir in sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True):
        steps = read_steps(run_dir)
        p = progress(run_dir, steps)
        trained = [m for s, m in steps.items() if s > 0]
        vals = [m["val/accuracy"] for m in steps.values() if "val/accuracy" in m]
        try:
            started = json.loads((run_dir / "owner.json").read_text()).get("started", "")
        except (OSError, ValueError):
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(run_dir.stat().st_mtime))
        key = str(run_dir.resolve())
        rows.append({"run": run_dir.name, "status": status(run_dir, exit_codes.get(key),
                                                           key in exit_codes and exit_codes[key] is None),
                     "step": f"{p.step}/{p.total or '?'}",
                     "reward": round(trained[-1].get("critic/score/mean", float("nan")), 4) if trained else None,
                     "val accuracy": " -> ".join(f"{v:.3f}" for v in (vals[:1] + vals[1:][-1:])) if vals else "",
                     "started": started, "folder": str(run_dir.resolve())})
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def samples_frame(run_dir: Path, limit: int = 8) -> pd.DataFrame:
    """The latest validation's sample rollouts with their rewards (rlframe/report.py's reader)."""
    rows = [{"step": r.get("step", ""), "response": str(r.get("response", ""))[:400],
             "ground truth": str(r.get("ground_truth", "")), "reward": r.get("score", "")}
            for r in read_samples(Path(run_dir), limit)]
    return pd.DataFrame(rows, columns=["step", "response", "ground truth", "reward"])


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last lines of a log file ('' when there is none)."""
    if path is None or not Path(path).is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def report_html(run_dir: Path) -> str:
    """The run's report.html in an iframe (self-contained: inline SVG, no scripts fetched), or a note."""
    import html

    path = Path(run_dir) / "report.html"
    if not path.is_file():
        return "<p>no report.html yet: the trainer writes it at the end of the run (python -m rlframe.report &lt;run&gt;)</p>"
    return (f'<iframe title="report" style="width:100%;height:720px;border:1px solid #ccc" '
            f'srcdoc="{html.escape(path.read_text(), quote=True)}"></iframe>')
