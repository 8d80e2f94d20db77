"""Each config key's help text, read from its declaration in rlframe/config/ (the comments beside the field).

    key_help("actor.optim.lr")   # "actor.optim.lr (float, default 1e-06): <the comment lines of that field>"

The schema documents its fields with comments above a field and after it on the same line; this reads them
from the dataclass's source, so the board's help is the schema's own text and cannot drift from it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Any


def field_owner(key: str) -> tuple[Any, str] | None:
    """The dataclass that declares the last part of a dotted key, and that part; None when it is not a field."""
    from rlframe.config import RLConfig

    cls: Any = RLConfig
    parts = key.split(".")
    for part in parts[:-1]:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        cls = hints.get(part)
        if cls is None or not dataclasses.is_dataclass(cls):
            return None
    if not dataclasses.is_dataclass(cls) or parts[-1] not in {f.name for f in dataclasses.fields(cls)}:
        return None
    return cls, parts[-1]


@functools.cache
def comments_of(cls: type) -> dict[str, str]:
    """{field name: its comment text} from the class body's source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^\s+([A-Za-z_][A-Za-z0-9_]*)\s*:", line)
        if match and not stripped.startswith(("def ", "@")):
            inline = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            out[match.group(1)] = " ".join(above + ([inline] if inline else [])).strip()
        above = []
    return out


def key_help(key: str) -> str:
    """`key (type, default X): the schema's comment`, or just the key when it has none."""
    from rlframe.schema_types import field_type, type_in_words

    owner = field_owner(key)
    if owner is None:
        return key
    cls, name = owner
    default: Any = "-"
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
    text = comments_of(cls).get(name, "")
    head = f"{key} ({type_in_words(field_type(key))}, default {default})"
    return f"{head}: {text}" if text else head
