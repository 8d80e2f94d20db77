"""What a run's start does once (issue 44): the prompt datasets the pre-Ray checks build are the driver's.

rlframe/preflight.py reads, checks and tokenizes every row before Ray starts; the stage's driver built the same
datasets again. Each build logs one "RLDataset: N rows from K file(s)" line to logs/driver.log: one run of the
tiny model shows one per dataset (train, validation), not two.
"""

from __future__ import annotations

from conftest import TINY_RUN_OVERRIDES, run_main


def test_the_datasets_are_built_once_at_start(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY_RUN_OVERRIDES if not o.startswith("trainer.total_steps")]
    done = run_main(["recipe=grpo_math", *overrides, "trainer.total_steps=1", f"model.path={tiny_model_dir}",
                     f"trainer.run_dir={run_dir}", "rollout.engine=hf", "trainer.val_before_train=false"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    builds = [line for line in (run_dir / "logs" / "driver.log").read_text().splitlines() if "RLDataset: " in line
              and " rows from " in line]
    assert len(builds) == 2, builds  # train and validation, each once
