"""Videos in prompts: reading them from a row (verl's and EasyR1's layouts), sampling frames, frame times.

The row layouts read unchanged::

    verl     videos  [{"video": "clip.avi", "fps": 2.0, "max_frames": 32}]      <video> in the prompt
             videos  [{"video": ["f0.png", "f1.png", ...]}]                      (a list of frame images)
    EasyR1   videos  ["clip.avi"]  or  [["f0.png", "f1.png", ...]]             <video> in the prompt

A video is a file path (relative paths are taken from the data file's folder; anything OpenCV's
FFmpeg/MJPEG readers decode: .avi, .mp4, .mkv, ...) or a list of frame images (each anything
``decode_image`` takes: bytes, {"bytes", "path"}, a path, a PIL image). Per item ``fps`` (frames
sampled per second) and ``max_frames`` override ``data.video_fps`` / ``data.video_max_frames``.

Frame sampling (Qwen2-VL's video processor, ``sample_frames``): a file of ``total`` frames at
``native_fps`` lasts ``total / native_fps`` s; ``n = clamp(total / native_fps * fps, 2, min(max_frames,
total))`` floored to a multiple of the temporal patch (2), and the frames ``floor(k * total / n)``,
k = 0..n-1, are kept. A list of frames is taken as already sampled at ``fps``, cut to ``max_frames``
(an odd count is padded by the processor, which repeats the last frame). The sampled rate
``n / duration`` gives Qwen2.5-VL's ``second_per_grid_ts = temporal_patch_size / sampled_fps``: the
seconds one temporal patch spans, which the model's 3-D rotary positions scale time by.

A video is decoded ONCE, when the data set is read (before Ray starts): a file that cannot be
decoded is an error naming the file, the row and the column (``VideoProblem`` -> RLDataset adds
the file and row); the sampled frames (uint8, size-fitted) are kept with the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlframe.data.multimodal import ImageProblem, decode_image

VIDEO_PLACEHOLDER = "<video>"
VIDEO_SUFFIXES = (".avi", ".mp4", ".mkv", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".gif")


class VideoProblem(ImageProblem):
    """A row's video field is unusable; `field` names it (e.g. ``videos[0]``)."""


@dataclass
class Video:
    """A decoded video: its sampled frames ([n, H, W, 3] uint8) and their sampling rate (frames per second)."""

    frames: np.ndarray
    fps: float

    @property
    def frame_times(self) -> list[float]:
        """Seconds from the first sampled frame of each sampled frame."""
        return [k / self.fps for k in range(len(self.frames))]


def video_list(row: dict, video_key: str) -> list:
    """The row's videos as a list ([] when the column is absent or null)."""
    value = row.get(video_key)
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, Path, dict)):
        return [value]  # one video given bare
    return list(value)


def sample_indices(total: int, native_fps: float, fps: float, max_frames: int, temporal_patch: int = 2) -> list[int]:
    """The frames kept of a `total`-frame file at `native_fps` (module docstring; Qwen2-VL's rule)."""
    top = max(temporal_patch, math.floor(min(max_frames, total) / temporal_patch) * temporal_patch)
    wanted = total / native_fps * fps
    n = min(max(wanted, temporal_patch), top)
    n = max(temporal_patch, math.floor(n / temporal_patch) * temporal_patch)
    n = min(n, total)
    return [int(k * total / n) for k in range(n)]


def _read_file(path: Path, field: str, fps: float, max_frames: int) -> Video:
    import cv2

    if not path.is_file():
        raise VideoProblem(field, f"video file not found: {path}")
    capture = cv2.VideoCapture(str(path))
    try:
        frames = []
        while capture.isOpened():
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(frame)
        native_fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
    finally:
        capture.release()
    if not frames:
        raise VideoProblem(field, f"cannot decode the video ({path}): no frame could be read (not a video file, "
                                  "or a codec OpenCV's reader lacks). Fix: re-encode it (e.g. ffmpeg -i IN -c:v "
                                  "mjpeg OUT.avi), or store the video as a list of frame images")
    if not native_fps or not math.isfinite(native_fps) or native_fps <= 0:
        native_fps = fps  # no rate in the container: take the frames as sampled at fps
    keep = sample_indices(len(frames), native_fps, fps, max_frames)
    sampled_fps = len(keep) / (len(frames) / native_fps)
    rgb = np.stack([cv2.cvtColor(frames[k], cv2.COLOR_BGR2RGB) for k in keep])
    return Video(rgb, sampled_fps)


def decode_video(value: Any, field: str, base_dir: str | Path | None, fps: float, max_frames: int) -> Video:
    """A row's video (any form of the module docstring) -> its sampled frames and their rate."""
    if isinstance(value, dict):
        if "video" not in value:
            raise VideoProblem(field, f"a video dict needs a 'video' key (verl's layout: {{'video': path, 'fps': 2, "
                                      f"'max_frames': 32}}), got keys {sorted(value)}")
        fps = float(value.get("fps") or fps)
        max_frames = int(value.get("max_frames") or max_frames)
        value = value["video"]
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.tolist()
    if fps <= 0 or max_frames < 1:
        raise VideoProblem(field, f"fps={fps} and max_frames={max_frames} must be positive")
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return _read_file(path, field, fps, max_frames)
    if isinstance(value, (list, tuple)):
        if not value:
            raise VideoProblem(field, "an empty list of frames")
        frames = []
        for k, frame in enumerate(value[:max_frames]):
            try:
                frames.append(np.asarray(decode_image(frame, f"{field}[{k}]", base_dir)))
            except ImageProblem as exc:
                raise VideoProblem(exc.field, exc.problem) from None
        if len({f.shape for f in frames}) != 1:
            raise VideoProblem(field, f"the frames differ in size ({sorted({f.shape[:2] for f in frames})}). Fix: "
                                      "frames of one video must have one size")
        return Video(np.stack(frames), fps)
    raise VideoProblem(field, f"expected a video file path, a list of frame images or a {{'video': ...}} dict, "
                              f"got {type(value).__name__}")


def fit_frames(video: Video, field: str, min_pixels: int, max_pixels: int, resize: bool) -> Video:
    """Scale the frames (aspect kept) into [min_pixels, max_pixels] as ``fit_pixels`` does for images."""
    from PIL import Image

    from rlframe.data.multimodal import fit_pixels

    first = Image.fromarray(video.frames[0])
    fitted = fit_pixels(first, field, min_pixels, max_pixels, resize)
    if fitted.size == first.size:
        return video
    frames = np.stack([np.asarray(Image.fromarray(f).resize(fitted.size, resample=3)) for f in video.frames])
    return Video(frames, video.fps)


def write_video(path: str | Path, frames: np.ndarray, fps: float) -> Path:
    """Write RGB uint8 frames [n, H, W, 3] as an MJPEG .avi (what OpenCV writes without extra codecs)."""
    import cv2

    path = Path(path)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), float(fps), (width, height))
    if not writer.isOpened():
        raise OSError(f"OpenCV cannot write {path}")
    try:
        for frame in frames:
            writer.write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    return path
