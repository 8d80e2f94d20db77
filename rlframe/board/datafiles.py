"""A data file's first rows and the columns the loader can map to prompt / answer / images.

    info = inspect_data(path)    # DataInfo(columns, rows (the first ones, as text), prompt, answer, images)

Rows are read by the loader itself (rlframe/data/dataset.py `read_rows`: parquet, jsonl, json, csv, arrow,
datasets folders). A prompt column holds text or a chat list ([{role, content}, ...]); the answer is a
plain column or the verl layout's `reward_model.ground_truth` (data.answer_key); images a list column
(data.image_key). A file in which no column holds text cannot be a prompt set: that is the error here,
before any preview or launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlframe.board.security import BoardError

PROMPT_NAMES = ("prompt", "question", "problem", "instruction", "input", "query", "messages")
ANSWER_NAMES = ("reward_model.ground_truth", "answer", "ground_truth", "solution", "label", "target")
IMAGE_NAMES = ("images", "image")
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
    answers = [c for c in columns if c not in prompt_columns or c in ANSWER_NAMES]
    frame = pd.DataFrame([{c: shown(value_at(r, c)) for c in columns} for r in head], columns=columns)
    return DataInfo(path=str(path), num_rows=len(rows), columns=columns, rows=frame, prompt_columns=prompt_columns,
                    prompt=first_match(PROMPT_NAMES, prompt_columns),
                    answer=first_match(ANSWER_NAMES, [c for c in answers if c in ANSWER_NAMES] or answers),
                    images=next((n for n in IMAGE_NAMES if n in columns), ""))
