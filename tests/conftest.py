"""Shared fixtures: a tiny random-init Llama with a real (test-trained) tokenizer, saved as an HF folder."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
REPO_ROOT = Path(__file__).resolve().parents[1]


def build_tiny_model_dir(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from helpers_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def local_ray(num_cpus: int, **init_kwargs):
    """A local Ray cluster started in this process and stopped at the end (every daemon reaped, without a second's
    wait on the autoscaler's monitor), with the Ray settings of a run's own local cluster
    (rlframe.controller.cluster.local_cluster_settings): no idle workers prestarted for the first driver (~1
    CPU-second each, one per logical CPU, none of them used by a group of actors with a runtime env), no metrics
    collection, task events kept to 1,000. Already connected: used as it is, and left running."""
    import ray

    from rlframe.controller.cluster import local_cluster_settings, shutdown

    if ray.is_initialized():
        yield
        return
    with pytest.MonkeyPatch.context() as settings:  # read by the daemons ray.init starts; undone after it
        for name, value in local_cluster_settings().items():
            settings.setenv(name, value)
        ray.init(num_cpus=num_cpus, include_dashboard=False, **init_kwargs)
    try:
        yield
    finally:
        shutdown()


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance per test module (8 logical CPUs, local_ray); actors import rlframe from where we did."""
    import rlframe

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(rlframe.__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if package_root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, paths)])
    with local_ray(8):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# The environment the tests started with, plus what every run gets: the fork server's (tests/fork_runner.py).
RUN_ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
# What the running test set or deleted with `monkeypatch` (None: deleted): a run's environment is RUN_ENV with these.
# Not the test process's environment as it is now: importing sklearn, cv2 or Transformer Engine, or ray.init, sets
# variables in it (KMP_*, LD_LIBRARY_PATH, NVTE_*, RAY_AUTH_MODE, ...) that no user's command starts with, and each
# would keep a run from being forked.
TEST_ENV: dict[str, str | None] = {}


class _NotedMonkeyPatch(pytest.MonkeyPatch):
    """pytest's monkeypatch, noting in TEST_ENV what a test sets in or deletes from the environment."""

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        TEST_ENV[name] = os.environ[name]

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        TEST_ENV[name] = None


@pytest.fixture
def monkeypatch():
    patch = _NotedMonkeyPatch()
    yield patch
    patch.undo()
    TEST_ENV.clear()


# RLFRAME_TESTS_FORK=0: every run in a fresh interpreter.
FORKED_RUNS = os.environ.get("RLFRAME_TESTS_FORK", "1") != "0"
_fork_server = None
# A forked run that would start a local Ray cluster of SUITE_CLUSTER_CPUS CPUs (the tiny runs' trainer.num_cpus=4)
# joins this test process's own instead: one `ray start --head` of those CPUs and the settings rlframe gives a local
# cluster, started once. RLFRAME_TESTS_SHARED_RAY=0: every run starts its own.
SUITE_CLUSTER_CPUS = 4
SHARED_RAY = os.environ.get("RLFRAME_TESTS_SHARED_RAY", "1") != "0"
_suite_cluster = None
# A forked run's Ray workers are forked too, from a process that imported their libraries (tests/worker_zygote.py).
# RLFRAME_TESTS_FORK_WORKERS=0: every worker a fresh interpreter, as Ray starts it.
FORKED_WORKERS = os.environ.get("RLFRAME_TESTS_FORK_WORKERS", "1") != "0"
_worker_zygote = None


