"""Audio in prompts, in one process: verl's and LLaMA-Factory's row layouts, WAV decoding and resampling on
hand-computed numbers, bad audios named by file, row and column, the processor's <|AUDIO|> count against
the features, packed vs padded log-probs, and the HF rollout's log-probs against the trainer's on audio
prompts (the run through `python -m rlframe.main`: tests/test_audio_e2e.py).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlframe.data.audio import audio_token_count, decode_audio, pcm_to_float, resample, write_wav
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.files import DatasetError
from rlframe.device import DeviceProfile

CPU = DeviceProfile(device="cpu", dtype=torch.float32, backend="gloo", attn_implementation="sdpa",
                    rollout_engine="hf", sleep_mode=False)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    from rlframe.models.tiny_audio import build_tiny_audio_dir

    return build_tiny_audio_dir(tmp_path_factory.mktemp("tiny_audio"))


@pytest.fixture(scope="module")
def tokenizer(audio_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(audio_dir)


def tone(freq: float, seconds: float, rate: int) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)


def audio_row(content: str, audios, answer: str = "1", key: str = "audios") -> dict:
    return {"prompt": [{"role": "user", "content": content}], key: audios, "reward_model": {"ground_truth": answer}}


def write_rows(path, rows) -> str:
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ------------------------------------------------------------------ decoding and resampling


def test_pcm_scaling_hand_computed():
    assert pcm_to_float(np.array([-32768, 0, 16384], np.int16)).tolist() == [-1.0, 0.0, 0.5]
    assert pcm_to_float(np.array([0, 128, 192], np.uint8)).tolist() == [-1.0, 0.0, 0.5]
    assert pcm_to_float(np.array([[2 ** 30, 0]], np.int32)).tolist() == [0.25]  # (0.5 + 0) / 2: channels averaged


def test_resampling_hand_computed():
    x = tone(440.0, 0.1, 44100)  # 4410 samples
    assert resample(x, 16000, 16000).tolist() == x.astype(np.float32).tolist()  # at the rate: unchanged
    # gcd(44100, 16000) = 100: up 160, down 441 -> ceil(4410 * 160 / 441) = 1600 samples
    y = resample(x, 44100, 16000)
    assert y.shape == (1600,) and y.dtype == np.float32
    # 8000 -> 16000 (up 2): ceil(800 * 2) = 1600; a constant stays constant away from the edges (the filter's
    # gain at 0 Hz is 1), and a 440 Hz tone's spectrum still peaks at 440 Hz (bin 440 / (16000 / 1600) = 44)
    assert resample(np.ones(800), 8000, 16000)[200:-200] == pytest.approx(1.0, abs=1e-3)
    for rate in (8000, 22050, 44100):
        z = resample(tone(440.0, 0.1, rate), rate, 16000)
        assert len(z) == 1600 and int(np.argmax(np.abs(np.fft.rfft(z)))) == 44


def test_wav_file_bytes_and_array_decode_the_same(tmp_path):
    x = tone(500.0, 0.25, 8000)
    write_wav(tmp_path / "a.wav", x, 8000)
    from_file = decode_audio("a.wav", "audios[0]", tmp_path)
    from_bytes = decode_audio({"bytes": (tmp_path / "a.wav").read_bytes(), "path": None}, "audios[0]", None)
    from_array = decode_audio({"array": (np.clip(x, -1, 1) * 32767).astype(np.int16) / 32768, "sampling_rate": 8000},
                              "audios[0]", None)
    assert len(from_file) == 4000  # 0.25 s at 16000 Hz
    np.testing.assert_array_equal(from_file, from_bytes)
    np.testing.assert_allclose(from_file, from_array, atol=1e-6)


# ------------------------------------------------------------------ rows, tokens and features


def test_verl_and_llamafactory_layouts_read_unchanged(tmp_path, tokenizer):
    write_wav(tmp_path / "one.wav", tone(440.0, 1.0, 8000), 8000)
    write_wav(tmp_path / "two.wav", tone(880.0, 0.5, 22050), 22050)
    rows = [
        audio_row("<audio>How many beeps?", ["one.wav"]),  # verl / LLaMA-Factory: a list of paths
        audio_row("<audio>Which is higher?", [{"array": tone(300.0, 0.7, 11025).tolist(), "sampling_rate": 11025}]),
        audio_row("First <audio> then <audio>: which is higher?", ["one.wav", "two.wav"]),
    ]
    ds = RLDataset([write_rows(tmp_path / "a.parquet", rows)], tokenizer, max_prompt_length=512)
    audio_pad = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    frames = [ds[i]["multi_modal_inputs"]["feature_attention_mask"].sum(-1).tolist() for i in range(3)]
    # ceil(n / 160) frames of n samples at 16000 Hz: 1 s -> 100, 0.7 s -> 70, 0.5 s -> 50
    assert frames == [[100], [70], [100, 50]]
    # ((f - 1) // 2 + 1 - 2) // 2 + 1 tokens: 100 -> 25, 70 -> 17, 50 -> 12
    assert [audio_token_count(f) for f in (100, 70, 50)] == [25, 17, 12]
    assert [ds[i]["input_ids"].count(audio_pad) for i in range(3)] == [25, 17, 37]
    assert ds[0]["multi_modal_inputs"]["input_features"].shape == (1, 128, 3000)  # padded to the 30 s window
    data = ds[2]["multi_modal_data"]["audio"]
    assert [(len(x), rate) for x, rate in data] == [(16000, 16000), (8000, 16000)]  # resampled once, kept
    assert ds.num_audios == 4 and ds.audio_decode_seconds > 0
    other = RLDataset([write_rows(tmp_path / "o.parquet", [audio_row("<audio>?", ["one.wav"], key="sounds")])],
                      tokenizer, max_prompt_length=512, audio_key="sounds")
    assert other[0]["input_ids"].count(audio_pad) == 25


def test_processor_token_count_matches_the_models_features(audio_dir, tokenizer, tmp_path):
    """The <|AUDIO|> count the processor writes is what the model's encoder gives (its forward checks it), and
    transformers' own Qwen2AudioProcessor writes the same ids."""
    from transformers import AutoProcessor

    from rlframe.workers.engine.hf_model import build_causal_lm

    model = build_causal_lm(str(audio_dir), CPU).eval()
    theirs = AutoProcessor.from_pretrained(audio_dir)
    for seconds in (0.061, 0.33, 1.0, 2.71, 4.0):
        write_wav(tmp_path / "t.wav", tone(600.0, seconds, 16000), 16000)
        ds = RLDataset([write_rows(tmp_path / "t.parquet", [audio_row("<audio>?", ["t.wav"])])], tokenizer,
                       max_prompt_length=512)
        item = ds[0]
        ids = torch.tensor([item["input_ids"]])
        with torch.no_grad():
            encoded = model.model.audio_tower(item["multi_modal_inputs"]["input_features"]).last_hidden_state
            _, lengths = model.model.audio_tower._get_feat_extract_output_lengths(
                item["multi_modal_inputs"]["feature_attention_mask"].sum(-1))
            model(input_ids=ids, **item["multi_modal_inputs"])  # raises on a count mismatch
        assert int((ids == model.config.audio_token_id).sum()) == int(lengths[0]) <= encoded.shape[1]
        reference = theirs(text=item["raw_prompt"], audio=[item["multi_modal_data"]["audio"][0][0]],
                           return_tensors="pt")
        assert reference["input_ids"][0].tolist() == item["input_ids"]
        torch.testing.assert_close(reference["input_features"], item["multi_modal_inputs"]["input_features"])


