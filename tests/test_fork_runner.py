"""The tests' forked runs (tests/fork_runner.py) behave as `python -m rlframe.main` in a fresh interpreter: the same
stdout, stderr and exit status, from the request's working directory, environment and arguments; a run that
outlives its timeout is killed with its process group; an environment a preloaded library would read differently
is not forked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest

from conftest import REPO_ROOT, RUN_ENV, read_metrics, run_env, run_tiny
from fork_runner import ForkServer
from test_checkpoint_resume import comparable


@pytest.fixture(scope="module")
def server():
    server = ForkServer(RUN_ENV)
    yield server
    server.close()


def fresh(args: list[str], cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlframe.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_forked_run_prints_and_exits_as_a_fresh_interpreter(server, tmp_path):
    (tmp_path / "mine.yaml").write_text((REPO_ROOT / "recipes" / "grpo_math.yaml").read_text())
    env = {**RUN_ENV, "RLFRAME_RUNS_DIR": str(tmp_path / "runs")}
    cases = [["--help"],                                               # usage, exit 0
             ["recipe=mine.yaml", "--cfg", "job", "actor.optim.lr=0.5"],  # a recipe found from the working directory
             ["recipe=no_such_recipe"],                                # a usage error: one screen, exit 1
             ["recipe=grpo_math", "actor.no_such_key=1"],              # a key error naming the key
             ["recipe=grpo_math", "rollout.n=1"]]                      # a validation error (before any run folder)
    results = []
    for args in cases:
        forked, expected = server.run(args, tmp_path, env, timeout=120), fresh(args, tmp_path, env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (expected.returncode, expected.stdout,
                                                                     expected.stderr), args
        results.append(forked)
    assert [result.returncode for result in results] == [0, 0, 1, 1, 1]
    assert "lr: 0.5" in results[1].stdout
    assert not (tmp_path / "runs").exists()


def test_a_run_past_its_timeout_is_killed_with_its_process_group(server, tmp_path):
    """A reward file that, imported by the driver itself (not by its import check, in a session of its own), starts
    a child and blocks: the timeout kills the driver and that child (the run's process group)."""
    marker = tmp_path / "child.pid"
    (tmp_path / "hang.py").write_text(
        "import subprocess, sys, time\n"
        "if __name__ != 'rlframe_reward_import_check':\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"    open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(600)\n"
        "def compute_score(**kw): return 0.0\n")
    args = ["recipe=grpo_math", f"reward.functions=[{{path: {tmp_path / 'hang.py'}, name: compute_score}}]"]
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(args, tmp_path, RUN_ENV, timeout=20)
    assert time.monotonic() - start < 60
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _state(child) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(child) in ("gone", "Z"), "the run's child outlived the timeout"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_an_environment_read_at_import_is_not_forked(server):
    assert server.forkable(dict(RUN_ENV))
    assert server.forkable({**RUN_ENV, "RLFRAME_CACHE": "/elsewhere"})  # read by rlframe when a run asks
    assert server.forkable({**RUN_ENV, "RAY_ADDRESS": "auto"})  # read by ray.init, not at import
    assert not server.forkable({**RUN_ENV, "RAY_DEDUP_LOGS": "0"})
    assert not server.forkable({**RUN_ENV, "OMP_NUM_THREADS": "7"})
    assert not server.forkable({**RUN_ENV, "PYTHONPATH": "/somewhere/else"})


def test_the_suites_runs_are_forked_after_its_libraries_changed_the_environment(server, monkeypatch):
    """Importing sklearn, cv2 or Transformer Engine, or a Ray cluster started in the test process, sets variables in
    its environment (KMP_*, LD_LIBRARY_PATH, NVTE_*, RAY_AUTH_MODE): a run's environment is the one the tests started
    with and what the test set with monkeypatch, or no run would be forked once a test built a model or started Ray."""
    import ray
    import sklearn  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    ray.init(num_cpus=1, include_dashboard=False)
    ray.shutdown()
    with pytest.MonkeyPatch.context() as library:  # (pytest's own, not the test's: as cv2 sets it)
        library.setenv("LD_LIBRARY_PATH", "/as/cv2/sets/it")
        assert os.environ.get("KMP_DUPLICATE_LIB_OK") and os.environ.get("RAY_AUTH_MODE")
        env = run_env()
        assert server.forkable(env) and server.differences(env) == set(), server.differences(env)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("RLFRAME_CACHE", "/a/cache")
        monkeypatch.delenv("HOME")
        env = run_env()
        assert (env["HF_HUB_OFFLINE"], env["RLFRAME_CACHE"], "HOME" in env) == ("1", "/a/cache", False)
        assert server.differences(env) >= {"HF_HUB_OFFLINE", "RLFRAME_CACHE", "HOME"} and not server.forkable(env)


@pytest.mark.skipif(not (conftest.FORKED_RUNS and conftest.SHARED_RAY), reason="RLFRAME_TESTS_FORK=0 or RLFRAME_TESTS_SHARED_RAY=0")
def test_a_tiny_run_joins_the_suite_cluster_and_its_workers_end_with_it(tmp_path, tiny_model_dir, monkeypatch):
    """A forked tiny run (trainer.num_cpus=4) joins this test process's Ray cluster instead of starting its own
    (tests/conftest.py suite_cluster_address), and none of its workers outlives it there. Its workers were forked
    (tests/worker_zygote.py), and the same run with fresh workers logs the same figures."""
    tiny = ("grpo_math", "trainer.val_before_train=false", "trainer.val_at_end=false", "trainer.export_hf=false")
    if conftest.FORKED_WORKERS:  # (its first workers would not wait for its imports past CLIENT_WAIT_S)
        conftest.worker_zygote_env()
        conftest._worker_zygote.wait_listening()
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, *tiny)
    workers = [int(log.stem.removeprefix("worker-")) for log in (run_dir / "logs").glob("worker-*.log")]
    assert workers
    cluster_logs = Path(conftest._suite_cluster.temp_dir).glob("session_*/logs/worker-*.out")
    assert set(workers) <= {int(log.stem.rsplit("-", 1)[1]) for log in cluster_logs}  # its workers were the cluster's
    deadline = time.monotonic() + 30
    while any(_state(pid) not in ("gone", "Z") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {pid: _state(pid) for pid in workers if _state(pid) not in ("gone", "Z")} == {}
    if not conftest.FORKED_WORKERS:
        return
    assert set(workers) <= conftest._worker_zygote.forked()
    monkeypatch.setattr(conftest, "FORKED_WORKERS", False)
    (tmp_path / "fresh").mkdir()
    fresh_dir, _ = run_tiny(tmp_path / "fresh", tiny_model_dir, *tiny)
    fresh_workers = {int(log.stem.removeprefix("worker-")) for log in (fresh_dir / "logs").glob("worker-*.log")}
    assert fresh_workers and not fresh_workers & conftest._worker_zygote.forked()
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(fresh_dir))
