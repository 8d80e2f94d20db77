"""The DeepSpeed ZeRO engine (`actor.strategy=deepspeed`): `settings.py` (the `deepspeed:` section and its
checks; cheap to import), `engine.py` (DeepSpeedEngine), `ops.py` (DeepSpeed's compiled C++ ops).

The names of the former single module `rlframe.workers.engine.deepspeed` still resolve here, imported
on first use, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib

_MODULES = ("settings", "ops", "engine")


def __getattr__(name: str):
    if name not in _MODULES and not name.startswith("__"):
        for module in _MODULES:
            found = importlib.import_module(f"{__name__}.{module}")
            if hasattr(found, name):
                return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
