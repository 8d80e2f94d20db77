"""`python -m rlframe.report <run_dir>`: one self-contained HTML page about a run.

Reads `<run_dir>/metrics.jsonl` (and `validation_samples.jsonl`, `config.yaml`, `doctor.json`, `gates.jsonl`,
`judge_outputs.jsonl` when present) and writes `<run_dir>/report.html`: the doctor's checklist (`python -m rlframe.doctor`) and the
gates that fired during training (trainer.gates), reward and accuracy curves (train and validation), response
length, KL, entropy, clip fractions, the rollout/trainer log-prob gap, the time of each phase per step,
throughput, memory, a table of sample rollouts with their rewards, and an LLM judge's every verdict (reward.judge). The plots are inline SVG drawn
here: no script from a CDN, nothing fetched, so the file opens anywhere (and can be mailed).
The trainer regenerates it at the end of every run.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path

from rlframe.trainer.startup import PREFIX as STARTUP_PREFIX, describe as describe_startup

# (title, [(metric key, label, dashed)]): a chart is drawn when at least one of its keys was logged.
CHARTS: list[tuple[str, list[tuple[str, str, bool]]]] = [
    ("Reward", [("critic/score/mean", "train score", False), ("reward/score_mean", "train reward", False),
                ("val/reward_mean", "validation reward", True), ("val/score_mean", "validation score", True),
                ("val/reward_mean_ci_low", "validation reward 95% CI low", True),
                ("val/reward_mean_ci_high", "validation reward 95% CI high", True)]),
    ("Accuracy", [("critic/accuracy", "train", False), ("val/accuracy", "validation", True),
                  ("val/accuracy_ci_low", "validation 95% CI low", True),
                  ("val/accuracy_ci_high", "validation 95% CI high", True)]),
    ("Response length (tokens)", [("response_length/mean", "train mean", False), ("response_length/max", "train max", False),
                                  ("val/response_length", "validation mean", True)]),
    ("KL", [("actor/kl_loss", "KL loss (to the reference)", False), ("actor/ppo_kl", "PPO KL (to the old policy)", False),
            ("reward/kl_penalty", "KL penalty in the reward", False)]),
    ("Entropy", [("actor/entropy", "policy entropy", False), ("actor/entropy_loss", "entropy loss", False)]),
    ("Clip fractions", [("actor/pg_clipfrac", "ratio clipped (upper)", False),
                        ("actor/pg_clipfrac_lower", "ratio clipped (dual, lower)", False),
                        ("response_length/clip_ratio", "responses cut at the length limit", False)]),
    ("Rollout vs trainer log-prob gap", [("rollout/logprob_abs_diff", "mean |logp_rollout - logp_trainer|", False)]),
    ("LLM judge (reward.judge)", [("reward/judge_score_mean", "judge score (scorable samples)", False),
                                  ("reward/judge_unscorable_rate", "unscorable share", False),
                                  ("reward/judge_parse_failure_rate", "replies that did not parse", True),
                                  ("reward/judge_request_failure_rate", "requests that failed", True)]),
    ("Group signal (gates)", [("reward/zero_variance_groups", "share of groups scoring alike", False),
                              ("reward/score_std", "score std over the batch", False)]),
    ("Losses and gradient", [("actor/pg_loss", "policy loss", False), ("actor/grad_norm", "grad norm", False),
                             ("critic/vf_loss", "value loss", False)]),
    ("Throughput (tokens/s)", [("perf/generated_tokens_per_s", "generation", False),
                               ("perf/actor_train_tokens_per_s", "actor update", False)]),
    ("Model FLOPs utilisation", [("perf/mfu", "MFU", False)]),
    ("Peak memory per phase (GiB; device on GPU, RSS on CPU)",
     [("perf/peak_mem_gib/generate_sequences", "generation", False),
      ("perf/peak_mem_gib/compute_log_prob", "old log-probs", False),
      ("perf/peak_mem_gib/compute_ref_log_prob", "reference log-probs", False),
      ("perf/peak_mem_gib/compute_values", "values", False),
      ("perf/peak_mem_gib/update_critic", "critic update", False),
      ("perf/peak_mem_gib/update_actor", "actor update", False),
      ("perf/peak_mem_gib/sync_weights", "weight sync", False)]),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]
WIDTH, HEIGHT, PAD_L, PAD_R, PAD_T, PAD_B = 520, 260, 62, 16, 28, 40


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: {key: value}}; several lines of one step are merged, later wins."""
    steps: dict[int, dict[str, float]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory (trainer.loggers must include jsonl)?")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: the rest of the run is still worth a report
        step = int(record.pop("step", number))
        steps.setdefault(step, {}).update({k: float(v) for k, v in record.items() if isinstance(v, (int, float))})
    return dict(sorted(steps.items()))


def read_timeline(run_dir: Path) -> dict[int, dict[str, tuple[float, float]]]:
    """timeline.jsonl -> {step: {phase: (start, end)}}, seconds from the step's start."""
    steps: dict[int, dict[str, tuple[float, float]]] = {}
    for line in (Path(run_dir) / "timeline.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {})[row["phase"]] = (row["start"], row["end"])
    return steps


def series(steps: dict[int, dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(step, m[key]) for step, m in steps.items() if key in m and math.isfinite(m[key])]


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    ticks = [round(start, 12)]
    while ticks[-1] < high - step * 1e-9:  # the last tick at or above the highest value
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4g}"


def line_chart(title: str, lines: list[tuple[str, list[tuple[float, float]], bool]]) -> str:
    """An SVG line chart: each line (label, [(x, y)], dashed); single points drawn as dots."""
    xs = [x for _, pts, _ in lines for x, _ in pts]
    ys = [y for _, pts, _ in lines for _, y in pts]
    x_ticks, y_ticks = _nice_ticks(min(xs), max(xs)), _nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    plot_w, plot_h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def px(x: float) -> float:
        return PAD_L + (x - x0) / ((x1 - x0) or 1) * plot_w

    def py(y: float) -> float:
        return PAD_T + plot_h - (y - y0) / ((y1 - y0) or 1) * plot_h

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" class="title">{html.escape(title)}</text>']
    for y in y_ticks:
        parts.append(f'<line x1="{PAD_L}" x2="{WIDTH - PAD_R}" y1="{py(y):.1f}" y2="{py(y):.1f}" class="grid"/>'
                     f'<text x="{PAD_L - 6}" y="{py(y) + 4:.1f}" text-anchor="end" class="tick">{_fmt(y)}</text>')
    for x in x_ticks:
        parts.append(f'<text x="{px(x):.1f}" y="{HEIGHT - PAD_B + 16}" text-anchor="middle" class="tick">{_fmt(x)}</text>')
    parts.append(f'<text x="{PAD_L + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle" class="tick">step</text>')
    for i, (label, pts, dashed) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        if len(pts) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            parts.append(f'<polyline class="series" points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
                         f'<title>{html.escape(label)} @ step {_fmt(x)}: {_fmt(y)}</title></circle>')
        ly = PAD_T + 4 + 14 * i
        if i == 0:  # a light box behind the legend, so lines under it stay readable
            longest = max(len(label) for label, _, _ in lines)
            parts.append(f'<rect x="{PAD_L + 4}" y="{PAD_T - 6}" width="{34 + 5.6 * longest:.0f}" '
                         f'height="{14 * len(lines) + 4}" fill="#fff" fill-opacity="0.8"/>')
        parts.append(f'<line x1="{PAD_L + 8}" x2="{PAD_L + 26}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>'
                     f'<text x="{PAD_L + 30}" y="{ly + 4}" class="legend">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def phase_chart(steps: dict[int, dict[str, float]]) -> str | None:
    """Stacked bars: seconds of each timing/* phase per training step (timing/step is the total)."""
    phases = sorted({k for m in steps.values() for k in m if k.startswith("timing/") and k not in ("timing/step",)
                     and not k.startswith(STARTUP_PREFIX)})  # (the start-up profile: a row of the summary)
    rows = [(step, {p: m.get(p, 0.0) for p in phases}) for step, m in steps.items()
            if any(p in m for p in phases) and step > 0]
    if not rows:
        return None
    totals = [sum(v.values()) for _, v in rows]
    y_ticks = _nice_ticks(0.0, max(totals) or 1.0)
    plot_w, plot_h = WIDTH - PAD_L - PAD_R - 150, HEIGHT - PAD_T - PAD_B
    bar_w = plot_w / len(rows)
    top = y_ticks[-1]
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
             f'height="{HEIGHT}" role="img" aria-label="time per step">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" class="title">Time per step by phase (s)</text>']
    for y in y_ticks:
        yy = PAD_T + plot_h - y / top * plot_h
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>'
                     f'<text x="{PAD_L - 6}" y="{yy + 4:.1f}" text-anchor="end" class="tick">{_fmt(y)}</text>')
    label_every = max(1, len(rows) // 10)
    for i, (step, values) in enumerate(rows):
        base = 0.0
        x = PAD_L + i * bar_w
        for j, phase in enumerate(phases):
            value = values[phase]
            if value <= 0:
                continue
            y_top = PAD_T + plot_h - (base + value) / top * plot_h
            height = value / top * plot_h
            parts.append(f'<rect class="bar" x="{x + bar_w * 0.1:.1f}" y="{y_top:.1f}" width="{bar_w * 0.8:.1f}" '
                         f'height="{max(height, 0.5):.1f}" fill="{COLORS[j % len(COLORS)]}">'
                         f'<title>step {step} {phase[7:]}: {value:.2f}s</title></rect>')
            base += value
        if i % label_every == 0:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{HEIGHT - PAD_B + 16}" text-anchor="middle" class="tick">{step}</text>')
    parts.append(f'<text x="{PAD_L + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle" class="tick">step</text>')
    for j, phase in enumerate(phases):
        ly = PAD_T + 18 + 14 * j
        parts.append(f'<rect x="{PAD_L + plot_w + 12}" y="{ly - 8}" width="12" height="10" fill="{COLORS[j % len(COLORS)]}"/>'
                     f'<text x="{PAD_L + plot_w + 28}" y="{ly + 1}" class="legend">{html.escape(phase[7:])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def read_samples(run_dir: Path, limit: int = 16) -> list[dict]:
    """The last validation's sample rollouts (validation_samples.jsonl; `step` when the trainer wrote it)."""
    rows = read_jsonl_rows(run_dir / "validation_samples.jsonl")
    if rows and "step" in rows[-1]:
        last = rows[-1]["step"]
        rows = [r for r in rows if r.get("step") == last]
    return rows[-limit:]


def read_gate_events(run_dir: Path) -> list[dict]:
    """gates.jsonl: one row per gate that fired (rlframe/trainer/gates.py), in order."""
    return read_jsonl_rows(run_dir / "gates.jsonl")


def read_jsonl_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, in order; [] when it is absent; a line cut by a crash is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


STATUS_COLORS = {"pass": "#2ca02c", "warn": "#ff7f0e", "fail": "#d62728", "skip": "#7f7f7f"}


def doctor_section(run_dir: Path) -> str:
    """The doctor's checklist (doctor.json) as a table, or a line saying how to get one."""
    from rlframe.doctor.result import read_doctor_json

    doctor = read_doctor_json(run_dir)
    if doctor is None:
        return ("<p>no doctor.json: run <code>python -m rlframe.doctor &lt;the same arguments&gt; "
                "trainer.run_dir=&lt;this directory&gt;</code> before training to check the wiring</p>")
    counts = doctor.get("counts", {})
    rows = "".join(
        f"<tr><td style='color:{STATUS_COLORS.get(c.get('status'), '#222')};font-weight:600'>"
        f"{html.escape(str(c.get('status', '')).upper())}</td><td>{html.escape(str(c.get('group', '')))}/"
        f"{html.escape(str(c.get('name', '')))}</td><td>{html.escape(str(c.get('measured', '')))}</td>"
        f"<td>{html.escape(str(c.get('fix', '')))}</td></tr>" for c in doctor.get("checks", []))
    head = (f"<p>{html.escape(str(doctor.get('created', '')))}: {counts.get('pass', 0)} pass, {counts.get('warn', 0)} warn, "
            f"{counts.get('fail', 0)} fail, {counts.get('skip', 0)} skipped ({doctor.get('wall_s', 0)} s)</p>")
    return head + f"<table><tr><th>status</th><th>check</th><th>measured</th><th>fix</th></tr>{rows}</table>"


def gates_section(run_dir: Path) -> str:
    events = read_gate_events(run_dir)
    if not events:
        return "<p>no gate fired</p>"
    rows = "".join(
        f"<tr><td class='num'>{int(e.get('step', 0))}</td><td>{html.escape(str(e.get('name', '')))} "
        f"({html.escape(str(e.get('action', '')))})</td><td>{html.escape(str(e.get('metric', '')))}</td>"
        f"<td class='num'>{html.escape(_fmt(float(e.get('value', float('nan')))))}</td>"
        f"<td class='num'>{html.escape(_fmt(float(e.get('threshold', float('nan')))))}</td>"
        f"<td>{html.escape(str(e.get('cause', '')))}</td></tr>" for e in events)
    return ("<table><tr><th>step</th><th>gate</th><th>metric</th><th>value</th><th>threshold</th><th>likely cause</th></tr>"
            f"{rows}</table>")


def checkpoint_eval_section(run_dir: Path) -> str:
    """<run>/eval_checkpoints.json (`python -m rlframe.eval run=<run> checkpoints=all`): the curve and the table."""
    path = run_dir / "eval_checkpoints.json"
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    rows = data.get("rows", [])
    if not rows:
        return ""
    keys = ["accuracy"] + [k for k in rows[0]["metrics"] if "@" in k and "/" not in k
                           and not k.endswith(("_ci_low", "_ci_high", "_seed_std"))]

    def cell(metrics: dict, key: str) -> str:
        low, high = metrics.get(key + "_ci_low"), metrics.get(key + "_ci_high")
        return _fmt(metrics[key]) + (f" [{_fmt(low)}, {_fmt(high)}]" if low is not None else "")

    steps = [float(r["step"]) for r in rows]
    curve = [(label, list(zip(steps, [r["metrics"][key] for r in rows])), dashed)
             for key, label, dashed in (("accuracy", "accuracy", False), ("accuracy_ci_low", "95% CI low", True),
                                        ("accuracy_ci_high", "95% CI high", True))]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", "model"] + keys)
    body = "".join("<tr>" + f"<td class='num'>{r['step']}</td><td>{html.escape(r['model'])}</td>"
                   + "".join(f"<td class='num'>{html.escape(cell(r['metrics'], k))}</td>" for k in keys) + "</tr>"
                   for r in rows)
    settings = ", ".join(f"{k}={v}" for k, v in data.get("settings", {}).items())
    return (f"<h2>Evaluation over checkpoints</h2><p>One engine and setting for every row: {html.escape(settings)}</p>"
            f"<div class='charts'>{line_chart('Evaluation over checkpoints: accuracy', curve)}</div>"
            f"<table><tr>{head}</tr>{body}</table>")


JUDGE_ROWS_SHOWN = 2000  # judge outputs in the report (the file keeps them all)


def judge_section(run_dir: Path) -> str:
    """Every LLM-judge output (judge_outputs.jsonl: step, uid, response, the judge's reply, its score or
    'unscorable' and why), newest last; "" without a judge."""
    rows = read_jsonl_rows(run_dir / "judge_outputs.jsonl")
    if not rows:
        return ""
    unscorable = sum(1 for r in rows if r.get("score") is None)
    shown = rows[-JUDGE_ROWS_SHOWN:]

    def cut(text, n=400) -> str:
        text = str(text if text is not None else "")
        return html.escape(text if len(text) <= n else text[:n] + " ...")

    body = "".join(
        f"<tr><td class='num'>{html.escape(str(r.get('step', '')))}</td><td>{cut(r.get('uid', ''), 40)}</td>"
        f"<td><pre>{cut(r.get('response'))}</pre></td><td><pre>{cut(r.get('judge'))}</pre></td>"
        + (f"<td class='num'>{html.escape(_fmt(float(r['score'])))}</td>" if r.get("score") is not None else
           f"<td style='color:#d62728'>unscorable: {cut(r.get('why') or 'no verdict', 80)}</td>") + "</tr>"
        for r in shown)
    more = f" (the last {len(shown)} here; all in judge_outputs.jsonl)" if len(shown) < len(rows) else ""
    return (f"<h2>LLM judge outputs</h2><p>{len(rows)} verdicts, {unscorable} unscorable (left out of their group's "
            f"baseline with advantage 0){more}</p><details><summary>every verdict</summary><table><tr><th>step</th>"
            f"<th>uid</th><th>response</th><th>judge's reply</th><th>score</th></tr>{body}</table></details>")


def summary_rows(steps: dict[int, dict[str, float]]) -> list[tuple[str, str]]:
    vals = [(s, m) for s, m in steps.items() if "val/reward_mean" in m]
    rows = [("steps logged", str(max((s for s in steps), default=0)))]
    if vals:
        (s0, first), (s1, last) = vals[0], vals[-1]
        for key in ("val/reward_mean", "val/accuracy"):
            if key in first and key in last:
                rows.append((key, f"{first[key]:.4f} (step {s0}) &rarr; {last[key]:.4f} (step {s1})"))
    times = [m["timing/step"] for m in steps.values() if "timing/step" in m]
    if times:
        rows.append(("mean seconds per step", f"{sum(times) / len(times):.1f}"))
        rows.append(("total training time", f"{sum(times) / 60:.1f} min"))
    if STARTUP_PREFIX + "total" in steps.get(0, {}):
        rows.append(("start-up (timing/startup/*)", html.escape(describe_startup(steps[0]))))
    return rows


def build_report(run_dir: str | Path) -> str:
    """The HTML text of the report for a run directory."""
    run_dir = Path(run_dir)
    steps = read_metrics(run_dir)
    charts = []
    for title, keys in CHARTS:
        lines = [(label, series(steps, key), dashed) for key, label, dashed in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            charts.append(line_chart(title, lines))
    phase = phase_chart(steps)
    if phase:
        charts.append(phase)
    memory_keys = sorted({k for m in steps.values() for k in m if "memory" in k or k.startswith("mem/")})
    if memory_keys:
        charts.append(line_chart("Memory", [(k, series(steps, k), False) for k in memory_keys]))
    samples = read_samples(run_dir)
    sample_rows = "".join(
        f"<tr><td class='num'>{html.escape(_fmt(float(s.get('score', float('nan')))))}</td>"
        f"<td>{html.escape(str(s.get('ground_truth', '')))}</td><td><pre>{html.escape(str(s.get('response', '')))}</pre></td></tr>"
        for s in samples)
    config = run_dir / "config.yaml"
    config_html = (f"<details><summary>resolved configuration (config.yaml)</summary><pre>"
                   f"{html.escape(config.read_text())}</pre></details>") if config.is_file() else ""
    summary = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in summary_rows(steps))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rlframe run report: {html.escape(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.chart {{ border: 1px solid #ddd; background: #fff; }}
.chart .title {{ font-size: 13px; font-weight: 600; }} .chart .tick, .chart .legend {{ font-size: 10px; fill: #444; }}
.chart .grid {{ stroke: #eee; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
td.num {{ text-align: right; }} pre {{ white-space: pre-wrap; margin: 0; max-width: 900px; font-size: 12px; }}
</style></head><body>
<h1>rlframe run report: {html.escape(run_dir.name)}</h1>
<p>{html.escape(str(run_dir.resolve()))}</p>
<table>{summary}</table>
<h2>Doctor (before training)</h2>
{doctor_section(run_dir)}
<h2>Gates that fired</h2>
{gates_section(run_dir)}
<h2>Curves</h2>
<div class="charts">{''.join(charts) or '<p>No metrics logged yet.</p>'}</div>
{checkpoint_eval_section(run_dir)}
{judge_section(run_dir)}
<h2>Sample rollouts (last validation)</h2>
{'<table><tr><th>reward</th><th>ground truth</th><th>response</th></tr>' + sample_rows + '</table>' if samples else '<p>none written</p>'}
{config_html}
<script>
// Marks each chart with how many of its marks the browser laid out (tests open the report headless).
window.addEventListener("load", function () {{
  var charts = document.querySelectorAll("svg.chart"), drawn = 0;
  charts.forEach(function (svg) {{
    var n = 0;
    svg.querySelectorAll(".series, .bar, circle").forEach(function (el) {{
      var box = el.getBBox();
      if (box.width > 0 || box.height > 0) n++;
    }});
    svg.setAttribute("data-rendered", n);
    if (n > 0) drawn++;
  }});
  document.body.setAttribute("data-charts-rendered", drawn + "/" + charts.length);
}});
</script>
</body></html>
"""


def write_report(run_dir: str | Path) -> Path:
    """Write `<run_dir>/report.html` (atomically) and return its path."""
    run_dir = Path(run_dir)
    text = build_report(run_dir)
    out = run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlframe.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir)
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"report: {path}")


if __name__ == "__main__":
    main()
