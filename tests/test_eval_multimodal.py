"""rlframe.eval on image, video and audio rows (tiny random Qwen2.5-VL and Qwen2-Audio, generated data files): the
media reach generation and scoring as in training's validation, and the text-only methods are refused naming the
column.

The check that generation saw the media: the engine's own log-probs of its greedy tokens (HF generate with the
processor's pixel/audio inputs) equal a forward of the same rows with the same inputs (the teacher role's engine,
teacher = the model), as training's rollout/logprob_abs_diff checks; a generation without them would disagree.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO_ROOT

LENGTH_REWARD = str(REPO_ROOT / "tests" / "length_reward.py")


def media_file(modality: str, out_dir):
    if modality == "image":
        from rlframe.data.shapes import generate_shapes_dataset

        return generate_shapes_dataset(out_dir, n_train=1, n_val=2, size=56)[1]
    if modality == "video":
        from rlframe.data.video_shapes import generate_video_shapes_dataset

        return generate_video_shapes_dataset(out_dir, n_train=1, n_val=2)[1]
    from rlframe.data.audio_tones import generate_audio_tones_dataset

    return generate_audio_tones_dataset(out_dir, n_train=1, n_val=2)[1]


MODEL = {"image": "tiny-qwen2.5-vl", "video": "tiny-qwen2.5-vl", "audio": "tiny-qwen2-audio"}


def evaluator_for(modality, tmp_path, *extra):
    from rlframe.eval import build_config, options_from_args, parse_args, resolve_model
    from rlframe.evaluation.core import Evaluator

    data = media_file(modality, tmp_path / "data")
    model = resolve_model(MODEL[modality], tmp_path)
    args = parse_args([f"model={model}", f"data={data}", f"reward={LENGTH_REWARD}", "engine=hf",
                       "max_response_length=8", "max_prompt_length=1024", *extra])
    cfg, model, files, _ = build_config(args)
    return Evaluator(cfg, model, files, options_from_args(args))


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_media_reach_generation_and_scoring(modality, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    from rlframe.eval import resolve_model

    teacher = resolve_model(MODEL[modality], tmp_path)
    evaluator = evaluator_for(modality, tmp_path, f"teacher={teacher}")
    try:
        assert all(modality in row["multi_modal_data"] for row in evaluator.rows)
        results = evaluator.evaluate()
    finally:
        evaluator.close()
    samples = results["plain"].samples
    assert len(samples.texts) == 2 and samples.lengths.min() > 0
    # generation (HF generate) and the forward scored the same inputs: the same log-probs of the sampled tokens
    np.testing.assert_allclose(samples.engine_log_prob, samples.teacher.model_log_prob, atol=1e-4)
    assert abs(results["plain"].extra["teacher_reverse_kl"]) < 1e-6  # the model as its own teacher


@pytest.mark.parametrize("method", ["cot", "constrained"])
def test_text_only_methods_refuse_media_rows(method, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    from rlframe.evaluation.core import EvalInputError

    extra = [f"method={method}"] + (["constrain=boxed"] if method == "constrained" else [])
    with pytest.raises(EvalInputError, match=r"row 0 has video input \(column 'videos', data.video_key\)"):
        evaluator_for("video", tmp_path, *extra)
