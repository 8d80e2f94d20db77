"""Training engines: one interface (`base.TrainingEngine`), one package per backend (`fsdp/`, `deepspeed/`,
`megatron/`; LoRA adapters are `lora.py`, applied by the fsdp engine).

    engine = build_engine(settings, profile, name="actor")

`settings.strategy` names the engine in `registry.ENGINES`; adding one is described there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlframe.workers.engine.registry import ENGINES, engine_class

if TYPE_CHECKING:
    from rlframe.device import DeviceProfile
    from rlframe.workers.engine.base import TrainingEngine
    from rlframe.workers.settings import EngineSettings


def build_engine(settings: EngineSettings, profile: DeviceProfile, name: str = "actor") -> TrainingEngine:
    if settings.strategy not in ENGINES:
        raise ValueError(f"{name}.strategy={settings.strategy!r} is not an engine ({', '.join(ENGINES)})")
    return engine_class(settings.strategy)(settings, profile, name=name)


__all__ = ["ENGINES", "build_engine"]
