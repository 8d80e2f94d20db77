"""Images in prompts: reading them from a row, fitting their size, and building a VLM's pixel inputs.

The row layout is verl's and EasyR1's: an ``images`` column (``data.image_key``) holding a list of
images, and ``<image>`` placeholders in the prompt text, one per image, in order::

    prompt   [{"role": "user", "content": "<image>How many red circles are there?"}]
    images   [{"bytes": b"\\x89PNG...", "path": None}]

An image may be raw bytes, a ``{"bytes": ..., "path": ...}`` dict (how parquet and ``datasets``
store an Image feature), a file path (relative paths are taken from the data file's folder) or a
PIL image. Each placeholder becomes a ``{"type": "image"}`` entry of the message's content list, so
the model's chat template renders its own vision tokens (Qwen2-VL: ``<|vision_start|><|image_pad|>
<|vision_end|>``); ``VisionProcessor`` then expands each ``<|image_pad|>`` to one token per merged
patch (``image_grid_thw.prod() // merge_size**2``), which is what the model's forward scatters the
vision tower's output into.

Size limits: an image with more than ``max_pixels`` pixels (width x height) is scaled down, one with
fewer than ``min_pixels`` scaled up, keeping its aspect ratio (``resize_images=true``, the default);
with ``resize_images=false`` an image above ``max_pixels`` is an error naming the file, row and field.
Every problem is raised as ``ImageProblem(field, problem)``; RLDataset adds the file and row.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
_PLACEHOLDERS = re.compile("(<image>|<video>|<audio>)")
MULTI_MODAL_KEYS = ("multi_modal_data", "multi_modal_inputs")  # the per-row non-tensor fields of a batch


class ImageProblem(ValueError):
    """A row's image field is unusable; `field` names it (e.g. ``images[1]``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r}: {problem}")
        self.field, self.problem = field, problem


def decode_image(value: Any, field: str, base_dir: str | Path | None = None):
    """bytes / {"bytes", "path"} / a path / a PIL image -> an RGB PIL image (fully decoded)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
            value = data if data else path
            if value is None:
                raise ImageProblem(field, "an image dict with neither 'bytes' nor 'path'")
        if isinstance(value, (bytes, bytearray, memoryview)):
            source, what = io.BytesIO(bytes(value)), f"{len(value)} bytes"
        elif isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise ImageProblem(field, f"image file not found: {path}")
            source, what = path, str(path)
        else:
            raise ImageProblem(field, f"expected image bytes, a {{'bytes', 'path'}} dict, a file path or a PIL image, "
                                      f"got {type(value).__name__}")
        try:
            image = Image.open(source)
            image.load()
        except UnidentifiedImageError:
            raise ImageProblem(field, f"cannot decode the image ({what}): not an image format PIL reads (PNG, JPEG, "
                                      "WebP, ...). Fix: store the encoded image file's bytes, or its path") from None
        except (OSError, ValueError) as exc:
            raise ImageProblem(field, f"cannot decode the image ({what}): {_without_reprs(exc)}") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def _without_reprs(exc: Exception) -> str:
    """The error's text without object reprs such as <_io.BytesIO object at 0x7f...>."""
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the image", str(exc)) or type(exc).__name__


def fit_pixels(image, field: str, min_pixels: int, max_pixels: int, resize: bool):
    """Scale `image` (aspect ratio kept) so that min_pixels <= width * height <= max_pixels.

    scale = sqrt(max_pixels / (w h)) when too large, sqrt(min_pixels / (w h)) when too small; the new
    sides are floor(w * scale), floor(h * scale) (at least 1). With `resize` false an image above
    max_pixels raises instead (a small one is left to the model's processor, which pads it up).
    """
    width, height = image.size
    pixels = width * height
    if pixels > max_pixels:
        if not resize:
            raise ImageProblem(field, f"the image is {width}x{height} = {pixels} pixels, more than "
                                      f"data.max_pixels={max_pixels}, and data.resize_images=false. Fix: "
                                      "data.resize_images=true (scale it down), or raise data.max_pixels")
        scale = math.sqrt(max_pixels / pixels)
    elif pixels < min_pixels and resize:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return image
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return image.resize(size, resample=3)  # bicubic


