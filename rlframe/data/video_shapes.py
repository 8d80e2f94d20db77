"""A generated video dataset: short clips of one coloured shape moving in a straight line, and the question
which way it moves.

Each clip is ``frames`` frames (``size`` x ``size`` px, white background, ``fps`` frames per second) of a
circle, square or triangle in red, green or blue moving left, right, up or down across the frame,
written as an MJPEG ``.avi`` file (OpenCV) next to the parquet files. The question asks for the
direction as a number, so that the ordinary math reward scores it::

    <video>Which way does the red circle move? Answer 1 for left, 2 for right, 3 for up, 4 for down.  -> 2

in verl's multimodal layout (one ``<video>`` placeholder per video; the video a path relative to the
data file, with its sampling rate)::

    data_source   "video_shapes"
    prompt        [{"role": "user", "content": "<video>" + question + " " + INSTRUCTION}]
    videos        [{"video": "videos/train_00000.avi", "fps": 4.0, "max_frames": 8}]
    ability       "vision"
    reward_model  {"style": "rule", "ground_truth": "2"}
    extra_info    {"split": "train", "index": 0, "shape": "circle", "colour": "red", "direction": "right"}

Seeded and deterministic; the validation split uses a different seed stream.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from rlframe.data.parquet_rows import write_rows
from rlframe.data.shapes import COLOURS, INSTRUCTION, SHAPES, draw_shape
from rlframe.data.video import write_video

DATA_SOURCE = "video_shapes"
DIRECTIONS = ("left", "right", "up", "down")  # answer 1..4
_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def draw_clip(shape: str, colour: str, direction: str, size: int, frames: int, offset: float) -> np.ndarray:
    """[frames, size, size, 3] uint8: the shape moving from one side to the other (offset: its lane, 0..1)."""
    from PIL import Image, ImageDraw

    r = size * 0.14
    dx, dy = _STEP[direction]
    lane = r + offset * (size - 2 * r)
    out = []
    for k in range(frames):
        t = r + (size - 2 * r) * k / max(1, frames - 1)  # from one edge to the other
        if dx:
            cx, cy = (t if dx > 0 else size - t), lane
        else:
            cx, cy = lane, (t if dy > 0 else size - t)
        image = Image.new("RGB", (size, size), "white")
        draw_shape(ImageDraw.Draw(image), shape, colour, cx, cy, r)
        out.append(np.asarray(image))
    return np.stack(out)


def video_shapes_rows(out_dir: Path, n: int, seed: int, split: str, size: int, frames: int, fps: float) -> list[dict]:
    rng = random.Random(f"video-shapes-{split}-{seed}")
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n):
        shape, colour, direction = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(DIRECTIONS)
        clip = draw_clip(shape, colour, direction, size, frames, rng.random())
        name = f"videos/{split}_{index:05d}.avi"
        write_video(out_dir / name, clip, fps)
        question = (f"Which way does the {colour} {shape} move? Answer 1 for left, 2 for right, 3 for up, "
                    "4 for down.")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"<video>{question} {INSTRUCTION}"}],
            "videos": [{"video": name, "fps": float(fps), "max_frames": int(frames)}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(DIRECTIONS.index(direction) + 1)},
            "extra_info": {"split": split, "index": index, "shape": shape, "colour": colour, "direction": direction},
        })
    return rows


def generate_video_shapes_dataset(out_dir: str | Path, n_train: int = 64, n_val: int = 16, seed: int = 0,
                                  size: int = 56, frames: int = 8, fps: float = 4.0) -> tuple[Path, Path]:
    """Write train.parquet, val.parquet and their clips (videos/*.avi) into `out_dir`; returns the parquet paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rows = video_shapes_rows(out_dir, n, s, name, size, frames, fps)
        paths.append(write_rows(rows, out_dir / f"{name}.parquet"))
    return paths[0], paths[1]
