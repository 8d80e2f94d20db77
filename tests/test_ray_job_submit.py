"""`ray job submit -- python -m rlframe.main ...` against a running cluster (`ray start --head`), as KubeRay's RayJob,
Anyscale and most shared clusters run work; docs/cluster-jobs.md.

- plain: the main job's 2-step version on the tiny model, no trainer.run_dir: the run lands in the documented
  default for jobs, ~/rlframe/runs/<experiment_name>-<time> on the head node (not inside Ray's temporary copy of
  the working directory), with its metrics and report;
- with `--working-dir` and `--runtime-env-json` setting an env var the driver sets too (TOKENIZERS_PARALLELISM),
  plus trainer.runtime_env.working_dir (what docs/multinode.md recommends for a driver started by hand): before,
  the driver died at start with "Failed to merge the Job's runtime env ... because of a conflict"; now the job's
  values win, with one note each, and the env var reaches the workers.

The cluster is ours alone (tests/ray_cluster.py: own ports and temp dir, stopped by terminating our own processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_RUN_OVERRIDES, read_metrics
from ray_cluster import RAY, LocalRayCluster

from rlframe.controller.cluster import JOB_CONFIG_ENV, merge_with_job_env

MARK = "RLFRAME_JOB_MARK"


def test_merge_drops_what_the_job_sets_and_notes_differences():
    ours = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_X": "0", "A": "1"}, "working_dir": "/here",
            "worker_process_setup_hook": "rlframe.workers.log_capture.capture_worker_output"}
    job = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "A": "2"}, "working_dir": "gcs://_ray_pkg_x.zip"}
    merged, notes = merge_with_job_env(ours, job)
    assert merged == {"env_vars": {"VLLM_X": "0"},
                      "worker_process_setup_hook": "rlframe.workers.log_capture.capture_worker_output"}
    assert notes == ["env var A: the job's '2' (ours was '1')",
                     "runtime_env working_dir: the job's 'gcs://_ray_pkg_x.zip' (ours was '/here')"]
    assert merge_with_job_env(ours, None) == (ours, [])  # not a submitted job: ours as it is


def test_default_run_folder_under_a_job(monkeypatch, tmp_path):
    from rlframe.main import runs_folder

    monkeypatch.delenv("RLFRAME_RUNS_DIR", raising=False)
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    assert runs_folder() == Path("runs")
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {}}))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert runs_folder() == tmp_path / "rlframe" / "runs"
    monkeypatch.setenv("RLFRAME_RUNS_DIR", str(tmp_path / "shared"))
    assert runs_folder() == tmp_path / "shared"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    c = LocalRayCluster([{}], cpus_per_node=4)
    c.env["HOME"] = str(home)  # the job's driver inherits the cluster's environment: ~ is this folder
    with c:
        c.home = home
        yield c
    assert not c.leftover_processes(), "processes of the test cluster survived its stop"


def submit(cluster: LocalRayCluster, submit_args: list[str], main_args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [RAY, "job", "submit", f"--address={cluster.dashboard_url}", *submit_args, "--",
               sys.executable, "-m", "rlframe.main", *main_args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def main_job_args(model_dir: Path, *extra: str) -> list[str]:
    return ["recipe=grpo_math", *TINY_RUN_OVERRIDES, "rollout.engine=hf", f"model.path={model_dir}", *extra]


def check_run(run_dir: Path, output: str) -> None:
    assert (run_dir / "report.html").is_file(), output[-4000:]
    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2] and all("actor/pg_loss" in m for m in trained)


def test_plain_submit_runs_into_the_documented_run_folder(cluster, tiny_model_dir, tmp_path):
    done = submit(cluster, [], main_job_args(tiny_model_dir, "trainer.experiment_name=job_plain"), tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-6000:]
    runs = sorted((cluster.home / "rlframe" / "runs").glob("job_plain-*"))
    assert len(runs) == 1, output[-3000:]
    assert f"run directory: {runs[0]}" in output
    check_run(runs[0], output)


def test_submit_with_working_dir_and_runtime_env_merges_with_the_drivers(cluster, tiny_model_dir, tmp_path):
    project = tmp_path / "project"  # the user's own folder, uploaded by --working-dir
    project.mkdir()
    (project / "notes.txt").write_text("a user's file\n")
    run_dir = tmp_path / "run"
    job_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", MARK: "on"}}
    done = submit(cluster, [f"--working-dir={project}", f"--runtime-env-json={json.dumps(job_env)}"],
                  main_job_args(tiny_model_dir, f"trainer.run_dir={run_dir}", f"trainer.runtime_env.working_dir={project}"),
                  tmp_path)
    output = done.stdout + done.stderr
    assert "Failed to merge the Job's runtime env" not in output
    assert done.returncode == 0 and "succeeded" in output, output[-6000:]
    assert "note: ray job: runtime_env working_dir: the job's" in output
    check_run(run_dir, output)
    from ray.util.state import list_actors

    hosts = list_actors(address=cluster.dashboard_url, detail=True, limit=10000,
                        filters=[("class_name", "=", "WorkerHost")])
    assert hosts and any(MARK in str(actor.serialized_runtime_env) for actor in hosts)  # the job's env var reached them
