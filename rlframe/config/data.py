"""The `data:` section (where the prompts come from, their lengths, the batch) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class ArithmeticDataConfig:
    n_train: int = 2000
    n_val: int = 64
    seed: int = 0
    max_operand: int = 20


@dataclass
class ShapesDataConfig:
    """data.source=shapes: generated pictures of coloured shapes + counting questions (rlframe/data/shapes.py)."""
    n_train: int = 256
    n_val: int = 32
    seed: int = 0
    size: int = 112  # image side in pixels (112 px = 8 x 8 patches of 14 px = 16 image tokens on Qwen2.5-VL)


@dataclass
class DataConfig:
    source: str = "arithmetic"  # arithmetic (generated) | shapes (generated, with images) | files
    # A file, a list of files, `~` and globs (parquet, jsonl, json, csv, arrow, datasets folders, hub
    # ids name@split); giving train_files implies source=files (rlframe/data/files.py).
    train_files: Any = field(default_factory=list)
    val_files: Any = field(default_factory=list)
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)
    shapes: ShapesDataConfig = field(default_factory=ShapesDataConfig)
    prompt_key: str = "prompt"
    # Images (verl/EasyR1 layout, rlframe/data/multimodal.py): the column holding each row's list of
    # images, one <image> placeholder per image in the prompt. An image outside [min_pixels,
    # max_pixels] (width x height) is scaled into the range (aspect kept) when resize_images, else
    # one above max_pixels is an error naming file, row and field.
    image_key: str = "images"
    min_pixels: int = 3136  # 56 x 56 (Qwen2-VL's processor default)
    max_pixels: int = 1003520  # 1280 x 28 x 28 (Qwen2-VL's processor default)
    resize_images: bool = True
    answer_key: Optional[str] = None
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 8  # prompts per step
    val_max_samples: Optional[int] = None  # null: the whole validation set; N: its first N rows
    # A Jinja template for the user message (EasyR1's format_prompt): `{{ content }}` (also
    # `{{ prompt }}`, `{{ question }}`) is the prompt text; a file path or the template text itself.
    prompt_template: Optional[str] = None
    overlong: str = "filter"  # filter | error | truncate_left
    bad_rows: str = "error"  # error | skip
    shuffle: bool = True
    seed: int = 0


SOURCES = ("arithmetic", "shapes", "files")


# ------------------------------------------------------------------------------------ checks
def train_batch_positive(cfg, need) -> None:
    need(cfg.data.train_batch_size >= 1, "data.train_batch_size", "must be >= 1")


def lengths_positive(cfg, need) -> None:
    need(cfg.data.max_prompt_length > 0 and cfg.data.max_response_length > 0, "data.max_response_length",
         "prompt and response lengths must be positive")


def source_known(cfg, need) -> None:
    need(cfg.data.source in SOURCES, "data.source", f"'{cfg.data.source}' is not arithmetic, shapes or files")


def pixel_range_ordered(cfg, need) -> None:
    data = cfg.data
    need(0 < data.min_pixels <= data.max_pixels, "data.min_pixels/max_pixels",
         f"need 0 < min_pixels <= max_pixels, got {data.min_pixels} and {data.max_pixels}. "
         "Fix: e.g. data.min_pixels=3136 data.max_pixels=1003520")


def shapes_fill_a_batch(cfg, need) -> None:
    data = cfg.data
    if data.source != "shapes":
        return
    need(data.shapes.n_train >= data.train_batch_size and data.shapes.size >= 28, "data.shapes",
         f"n_train={data.shapes.n_train} must fill one batch of data.train_batch_size={data.train_batch_size} "
         f"and size={data.shapes.size} must be >= 28 px")


def data_files_exist(cfg, need) -> None:
    """data.source=files: at least one train file; every train and validation file on disk (or a hub id)."""
    data = cfg.data
    if data.source != "files":
        return
    need(bool(data.train_files), "data.train_files", "data.source=files needs at least one train file")
    from rlframe.data.files import is_hub_id, resolve_data_files

    for f in resolve_data_files(data.train_files) + resolve_data_files(data.val_files):
        need(Path(f).exists() or is_hub_id(f), "data.train_files/val_files",
             f"'{f}' does not exist. Fix: create it (e.g. python examples/data_preprocess/gsm8k.py "
             "--local_dir ~/data/gsm8k) or point the key at your file")


def val_max_samples_positive(cfg, need) -> None:
    need(cfg.data.val_max_samples is None or cfg.data.val_max_samples >= 1, "data.val_max_samples",
         "must be >= 1, or null for the whole validation set")


CHECKS = (train_batch_positive, lengths_positive, source_known, pixel_range_ordered, shapes_fill_a_batch,
          data_files_exist, val_max_samples_positive)
