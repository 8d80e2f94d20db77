"""The console progress (plain lines off a terminal, rich on one), the wandb mode, samples as a wandb table."""

from __future__ import annotations

import io
import json

from rlframe.trainer.tracking import Progress, Tracker, format_duration, wandb_mode

STEP = {"critic/score/mean": 0.25, "val/accuracy": 0.5, "timing/rollout": 40.0, "timing/update": 20.0,
        "timing/step": 60.0}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_progress_lines_with_eta():
    out = io.StringIO()
    progress = Progress(total_steps=4, stream=out)
    progress.show(0, {"val/reward_mean": 0.1})
    progress.show(1, STEP)
    progress.show(2, {**STEP, "timing/step": 120.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step    0/4") and "ETA" not in lines[0]  # no step timed yet
    assert "[#####...............]  25%" in lines[1] and "ETA 3m00s" in lines[1]  # 3 steps x 60 s
    assert "ETA 3m00s" in lines[2]  # 2 steps left x mean(60, 120)
    assert "reward=0.25" in lines[1] and "val/accuracy=0.5" in lines[1]
    assert "| rollout=40.0s update=20.0s step=60.0s" in lines[1]
    assert "\x1b[" not in out.getvalue()  # no terminal codes in a log file


def test_rich_progress_on_a_terminal():
    out = Terminal()
    Progress(total_steps=4, stream=out).show(1, STEP)
    text = out.getvalue()
    assert "step 1/4" in text and "━" in text and "ETA 3m00s" in text and "reward 0.25" in text


def test_format_duration():
    assert [format_duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_wandb_mode_honours_login(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_mode() == "offline"  # no key anywhere
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")  # what `wandb login` writes
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode() == "offline"  # the user's WANDB_MODE wins
    monkeypatch.delenv("WANDB_MODE")
    netrc.write_text("machine example.com login a password b\n")
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode() == "online"


def test_offline_wandb_gets_metrics_and_a_samples_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(tmp_path, ["jsonl", "wandb"], "rlframe-test", "tracking", {"a": 1}, total_steps=2)
    tracker.log(1, STEP)
    tracker.log_samples(1, "validation", [{"response": "\\boxed{4}", "ground_truth": "4", "score": 1.0}])
    tracker.close()
    assert "wandb: offline" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["critic/score/mean"] == 0.25
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
    tables = list(runs[0].rglob("validation/samples*.table.json"))
    assert tables and json.loads(tables[0].read_text())["data"][0][1] == "\\boxed{4}"
