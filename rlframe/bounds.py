"""Bounds and choices declared beside a config field, and the one check that reads them all.

    lr: float = bounded(1e-6, "> 0")                              # a finite number in a range
    betas: list[float] = bounded([0.9, 0.999], "[0, 1)", length=2)  # each item, and the list's length
    val_every: int = bounded(0, ">= 0", "0: only before and after training")  # a note for the message
    overlong: str = one_of("filter", ("filter", "error", "truncate_left"))

A bound is `>= a`, `> a`, `<= a`, `< a`, an interval `[a, b]` / `(a, b)` / `[a, b)` / `(a, b]`, or
`finite` (any number but NaN and infinity); several joined by ` or ` (`== -1 or >= 1`). Every bounded
number must also be finite; None passes (an Optional field's "unset"). `bound_problems(cfg)` walks the
configuration's dataclasses (lists of them too: `reward.functions[0].weight`) and reports each value
outside its field's bound as "key: message", the message ending with the field's default as the fix.

No project imports: the stage sections (rlframe/stages/config.py) use it as well as rlframe/config/.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterator

_CMP = re.compile(r"^(>=|<=|==|>|<)\s*(-?[\d.e+-]+|inf)$")
_INTERVAL = re.compile(r"^([\[(])\s*(-?[\d.e+-]+|-inf)\s*,\s*(-?[\d.e+-]+|inf)\s*([\])])$")


def bounded(default: Any, bound: str, note: str = "", *, length: int | None = None):
    """A dataclass field whose value (each item, for a list) must satisfy `bound`; `length`: a list's length."""
    _parse(bound)  # a malformed bound fails at import, not at validation
    meta = {"bound": bound, "note": note, "length": length}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def one_of(default: Any, choices: tuple, note: str = ""):
    """A dataclass field whose value must be one of `choices` (None passes when the field is Optional)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices), "note": note})


def _parse(bound: str) -> list:
    """`bound` -> a list of alternatives, each a list of (operator, number) pairs that must all hold."""
    alternatives = []
    for part in bound.split(" or "):
        part = part.strip()
        if part == "finite":
            alternatives.append([])
        elif m := _CMP.match(part):
            alternatives.append([(m.group(1), float(m.group(2)))])
        elif m := _INTERVAL.match(part):
            low, high = float(m.group(2)), float(m.group(3))
            alternatives.append([(">=" if m.group(1) == "[" else ">", low), ("<=" if m.group(4) == "]" else "<", high)])
        else:
            raise ValueError(f"not a bound: {bound!r} (use >= a, > a, [a, b), ..., finite, joined by ' or ')")
    return alternatives


_OPS = {">=": lambda x, a: x >= a, ">": lambda x, a: x > a, "<=": lambda x, a: x <= a, "<": lambda x, a: x < a,
        "==": lambda x, a: x == a}


def within(value: Any, bound: str) -> bool:
    """A finite int or float (not a bool) satisfying `bound`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return any(all(_OPS[op](value, a) for op, a in alternative) for alternative in _parse(bound))


def _fix(key: str, default: Any, meta: dict) -> str:
    note = f" ({meta['note']})" if meta.get("note") else ""
    shown = "null" if default is None else default
    return f"{note}. Fix: {key}={shown} (the default)" if default is not dataclasses.MISSING else note


def _field_problem(key: str, value: Any, default: Any, meta: dict) -> str | None:
    if "choices" in meta:
        if value is None or value in meta["choices"]:
            return None
        choices = ", ".join(str(c) for c in meta["choices"])
        return f"{key}: {value!r} is not one of {choices}{_fix(key, default, meta)}"
    if "bound" not in meta or value is None:
        return None
    bound, length = meta["bound"], meta.get("length")
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if length is not None and (not isinstance(value, (list, tuple)) or len(items) != length):
        return f"{key}: {value!r}: must be a list of {length} numbers, each {describe(bound)}{_fix(key, default, meta)}"
    bad = [item for item in items if not within(item, bound)]
    if not bad:
        return None
    what = "each item must be" if isinstance(value, (list, tuple)) else "must be"
    return f"{key}: {value!r}: {what} {describe(bound, bad[0])}{_fix(key, default, meta)}"


def describe(bound: str, value: Any = None) -> str:
    """`bound` in words: "> 0", "in (0, 1]", "finite"; "a finite number > 0" when `value` is NaN or infinite."""
    phrase = " or ".join(f"in {part.strip()}" if part.strip()[:1] in "[(" else part.strip()
                         for part in bound.split(" or "))
    if isinstance(value, float) and not math.isfinite(value) and bound != "finite":
        return f"a finite number, {phrase}"
    return phrase


def walk_fields(obj: Any, prefix: str = "", defaults: Any = None) -> Iterator[tuple[str, Any, Any, dataclasses.Field]]:
    """(dotted key, value, default, field) of every field of a dataclass instance, nested ones and lists of them
    included; the default is the value in `defaults` (a default-built tree of the same shape)."""
    if defaults is None:
        try:
            defaults = type(obj)()
        except TypeError:
            defaults = None
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        default = getattr(defaults, f.name, dataclasses.MISSING) if defaults is not None else dataclasses.MISSING
        yield key, value, default, f
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            same_shape = dataclasses.is_dataclass(default) and type(default) is type(value)
            yield from walk_fields(value, key + ".", default if same_shape else None)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    yield from walk_fields(item, f"{key}[{i}].")


def bound_problems(cfg: Any) -> list[str]:
    """Every field of `cfg` (a dataclass tree) outside its declared bound or choices, as "key: message"."""
    problems = []
    for key, value, default, f in walk_fields(cfg):
        problem = _field_problem(key, value, default, dict(f.metadata))
        if problem:
            problems.append(problem)
    return problems


def declared(cls: type) -> dict[str, str]:
    """{field name: its bound or choices} of one dataclass (for docs and tests)."""
    out = {}
    for f in dataclasses.fields(cls):
        if "bound" in f.metadata:
            out[f.name] = f.metadata["bound"]
        elif "choices" in f.metadata:
            out[f.name] = "one of " + ", ".join(map(str, f.metadata["choices"]))
    return out
