"""`--help` / `-h` of every entry point: usage, exit 0, nothing started (no Ray, no model); and the configuration
printers of rlframe.main: `--keys [prefix]` (the key reference) and `--cfg job` (the composed configuration).

Before, `python -m rlframe.main --help` ended in `error: ... LexerNoViableAltException: --help` (exit 1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

RECIPES = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml"))
ENTRY_POINTS = ["rlframe.main", "rlframe.plan", "rlframe.pairs", "rlframe.eval", "rlframe.export", "rlframe.report",
                "rlframe.doctor", "rlframe.board"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO_ROOT)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_prints_usage_and_exits_0(module):
    for flag in ("--help", "-h"):
        done = run(module, flag)
        assert done.returncode == 0, (module, flag, done.stdout[-2000:], done.stderr[-2000:])
        assert f"python -m {module}" in done.stdout or "usage:" in done.stdout, done.stdout
        assert not done.stdout.startswith("error") and "Traceback" not in done.stderr


@pytest.mark.parametrize("module", ["rlframe.main", "rlframe.plan", "rlframe.pairs"])
def test_recipe_entry_points_list_the_recipes_and_where_the_keys_are(module):
    out = run(module, "--help").stdout
    for recipe in RECIPES:
        assert f"  {recipe} " in out, recipe
    assert "recipe=NAME" in out and "--keys" in out and "reference/configuration" in out
    assert "actor.optim.lr=2e-6" in out  # how an override is written


def test_keys_prints_the_reference_of_a_prefix():
    done = run("rlframe.main", "--keys", "actor.optim")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("actor.optim.lr (float, default 1e-06, > 0): ") for line in lines), lines
    assert all(line.startswith("actor.optim.") for line in lines)
    bad = run("rlframe.main", "--keys", "no_such_section")
    assert bad.returncode == 1 and "error: no configuration key starts with 'no_such_section'" in bad.stdout


def test_cfg_job_prints_the_composed_configuration_without_running():
    import yaml

    done = run("rlframe.main", "--cfg", "job", "recipe=ppo_math", "critic.ppo_epochs=3")
    assert done.returncode == 0, done.stderr
    cfg = yaml.safe_load(done.stdout)
    assert cfg["algorithm"]["adv_estimator"] == "gae" and cfg["critic"]["ppo_epochs"] == 3
    assert "run directory" not in done.stdout  # nothing was prepared or run
