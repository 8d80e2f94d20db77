"""Videos in prompts, in one process: verl's and EasyR1's row layouts, frame sampling and frame times, the
video patches against the image processor's, bad videos named by file, row and column, the tiny
Qwen2.5-VL's positions in time, packed vs padded vs one-row log-probs, and the HF rollout's log-probs
against the trainer's on video prompts (the run through `python -m rlframe.main`: tests/test_video_e2e.py).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.files import DatasetError
from rlframe.data.video import Video, decode_video, sample_indices, write_video
from rlframe.device import DeviceProfile

CPU = DeviceProfile(device="cpu", dtype=torch.float32, backend="gloo", attn_implementation="sdpa",
                    rollout_engine="hf", sleep_mode=False)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlframe.models.tiny_vlm import build_tiny_vlm_dir

    return build_tiny_vlm_dir(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from rlframe.data.video_shapes import generate_video_shapes_dataset

    return generate_video_shapes_dataset(tmp_path_factory.mktemp("video_shapes"), n_train=6, n_val=2)


def ramp(n: int, size: int = 56) -> np.ndarray:
    """n frames whose brightness is 10 * k (frame k), a red square at its index's column."""
    frames = np.zeros((n, size, size, 3), np.uint8)
    for k in range(n):
        frames[k] = 10 * k
        frames[k, :8, k * 2:k * 2 + 8, 0] = 255
    return frames


def write_rows(path, rows) -> str:
    """Parquet when the rows share one layout; JSON lines otherwise (a parquet column holds one type)."""
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def video_row(content: str, videos, answer: str = "1", key: str = "videos") -> dict:
    return {"prompt": [{"role": "user", "content": content}], key: videos, "reward_model": {"ground_truth": answer}}


# ------------------------------------------------------------------ sampling and decoding


def test_sample_indices_hand_computed():
    # 16 frames at 4 fps = 4 s; 2 fps -> 8 frames, every 2nd
    assert sample_indices(16, 4.0, 2.0, 32) == [0, 2, 4, 6, 8, 10, 12, 14]
    # max_frames 5 -> floored to 4 (a multiple of the temporal patch): 0, 4, 8, 12
    assert sample_indices(16, 4.0, 2.0, 5) == [0, 4, 8, 12]
    # 3 frames at 1 fps, asked 0.1 fps: at least 2 frames, floor(k * 3 / 2)
    assert sample_indices(3, 1.0, 0.1, 32) == [0, 1]
    # 10 frames at 10 fps, 30 fps asked: no more than there are (10)
    assert sample_indices(10, 10.0, 30.0, 32) == list(range(10))


