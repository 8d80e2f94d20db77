"""Data as verl / EasyR1 users have it: verl-layout parquet with dict ground truths, csv, JSON arrays,
data files as strings with ~ and globs, EasyR1's {{ content }} prompt template."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_tokenizer import build_tokenizer
from rlframe.data.dataset import DatasetError, RLDataset, collate_prompts, read_rows
from rlframe.data.files import is_hub_id, resolve_data_files


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def verl_row(index, source, question, truth):
    return {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": index}}


def test_verl_parquet_with_dict_ground_truths(tmp_path, tokenizer):
    # verl's gsm8k layout (string truths) and its countdown layout (dict truths), one parquet file each
    pq.write_table(pa.Table.from_pylist([verl_row(0, "openai/gsm8k", "What is 2+3?", "5")]), tmp_path / "gsm8k.parquet")
    pq.write_table(pa.Table.from_pylist([verl_row(1, "countdown", "Make 10 from 2, 5", {"target": 10, "numbers": [2, 5]}),
                                         verl_row(2, "countdown", "Make 7 from 3, 4", {"target": 7, "numbers": [3, 4]})]),
                   tmp_path / "countdown.parquet")
    pq.write_table(pa.Table.from_pylist([verl_row(3, "numbers", "Half of 7?", 3.5)]), tmp_path / "numbers.parquet")
    ds = RLDataset([str(tmp_path / f"{n}.parquet") for n in ("gsm8k", "countdown", "numbers")], tokenizer,
                   max_prompt_length=64)
    assert len(ds) == 4
    truths = [ds[i]["ground_truth"] for i in range(4)]
    assert truths[0] == "5" and truths[3] == 3.5
    assert truths[1]["target"] == 10 and list(truths[1]["numbers"]) == [2, 5]
    batch = collate_prompts([ds[i] for i in range(4)], pad_token_id=0)
    assert batch.non_tensor_batch["ground_truth"][2] == {"target": 7, "numbers": [3, 4]}
    assert list(batch.non_tensor_batch["data_source"]) == ["openai/gsm8k", "countdown", "countdown", "numbers"]


def test_csv_and_json_array_and_template(tmp_path, tokenizer):
    (tmp_path / "a.csv").write_text("question,answer\nWhat is 1+1?,2\nWhat is 2+2?,4\n")
    (tmp_path / "b.json").write_text(json.dumps([{"question": "What is 3+3?", "answer": "6"}]))
    files = resolve_data_files(f"{tmp_path}/*")
    assert files == [str(tmp_path / "a.csv"), str(tmp_path / "b.json")]
    assert read_rows(files[1]) == [{"question": "What is 3+3?", "answer": "6"}]
    ds = RLDataset(files, tokenizer, prompt_key="question", answer_key="answer", max_prompt_length=128,
                   prompt_template="{{ content }} Put the final answer in \\boxed{}.")
    assert len(ds) == 3
    assert [ds[i]["ground_truth"] for i in range(3)] == [2, 4, "6"]  # csv numbers stay numbers
    assert "What is 1+1? Put the final answer in \\boxed{}." in ds[0]["raw_prompt"]
    template = tmp_path / "format.jinja"
    template.write_text("Q: {{ content }}")
    ds = RLDataset(files[1], tokenizer, prompt_key="question", answer_key="answer", prompt_template=str(template))
    assert "Q: What is 3+3?" in ds[0]["raw_prompt"]
    with pytest.raises(DatasetError, match="prompt_template file not found"):
        RLDataset(files[1], tokenizer, prompt_key="question", answer_key="answer", prompt_template="nope.jinja")


def test_data_file_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.parquet").write_bytes(b"")
    assert resolve_data_files("~/x.parquet") == [str(tmp_path / "x.parquet")]
    assert resolve_data_files(["~/x.parquet", "~/missing_*.parquet"]) == [str(tmp_path / "x.parquet"),
                                                                           str(tmp_path / "missing_*.parquet")]
    assert is_hub_id("hiyouga/math12k@train") and is_hub_id("openai/gsm8k:main@test")
    assert not is_hub_id(str(tmp_path / "x.parquet")) and not is_hub_id("data/train.parquet")


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetError, match=r"no-such-owner/no-such-set@train.*--local_dir"):
        read_rows("no-such-owner/no-such-set@train")
