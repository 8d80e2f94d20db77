"""The issue's malformed-data list, each reported with file, row and field (tests/test_data.py covers
the other field checks): missing field, wrong type, empty prompt, overlong prompt, non-UTF-8 bytes
(in a jsonl line and in a parquet binary column)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_tokenizer import build_tokenizer
from rlframe.data.dataset import DatasetError, RLDataset


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def good(question="What is 1 plus 2?"):
    return {"data_source": "toy", "prompt": [{"role": "user", "content": question}],
            "reward_model": {"ground_truth": "3"}}


def jsonl_lines(rows) -> bytes:
    return b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows)


CASES = {
    "missing field": ({k: v for k, v in good().items() if k != "reward_model"}, "'reward_model.ground_truth'", "missing"),
    "wrong type": ({**good(), "prompt": 42}, "'prompt'", "got int"),
    "empty prompt": ({**good(), "prompt": [{"role": "user", "content": 7}]}, "'prompt[0].content'", "not a string"),
    "empty string prompt": ({**good(), "prompt": ""}, "'prompt'", "empty"),
    "overlong prompt": (good("How many apples are there? " * 40), "'prompt'", "max_prompt_length=64"),
    "non-UTF-8 bytes": (b'{"data_source": "toy", "prompt": [{"role": "user", "content": "caf\xe9 \xff?"}], '
                        b'"reward_model": {"ground_truth": "3"}}\n', "'prompt[0].content'", "not valid UTF-8 text (byte 0xe9"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_row_named_with_file_row_and_field(tmp_path, tokenizer, case):
    bad, field, problem = CASES[case]
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl_lines([good(), good(), good(), bad, good()]))
    with pytest.raises(DatasetError) as info:
        RLDataset([str(path)], tokenizer, max_prompt_length=64)
    message = str(info.value)
    assert "train.jsonl, row 3" in message and f"field {field}" in message and problem in message, message
    if case != "overlong prompt":  # overlong prompts have their own policy (filter / truncate_left)
        skipped = RLDataset([str(path)], tokenizer, max_prompt_length=64, bad_rows="skip")
        assert len(skipped) == 4 and skipped.num_skipped == 1


def test_non_utf8_in_parquet_binary_column(tmp_path, tokenizer):
    table = pa.table({"question": pa.array([b"What is 1 plus 2?", b"What is \xc3\x28?"], type=pa.binary()),
                      "answer": ["3", "4"]})
    pq.write_table(table, tmp_path / "qa.parquet")
    with pytest.raises(DatasetError, match=r"qa.parquet, row 1: field 'question': not valid UTF-8 text \(byte 0xc3"):
        RLDataset([str(tmp_path / "qa.parquet")], tokenizer, prompt_key="question", answer_key="answer")
