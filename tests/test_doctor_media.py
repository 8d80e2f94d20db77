"""The doctor's media checks (rlframe/doctor/media_checks.py) on the real tiny models built here: the tiny
Qwen2.5-VL (images, videos) and the tiny Qwen2-Audio pass with hand-computed token counts; a folder copy whose
config.json points a modality's id at another token fails naming both ids and the fix; a template that drops the
audio entry fails; text models and text data are skipped with the reason; the doctor's own pure checks run them.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset
from rlframe.doctor.media_checks import check_media, check_modality


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlframe.models.tiny_vlm import build_tiny_vlm_dir

    return build_tiny_vlm_dir(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    from rlframe.models.tiny_audio import build_tiny_audio_dir

    return build_tiny_audio_dir(tmp_path_factory.mktemp("tiny_audio"))


def tokenizer_of(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def broken_copy(folder, tmp_path, key: str, token: str):
    """A copy of `folder` whose config.json points `key` at `token`'s id; returns (copy, the right id, the wrong)."""
    copy = tmp_path / f"broken-{key}"
    shutil.copytree(folder, copy)
    tokenizer = tokenizer_of(copy)
    config = json.loads((copy / "config.json").read_text())
    right, wrong = config[key], tokenizer.convert_tokens_to_ids(token)
    assert right != wrong
    config[key] = wrong
    (copy / "config.json").write_text(json.dumps(config))
    return copy, right, wrong


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def by_name(results):
    return {r.name: r for r in results}


def test_tiny_vlm_image_and_video_pass_with_hand_computed_counts(vlm_dir):
    tokenizer, cfg = tokenizer_of(vlm_dir), RLConfig()
    image_id, video_id = tokenizer.convert_tokens_to_ids("<|image_pad|>"), tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image = by_name(check_modality("image", cfg, tokenizer, str(vlm_dir)))
    assert [r.status for r in image.values()] == ["pass", "pass"], image
    assert f"tokenizer id {image_id} = config.json image_token_id" in image["image_token_id"].measured
    # 112 x 84 px -> 8 x 6 patches of 14 px, merged 2 x 2: 48 / 4 = 12 tokens
    assert f"a 112x84 image expands to 12 tokens of id {image_id}, the model's encoder returns 12 features" \
        in image["image_placeholder"].measured
    assert "<|vision_start|><|image_pad|><|vision_end|>" in image["image_placeholder"].measured
    video = by_name(check_modality("video", cfg, tokenizer, str(vlm_dir)))
    assert [r.status for r in video.values()] == ["pass", "pass"], video
    # 4 frames of 56 x 56 px -> 2 temporal patches x 4 x 4 patches = 32, merged 2 x 2: 8 tokens
    assert f"a 4-frame 56x56 video expands to 8 tokens of id {video_id}, the model's encoder returns 8 features " \
           "(grid [[2, 4, 4]]" in video["video_placeholder"].measured


def test_tiny_audio_passes_with_hand_computed_counts(audio_dir):
    tokenizer = tokenizer_of(audio_dir)
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    results = by_name(check_modality("audio", RLConfig(), tokenizer, str(audio_dir)))
    assert [r.status for r in results.values()] == ["pass", "pass"], results
    assert f"tokenizer id {audio_id} = config.json audio_token_index" in results["audio_token_id"].measured
    # 1 s at 16000 Hz = 100 mel frames (hop 160) -> conv stride 2: 50 -> pooling by 2: (50 - 2) // 2 + 1 = 25
    assert (f"a 1 s audio at 16000 Hz expands to 25 tokens of id {audio_id}, the model's encoder returns 25 features "
            "(Qwen2-Audio's encoder on [100] mel frames)") in results["audio_placeholder"].measured


def test_video_id_pointing_at_another_token_fails_naming_both_ids(vlm_dir, tmp_path):
    broken, right, wrong = broken_copy(vlm_dir, tmp_path, "video_token_id", "<|vision_end|>")
    tokenizer, cfg = tokenizer_of(broken), RLConfig()
    ids, placeholder = check_modality("video", cfg, tokenizer, str(broken))
    assert ids.status == "fail" and ids.name == "video_token_id"
    assert f"config.json video_token_id = {wrong} ('<|vision_end|>')" in ids.measured
    assert f"the tokenizer's '<|video_pad|>' is id {right}" in ids.measured
    assert f'"video_token_id": {right}' in ids.fix and str(broken) in ids.fix
    # the probe's prompt holds 1 token of the config's id (the template's <|vision_end|>) for 8 features
    assert placeholder.status == "fail" and f"expands to 1 token of id {wrong}" in placeholder.measured
    assert "returns 8 features" in placeholder.measured and "media/video_token_id" in placeholder.fix
    # the image id of the same copy is right: its checks still pass
    assert [r.status for r in check_modality("image", cfg, tokenizer, str(broken))] == ["pass", "pass"]


