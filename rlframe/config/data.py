"""The `data:` section (where the prompts come from, their lengths, the batch) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlframe.bounds import bounded, one_of

OVERLONG = ("filter", "error", "truncate_left")  # (rlframe/data/dataset.py OVERLONG_POLICIES)
BAD_ROWS = ("error", "skip")


@dataclass
class ArithmeticDataConfig:
    n_train: int = bounded(2000, ">= 1")  # generated training problems (data.source=arithmetic)
    n_val: int = bounded(64, ">= 1")  # generated validation problems (none also in the training split)
    seed: int = bounded(0, ">= 0")  # the generator's seed: the same seed, the same problems
    max_operand: int = bounded(20, ">= 1")  # operands are drawn from 0..max_operand (the difficulty)


@dataclass
class ShapesDataConfig:
    """data.source=shapes: generated pictures of coloured shapes + counting questions (rlframe/data/shapes.py)."""
    n_train: int = bounded(256, ">= 1")  # generated training pictures
    n_val: int = bounded(32, ">= 1")  # generated validation pictures
    seed: int = bounded(0, ">= 0")  # the generator's seed
    size: int = bounded(112, ">= 28")  # image side in pixels (112 px = 8 x 8 patches of 14 px = 16 image tokens on Qwen2.5-VL)
    # images: pictures of shapes + counting questions | video: clips of one moving shape + "which way does it
    # move" (rlframe/data/video_shapes.py; frames x size^2 / (2 x 28^2) video tokens)
    kind: str = one_of("images", ("images", "video"))
    frames: int = bounded(8, ">= 2")  # kind=video: frames per clip
    fps: float = bounded(4.0, "> 0")  # kind=video: the clips' frame rate (frames per second)


@dataclass
class TonesDataConfig:
    """data.source=tones: generated sine-tone clips + "how many beeps" / "which is higher" (rlframe/data/audio_tones.py)."""
    n_train: int = bounded(64, ">= 1")  # generated training clips
    n_val: int = bounded(16, ">= 1")  # generated validation clips
    seed: int = bounded(0, ">= 0")  # the generator's seed
    rate: int = bounded(8000, ">= 2000")  # the .wav files' sampling rate in Hz (the reader resamples to the model's)
    beep_seconds: float = bounded(0.15, "> 0")  # one beep's length in seconds
    gap_seconds: float = bounded(0.1, "> 0")  # the silence between beeps (and before and after) in seconds


@dataclass
class DataConfig:
    # arithmetic (generated) | shapes (generated, with images or videos) | tones (generated, with audio) | files
    source: str = "arithmetic"
    # A file, a list of files, `~` and globs (parquet, jsonl, json, csv, arrow, datasets folders, hub
    # ids name@split); giving train_files implies source=files (rlframe/data/files.py).
    train_files: Any = field(default_factory=list)
    # validation files, as train_files ([]: no validation set; the generated sources make their own)
    val_files: Any = field(default_factory=list)
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)
    shapes: ShapesDataConfig = field(default_factory=ShapesDataConfig)
    tones: TonesDataConfig = field(default_factory=TonesDataConfig)
    prompt_key: str = "prompt"  # the prompt column: a chat list of messages or a plain string
    # Images (verl/EasyR1 layout, rlframe/data/multimodal.py): the column holding each row's list of
    # images, one <image> placeholder per image in the prompt. An image outside [min_pixels,
    # max_pixels] (width x height) is scaled into the range (aspect kept) when resize_images, else
    # one above max_pixels is an error naming file, row and field.
    image_key: str = "images"
    min_pixels: int = bounded(3136, ">= 1")  # 56 x 56 (Qwen2-VL's processor default)
    max_pixels: int = bounded(1003520, ">= 1")  # 1280 x 28 x 28 (Qwen2-VL's processor default)
    # scale an out-of-range image into [min_pixels, max_pixels] (false: one above max_pixels is an error)
    resize_images: bool = True
    # Videos (verl layout [{"video": path, "fps", "max_frames"}], EasyR1's [path]; a path or a list of frame
    # images; one <video> placeholder per video; rlframe/data/video.py): the column of each row's videos.
    # Each is decoded once when the data is read (before Ray starts); a bad file is named by file, row, column.
    video_key: str = "videos"
    video_fps: float = bounded(2.0, "> 0")  # frames sampled per second of video (a row item's fps overrides it)
    video_max_frames: int = bounded(32, ">= 2")  # at most this many frames per video (an item's max_frames overrides it)
    video_min_pixels: Optional[int] = bounded(None, ">= 1")  # one frame's pixel floor (null: data.min_pixels)
    video_max_pixels: Optional[int] = bounded(None, ">= 1")  # one frame's pixel cap (null: data.max_pixels)
    # Audios (verl layout [path] or [{"array": [...], "sampling_rate": N}], LLaMA-Factory's [path]; .wav files;
    # one <audio> placeholder per audio; rlframe/data/audio.py): the column of each row's audios. Each is decoded
    # and resampled to the model's feature rate (16000 Hz) once, before Ray starts; a bad file is named by file, row, column.
    audio_key: str = "audios"
    # a plain ground-truth column (e.g. answer); null: the verl layout's reward_model.ground_truth
    answer_key: Optional[str] = None
    max_prompt_length: int = bounded(128, ">= 1")  # tokens, after the chat template
    max_response_length: int = bounded(64, ">= 1")  # tokens a response may generate (multi-turn: model + tool tokens)
    train_batch_size: int = bounded(8, ">= 1")  # prompts per step
    val_max_samples: Optional[int] = bounded(None, ">= 1")  # null: the whole validation set; N: its first N rows
    # A Jinja template for the user message (EasyR1's format_prompt): `{{ content }}` (also
    # `{{ prompt }}`, `{{ question }}`) is the prompt text; a file path or the template text itself.
    prompt_template: Optional[str] = None
    # A prompt longer than max_prompt_length: dropped (filter) | an error naming file and row | its first tokens cut
    overlong: str = one_of("filter", OVERLONG)
    bad_rows: str = one_of("error", BAD_ROWS)  # a malformed row: an error naming file, row and field | dropped, counted
    shuffle: bool = True  # shuffle the training prompts each epoch (seeded by data.seed; resumable)
    seed: int = bounded(0, ">= 0")  # seed of the training order (shuffle) and of the stages' prompt orders


SOURCES = ("arithmetic", "shapes", "tones", "files")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow")  # (rlframe/data/dataset.py read_rows)


# ------------------------------------------------------------------------------------ checks


def source_known(cfg, need) -> None:
    need(cfg.data.source in SOURCES, "data.source", f"'{cfg.data.source}' is not arithmetic, shapes, tones or files")


def pixel_range_ordered(cfg, need) -> None:
    data = cfg.data
    need(data.min_pixels <= data.max_pixels, "data.min_pixels/max_pixels",
         f"need min_pixels <= max_pixels, got {data.min_pixels} and {data.max_pixels}. "
         "Fix: e.g. data.min_pixels=3136 data.max_pixels=1003520")


def shapes_fill_a_batch(cfg, need) -> None:
    data = cfg.data
    if data.source != "shapes":
        return
    need(data.shapes.n_train >= data.train_batch_size, "data.shapes.n_train",
         f"{data.shapes.n_train} pictures cannot fill one batch of data.train_batch_size={data.train_batch_size}. "
         "Fix: raise data.shapes.n_train or lower data.train_batch_size")


def tones_fill_a_batch(cfg, need) -> None:
    data = cfg.data
    if data.source != "tones":
        return
    need(data.tones.n_train >= data.train_batch_size, "data.tones.n_train",
         f"{data.tones.n_train} clips cannot fill one batch of data.train_batch_size={data.train_batch_size}. "
         "Fix: raise data.tones.n_train or lower data.train_batch_size")


def data_files_exist(cfg, need) -> None:
    """data.source=files: at least one train file; every train and validation file on disk (or a hub id)."""
    data = cfg.data
    if data.source != "files":
        return
    need(bool(data.train_files), "data.train_files", "data.source=files needs at least one train file")
    from rlframe.data.files import is_hub_id, resolve_data_files

    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for f in resolve_data_files(files):
            need(Path(f).exists() or is_hub_id(f), key,
                 f"'{f}' does not exist. Fix: create it (e.g. python examples/data_preprocess/gsm8k.py "
                 "--local_dir ~/data/gsm8k) or point the key at your file")
            need(not Path(f).is_file() or Path(f).suffix.lower() in DATA_SUFFIXES, key,
                 f"'{f}': unsupported data file type {Path(f).suffix!r}. Fix: one of {', '.join(DATA_SUFFIXES)}, "
                 "a datasets save_to_disk folder or a hub id name@split")


CHECKS = (source_known, pixel_range_ordered, shapes_fill_a_batch, tones_fill_a_batch, data_files_exist)
