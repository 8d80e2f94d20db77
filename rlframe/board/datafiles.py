"""A data file's first rows and the columns the loader can map to prompt / answer / images / videos / audios.

    info = inspect_data(path)    # DataInfo(columns, rows (first ones, as text), prompt, answer, images, videos, audios)

Rows are read by the loader itself (rlframe/data/dataset.py `read_rows`: parquet, jsonl, json, csv, arrow,
datasets folders). A prompt column holds text or a chat list ([{role, content}, ...]); the answer is a
plain column or the verl layout's `reward_model.ground_truth` (data.answer_key); images, videos and audios
list columns (data.image_key, data.video_key, data.audio_key; docs/vision.md). Images are found by their name
(IMAGE_NAMES); videos and audios by theirs (VIDEO_NAMES, AUDIO_NAMES) or else by what the first rows hold
(`media_column`: lists of video file paths or verl's {"video": ...} items; of .wav paths, .wav bytes or
{"array", "sampling_rate"} items). A file in which no column holds text cannot be a prompt set: that is the
error here, before any preview or launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlframe.board.security import BoardError

PROMPT_NAMES = ("prompt", "question", "problem", "instruction", "input", "query", "messages")
ANSWER_NAMES = ("reward_model.ground_truth", "answer", "ground_truth", "solution", "label", "target")
IMAGE_NAMES = ("images", "image")
VIDEO_NAMES = ("videos", "video")  # data.video_key's default first
AUDIO_NAMES = ("audios", "audio")  # data.audio_key's default first
SHOWN_ROWS = 5


@dataclass
class DataInfo:
    path: str
    num_rows: int
    columns: list[str]
    rows: pd.DataFrame
    prompt_columns: list[str] = field(default_factory=list)
    prompt: str = ""
    answer: str = ""
    images: str = ""
    videos: str = ""
    audios: str = ""


def columns_of(row: dict, prefix: str = "") -> list[str]:
    """Top-level keys, and `a.b` for the keys of a mapping column (reward_model.ground_truth)."""
    out = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        out.append(name)
        if isinstance(value, dict) and not prefix:
            out += columns_of(value, prefix=f"{name}.")
    return out


def value_at(row: dict, dotted: str):
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def is_prompt(value) -> bool:
    """Text, or a chat list of {role, content} mappings (numpy arrays from parquet included)."""
    if isinstance(value, str):
        return bool(value.strip())
    if hasattr(value, "tolist"):
        value = value.tolist()
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def shown(value, width: int = 160) -> str:
    text = str(value.tolist() if hasattr(value, "tolist") else value)
    return text if len(text) <= width else text[: width - 3] + "..."


def first_match(names: tuple[str, ...], candidates: list[str]) -> str:
    return next((n for n in names if n in candidates), candidates[0] if candidates else "")


def is_video(item) -> bool:
    """One video of a row as rlframe/data/video.py reads it: a video file's path, or verl's {"video": ...}."""
    from rlframe.data.video import VIDEO_SUFFIXES

    if isinstance(item, dict):
        return "video" in item
    return isinstance(item, str) and item.lower().endswith(VIDEO_SUFFIXES)


def is_audio(item) -> bool:
    """One audio of a row as rlframe/data/audio.py reads it: a .wav path or bytes, {"array", "sampling_rate"} or
    {"bytes", "path"} (a datasets Audio in parquet)."""
    if isinstance(item, dict):  # ({"bytes", "path"} is a datasets Image too: its bytes or path must be a .wav)
        return {"array", "sampling_rate"} <= set(item) or is_audio(item.get("bytes")) or is_audio(item.get("path"))
    if isinstance(item, bytes):
        return item[:4] == b"RIFF"
    return isinstance(item, str) and item.lower().endswith(".wav")


def media_column(names: tuple[str, ...], looks_like, head: list[dict], candidates: list[str]) -> str:
    """The first of `names` among the columns; else the first column whose every non-empty value in the first rows
    is a non-empty list of items `looks_like` accepts; '' when none."""
    named = next((n for n in names if n in candidates), "")
    if named:
        return named
    for column in candidates:
        values = [value_at(r, column) for r in head]
        values = [v.tolist() if hasattr(v, "tolist") else v for v in values if v is not None]
        if values and all(isinstance(v, list) and v and all(looks_like(i) for i in v) for v in values):
            return column
    return ""


def inspect_data(path: str | Path) -> DataInfo:
    """Read the file with the loader; BoardError when it cannot be read or no column holds prompts."""
    from rlframe.data.dataset import read_rows
    from rlframe.data.files import DatasetError

    try:
        rows = read_rows(str(path))
    except (DatasetError, OSError, ValueError) as err:
        raise BoardError(f"{Path(path).name}: {err}") from None
    if not rows:
        raise BoardError(f"{Path(path).name} holds no rows. Fix: upload the file with your prompts")
    head = rows[:SHOWN_ROWS]
    columns = list(dict.fromkeys(c for row in head for c in columns_of(row)))
    prompt_columns = [c for c in columns if all(is_prompt(value_at(r, c)) for r in head)]
    if not prompt_columns:
        raise BoardError(f"{Path(path).name}: no column holds text prompts (columns: {', '.join(columns) or 'none'}). "
                         "A prompt column holds text or a chat list [{role, content}, ...]. "
                         "Fix: add such a column (e.g. 'prompt'), or upload the prepared file "
                         "(examples/data_preprocess/ writes the common layout)")
    others = [c for c in columns if c not in prompt_columns]
    images = next((n for n in IMAGE_NAMES if n in columns), "")
    videos = media_column(VIDEO_NAMES, is_video, head, [c for c in others if c != images])
    audios = media_column(AUDIO_NAMES, is_audio, head, [c for c in others if c not in (images, videos)])
    media = {images, videos, audios} - {""}
    answers = [c for c in columns if (c not in prompt_columns and c not in media) or c in ANSWER_NAMES]
    frame = pd.DataFrame([{c: shown(value_at(r, c)) for c in columns} for r in head], columns=columns)
    return DataInfo(path=str(path), num_rows=len(rows), columns=columns, rows=frame, prompt_columns=prompt_columns,
                    prompt=first_match(PROMPT_NAMES, prompt_columns),
                    answer=first_match(ANSWER_NAMES, [c for c in answers if c in ANSWER_NAMES] or answers),
                    images=images, videos=videos, audios=audios)