def test_audio_id_pointing_at_another_token_fails_naming_both_ids(audio_dir, tmp_path):
    broken, right, wrong = broken_copy(audio_dir, tmp_path, "audio_token_index", "<|audio_bos|>")
    ids, placeholder = check_modality("audio", RLConfig(), tokenizer_of(broken), str(broken))
    assert ids.status == "fail"
    assert f"audio_token_index = {wrong} ('<|audio_bos|>')" in ids.measured and f"is id {right}" in ids.measured
    assert f'"audio_token_index": {right}' in ids.fix
    # the template writes one <|audio_bos|> per audio: 1 token of the config's id for 25 features
    assert placeholder.status == "fail" and f"expands to 1 token of id {wrong}" in placeholder.measured


def test_a_template_that_drops_the_audio_entry_fails(audio_dir):
    tokenizer = tokenizer_of(audio_dir)
    tokenizer.chat_template = tokenizer.chat_template.replace("<|audio_bos|><|AUDIO|><|audio_eos|>", "")
    ids, placeholder = check_modality("audio", RLConfig(), tokenizer, str(audio_dir))
    assert ids.status == "pass"
    assert placeholder.status == "fail" and "renders through the chat template as 0 '<|AUDIO|>'" in placeholder.measured
    assert "{'type': 'audio'}" in placeholder.fix


def test_audio_data_on_a_vision_model_fails_naming_the_missing_key(vlm_dir):
    ids, placeholder = check_modality("audio", RLConfig(), tokenizer_of(vlm_dir), str(vlm_dir))
    assert ids.status == "fail" and "names no audio_token_index / audio_token_id" in ids.measured
    assert "Qwen2-Audio" in ids.fix and placeholder.status == "skip"


def test_text_model_or_text_data_is_skipped_with_the_reason(tiny_model_dir, vlm_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}}]
    files = write_jsonl(tmp_path / "text.jsonl", rows)
    text_tokenizer = tokenizer_of(tiny_model_dir)
    (skip,) = check_media(RLConfig(), text_tokenizer, str(tiny_model_dir), RLDataset(files, text_tokenizer))
    assert skip.status == "skip" and "text model" in skip.measured
    vlm_tokenizer = tokenizer_of(vlm_dir)
    (skip,) = check_media(RLConfig(), vlm_tokenizer, str(vlm_dir), RLDataset(files, vlm_tokenizer))
    assert skip.status == "skip" and "the model reads image (image_token_id), video (video_token_id)" in skip.measured
    assert check_media(RLConfig(), text_tokenizer, str(tiny_model_dir), None)[0].status == "skip"


def test_data_rows_counted_only_for_the_modalities_they_use(vlm_dir, audio_dir, tmp_path):
    # an image row: 56 x 56 px -> 4 x 4 patches / 4 = 4 tokens
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "blue.png")
    image_rows = [{"prompt": [{"role": "user", "content": "<image>What colour?"}], "images": ["blue.png"],
                   "reward_model": {"ground_truth": "blue"}}]
    tokenizer = tokenizer_of(vlm_dir)
    dataset = RLDataset(write_jsonl(tmp_path / "images.jsonl", image_rows), tokenizer, min_pixels=3136)
    results = check_media(RLConfig(), tokenizer, str(vlm_dir), dataset)
    assert [(r.name, r.status) for r in results] == [("image_token_id", "pass"), ("image_placeholder", "pass")]
    assert "images.jsonl (1 image(s)): 4 = 4" in results[1].measured
    # an audio row of 0.5 s at 8000 Hz -> 8000 samples at 16000 Hz = 50 frames -> 25 -> 12 tokens
    wave = (0.5 * np.sin(2 * np.pi * 440 * np.arange(4000) / 8000)).tolist()
    audio_rows = [{"prompt": [{"role": "user", "content": "<audio>How many beeps?"}],
                   "audios": [{"array": wave, "sampling_rate": 8000}], "reward_model": {"ground_truth": "1"}}]
    tokenizer = tokenizer_of(audio_dir)
    dataset = RLDataset(write_jsonl(tmp_path / "audios.jsonl", audio_rows), tokenizer)
    results = check_media(RLConfig(), tokenizer, str(audio_dir), dataset)
    assert [(r.name, r.status) for r in results] == [("audio_token_id", "pass"), ("audio_placeholder", "pass")]
    assert "audios.jsonl (1 audio(s)): 12 = 12" in results[1].measured


def test_the_doctor_runs_the_media_checks_on_the_audio_recipe(tmp_path, monkeypatch):
    from rlframe.doctor.__main__ import pure_checks
    from rlframe.main import compose_config

    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["recipe=grpo_audio_tones", f"trainer.run_dir={tmp_path / 'run'}", "trainer.device=cpu"])
    results, _ = pure_checks(cfg, tmp_path / "run")
    media = {r.name: r.status for r in results if r.group == "media"}
    assert media == {"audio_token_id": "pass", "audio_placeholder": "pass"}, [r for r in results if r.group == "media"]
