"""Data: the arithmetic generator, RLDataset validation and templating, collation, the sampler,
and GSM8K preprocessing on the real file."""

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from helpers_tokenizer import build_tokenizer
from rlframe.data.arithmetic import DATA_SOURCE, INSTRUCTION, generate_arithmetic_dataset
from rlframe.data.dataset import DatasetError, RLDataset, collate_prompts, read_rows
from rlframe.data.sampler import StatefulSampler
from rlframe.reward.loader import load_reward_function

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def row(question="What is 1 plus 2?", truth="3", **overrides):
    base = {"data_source": "toy", "prompt": [{"role": "user", "content": question}],
            "reward_model": {"ground_truth": truth}, "extra_info": {"k": 1}}
    base.update(overrides)
    return base


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_disjoint_and_in_layout(tmp_path):
    train, val = generate_arithmetic_dataset(tmp_path / "a", n_train=300, n_val=50, seed=3)
    train2, val2 = generate_arithmetic_dataset(tmp_path / "b", n_train=300, n_val=50, seed=3)
    rows, vrows = read_rows(train), read_rows(val)
    assert rows == read_rows(train2) and vrows == read_rows(val2)
    assert len(rows) == 300 and len(vrows) == 50
    questions = {r["extra_info"]["question"] for r in rows}
    assert len(questions) == 300
    assert questions.isdisjoint(r["extra_info"]["question"] for r in vrows)
    other, _ = generate_arithmetic_dataset(tmp_path / "c", n_train=300, n_val=50, seed=4)
    assert read_rows(other) != rows
    first = rows[0]
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["data_source"] == DATA_SOURCE and first["ability"] == "math"
    assert first["prompt"][0]["role"] == "user" and first["prompt"][0]["content"].endswith(INSTRUCTION)
    assert first["reward_model"]["style"] == "rule"
    assert first["extra_info"]["split"] == "train" and vrows[0]["extra_info"]["split"] == "val"
    for r in rows + vrows:  # answers are right and non-negative
        q, truth = r["extra_info"]["question"], int(r["reward_model"]["ground_truth"])
        numbers = [int(t) for t in q.replace("?", " ").replace(".", " ").split() if t.isdigit()]
        assert truth >= 0 and truth in (numbers[0] + numbers[1], numbers[0] - numbers[1])
        assert max(numbers) <= 20


