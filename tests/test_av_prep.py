"""examples/data_preprocess/mmau.py (audio multiple-choice QA -> verl's audio layout) on records the test writes
in the hub set's schema with real generated .wav clips: the conversion on hand-checked rows, its errors, the
script run as users run it (through `datasets`, --local_dir), and the parquet it writes read through rlframe's
own data path (RLDataset) with the tiny Qwen2-Audio's tokenizer and scored by reward_fns/math.py."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.io import wavfile

from rlframe.data.audio import write_wav
from rlframe.data.audio_tones import clip

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "examples" / "data_preprocess" / "mmau.py"


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mmau = load_module(SCRIPT, "mmau_prep")


def wav_bytes(tmp_path, name, samples, rate) -> bytes:
    return write_wav(tmp_path / name, samples, rate).read_bytes()


def record(audio, question, choices, answer, number=1) -> dict:
    """One record in lmms-lab/mmau's schema (choices: a JSON list in a string; answer: the choice's text)."""
    return {"id": f"mmau-test-mini-{number:04d}", "audio": audio, "question": question, "choices": json.dumps(choices),
            "answer": answer, "dataset": "generated-tones", "task": "sound", "split": "test-mini",
            "category": "Counting", "sub-category": "beeps", "difficulty": "easy"}


@pytest.fixture
def records(tmp_path):
    """Two answered records (2 beeps at 16 kHz, 1.0 s long; two tones at 8 kHz, 0.5 s long) and one unanswered."""
    beeps = clip([440.0, 440.0], 0.2, 0.2, 16000)  # 0.2 + 2 x (0.2 + 0.2) = 1.0 s
    assert len(beeps) == 16000
    pair = np.pad(clip([660.0, 330.0], 0.15, 0.05, 8000), (0, 400))  # 0.05 + 2 x (0.15 + 0.05) + 0.05 = 0.5 s
    assert len(pair) == 4000
    first = wav_bytes(tmp_path, "beeps.wav", beeps, 16000)
    second = wav_bytes(tmp_path, "pair.wav", pair, 8000)
    return [record({"bytes": first, "path": "beeps.wav"}, "How many beeps are there?", ["one", "two", "three", "four"],
                   "two", 1),
            record({"bytes": second, "path": "pair.wav"}, "Which tone is higher?", ["The first", "The second"],
                   "the first", 2),
            record({"bytes": second, "path": "pair.wav"}, "Is it loud?", ["yes", "no"], "", 3)]


def test_rows_hand_checked(records):
    row = mmau.to_row(records[0], "test_mini", 0)
    assert row["prompt"] == [{"role": "user", "content": "<audio>How many beeps are there?\n1. one\n2. two\n3. three\n"
                                                         "4. four\n" + mmau.INSTRUCTION}]
    assert row["audios"] == [{"bytes": records[0]["audio"]["bytes"], "path": None}]  # the .wav file, unchanged
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert row["data_source"] == "lmms-lab/mmau" and row["ability"] == "audio"
    assert row["extra_info"] == {"split": "test_mini", "index": 0, "question": "How many beeps are there?",
                                 "choices": ["one", "two", "three", "four"], "answer": "two",
                                 "id": "mmau-test-mini-0001", "dataset": "generated-tones", "task": "sound",
                                 "category": "Counting", "sub-category": "beeps", "difficulty": "easy"}
    # the answer is matched case-insensitively; a plain list of choices is taken too
    second = mmau.to_row({**records[1], "choices": ["The first", "The second"]}, "test_mini", 1)
    assert second["reward_model"]["ground_truth"] == "1"
    assert mmau.to_row(records[2], "test_mini", 2) is None  # no answer (MMAU's test split): skipped


def test_decoded_audio_becomes_pcm16_wav():
    """A decoded {"array", "sampling_rate"} -> 16-bit PCM .wav: round(clip(x, -1, 1) * 32767), channels averaged."""
    out = mmau.audio_record({"array": [0.0, 0.5, -1.0, 1.5], "sampling_rate": 8000})
    rate, data = wavfile.read(io.BytesIO(out["bytes"]))
    assert out["path"] is None and rate == 8000 and data.dtype == np.int16
    assert data.tolist() == [0, 16384, -32767, 32767]  # 0.5 * 32767 = 16383.5 -> 16384 (round half to even)
    _, stereo = wavfile.read(io.BytesIO(mmau.pcm16_wav(np.array([[0.5, 0.25, 0.0], [0.5, 0.75, -0.5]]), 16000)))
    assert stereo.tolist() == [16384, 16384, -8192]  # means 0.5, 0.5, -0.25: -8191.75 -> -8192


def test_bad_records_named(records, tmp_path):
    wrong = {**records[1], "answer": "the third"}
    with pytest.raises(ValueError, match=r"src, record 1: ValueError: answer 'the third' is none of the choices"):
        mmau.write_rows([records[0], wrong], tmp_path / "x.parquet", "test_mini", "src")
    with pytest.raises(ValueError, match=r"src, record 0: ValueError: the audio is not a \.wav file"):
        mmau.write_rows([{**records[0], "audio": {"bytes": b"ID3\x03 not audio", "path": "x.mp3"}}],
                        tmp_path / "x.parquet", "test_mini", "src")
    with pytest.raises(ValueError, match=r"src, record 0: ValueError: choices must be a list of at least 2 options"):
        mmau.write_rows([{**records[0], "choices": '"one"'}], tmp_path / "x.parquet", "test_mini", "src")
    with pytest.raises(ValueError, match=r"src, record 0: KeyError: 'question'"):
        mmau.write_rows([{k: v for k, v in records[0].items() if k != "question"}], tmp_path / "x.parquet",
                        "test_mini", "src")
    assert not (tmp_path / "x.parquet").exists()


@pytest.fixture(scope="module")
def audio_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlframe.models.tiny_audio import build_tiny_audio_dir

    return AutoTokenizer.from_pretrained(build_tiny_audio_dir(tmp_path_factory.mktemp("tiny_audio")))


def test_script_through_datasets_then_rlframe_reads_it(records, tmp_path, audio_tokenizer):
    import datasets

    from rlframe.data.audio import audio_token_count
    from rlframe.data.dataset import RLDataset

    # A `datasets` folder stands in for the hub (these machines cannot reach it): the same loader, an Audio column.
    def split(rows):
        return datasets.Dataset.from_list(rows).cast_column("audio", datasets.Audio(sampling_rate=192000))
    folder = tmp_path / "mmau_hf"
    datasets.DatasetDict({"test_mini": split(records), "test": split([records[2]])}).save_to_disk(str(folder))
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--hf_dataset", str(folder), "--local_dir", "~/data/mmau",
                           "--splits", "test_mini,test"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "test_mini: 2 rows" in done.stdout and "(1 without an answer skipped)" in done.stdout, done.stdout
    assert "test: no answered rows (1 without an answer skipped)" in done.stdout, done.stdout
    written = home / "data" / "mmau" / "test_mini.parquet"
    assert sorted(p.name for p in written.parent.iterdir()) == ["test_mini.parquet"]
    rows = pq.read_table(written).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "1"]
    assert rows[0]["audios"][0]["bytes"] == records[0]["audio"]["bytes"]  # the file's own bytes, not re-encoded

    ds = RLDataset([str(written)], audio_tokenizer, max_prompt_length=1024)
    assert len(ds) == 2 and ds.num_audios == 2
    # 1.0 s at 16 kHz -> 100 mel frames -> 25 tokens; 0.5 s at 8 kHz -> 8000 samples at 16 kHz -> 50 frames -> 12
    assert [audio_token_count(f) for f in (100, 50)] == [25, 12]
    audio_pad = audio_tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert [ds[i]["input_ids"].count(audio_pad) for i in range(2)] == [25, 12]
    assert [ds[i]["multi_modal_inputs"]["feature_attention_mask"].sum().item() for i in range(2)] == [100, 50]
    assert [ds[i]["ground_truth"] for i in range(2)] == ["2", "1"]
    assert ds[0]["data_source"] == "lmms-lab/mmau" and "2. two" in ds[0]["raw_prompt"]

    math_reward = load_module(REPO_ROOT / "reward_fns" / "math.py", "math_reward")
    score = lambda text, i: math_reward.compute_score("lmms-lab/mmau", text, ds[i]["ground_truth"])["score"]  # noqa: E731
    assert score("Two beeps. The answer is \\boxed{2}.", 0) == 1.0
    assert score("The answer is \\boxed{3}.", 0) == 0.0 and score("The answer is \\boxed{1}.", 1) == 1.0

    # without the hub: a clear error saying what to do
    done = subprocess.run([sys.executable, str(SCRIPT), "--hf_dataset", "no-such-owner/no-such-mmau", "--local_dir",
                           str(tmp_path / "x")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "--hf_dataset FOLDER" in done.stderr, done.stderr