def image_list(row: dict, image_key: str) -> list:
    """The row's images as a list ([] when the column is absent or null)."""
    value = row.get(image_key)
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]  # one image given bare


def split_placeholders(messages: list[dict], num_images: int, prompt_field: str, image_key: str,
                       num_videos: int = 0, video_key: str = "videos", num_audios: int = 0,
                       audio_key: str = "audios") -> list[dict]:
    """Turn each ``<image>`` (``<video>``, ``<audio>``) of the message texts into a {"type": "image"}
    ({"type": "video"}, {"type": "audio"}) content entry.

    The placeholders of each kind (counted over all messages, in order) must match the row's images
    (videos, audios) one to one.
    """
    texts = [m["content"] for m in messages if isinstance(m["content"], str)]
    for placeholder, count, key, what in ((IMAGE_PLACEHOLDER, num_images, image_key, "image"),
                                          (VIDEO_PLACEHOLDER, num_videos, video_key, "video"),
                                          (AUDIO_PLACEHOLDER, num_audios, audio_key, "audio")):
        found = sum(text.count(placeholder) for text in texts)
        if found != count:
            more = "more" if found > count else "fewer"
            raise ImageProblem(prompt_field if found > count else key,
                               f"{found} {placeholder} placeholder(s) in the prompt but {count} {what}(s) in "
                               f"{key!r} ({more} placeholders than {what}s). Fix: one {placeholder} per {what}, "
                               "in order")
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or not _PLACEHOLDERS.search(content):
            out.append(message)
            continue
        parts: list[dict] = []
        for piece in _PLACEHOLDERS.split(content):
            if piece == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
            elif piece == VIDEO_PLACEHOLDER:
                parts.append({"type": "video"})
            elif piece == AUDIO_PLACEHOLDER:
                parts.append({"type": "audio"})
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": message["role"], "content": parts})
    return out


