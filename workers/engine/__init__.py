"""Trainer engines: one interface (`base.TrainerEngine`), one implementation per backend.

    engine = build_engine(settings, profile, name="actor")

`settings.strategy` picks the implementation from `ENGINES`. To add a backend: implement
`TrainerEngine` (forward_micro, backward, clip_norm, iter_full_weights, save_state, load_state;
optionally offload/reload and sequence parallelism) in a module here, add it to `ENGINES`, and
allow its name in `rlframe/config.py`'s validation of `actor.strategy`.
"""

from __future__ import annotations

from rlframe.device import DeviceProfile
from rlframe.workers.engine.base import LossFn, LossOutput, MetricSums, TrainerEngine
from rlframe.workers.settings import EngineSettings

ENGINES = ("fsdp", "deepspeed", "megatron")


def build_engine(settings: EngineSettings, profile: DeviceProfile, name: str = "actor") -> TrainerEngine:
    if settings.strategy == "fsdp":
        from rlframe.workers.engine.fsdp import FSDPEngine

        return FSDPEngine(settings, profile, name=name)
    if settings.strategy == "deepspeed":
        from rlframe.workers.engine.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(settings, profile, name=name)
    if settings.strategy == "megatron":
        from rlframe.workers.engine.megatron import MegatronEngine

        return MegatronEngine(settings, profile, name=name)
    raise ValueError(f"{name}.strategy={settings.strategy!r} is not an engine ({', '.join(ENGINES)})")


__all__ = ["ENGINES", "LossFn", "LossOutput", "MetricSums", "TrainerEngine", "build_engine"]
