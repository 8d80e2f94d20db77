"""Run shipped recipes at their CPU scale and write docs/results.md: before/after figures with intervals.

    python examples/benchmark/recipes_table.py                         # every recipe in recipes/ (hours on a CPU)
    python examples/benchmark/recipes_table.py --recipes sft_math      # one; the other rows are kept
    python examples/benchmark/recipes_table.py --from-run grpo_math=runs/x --wall 474   # a run made elsewhere
    python examples/benchmark/recipes_table.py --recipes dpo_math -- trainer.total_steps=2   # overrides: noted in the row

Each row: recipe, stage, steps, validation reward and accuracy before -> after (the accuracy with its 95%
interval, val/accuracy_ci_low/high, a percentile bootstrap over the validation prompts), wall time, commit
and date. A run's figures come from its metrics.jsonl (its first and last validation). Rows already in
docs/results.md for recipes not run now are kept as they are, so the table grows recipe by recipe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "docs" / "results.md"
HEADER = ("| recipe | stage | steps | val reward before -> after | val accuracy before -> after [95% CI] | wall | "
          "commit | date |")
INTRO = """# Results

Shipped recipes at their CPU scale on the embedded default model (a 2-core CPU machine), written by
`python examples/benchmark/recipes_table.py` (one row per recipe run; rows of recipes not re-run are kept).
A recipe without a row runs end to end in CI on a tiny model (`tests/test_recipes.py`), which checks that it
runs, not what it learns.
Validation is greedy on the recipe's held-out prompts; the interval is the 95% percentile bootstrap over
those prompts that validation logs as `val/accuracy_ci_low` / `_ci_high` (rlframe/trainer/validation.py).
A row whose run predates those keys has no interval. The main job's row (`grpo_math`) is checked in CI
against its deterministic figures (tests/test_eval_results_table.py).
"""


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def read_validations(run_dir: Path) -> tuple[int, dict, dict]:
    """(the last step, the first validation's metrics, the last one's) from <run_dir>/metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [m for m in lines if any(k.startswith("val/") for k in m)]
    if not vals:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no validation (val/*) line")
    return max(int(m.get("step", 0)) for m in lines), vals[0], vals[-1]


def stage_of(run_dir: Path) -> str:
    config = run_dir / "config.yaml"
    if config.is_file():
        for line in config.read_text().splitlines():
            if line.strip().startswith("stage:"):
                return line.split(":", 1)[1].strip() or "rl"
    return "rl"


def fmt_pair(before: dict, after: dict, key: str, interval: bool) -> str:
    if key not in before or key not in after:
        return "—"
    text = f"{before[key]:.4f} -> {after[key]:.4f}"
    if interval and f"{key}_ci_low" in after:
        text += f" [{after[key + '_ci_low']:.4f}, {after[key + '_ci_high']:.4f}]"
        if f"{key}_ci_low" in before:
            text = (f"{before[key]:.4f} [{before[key + '_ci_low']:.4f}, {before[key + '_ci_high']:.4f}] -> "
                    f"{after[key]:.4f} [{after[key + '_ci_low']:.4f}, {after[key + '_ci_high']:.4f}]")
    return text


def row_of(recipe: str, run_dir: Path, wall_s: float | None, overrides: list[str], commit: str) -> str:
    """One table row from a finished run directory."""
    steps, before, after = read_validations(run_dir)
    name = f"`{recipe}`" + (f" ({' '.join(overrides)})" if overrides else "")
    wall = f"{wall_s / 60:.1f} min" if wall_s else "—"
    return (f"| {name} | {stage_of(run_dir)} | {steps} | {fmt_pair(before, after, 'val/reward_mean', False)} | "
            f"{fmt_pair(before, after, 'val/accuracy', True)} | {wall} | {commit} | "
            f"{datetime.date.today().isoformat()} |")


def run_recipe(recipe: str, overrides: list[str], work: Path) -> tuple[Path, float]:
    """`python -m rlframe.main recipe=<recipe>` into a fresh run directory; (run_dir, wall seconds)."""
    run_dir = work / recipe
    log = work / f"{recipe}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", "rlframe.main", f"recipe={recipe}", f"trainer.run_dir={run_dir}",
                                *overrides], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"error: recipe={recipe} exited {code}; see {log}")
    return run_dir, wall


def existing_rows(path: Path) -> dict[str, str]:
    """{recipe: its row} from the table in docs/results.md (empty when there is none)."""
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| `"):
            rows[line.split("`")[1]] = line
    return rows


def existing_notes(path: Path) -> list[str]:
    """The notes under the table (lines starting with "- ", up to the first later section), kept when the table is
    rewritten (a later section's own list stays in that section)."""
    if not path.is_file():
        return []
    table_seen = False
    notes = []
    for line in path.read_text().splitlines():
        if table_seen and line.startswith("## "):
            break
        table_seen = table_seen or line.startswith("| recipe")
        if table_seen and line.startswith("- "):
            notes.append(line)
    return notes


def existing_sections(path: Path) -> str:
    """The sections after the table (from its first "## " heading on), kept as they are."""
    if not path.is_file():
        return ""
    text = path.read_text()
    start = text.find("\n## ")
    return text[start + 1:] if start >= 0 else ""


def write_results(rows: dict[str, str], path: Path = RESULTS, notes: list[str] | None = None) -> None:
    """The page: the introduction, one row per recipe (sorted), the notes, then any later sections."""
    notes = existing_notes(path) if notes is None else notes
    sections = existing_sections(path)
    lines = [INTRO, HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [rows[recipe] for recipe in sorted(rows)]
    if notes:
        lines += [""] + notes
    text = "\n".join(lines) + "\n"
    path.write_text(text + ("\n" + sections if sections else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", help="comma-separated recipe names (default: every recipe in recipes/)")
    parser.add_argument("--from-run", action="append", default=[], metavar="RECIPE=RUN_DIR",
                        help="take a row from a finished run instead of running it (repeatable)")
    parser.add_argument("--wall", type=float, help="with one --from-run: its wall time in seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="overrides for every run (after --), noted in each row")
    args = parser.parse_args()
    rows = existing_rows(args.out)
    commit = git_commit()
    for item in args.from_run:
        recipe, _, run_dir = item.partition("=")
        rows[recipe] = row_of(recipe, Path(run_dir), args.wall, [], commit)
    if args.recipes is not None or not args.from_run:
        names = (args.recipes.split(",") if args.recipes
                 else sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml")))
        work = Path(tempfile.mkdtemp(prefix="rlframe_recipes_"))
        for recipe in names:
            run_dir, wall = run_recipe(recipe, args.overrides, work)
            rows[recipe] = row_of(recipe, run_dir, wall, args.overrides, commit)
            write_results(rows, args.out)  # after each recipe: a long sweep keeps what it measured
            print(rows[recipe], flush=True)
    write_results(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
