"""Reward code that misbehaves outside its return value: exits or hangs at import, forks, floods the log,
overflows float32, fails on every sample. Each is contained and named; none ends, hangs or floods the run."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlframe.reward.loader import check_reward_imports, import_problem
from rlframe.reward.manager import RewardError, RewardManager, RewardSpec

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


SCORE = "\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def test_main_names_a_reward_file_that_exits_or_blocks_at_import(tmp_path):
    """`python -m rlframe.main` with one reward file calling os._exit(0) and one blocking at import: a
    one-screen error naming both reward.functions[i] and their files, before any work (not a silent exit 0, not
    a hang)."""
    exits = write(tmp_path, "exits_at_import.py", "import os\nos._exit(0)\n" + SCORE)
    blocks = write(tmp_path, "blocks_at_import.py", "import time\nprint('connecting...')\ntime.sleep(1000)\n" + SCORE)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlframe.main", "recipe=grpo_math", "reward.import_timeout_s=3",
                           f"reward.functions=[{{path: '{exits}'}}, {{path: '{blocks}'}}]",
                           f"trainer.run_dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 90
    assert done.returncode not in (0, None), done.stdout[-2000:] + done.stderr[-2000:]
    err = done.stderr
    assert "error:" in err and "Traceback" not in err, err[-3000:]
    assert "reward.functions[0]" in err and "exits_at_import.py" in err and "ended the importing process" in err
    assert "reward.functions[1]" in err and "blocks_at_import.py" in err and "did not finish within 3 s" in err
    assert "connecting..." in err  # what the file printed before it blocked
    assert not (tmp_path / "run").exists()  # nothing started


def test_import_check_kills_what_the_import_started_and_remembers_a_good_file(tmp_path):
    pid_file = tmp_path / "pid"
    forks = write(tmp_path, "forks_at_import.py", textwrap.dedent(f"""
        import subprocess, time
        open({str(pid_file)!r}, "w").write(str(subprocess.Popen(["sleep", "1000"]).pid))
        time.sleep(1000)
        """) + SCORE)
    assert "did not finish within 1 s" in import_problem(forks, 1.0)
    assert not _alive(int(pid_file.read_text()))
    good = write(tmp_path, "good.py", SCORE)
    assert import_problem(good, 5.0) is None
    cfg = type("Cfg", (), {"reward": type("R", (), {"functions": [type("F", (), {"path": good, "name": "compute_score"})],
                                                    "import_timeout_s": 5.0})})
    assert check_reward_imports(cfg) == []


def test_the_import_check_dies_with_a_killed_driver(tmp_path):
    """The check runs in a session of its own (so that its timeout can kill its group); a driver SIGKILLed while it
    waits must not leave it importing a blocking file (before: it lived on until the import ended)."""
    import signal
    import subprocess
    import sys

    blocks = write(tmp_path, "blocks.py", "import time\ntime.sleep(1000)\n" + SCORE)
    driver = subprocess.Popen([sys.executable, "-c", "from rlframe.reward.loader import import_problem\n"
                               f"import_problem({str(blocks)!r}, 600.0)"])
    deadline, check = time.monotonic() + 60, None
    while check is None and time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            command = _cmdline(entry) if entry.name.isdigit() else ""
            if "rlframe_reward_import_check" in command and str(blocks) in command:
                check = int(entry.name)
        time.sleep(0.1)
    assert check is not None, "the import check did not start"
    time.sleep(0.5)  # (past its first lines)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert not _alive(check), "the import check outlived its driver"


def _cmdline(entry: Path) -> str:
    try:
        return (entry / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` still runs (not a zombie) after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


def test_processes_a_reward_forks_are_killed_with_its_worker(tmp_path):
    pids = tmp_path / "pids"
    forking = write(tmp_path, "forking.py", f"""
        import os, subprocess

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            child = subprocess.Popen(["sleep", "1000"])      # a server it never stops
            if os.fork() == 0:                                # and a forked copy of itself
                import time
                time.sleep(1000)
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{child.pid}}\\n")
            return 1.0
        """)
    with RewardManager([RewardSpec(forking)], num_workers=1) as manager:
        result = manager.score(["a", "b"], ["1", "1"], ["x", "x"])
    np.testing.assert_allclose(result.scores, [1.0, 1.0])
    children = [int(line) for line in pids.read_text().split()]
    assert len(children) == 2 and not any(_alive(pid) for pid in children)
    leftovers = subprocess.run(["pgrep", "-f", "^sleep 1000$"], capture_output=True, text=True).stdout.split()
    assert not set(map(int, leftovers)) & set(children)


def test_a_reward_printing_40_mb_does_not_flood_the_driver_log(tmp_path, capfd):
    loud = write(tmp_path, "loud.py", """
        import sys

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            line = "x" * 1023 + "\\n"
            sys.stdout.write(line * 20480)          # 20 MB on stdout
            sys.stderr.write(line * 20480)          # and 20 MB on stderr
            return 1.0
        """)
    with RewardManager([RewardSpec(loud)], num_workers=1, max_output_bytes=10_000) as manager:
        result = manager.score(["a"], ["1"], ["x"])
        time.sleep(0.5)  # the pump reads the rest of the pipe meanwhile
    out, err = capfd.readouterr()
    assert result.scores.tolist() == [1.0] and result.failures == []
    assert len(out) + len(err) < 20_000, len(out) + len(err)
    assert "printed more than 10000 bytes in this batch" in err


def test_a_score_beyond_float32_is_a_failure_not_a_nan_advantage(tmp_path):
    from types import SimpleNamespace

    from rlframe.algos.advantages import compute_grpo_advantage
    from rlframe.trainer.scorer import place_scores_on_last_token

    huge = write(tmp_path, "huge.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"big": 1e39, "neg": -1e39, "ok": 1.0}[solution_str]
        """)
    manager = RewardManager([RewardSpec(huge)], num_workers=0)
    result = manager.score(["big", "ok", "neg", "ok"], ["1"] * 4, ["x"] * 4)
    assert result.scores.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert result.metrics["reward/failures"] == 2 and "beyond float32" in result.failures[0]
    mask = torch.ones(4, 3)
    advantages, _ = compute_grpo_advantage(place_scores_on_last_token(result.scores, mask), mask,
                                           np.array(["p"] * 4, dtype=object),
                                           config=SimpleNamespace(norm_by_std=True, eps=1e-6))
    assert torch.isfinite(advantages).all()
    # two finite scores whose weighted sum overflows float32 are a failure too
    spread = write(tmp_path, "spread.py", SCORE.replace("return 1.0", "return 3e38"))
    summed = RewardManager([RewardSpec(spread), RewardSpec(spread)], num_workers=0).score(["a"], ["1"], ["x"])
    assert summed.scores.tolist() == [0.0] and "weighted sum" in summed.failures[-1]


