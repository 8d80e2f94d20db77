"""One tiny run with the defaults a first run has (no checkpoints, trainer.save_every=0; its model exported to
hf_model/), and what issue 44 found on it.

- The prompt datasets the pre-Ray checks build (rlframe/preflight.py) are the driver's: each build logs one
  "RLDataset: N rows from K file(s)" line to logs/driver.log, so the run shows one per dataset (train,
  validation), not two.
- `python -m rlframe.export <run>` on it says the run saved no checkpoint and points at its hf_model/ (it said
  "manifest.json is missing", as for a broken checkpoint).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY_RUN_OVERRIDES, run_main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("default_run")
    run_dir = tmp / "run"
    overrides = [o for o in TINY_RUN_OVERRIDES if not o.startswith("trainer.total_steps")]
    done = run_main(["recipe=grpo_math", *overrides, "trainer.total_steps=1", f"model.path={tiny_model_dir}",
                     f"trainer.run_dir={run_dir}", "rollout.engine=hf", "trainer.val_before_train=false"], cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return run_dir


def test_the_datasets_are_built_once_at_start(run_dir):
    builds = [line for line in (run_dir / "logs" / "driver.log").read_text().splitlines() if "RLDataset: " in line
              and " rows from " in line]
    assert len(builds) == 2, builds  # train and validation, each once


def test_export_of_a_run_without_checkpoints_points_at_its_hf_model(run_dir, tmp_path):
    assert not (run_dir / "checkpoints").exists() and (run_dir / "hf_model" / "config.json").is_file()
    done = subprocess.run([sys.executable, "-m", "rlframe.export", str(run_dir), str(tmp_path / "out")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.strip()
    assert error.startswith("error: the run ") and "saved no checkpoint" in error, error
    assert f"{run_dir / 'hf_model'}" in error and "manifest" not in error and "Traceback" not in error, error