@pytest.mark.parametrize("audio, match", [
    ("nothing.wav", r"a.(parquet|jsonl), row 1: field 'audios\[0\]': audio file not found: .*nothing.wav"),
    ("bad.wav", r"a.(parquet|jsonl), row 1: field 'audios\[0\]': cannot decode the audio \(.*bad.wav\)"),
    ({"array": [0.1, 0.2]}, r"row 1: field 'audios\[0\]': an \{'array': ...\} audio needs a positive 'sampling_rate'"),
    ("short.wav", r"row 1: field 'audios\[0\]': the audio lasts 0.050 s, too short for 2 audio tokens"),
    ("long.wav", r"row 1: field 'audios\[0\]': the audio lasts 31.00 s, longer than the model's window of 30 s"),
])
def test_bad_audios_named_by_file_row_and_field(tmp_path, tokenizer, audio, match):
    write_wav(tmp_path / "ok.wav", tone(440.0, 0.5, 16000), 16000)
    write_wav(tmp_path / "long.wav", tone(440.0, 31.0, 8000), 8000)
    write_wav(tmp_path / "short.wav", tone(440.0, 0.05, 16000), 16000)
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVE" + b"\0" * 100)
    rows = [audio_row("<audio>?", ["ok.wav"]), audio_row("<audio>?", [audio])]
    with pytest.raises(DatasetError, match=match):
        RLDataset([write_rows(tmp_path / "a.parquet", rows)], tokenizer, max_prompt_length=512)