def test_arithmetic_difficulty_and_cli(tmp_path):
    train, _ = generate_arithmetic_dataset(tmp_path, n_train=40, n_val=10, max_operand=5, ops=("+",))
    for r in read_rows(train):
        assert int(r["reward_model"]["ground_truth"]) <= 10
    with pytest.raises(ValueError, match="ops"):
        generate_arithmetic_dataset(tmp_path, ops=("*",))
    out = subprocess.run([sys.executable, "-m", "rlframe.data.arithmetic", "--out",
                          str(tmp_path / "cli"), "--n-train", "20", "--n-val", "5"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(read_rows(tmp_path / "cli" / "val.parquet")) == 5


def test_arithmetic_answers_score_with_math_reward(tmp_path):
    train, _ = generate_arithmetic_dataset(tmp_path, n_train=20, n_val=5)
    math_reward = load_reward_function(REPO / "reward_fns" / "math.py")
    for r in read_rows(train):
        truth = r["reward_model"]["ground_truth"]
        assert math_reward(DATA_SOURCE, f"\\boxed{{{truth}}}", truth)["score"] == 1.0


# ---------------------------------------------------------------- RLDataset


def test_dataset_items_parquet_jsonl_and_hf_folder(tmp_path, tokenizer):
    import datasets

    train, _ = generate_arithmetic_dataset(tmp_path, n_train=10, n_val=2)
    ds = RLDataset([str(train)], tokenizer, max_prompt_length=512)
    item = ds[3]
    assert set(item) == {"input_ids", "raw_prompt", "ground_truth", "data_source", "extra_info",
                         "index"}
    assert item["raw_prompt"].startswith("<|im_start|>user\n")
    assert item["raw_prompt"].endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(item["input_ids"]) == item["raw_prompt"]
    assert item["data_source"] == "arithmetic" and item["index"] == 3
    assert item["extra_info"]["index"] == 3

    jsonl = write_jsonl(tmp_path / "qa.jsonl", [{"question": "What is 2 plus 2?", "answer": "4"}])
    folder = tmp_path / "hf"
    datasets.Dataset.from_list([row()]).save_to_disk(str(folder))
    mixed = RLDataset([jsonl, str(folder)], tokenizer, prompt_key="question", answer_key="answer",
                      max_prompt_length=512, bad_rows="skip")
    # the jsonl row is plain QA; the folder row has no "question" column and is skipped
    assert len(mixed) == 1 and mixed.num_skipped == 1
    assert mixed[0]["ground_truth"] == "4" and mixed[0]["data_source"] == "qa"
    both = RLDataset([str(folder)], tokenizer, max_prompt_length=512)
    assert both[0]["extra_info"] == {"k": 1}


@pytest.mark.parametrize("bad, field", [
    ({"prompt": None}, "'prompt'"),
    ({"prompt": [{"role": "user"}]}, "'prompt[0].content'"),
    ({"prompt": [{"role": "user", "content": 5}]}, "'prompt[0].content'"),
    ({"prompt": "   "}, "'prompt'"),
    ({"reward_model": {"style": "rule"}}, "'reward_model.ground_truth'"),
    ({"reward_model": {"ground_truth": None}}, "'reward_model.ground_truth'"),
    ({"data_source": 7}, "'data_source'"),
    ({"extra_info": [1, 2]}, "'extra_info'"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer, bad, field):
    path = write_jsonl(tmp_path / "data.jsonl", [row(), row(), {**row(), **bad}, row()])
    with pytest.raises(DatasetError) as info:
        RLDataset([path], tokenizer)
    message = str(info.value)
    assert "data.jsonl" in message and "row 2" in message and field in message
    skipped = RLDataset([path], tokenizer, bad_rows="skip")
    assert len(skipped) == 3 and skipped.num_skipped == 1


def test_missing_file_and_bad_json(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="not found"):
        RLDataset([str(tmp_path / "nope.parquet")], tokenizer)
    (tmp_path / "broken.jsonl").write_text(json.dumps(row()) + "\n{not json\n")
    with pytest.raises(DatasetError, match="broken.jsonl, line 2"):
        RLDataset([str(tmp_path / "broken.jsonl")], tokenizer)


def test_overlong_prompts(tmp_path, tokenizer, caplog):
    long_question = "How many apples? " * 30
    path = write_jsonl(tmp_path / "d.jsonl", [row(), row(long_question), row(), row(long_question)])
    with pytest.raises(DatasetError, match=r"(?s)d.jsonl, row 1.*max_prompt_length=40"):
        RLDataset([path], tokenizer, max_prompt_length=40)
    with caplog.at_level(logging.INFO, logger="rlframe.data.dataset"):
        filtered = RLDataset([path], tokenizer, max_prompt_length=40, overlong="filter")
    assert len(filtered) == 2 and filtered.num_filtered == 2
    assert any("2 prompts longer than max_prompt_length=40" in r.getMessage() for r in caplog.records)
    truncated = RLDataset([path], tokenizer, max_prompt_length=40, overlong="truncate_left")
    assert len(truncated) == 4 and truncated.num_truncated == 2
    assert len(truncated[1]["input_ids"]) == 40
    assert truncated[1]["raw_prompt"].endswith("<|im_start|>assistant\n")


def test_prompt_template_and_file_weights(tmp_path, tokenizer):
    template = tmp_path / "t.jinja"
    template.write_text("Question: {{ prompt }}\nAnswer with a number.")
    path = write_jsonl(tmp_path / "plain.jsonl", [{"q": "What is 3 plus 4?", "a": 7}])
    ds = RLDataset([path], tokenizer, prompt_key="q", answer_key="a", prompt_template=str(template))
    assert "user\nQuestion: What is 3 plus 4?\nAnswer with a number.<|im_end|>" in ds[0]["raw_prompt"]
    assert ds[0]["ground_truth"] == 7

    a = write_jsonl(tmp_path / "a.jsonl", [row(f"a{i}") for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [row(f"b{i}") for i in range(2)])
    weighted = RLDataset([a, b], tokenizer, file_weights=[1.0, 1.0], seed=0)
    sources = [weighted[i]["raw_prompt"].split("user\n")[1][0] for i in range(len(weighted))]
    assert len(weighted) == 12 and sources.count("a") == 6 and sources.count("b") == 6


def test_collate_left_pads(tokenizer):
    rows = [{"input_ids": [5, 6, 7], "raw_prompt": "x", "ground_truth": "1", "data_source": "d",
             "extra_info": {}, "index": 0},
            {"input_ids": [8], "raw_prompt": "y", "ground_truth": ["1", "2"], "data_source": "d",
             "extra_info": {"a": 1}, "index": 1}]
    batch = collate_prompts(rows, pad_token_id=0)
    assert batch.batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.batch["input_ids"].dtype == torch.long
    assert list(batch.non_tensor_batch["ground_truth"][1]) == ["1", "2"]
    assert batch.non_tensor_batch["extra_info"][1] == {"a": 1}
    fixed = collate_prompts(rows, pad_token_id=0, max_prompt_length=5)
    assert fixed.batch["input_ids"].shape == (2, 5)
    assert fixed.batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="max_prompt_length=2"):
        collate_prompts(rows, pad_token_id=0, max_prompt_length=2)


def test_dataset_to_batch(tmp_path, tokenizer):
    train, _ = generate_arithmetic_dataset(tmp_path, n_train=8, n_val=2)
    ds = RLDataset([str(train)], tokenizer)
    sampler = StatefulSampler(len(ds), batch_size=4, seed=0)
    indices = next(iter(sampler))
    batch = collate_prompts([ds[i] for i in indices], tokenizer.pad_token_id)
    assert len(batch) == 4 and list(batch.non_tensor_batch["index"]) == indices
    mask = batch.batch["attention_mask"]
    for b, i in enumerate(indices):
        assert batch.batch["input_ids"][b][mask[b].bool()].tolist() == ds[i]["input_ids"]


# ---------------------------------------------------------------- sampler


def test_sampler_epochs_and_resume():
    sampler = StatefulSampler(10, 3, seed=7)
    assert len(sampler) == 3
    epoch0 = list(sampler)
    epoch1 = list(sampler)
    assert epoch0 != epoch1 and sampler.epoch == 2
    assert all(len(b) == 3 for b in epoch0) and len(set(sum(epoch0, []))) == 9
    fresh = StatefulSampler(10, 3, seed=7)
    assert list(fresh) == epoch0  # seeded

    run = StatefulSampler(10, 3, seed=7)
    stream = run.forever()
    seen = [next(stream) for _ in range(4)]  # one epoch and one batch
    state = run.state_dict()
    assert state == {"epoch": 1, "position": 1, "seed": 7}
    expected = [next(stream) for _ in range(5)]
    resumed = StatefulSampler(10, 3, seed=7)
    resumed.load_state_dict(state)
    again = resumed.forever()
    assert [next(again) for _ in range(5)] == expected
    assert seen[:3] == epoch0

    at_end = StatefulSampler(10, 3, seed=7)
    it = iter(at_end)
    for _ in range(3):
        next(it)
    resumed = StatefulSampler(10, 3, seed=7)
    resumed.load_state_dict(at_end.state_dict())
    assert list(resumed) == epoch1
    with pytest.raises(ValueError, match="seed"):
        resumed.load_state_dict({"epoch": 0, "position": 0, "seed": 8})
    assert list(StatefulSampler(5, 2, shuffle=False, drop_last=False)) == [[0, 1], [2, 3], [4]]


# ---------------------------------------------------------------- GSM8K


def _load_example(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason="GSM8K files not present")
def test_gsm8k_preprocessing_on_real_rows(tmp_path, tokenizer):
    gsm8k = _load_example("gsm8k_preprocess", REPO / "examples" / "data_preprocess" / "gsm8k.py")
    source = tmp_path / "in"
    source.mkdir()
    for split in ("train", "test"):
        lines = (GSM8K_DIR / f"{split}.jsonl").read_text().splitlines()[:20]
        (source / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    written = gsm8k.preprocess_gsm8k(source, tmp_path / "out")
    rows = pq.read_table(written["train"]).to_pylist()
    assert len(rows) == 20
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["reward_model"]["ground_truth"] == "72"  # Natalia's clips
    assert first["prompt"][0]["content"].startswith("Natalia sold clips")
    assert first["prompt"][0]["content"].endswith(gsm8k.INSTRUCTION)
    assert first["extra_info"]["answer"].endswith("#### 72")
    assert len(pq.read_table(written["test"])) == 20

    strict = load_reward_function(REPO / "reward_fns" / "gsm8k.py")
    for r in rows:  # the reference solutions score 1 under both reward files
        truth, solution = r["reward_model"]["ground_truth"], r["extra_info"]["answer"]
        assert strict("openai/gsm8k", solution, truth)["score"] == 1.0
        assert load_reward_function(REPO / "reward_fns" / "math.py")(
            "openai/gsm8k", solution, truth)["acc"] == 1.0
    assert strict("openai/gsm8k", "so 72 clips", "72")["score"] == 0.0
    assert strict("openai/gsm8k", "#### $1,000", "1000")["pred"] == "1000"
    ds = RLDataset([str(written["train"])], tokenizer, max_prompt_length=2048)
    assert len(ds) == 20 and ds[0]["ground_truth"] == "72"

    out = subprocess.run([sys.executable, str(REPO / "examples/data_preprocess/gsm8k.py"),
                          "--input_dir", str(source), "--output_dir", str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli" / "test.parquet").is_file()
