"""Signals and the run directory's owner on one tiny real run, as a user meets them (issue 33).

One `python -m rlframe.main` run (tiny model, HF rollout) in its own session:
- while it trains, a second run in the same trainer.run_dir is refused before it writes anything, naming the
  first's pid (before: both ran, metrics [1,2,1,2], config.yaml overwritten);
- SIGTERM mid-run: it stops at the next safe point, saves the finished step, prints one line (step, checkpoint,
  the resume command) and exits 143 without a traceback (before: SIGABRT, exit 134, Ray's C++ signal dump);
- the resumed run, sent SIGINT to its whole process group (what Ctrl-C does), exits 130 the same way (before: a
  40-line KeyboardInterrupt traceback, exit 1), and metrics.jsonl holds every step exactly once.
(A resume with another batch size, resume=disable over a used folder and all checkpoints corrupt are refused by
functions tests/test_run_dir.py runs on real folders: the same code, without paying for more runs here.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY_RUN_OVERRIDES, run_main

from rlframe.trainer.signals import Stopped, StopRequests


def _args(model_dir, run_dir, *extra):
    return ["recipe=grpo_math", *TINY_RUN_OVERRIDES, f"model.path={model_dir}", f"trainer.run_dir={run_dir}",
            "rollout.engine=hf", "trainer.total_steps=200", "trainer.save_every=100", "trainer.val_before_train=false",
            "trainer.export_hf=false", *extra]


def _start(args, cwd, log):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    # SIGINT at its default, as in a terminal: a shell's background job (CI's, or `cmd &`) inherits it ignored,
    # and the driver keeps an ignored SIGINT ignored (what a background job asked for)
    return subprocess.Popen([sys.executable, "-m", "rlframe.main", *args], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(proc, run_dir, step, log_path, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if step in _logged_steps(run_dir):
            return
        time.sleep(0.05)
    pytest.fail(f"the run did not reach step {step}:\n" + log_path.read_text()[-3000:])


def _finish(proc, timeout=120):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("the signalled run did not stop")


def test_one_owner_and_clean_stops_on_sigterm_and_sigint(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = _args(tiny_model_dir, run_dir)
    first_log = tmp_path / "first.log"
    with open(first_log, "w") as log:
        first = _start(args, tmp_path, log)
        try:
            _wait_for_step(first, run_dir, 1, first_log)
            config_before = (run_dir / "config.yaml").read_text()
            second = run_main(args, cwd=tmp_path)  # a concurrent second run in the same directory
            assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
            assert f"is in use by another run: pid {first.pid} on host" in second.stderr
            assert "started 20" in second.stderr and "trainer.run_dir=<another folder>" in second.stderr
            assert "Traceback" not in second.stderr + second.stdout
            assert (run_dir / "config.yaml").read_text() == config_before
            first.send_signal(signal.SIGTERM)
            code = _finish(first)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
    out = first_log.read_text()
    assert code == 143, out[-3000:]
    assert "Traceback" not in out and "SIGTERM received at time" not in out, out[-3000:]
    [summary] = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    stopped_at = int(summary.split("after step ")[1].split()[0])
    assert stopped_at >= 1 and f"of 200; last checkpoint: {run_dir / 'checkpoints' / f'step_{stopped_at}'}" in summary
    assert "resume: python -m rlframe.main recipe=grpo_math" in summary and f"trainer.run_dir={run_dir}" in summary
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at}"
    assert _logged_steps(run_dir) == list(range(1, stopped_at + 1))

    # the resumed run, stopped by Ctrl-C (SIGINT to its process group)
    resumed_log = tmp_path / "resumed.log"
    with open(resumed_log, "w") as log:
        resumed = _start(args, tmp_path, log)
        try:
            _wait_for_step(resumed, run_dir, stopped_at + 1, resumed_log)
            os.killpg(resumed.pid, signal.SIGINT)
            code = _finish(resumed)
        finally:
            if resumed.poll() is None:
                os.killpg(resumed.pid, signal.SIGKILL)
    out = resumed_log.read_text()
    assert code == 130, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at}'}" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    [summary] = [line for line in out.splitlines() if line.startswith("stopped by SIGINT after step ")]
    last = int(summary.split("after step ")[1].split()[0])
    assert last > stopped_at
    assert _logged_steps(run_dir) == list(range(1, last + 1))  # each step once, across the two runs
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last}"
    assert json.loads((run_dir / "owner.json").read_text())["ended"]  # released on the way out


def test_second_signal_stops_at_once_and_exit_codes():
    stop = StopRequests()
    stop.handle(signal.SIGTERM, None)
    assert stop.requested
    with pytest.raises(Stopped) as at_once:
        stop.handle(signal.SIGTERM, None)
    assert at_once.value.at_once and at_once.value.exit_code == 143
    assert Stopped(signal.SIGINT, at_once=False).exit_code == 130
