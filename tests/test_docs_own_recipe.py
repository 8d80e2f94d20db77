"""docs/own-recipe.md as a user follows it: its files (the code blocks with a title) written into a folder, the data
script run, the doctor and the run started there with `recipe=my_recipe.yaml`, on the tiny model for 2 steps.

The page's model path is a placeholder (/models/my_instruct_model): the test points it at the tiny model; every
other key is the page's. Before, `recipe=my_recipe.yaml` in the current folder ended in Hydra's AssertionError
traceback (the recipe's folder name was empty).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT, read_metrics

PAGE = REPO_ROOT / "docs" / "own-recipe.md"
FILE_BLOCK = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```$', re.S | re.M)


def page_files() -> dict[str, str]:
    return dict(FILE_BLOCK.findall(PAGE.read_text()))


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_page_names_its_files():
    files = page_files()
    assert set(files) == {"make_data.py", "my_reward.py", "my_recipe.yaml"}
    assert "recipe=my_recipe.yaml" in PAGE.read_text()


def test_own_recipe_page_runs_as_written(tiny_model_dir, tmp_path):
    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    made = run(["make_data.py"], tmp_path)
    assert made.returncode == 0, made.stderr
    sizes = [f"model.path={tiny_model_dir}", "trainer.total_steps=2", "trainer.run_dir=runs/mine", "trainer.num_cpus=4",
             "rollout.engine=hf", "data.val_max_samples=8"]  # the tiny model, 2 steps; the rest as the page says
    doctor = run(["-m", "rlframe.doctor", "recipe=my_recipe.yaml", *sizes, "--no-workers"], tmp_path)
    assert doctor.returncode == 0 and "0 fail" in doctor.stdout, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    assert "reward/own_answers" in doctor.stdout
    trained = run(["-m", "rlframe.main", "recipe=my_recipe.yaml", *sizes], tmp_path)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-4000:]
    run_dir = tmp_path / "runs" / "mine"
    assert "validation reward:" in trained.stdout and f"run directory: {run_dir}" in trained.stdout
    assert [m["step"] for m in read_metrics(run_dir) if m["step"] > 0] == [1, 2]
    assert (run_dir / "report.html").is_file() and (run_dir / "hf_model" / "config.json").is_file()
