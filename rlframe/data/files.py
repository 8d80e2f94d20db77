"""Where the data comes from: `data.train_files` / `val_files` as users write them.

A value may be one string or a list; each item may start with `~`, hold a glob (`data/*.parquet`,
sorted matches), or name a hub dataset as `name@split` (EasyR1's form, e.g. `openai/gsm8k@test`;
`name:config@split` picks a config). Files are read by `rlframe.data.dataset.read_rows`; the less
common formats (csv, arrow, JSON arrays) and hub ids go through the `datasets` library.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

class DatasetError(ValueError):
    """A data file or row is unusable; the message names the file, row and field."""


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?@[\w.\[\]:%-]+$")


def is_hub_id(item: str) -> bool:
    """`owner/name@split` (or `name@split`, `owner/name:config@split`) that is not a path on disk."""
    return bool(_HUB_ID.match(item)) and not Path(item).expanduser().exists()


def resolve_data_files(value: Any) -> list[str]:
    """A string or a list of strings -> a list of files: `~` expanded, globs matched (sorted).

    A pattern that matches nothing is kept as it is, so validation names it as missing.
    """
    if value is None:
        return []
    items = [value] if isinstance(value, (str, Path)) else list(value)
    files: list[str] = []
    for item in items:
        item = str(item)
        if is_hub_id(item):
            files.append(item)
            continue
        expanded = str(Path(item).expanduser())
        if any(ch in expanded for ch in "*?["):
            matches = sorted(glob.glob(expanded))
            files.extend(matches if matches else [expanded])
        else:
            files.append(expanded)
    return files


def read_with_datasets(path: Path) -> list[dict]:
    """csv / arrow / a JSON array through `datasets` (the layout verl and EasyR1 users already have)."""
    import datasets

    builder = {".csv": "csv", ".arrow": "arrow", ".json": "json"}[path.suffix.lower()]
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:
        raise DatasetError(f"{path}: the datasets library cannot read it as {builder} ({type(exc).__name__}: {exc})") from exc
    return ds.to_list()


def read_hub_rows(item: str) -> list[dict]:
    """`name[:config]@split` from the Hugging Face hub (or its local cache)."""
    import datasets

    name, split = item.rsplit("@", 1)
    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise DatasetError(
            f"data file '{item}' is neither a file here nor a dataset the hub gave ({type(exc).__name__}: "
            f"{str(exc)[:300]}). Fix: check the name and split (name@split), or without network access download "
            "it once elsewhere and point data.train_files at the saved file or folder "
            "(e.g. python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k)") from exc
    return ds.to_list()