def test_video_file_decoded_with_its_rate_and_frames(tmp_path):
    write_video(tmp_path / "clip.avi", ramp(16), fps=4.0)
    video = decode_video({"video": "clip.avi", "fps": 2.0, "max_frames": 32}, "videos[0]", tmp_path, 1.0, 8)
    assert video.frames.shape == (8, 56, 56, 3) and video.frames.dtype == np.uint8
    assert video.fps == pytest.approx(2.0)  # 8 frames over 16 / 4 = 4 s
    assert video.frame_times == pytest.approx([0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    # MJPEG is lossy: each sampled frame is close to the frame it came from (0, 2, 4, ... -> brightness 0, 20, 40, ...)
    means = video.frames[:, 20:, :, 1].mean(axis=(1, 2))
    np.testing.assert_allclose(means, [20 * j for j in range(8)], atol=3)
    # the data's defaults apply to a bare path; an item's max_frames overrides them
    assert len(decode_video(str(tmp_path / "clip.avi"), "v", None, 1.0, 32).frames) == 4
    assert len(decode_video({"video": "clip.avi", "max_frames": 2}, "v", tmp_path, 4.0, 32).frames) == 2


def test_video_patches_match_the_image_processor(vlm_dir, tokenizer):
    """A video of two equal frames is exactly an image to the vision tower: Qwen2-VL's image processor
    repeats an image over the temporal patch. Our numpy video patches must give the same tensor."""
    from PIL import Image

    from rlframe.data.multimodal import VisionProcessor

    processor = VisionProcessor(str(vlm_dir), tokenizer, 28 * 28, 224 * 224)
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    video = processor.video_inputs([Video(np.stack([frame, frame]), fps=2.0)])
    image = processor.pixel_inputs([Image.fromarray(frame)])
    assert video["video_grid_thw"].tolist() == [[1, 4, 6]] and image["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(video["pixel_values_videos"], image["pixel_values"], rtol=0, atol=1e-6)
    assert video["second_per_grid_ts"].tolist() == [1.0]  # 2 frames per temporal patch at 2 fps
    # 5 frames: padded to 6 with the last; 3 temporal patches
    five = processor.video_inputs([Video(ramp(5), fps=4.0)])
    assert five["video_grid_thw"].tolist() == [[3, 4, 4]] and five["second_per_grid_ts"].tolist() == [0.5]


def test_verl_and_easyr1_layouts_read_unchanged(tmp_path, tokenizer):
    frames = ramp(8)
    write_video(tmp_path / "clip.avi", frames, fps=4.0)
    from PIL import Image

    for k in range(4):
        Image.fromarray(frames[k]).save(tmp_path / f"f{k}.png")
    rows = [
        video_row("<video>Which way?", [{"video": "clip.avi", "fps": 4.0, "max_frames": 8}]),  # verl, a file
        video_row("<video>Which way?", [{"video": [f"f{k}.png" for k in range(4)], "fps": 2.0}]),  # verl, frames
        video_row("<video>Which way?", ["clip.avi"]),  # EasyR1: a list of paths (data.video_fps applies)
        video_row("Look: <image> then <video>", None) | {"images": [{"path": "f0.png"}],
                                                         "videos": [[f"f{k}.png" for k in range(2)]]},
    ]
    ds = RLDataset([write_rows(tmp_path / "v.parquet", rows)], tokenizer, max_prompt_length=512, video_fps=2.0)
    grids = [ds[i]["multi_modal_inputs"]["video_grid_thw"].tolist() for i in range(4)]
    seconds = [ds[i]["multi_modal_inputs"]["second_per_grid_ts"].tolist() for i in range(4)]
    assert grids == [[[4, 4, 4]], [[2, 4, 4]], [[2, 4, 4]], [[1, 4, 4]]]
    assert seconds == [[0.5], [1.0], [1.0], [1.0]]
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [ds[i]["input_ids"].count(video_pad) for i in range(4)] == [16, 8, 8, 4]  # t * h * w / 4
    assert ds[3]["input_ids"].count(image_pad) == 4 and "image_grid_thw" in ds[3]["multi_modal_inputs"]
    text = ds[3]["raw_prompt"]
    assert text.index("<|image_pad|>") < text.index("<|video_pad|>")  # in the order of the placeholders
    assert set(ds[0]["multi_modal_data"]) == {"video"} and ds[0]["multi_modal_data"]["video"][0].shape == (8, 56, 56, 3)
    assert ds.num_videos == 4 and ds.video_decode_seconds > 0  # decoded once each, when read
    # a video key other than the default
    other = RLDataset([write_rows(tmp_path / "o.parquet", [video_row("<video>?", ["clip.avi"], key="clips")])],
                      tokenizer, max_prompt_length=512, video_key="clips")
    assert other[0]["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]


@pytest.mark.parametrize("video, match", [
    ("nothing.avi", r"v.(parquet|jsonl), row 1: field 'videos\[0\]': video file not found: .*nothing.avi"),
    ({"video": "bad.avi"}, r"v.(parquet|jsonl), row 1: field 'videos\[0\]': cannot decode the video \(.*bad.avi\)"),
    ({"path": "clip.avi"}, r"row 1: field 'videos\[0\]': a video dict needs a 'video' key"),
    ([{"path": "clip.avi"}], r"row 1: field 'videos\[0\]\[0\]': cannot decode the image"),
])
def test_bad_videos_named_by_file_row_and_field(tmp_path, tokenizer, video, match):
    write_video(tmp_path / "clip.avi", ramp(4), fps=4.0)
    (tmp_path / "bad.avi").write_bytes(b"RIFF....AVI " + b"\0" * 200)
    rows = [video_row("<video>?", ["clip.avi"]), video_row("<video>?", [video])]
    with pytest.raises(DatasetError, match=match):
        RLDataset([write_rows(tmp_path / "v.parquet", rows)], tokenizer, max_prompt_length=512)


def test_video_placeholders_must_match(tmp_path, tokenizer):
    write_video(tmp_path / "clip.avi", ramp(4), fps=4.0)
    rows = [video_row("<video><video>?", ["clip.avi"])]
    with pytest.raises(DatasetError, match=r"row 0: field 'prompt': 2 <video> placeholder\(s\) in the prompt but 1 video"):
        RLDataset([write_rows(tmp_path / "v.parquet", rows)], tokenizer, max_prompt_length=512)


def test_video_prompt_too_long_is_filtered_not_cut(tmp_path, tokenizer):
    write_video(tmp_path / "clip.avi", ramp(16), fps=4.0)
    rows = [video_row("<video>?", ["clip.avi"]), video_row("<video>?", [{"video": "clip.avi", "max_frames": 2}])]
    ds = RLDataset([write_rows(tmp_path / "v.parquet", rows)], tokenizer, max_prompt_length=24,
                   overlong="truncate_left", video_fps=4.0)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds.num_truncated == 0


def test_video_shapes_data_deterministic_and_moving(tmp_path, clips):
    from rlframe.data.video_shapes import DIRECTIONS, generate_video_shapes_dataset

    again = generate_video_shapes_dataset(tmp_path, n_train=6, n_val=2)
    a, b = pq.read_table(clips[0]).to_pylist(), pq.read_table(again[0]).to_pylist()
    assert [r["reward_model"] for r in a] == [r["reward_model"] for r in b]
    for row in a:
        video = decode_video(row["videos"][0], "v", clips[0].parent, 2.0, 32)
        ink = (video.frames.astype(int).sum(-1) < 600)  # the shape's pixels, per frame
        ys, xs = [], []
        for mask in ink:
            y, x = np.nonzero(mask)
            ys.append(y.mean()), xs.append(x.mean())
        dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
        seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
        assert DIRECTIONS[int(row["reward_model"]["ground_truth"]) - 1] == seen == row["extra_info"]["direction"]


# ------------------------------------------------------------------ model: positions, log-probs


def test_video_positions_follow_seconds(vlm_dir, tokenizer):
    """Qwen2.5-VL: temporal patch k of a video sits at time start + k * tokens_per_second * second_per_grid_ts."""
    from transformers import AutoModelForImageTextToText

    from rlframe.workers.engine.hf_model import mrope_positions

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    tps = model.config.vision_config.tokens_per_second
    video_pad = model.config.video_token_id
    ids = torch.tensor([100, video_pad, video_pad, video_pad, video_pad, 101])  # grid 2 x 2 x 4: 2 tokens per patch
    for seconds in (0.5, 1.0):
        pos = mrope_positions(model, ids, None, torch.tensor([[2, 2, 4]]), torch.tensor([seconds]))
        step = tps * seconds
        assert pos[0].tolist() == [0, 1, 1, 1 + step, 1 + step, 3]  # time: temporal patch 1 is `step` later
        assert pos[1].tolist() == [0, 1, 1, 1, 1, 3]  # height: one merged row
        assert pos[2].tolist() == [0, 1, 2, 1, 2, 3]  # width: two merged columns; text goes on at 1 + 2


def rollout_like_batch(ds, tokenizer, rows, response_lengths, width=8):
    from rlframe.protocol import build_rollout_batch

    prompts = collate_prompts([ds[i] for i in rows], tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(20, 300, (n,), generator=g).tolist() for n in response_lengths]
    batch = build_rollout_batch(prompts, responses, [[0.0] * n for n in response_lengths], width, tokenizer.pad_token_id)
    batch.non_tensor_batch["multi_modal_inputs"] = prompts.non_tensor_batch["multi_modal_inputs"]
    return prompts, batch


def test_packed_video_log_probs_equal_unpacked_alone_and_the_models_own(vlm_dir, tokenizer, clips, tmp_path):
    from transformers import AutoModelForImageTextToText

    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs

    ds = RLDataset([str(clips[0])], tokenizer, max_prompt_length=256)
    _, batch = rollout_like_batch(ds, tokenizer, [0, 1, 2], [5, 8, 3])
    mm = batch.non_tensor_batch["multi_modal_inputs"]
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    mask = batch.batch["response_mask"]
    results = {}
    for packed in (False, True):
        model = build_causal_lm(str(vlm_dir), CPU, packed=packed).eval()
        with torch.no_grad():
            together = forward_response_log_probs(model, **inputs, response_width=8, packed=packed,
                                                  multi_modal_inputs=mm)[0] * mask
            alone = torch.cat([forward_response_log_probs(model, **{k: v[b:b + 1] for k, v in inputs.items()},
                                                          response_width=8, packed=packed,
                                                          multi_modal_inputs=mm[b:b + 1])[0]
                               for b in range(len(batch))]) * mask
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
        results[packed] = together
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-5)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    real = batch.batch["attention_mask"][1].bool()
    ids = batch.batch["input_ids"][1][real].unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=2 * (ids == model.config.video_token_id).int(), **mm[1]).logits
        # the video matters: other frames (reversed in time) change the log-probs
        flipped = dict(mm[1])
        grid_t, grid_hw = int(mm[1]["video_grid_thw"][0, 0]), int(mm[1]["video_grid_thw"][0, 1:].prod())
        flipped["pixel_values_videos"] = mm[1]["pixel_values_videos"].view(grid_t, grid_hw, -1).flip(0).reshape(
            grid_t * grid_hw, -1)
        other = model(input_ids=ids, mm_token_type_ids=2 * (ids == model.config.video_token_id).int(), **flipped).logits
    n = int(mask[1].sum())
    own = torch.log_softmax(logits[0, -n - 1:-1], -1).gather(-1, ids[0, -n:, None])[:, 0]
    torch.testing.assert_close(results[True][1, :n], own, rtol=0, atol=1e-5)
    assert float((logits - other).abs().max()) > 1e-4


def test_hf_rollout_log_probs_match_trainer_on_video_prompts(vlm_dir, tokenizer, clips):
    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import SamplingSettings

    ds = RLDataset([str(clips[0])], tokenizer, max_prompt_length=256)
    prompts = collate_prompts([ds[i] for i in range(4)], tokenizer.pad_token_id)
    rollout = HFRollout(str(vlm_dir), CPU, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = rollout.generate(prompts, SamplingSettings(max_new_tokens=12, temperature=1.0))
    mask = out.batch["response_mask"]
    assert mask.sum() >= 12
    config = rollout.model.config
    vision_ids = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    assert not (set(out.batch["responses"][mask.bool()].tolist()) & vision_ids)  # never sampled
    model = build_causal_lm(str(vlm_dir), CPU, packed=True).eval()
    with torch.no_grad():
        trainer = forward_response_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"],
                                             out.batch["position_ids"], 12, packed=True,
                                             multi_modal_inputs=prompts.non_tensor_batch["multi_modal_inputs"])[0]
    diff = ((trainer - out.batch["rollout_log_probs"]) * mask).abs()
    assert float(diff.max()) < 1e-4, json.dumps(diff.tolist())