def _scorer(reward_path, **reward):
    from helpers_tokenizer import build_tokenizer
    from rlframe.config import RLConfig, RewardFunctionConfig
    from rlframe.trainer.phases import PhaseClock
    from rlframe.trainer.scorer import Scorer

    cfg = RLConfig()
    cfg.reward.functions = [RewardFunctionConfig(path=reward_path)] if reward_path else []
    cfg.reward.num_workers = 0
    for key, value in reward.items():
        setattr(cfg.reward, key, value)
    tokenizer = build_tokenizer()
    return Scorer(cfg, tokenizer, PhaseClock()), tokenizer


def _batch(tokenizer, n=4, env_reward=None):
    from rlframe.protocol import DataProto

    ids = torch.tensor([tokenizer("12", add_special_tokens=False)["input_ids"][:1] * 3] * n)
    non_tensors = {"ground_truth": ["12"] * n, "data_source": ["arithmetic"] * n, "extra_info": [None] * n}
    if env_reward is not None:
        non_tensors["agent_env_reward"] = np.array(env_reward, dtype=object)
    return DataProto.from_dict(tensors={"responses": ids, "response_mask": torch.ones(n, 3)},
                               non_tensors={k: np.array(v, dtype=object) for k, v in non_tensors.items()})


def test_a_reward_failing_on_every_sample_stops_the_run_naming_it(tmp_path):
    broken = write(tmp_path, "broken_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": undefined_name}
        """)
    scorer, tokenizer = _scorer(broken, max_failure_steps=2)
    batch = _batch(tokenizer)
    scorer.join(batch, scorer.start(batch, overlap=False))  # batch 1: 4 of 4 failed, training goes on
    batch = _batch(tokenizer)
    with pytest.raises(RewardError) as error:  # batch 2 in a row: the run stops
        scorer.start(batch, overlap=True).future.result()
    text = str(error.value)
    assert "reward function broken_reward failed on 4 of 4 samples" in text
    assert "NameError" in text and "undefined_name" in text and "reward.max_failure_rate" in text
    scorer.close()
    # 1.0: never stop
    scorer, tokenizer = _scorer(broken, max_failure_steps=1, max_failure_rate=1.0)
    batch = _batch(tokenizer)
    scorer.join(batch, scorer.start(batch, overlap=False))
    assert batch.batch["token_level_scores"].sum() == 0


def test_an_environment_alone_gives_the_reward(tmp_path):
    """reward.functions=[] with a multi-turn environment: the config is valid and the score (and what
    val/accuracy counts) is the environment's reward."""
    from rlframe.config import ConfigError, RLConfig, validate_config
    from rlframe.trainer.scorer import validation_accuracy

    scorer, tokenizer = _scorer(None)
    batch = _batch(tokenizer, env_reward=[1.0, 0.0, 0.5, 1.0])
    result, scores, _ = scorer.rule_and_model_scores(batch, scorer.decode(batch))
    assert scores.tolist() == [1.0, 0.0, 0.5, 1.0] and validation_accuracy(result).tolist() == [1, 0, 0, 1]
    scored, _ = scorer.score(batch)
    assert scored.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 0.5, 1.0]

    def problems(**changes):
        cfg = RLConfig()
        cfg.reward.functions = []
        for path, value in changes.items():
            section, key = path.rsplit(".", 1)
            setattr(eval(f"cfg.{section}"), key, value)  # noqa: S307 -- our own literal paths
        try:
            validate_config(cfg)
        except ConfigError as error:
            return str(error)
        return ""
    assert "reward.functions: no reward function" in problems()
    env = dict(**{"rollout.multi_turn.enable": True, "rollout.multi_turn.environment.path": "tools/feedback_math.py",
                  "rollout.multi_turn.environment.name": "FeedbackMath"})
    assert "reward.functions" not in problems(**env)
