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


def split_placeholders(messages: list[dict], num_images: int, prompt_field: str, image_key: str) -> list[dict]:
    """Turn each ``<image>`` of the message texts into a {"type": "image"} content entry.

    The placeholders (counted over all messages, in order) must match the images one to one.
    """
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if found != num_images:
        more = "more" if found > num_images else "fewer"
        raise ImageProblem(prompt_field if found > num_images else image_key,
                           f"{found} {IMAGE_PLACEHOLDER} placeholder(s) in the prompt but {num_images} image(s) in "
                           f"{image_key!r} ({more} placeholders than images). Fix: one {IMAGE_PLACEHOLDER} per image, "
                           "in order")
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(message)
            continue
        parts: list[dict] = []
        for k, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if piece:
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

    def __init__(self, model_path: str, tokenizer, min_pixels: int, max_pixels: int, trust_remote_code: bool = False):
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

    def pixel_inputs(self, images: list) -> dict:
        """{"pixel_values", "image_grid_thw"} (torch tensors) of a row's images."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def expand(self, raw_prompt: str, image_grid_thw) -> str:
        """One `<|image_pad|>` per image in `raw_prompt` -> as many as that image has merged patches."""
        counts = (image_grid_thw.prod(-1) // self.merge_size ** 2).tolist()
        pieces = raw_prompt.split(self.IMAGE_TOKEN)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the chat template rendered {len(pieces) - 1} {self.IMAGE_TOKEN} for {len(counts)} images")
        return pieces[0] + "".join(self.IMAGE_TOKEN * n + piece for n, piece in zip(counts, pieces[1:]))

    def encode(self, raw_prompt: str, images: list) -> tuple[list[int], dict]:
        inputs = self.pixel_inputs(images)
        text = self.expand(raw_prompt, inputs["image_grid_thw"])
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], inputs


def share_multi_modal_fields(prompts, batch) -> None:
    """Give the generation prompts (a DataProto popped from `batch`) the rows' images too: the rollout
    engine needs them, and `batch` keeps them for the trainer's log-prob and update passes."""
    for key in MULTI_MODAL_KEYS:
        if key in batch.non_tensor_batch:
            prompts.non_tensor_batch[key] = batch.non_tensor_batch[key]