class VisionProcessor:
    """A VLM's image processor + its tokenizer: prompt text and images -> token ids and pixel inputs.

    Built from the model folder (`preprocessor_config.json`, through AutoImageProcessor, the PIL
    backend when torchvision is absent). Qwen2-VL family: `pixel_values` [patches, C*T*P*P] and
    `image_grid_thw` [images, 3]; image i takes image_grid_thw[i].prod() // merge_size**2 tokens.
    """

    IMAGE_TOKEN = "<|image_pad|>"
    VIDEO_TOKEN = "<|video_pad|>"

    def __init__(self, model_path: str, tokenizer, min_pixels: int, max_pixels: int, trust_remote_code: bool = False,
                 video_min_pixels: int | None = None, video_max_pixels: int | None = None):
        from transformers import AutoImageProcessor

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                model_path, min_pixels=min_pixels, max_pixels=max_pixels, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the data has images but model.path={model_path} has no image processor "
                             f"(preprocessor_config.json): {str(exc)[:200]}. Fix: a vision-language model "
                             "(e.g. Qwen/Qwen2.5-VL-3B-Instruct, or tiny-qwen2.5-vl for a smoke run)") from None
        self.tokenizer = tokenizer
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        if self.IMAGE_TOKEN not in tokenizer.get_vocab():
            raise ValueError(f"the tokenizer of {model_path} has no {self.IMAGE_TOKEN} token: rlframe's image "
                             "prompts support the Qwen2-VL / Qwen2.5-VL family")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.IMAGE_TOKEN)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.VIDEO_TOKEN)
        self.video_min_pixels = video_min_pixels or min_pixels
        self.video_max_pixels = video_max_pixels or max_pixels

    def pixel_inputs(self, images: list) -> dict:
        """{"pixel_values", "image_grid_thw"} (torch tensors) of a row's images."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def video_inputs(self, videos: list) -> dict:
        """{"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} (torch tensors) of a row's videos
        (``rlframe.data.video.Video``: sampled uint8 frames and their rate).

        Qwen2-VL's video processor, in numpy (transformers' needs torchvision): each frame resized to the
        video's ``smart_resize`` size (sides multiples of patch x merge), scaled to [0, 1], normalised
        with the image mean/std; the frames padded to a multiple of temporal_patch_size by repeating the
        last; patches [t * h * w, C * T * P * P] in the merge order the vision tower expects.
        ``second_per_grid_ts = temporal_patch_size / fps``: seconds per temporal patch.
        """
        import torch
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        p, m, t = int(ip.patch_size), self.merge_size, int(ip.temporal_patch_size)
        mean = np.asarray(ip.image_mean, dtype=np.float32).reshape(1, 3, 1, 1)
        std = np.asarray(ip.image_std, dtype=np.float32).reshape(1, 3, 1, 1)
        patches, grids, seconds = [], [], []
        for video in videos:
            frames = np.asarray(video.frames)
            height, width = frames.shape[1:3]
            h, w = smart_resize(height, width, factor=p * m, min_pixels=self.video_min_pixels,
                                max_pixels=self.video_max_pixels)
            if (h, w) != (height, width):
                frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=3)) for f in frames])
            x = (frames.astype(np.float32).transpose(0, 3, 1, 2) / 255.0 - mean) / std  # [n, C, h, w]
            if pad := -len(x) % t:
                x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
            gt, gh, gw = len(x) // t, h // p, w // p
            x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(x.reshape(gt * gh * gw, 3 * t * p * p))
            grids.append([gt, gh, gw])
            seconds.append(t / float(video.fps))
        return {"pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long),
                "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}

    def expand(self, raw_prompt: str, image_grid_thw=None, video_grid_thw=None) -> str:
        """Each `<|image_pad|>` (`<|video_pad|>`) of `raw_prompt` -> as many as that image (video) has
        merged patches (``grid_thw.prod() // merge_size**2``)."""
        counts = {}
        for token, grids in ((self.IMAGE_TOKEN, image_grid_thw), (self.VIDEO_TOKEN, video_grid_thw)):
            counts[token] = iter([] if grids is None else (grids.prod(-1) // self.merge_size ** 2).tolist())
            found, given = raw_prompt.count(token), 0 if grids is None else len(grids)
            if found != given:
                raise ValueError(f"the chat template rendered {found} {token} for {given} "
                                 f"{'images' if token == self.IMAGE_TOKEN else 'videos'}")
        pieces = re.split(f"({re.escape(self.IMAGE_TOKEN)}|{re.escape(self.VIDEO_TOKEN)})", raw_prompt)
        return "".join(piece * next(counts[piece]) if piece in counts else piece for piece in pieces)

    def inputs(self, images: list, videos: list | None = None) -> dict:
        """The forward's pixel inputs of a row's images and videos (the keys of each present kind)."""
        out = self.pixel_inputs(images) if images else {}
        if videos:
            out.update(self.video_inputs(videos))
        return out

    def encode(self, raw_prompt: str, images: list, videos: list | None = None) -> tuple[list[int], dict]:
        inputs = self.inputs(images, videos)
        text = self.expand(raw_prompt, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], inputs


def share_multi_modal_fields(prompts, batch) -> None:
    """Give the generation prompts (a DataProto popped from `batch`) the rows' images too: the rollout
    engine needs them, and `batch` keeps them for the trainer's log-prob and update passes."""
    for key in MULTI_MODAL_KEYS:
        if key in batch.non_tensor_batch:
            prompts.non_tensor_batch[key] = batch.non_tensor_batch[key]