def test_audio_placeholders_must_match(tmp_path, tokenizer):
    write_wav(tmp_path / "ok.wav", tone(440.0, 0.5, 16000), 16000)
    with pytest.raises(DatasetError, match=r"row 0: field 'prompt': 2 <audio> placeholder\(s\) in the prompt but 1 audio"):
        RLDataset([write_rows(tmp_path / "a.parquet", [audio_row("<audio><audio>?", ["ok.wav"])])], tokenizer,
                  max_prompt_length=512)


# ------------------------------------------------------------------ the trainer's forward against the engine


def audio_prompts(tmp_path, tokenizer):
    rows = []
    for k, (freq, seconds) in enumerate(((440.0, 0.4), (880.0, 1.0), (660.0, 0.25), (300.0, 0.6))):
        write_wav(tmp_path / f"a{k}.wav", tone(freq, seconds, 8000), 8000)
        rows.append(audio_row(f"<audio>How many beeps? {k}", [f"a{k}.wav"]))
    ds = RLDataset([write_rows(tmp_path / "a.parquet", rows[:4])], tokenizer, max_prompt_length=256)
    return collate_prompts([ds[i] for i in range(4)], tokenizer.pad_token_id)


def test_hf_rollout_log_probs_match_trainer_on_audio_prompts(audio_dir, tokenizer, tmp_path):
    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import SamplingSettings

    prompts = audio_prompts(tmp_path, tokenizer)
    rollout = HFRollout(str(audio_dir), CPU, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = rollout.generate(prompts, SamplingSettings(max_new_tokens=12, temperature=1.0))
    mask = out.batch["response_mask"]
    assert mask.sum() >= 12
    audio_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")}
    assert not (set(out.batch["responses"][mask.bool()].tolist()) & audio_ids)  # never sampled
    mm = prompts.non_tensor_batch["multi_modal_inputs"]
    results = {}
    for packed in (True, False):
        model = build_causal_lm(str(audio_dir), CPU, packed=packed).eval()
        with torch.no_grad():
            results[packed] = forward_response_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"],
                                                         out.batch["position_ids"], 12, packed=packed,
                                                         multi_modal_inputs=mm)[0]
        diff = ((results[packed] - out.batch["rollout_log_probs"]) * mask).abs()
        assert float(diff.max()) < 1e-4, json.dumps(diff.tolist())
    # the audio matters: other audio features change the trainer's log-probs
    swapped = [dict(m, input_features=m["input_features"].flip(-1)) for m in mm]
    with torch.no_grad():
        other = forward_response_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"],
                                           out.batch["position_ids"], 12, multi_modal_inputs=swapped)[0]
    assert float(((other - results[False]) * mask).abs().max()) > 1e-4
