"""examples/data_preprocess/gsm8k.py the way users run it (through `datasets`, --local_dir), and the
GSM8K recipe reading what it wrote; nothing a user runs points outside the repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from rlframe.config import validate_config
from rlframe.main import compose_config

REPO = Path(__file__).resolve().parents[1]

RECORDS = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                        "How many clips did Natalia sell altogether in April and May?",
            "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                      "altogether in April and May.\n#### 72"},
           {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"}]


def test_preprocess_through_datasets_then_the_recipe_reads_it(tmp_path, monkeypatch):
    import datasets

    # A `datasets` folder stands in for the hub (these machines cannot reach it): the same loader path.
    folder = tmp_path / "gsm8k_hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS),
                          "test": datasets.Dataset.from_list(RECORDS[:1])}).save_to_disk(str(folder))
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(REPO / "examples/data_preprocess/gsm8k.py"), "--hf_dataset", str(folder),
                           "--local_dir", "~/data/gsm8k"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(home / "data/gsm8k/train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "2400"]
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["data_source"] == "openai/gsm8k"

    monkeypatch.setenv("HOME", str(home))
    cfg = compose_config(["recipe=grpo_gsm8k"])
    assert cfg.data.train_files == [str(home / "data/gsm8k/train.parquet")]
    assert cfg.data.val_files == [str(home / "data/gsm8k/test.parquet")]
    validate_config(cfg)

    # without the hub and without --input_dir: a clear error saying what to do
    done = subprocess.run([sys.executable, str(REPO / "examples/data_preprocess/gsm8k.py"), "--hf_dataset",
                           "no-such-owner/no-such-gsm8k", "--local_dir", str(tmp_path / "x")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "--input_dir" in done.stderr, done.stderr


def test_nothing_a_user_runs_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in tracked:
        if name.startswith(("tests/", ".ci/")) or not name.endswith((".py", ".yaml", ".yml", ".md", ".toml", ".sh")):
            continue
        text = (REPO / name).read_text(errors="replace")
        if "../shared" in text or "/work/shared" in text:
            offenders.append(name)
    assert offenders == [], offenders
