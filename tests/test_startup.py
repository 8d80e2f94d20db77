"""The start-up profile (rlframe/trainer/startup.py): its bookkeeping on hand-made parts, and what a real run writes.

The end-to-end check (`check_startup_profile`) runs on the main job's recipe case of tests/test_recipes.py (a tiny
2-step run that validates before training): timing/startup/* at step 0, the console line, startup.json with the
exit, the report's row.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest

from rlframe.trainer.startup import PREFIX, StartupProfile, describe, process_age_s, worker_group_parts


def test_parts_add_up_to_the_total_with_other_for_the_rest():
    profile = StartupProfile()
    profile.begin()
    profile.parts["imports"] = 2.0  # (as if the interpreter had taken 2 s)
    profile.add("config", 0.5)
    profile.add("workers", 3.0)
    profile.add("workers", 1.0)  # two adds of one part sum
    profile.parts.update(worker_group_parts("colocated", 1.5, 2.5, [{"engine_init": 1.0, "model_load": 0.5},
                                                                     {"engine_init": 1.25}]))
    profile.total = 10.0
    m = profile.metrics()
    assert m[PREFIX + "workers"] == 4.0
    assert m[PREFIX + "spawn/colocated"] == 1.5 and m[PREFIX + "init/colocated"] == 2.5
    assert m[PREFIX + "engine_init/colocated"] == 1.25  # the slowest rank
    assert m[PREFIX + "model_load/colocated"] == 0.5
    # the groups' parts lie inside `workers`: other = 10 - (2 + 0.5 + 4) = 3.5, not less
    assert m[PREFIX + "other"] == 3.5
    assert describe(m) == ("start-up 10.0 s: imports 2.0, config 0.5, workers 4.0 (spawn/colocated 1.5, "
                           "init/colocated 2.5, engine_init/colocated 1.2, model_load/colocated 0.5)")


def test_a_phase_is_timed_and_the_first_finish_is_the_run_start():
    profile = StartupProfile()
    profile.begin()
    assert 0 < profile.parts["imports"] <= process_age_s()  # this process's age, from /proc (a test worker's: long)
    with profile.phase("ray_init"):
        time.sleep(0.05)
    assert 0.04 < profile.parts["ray_init"] < 1.0
    profile.finish()
    first = profile.total
    time.sleep(0.02)
    profile.finish()  # a restart's second start does not move it
    assert profile.total == first and first >= profile.parts["imports"]
    assert abs(process_age_s() - first) < 5


def test_the_exit_is_written_to_startup_json(tmp_path):
    profile = StartupProfile()
    profile.begin()
    profile.finish()
    with profile.exit_phase(tmp_path):
        time.sleep(0.05)
    written = json.loads((tmp_path / "startup.json").read_text())
    assert 0.04 < written["exit"] < 1.0 and "total" in written and "imports" in written


def check_startup_profile(run_dir: Path, stdout: str) -> None:
    """A run that validated before training: the profile at step 0, its line on the console and in the report,
    startup.json with the exit."""
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and "val/reward_mean" in first
    for part in ("imports", "config", "prepare", "ray_init", "cluster_check", "driver_setup", "workers",
                 "validation", "total", "spawn/colocated", "init/colocated", "model_load/colocated",
                 "engine_init/colocated", "build/actor_rollout/colocated"):
        assert PREFIX + part in first, f"step 0 lacks {PREFIX + part}: {sorted(first)}"
    total = first[PREFIX + "total"]
    driver = sum(first[PREFIX + p] for p in ("imports", "config", "prepare", "ray_init", "cluster_check",
                                             "driver_setup", "workers", "validation"))
    assert 0 < driver <= total + 0.05 and first[PREFIX + "other"] < 0.25 * total, first
    assert first[PREFIX + "spawn/colocated"] + first[PREFIX + "init/colocated"] <= first[PREFIX + "workers"] + 0.05
    assert first[PREFIX + "validation"] >= first["timing/validation"]
    assert f"start-up {total:.1f} s: imports" in stdout
    profile = json.loads((run_dir / "startup.json").read_text())
    assert 0 < profile["exit"] < 30 and abs(profile["total"] - total) < 1e-2
    assert "start-up (timing/startup/*)" in (run_dir / "report.html").read_text()


def test_transformers_loads_without_scikit_learn_which_stays_importable():
    """rlframe/__init__.py: transformers is told scikit-learn is absent (its one use, assisted decoding, is not
    ours); loading a tokenizer and a model class then imports no sklearn, and sklearn itself still imports."""
    import subprocess
    import sys

    probe = ("import sys, rlframe\n"
             "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
             "print('sklearn' in sys.modules, 'scipy.stats' in sys.modules)\n"
             "import sklearn.metrics\n"
             "print('sklearn.metrics' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True"]


class _CollectorProbe:
    """A role that records whether the garbage collector ran automatically while it was built."""

    def __init__(self, fail: bool = False):
        self.collector_was_enabled = gc.isenabled()
        if fail:
            raise RuntimeError("this role fails to build")


def test_the_collector_is_paused_while_roles_build_and_back_after_even_on_an_error():
    from rlframe.collector import collector_paused
    from rlframe.controller.errors import WorkerError
    from rlframe.controller.worker_host import WorkerHost

    assert gc.isenabled()
    host = WorkerHost(0, 1, 0, 1, num_cpus=1)
    host.init_roles("127.0.0.1", 0, None, {"probe": (_CollectorProbe, {})}, None)
    assert host.roles["probe"].collector_was_enabled is False and gc.isenabled()
    with pytest.raises(WorkerError, match="this role fails to build"):
        host.init_roles("127.0.0.1", 0, None, {"broken": (_CollectorProbe, {"fail": True})}, None)
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
