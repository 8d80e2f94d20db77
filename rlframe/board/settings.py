"""Saved settings: the train form as JSON files in <workspace>/settings/ (save, list, load by name)."""

from __future__ import annotations

import json
from pathlib import Path

from rlframe.board.forms import TrainForm
from rlframe.board.security import BoardError, clean_name


def settings_dir(workspace: Path) -> Path:
    return Path(workspace) / "settings"


def save_settings(workspace: Path, name: str, form: TrainForm) -> Path:
    if not name.strip():
        raise BoardError("give the settings a name to save them under")
    folder = settings_dir(workspace)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{clean_name(name.strip()).removesuffix('.json')}.json"
    path.write_text(json.dumps(form.to_dict(), indent=1, ensure_ascii=False))
    return path


def list_settings(workspace: Path) -> list[str]:
    return sorted(p.stem for p in settings_dir(workspace).glob("*.json"))


def load_settings(workspace: Path, name: str) -> TrainForm:
    path = settings_dir(workspace) / f"{clean_name(name)}.json"
    try:
        return TrainForm.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise BoardError(f"settings '{name}' cannot be read ({err}). Fix: save them again") from None