def run_main(args: list[str], cwd: Path, timeout: float = 600, fresh_interpreter: bool = False
             ) -> subprocess.CompletedProcess:
    """Run `python -m rlframe.main ARGS` as a user would, in its own process: forked from a process that already
    imported the driver's libraries (tests/fork_runner.py), its Ray workers forked from one that imported theirs
    (worker_zygote_env), or with `fresh_interpreter` (or an environment that changes what those libraries read at
    import) in a new interpreter."""
    global _fork_server
    env = run_env()
    if FORKED_RUNS and not fresh_interpreter:
        from fork_runner import ForkServer

        if _fork_server is None or _fork_server.process.poll() is not None:
            _fork_server = ForkServer(RUN_ENV)
        if _fork_server.forkable(env):
            address = suite_cluster_address(args, env)
            env = {**env, **({"RAY_ADDRESS": address} if address else {}), **worker_zygote_env()}
            return _fork_server.run(args, cwd, env, timeout)
    return subprocess.run([sys.executable, "-m", "rlframe.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_env() -> dict[str, str]:
    """The environment of a run: the one the tests started with, and what the running test set (TEST_ENV)."""
    env = dict(RUN_ENV)
    for name, value in TEST_ENV.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def suite_cluster_address(args: list[str], env: dict[str, str]) -> str | None:
    """The test process's shared Ray cluster, for a forked run that would otherwise start the same one:
    trainer.num_cpus=4 (what a local cluster's node and its workers' torch threads are sized by), no cluster address
    or dashboard of its own, and the fork server's environment (the workers inherit the raylet's, not the run's).
    None: it starts its own. The run's workers still start fresh, and end with it (Ray ends a job's actors when its
    driver exits)."""
    global _suite_cluster
    cpus = [arg.split("=", 1)[1] for arg in args if arg.startswith("trainer.num_cpus=")]
    own = ("trainer.ray_address=", "trainer.ray_dashboard=", "trainer.nnodes=")
    if not SHARED_RAY or cpus[-1:] != [str(SUITE_CLUSTER_CPUS)] or any(arg.startswith(own) for arg in args):
        return None
    if _fork_server.differences(env):
        return None
    if _suite_cluster is None or any(p.poll() is not None for p in _suite_cluster.processes):
        from ray_cluster import LocalRayCluster

        from rlframe.controller.cluster import local_cluster_settings

        _suite_cluster = LocalRayCluster([{}], cpus_per_node=SUITE_CLUSTER_CPUS, object_store_bytes=None,
                                         dashboard=False, env={**RUN_ENV, **local_cluster_settings()},
                                         in_temp_dir=True).start()
        atexit.register(_suite_cluster.stop)
    return _suite_cluster.address


def worker_zygote_env() -> dict[str, str]:
    """What a forked run adds to its environment so that its Ray workers are forked too (tests/worker_zygote.py):
    Ray's runtime-env hook, which gives the job the server's `py_executable`. The server (one per test process,
    started with the first forked run) has the environment the runs' workers get: the tests' and rlframe's
    WORKER_ENV (a worker whose environment differs in what its libraries read at import is not forked)."""
    global _worker_zygote
    if not FORKED_WORKERS:
        return {}
    if _worker_zygote is None or not _worker_zygote.alive():
        from worker_zygote import WorkerZygote

        from rlframe.main import WORKER_ENV

        _worker_zygote = WorkerZygote({**RUN_ENV, **WORKER_ENV})
        atexit.register(_worker_zygote.close)
    return _worker_zygote.run_env()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A 2-step run on the tiny model: small data, short responses, 2 samples per prompt.
TINY_RUN_OVERRIDES = [
    "trainer.total_steps=2",
    "data.arithmetic.n_train=64",
    "data.arithmetic.n_val=8",
    "data.val_max_samples=8",
    "data.max_prompt_length=256",
    "data.max_response_length=16",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_device=4",
    "rollout.n=2",
    "trainer.num_cpus=4",
]


def run_tiny(tmp_path: Path, model_dir: Path, recipe: str, *extra: str) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m rlframe.main recipe=RECIPE` on the tiny model for 2 steps; fails the test on a non-zero exit."""
    run_dir = tmp_path / "run"
    result = run_main([f"recipe={recipe}", *TINY_RUN_OVERRIDES, f"model.path={model_dir}", f"trainer.run_dir={run_dir}",
                       *extra], cwd=tmp_path)
    assert result.returncode == 0, f"run failed:\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    return run_dir, result


CPU_DEVICE = {"device": "cpu", "dtype": "float32", "attn_implementation": "sdpa", "rollout_engine": "hf"}


def plain_actor(model_dir, *, lr=1e-6, warmup_steps=0, max_consecutive_skips=3, mini_batch_size=8, micro_batch_size=4,
                max_tokens_per_micro_batch=0, shuffle=True, packed="false", seed=0, **loss):
    """The actor role as a plain object in this process (no Ray, no rollout engine), on the FSDP engine.

    `loss`: PolicyLossSettings fields (use_kl_loss, kl_loss_coef, ...)."""
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings, OptimSettings,
                                         PolicyLossSettings, UpdateLoop)

    engine = EngineSettings(model_path=str(model_dir), device=DeviceRequest(**CPU_DEVICE), use_remove_padding=packed,
                            optim=OptimSettings(lr=lr, warmup_steps=warmup_steps,
                                                max_consecutive_skips=max_consecutive_skips))
    loop = UpdateLoop(mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
                      max_tokens_per_micro_batch=max_tokens_per_micro_batch, shuffle=shuffle)
    return ActorRolloutWorker(ActorSettings(engine=engine, loop=loop, loss=PolicyLossSettings(**loss),
                                            log_prob=ForwardSettings(), rollout=None, seed=seed))


def plain_critic(model_dir, *, lr=1e-5, head_lr=1e-3, mini_batch_size=8, micro_batch_size=4, epochs=1,
                 cliprange_value=0.5, max_consecutive_skips=3):
    """The critic role as a plain object in this process, on the FSDP engine with a value head."""
    from rlframe.workers.roles.critic import CriticWorker
    from rlframe.workers.settings import (CriticSettings, DeviceRequest, EngineSettings, ForwardSettings,
                                         OptimSettings, UpdateLoop)

    engine = EngineSettings(model_path=str(model_dir), head="value", device=DeviceRequest(**CPU_DEVICE),
                            optim=OptimSettings(lr=lr, head_lr=head_lr, max_consecutive_skips=max_consecutive_skips))
    return CriticWorker(CriticSettings(engine=engine, loop=UpdateLoop(mini_batch_size=mini_batch_size,
                                                                      micro_batch_size=micro_batch_size, epochs=epochs),
                                       forward=ForwardSettings(), cliprange_value=cliprange_value))


def pytest_collection_modifyitems(config, items):
    """The longest file first (tests/test_recipes.py: every recipe end to end, ~15 minutes): with two test
    processes (`make test`, pytest-xdist taking whole files) the other one works through the rest meanwhile,
    instead of this file starting last and the suite waiting on it. The order within each file is kept."""
    items.sort(key=lambda item: item.path.name != "test_recipes.py")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through playwright (the board's browser tests); skipped where either is missing."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if chromium is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()
