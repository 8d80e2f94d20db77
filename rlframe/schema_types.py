"""The declared type of a configuration key, and that type in words for an error message.

    field_type("actor.optim.lr")              -> float
    field_type("reward.functions[0].weight")  -> float   (a list index: the list's item type)
    type_in_words(Optional[float])            -> "a number (or null)"

Beside rlframe/bounds.py (a field's bound): both read the typed schema, for the messages that name a key and
what it takes (rlframe/main.py's compose errors, the board's help on a key).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def field_type(key: str, root: Any = None) -> Any:
    """The schema's declared type of a dotted key (`actor.optim.lr` -> float); None when it is not a field.
    `root`: the dataclass the key starts from (default: RLConfig, the whole configuration)."""
    if root is None:
        from rlframe.config import RLConfig

        root = RLConfig
    cls: Any = root
    hint: Any = None
    for part in key.replace("[", ".[").split("."):
        if not part:
            continue
        if part.isdigit() or part.startswith("["):  # a list index: the list's item type
            args = typing.get_args(hint)
            hint = args[0] if args else None
            cls = hint
            continue
        if not dataclasses.is_dataclass(cls):
            return None
        hint = typing.get_type_hints(cls).get(part)
        cls = hint
    return hint


def type_in_words(hint: Any) -> str:
    """int -> "a whole number", Optional[float] -> "a number (or null)", list[float] -> "a list of numbers"."""
    words = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return type_in_words(args[0]) + " (or null)"
    if typing.get_origin(hint) is list:
        return "a list" + (f" of {type_in_words(args[0]).split(' ', 1)[-1]}s" if args and args[0] in words else "")
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return words.get(hint, "another type")
