"""The training engines by name (`actor.strategy`): where each one's class, config section and checks live.

    ENGINES["megatron"].engine        # "module:Class", imported only when an engine is built
    ENGINES["megatron"].settings      # MegatronSettings: the config's `megatron:` section, given to the engine as is

To add an engine: a package `workers/engine/<name>/` with its engine class (a `base.TrainingEngine`)
and, if it has knobs of its own, a `settings.py` holding one settings dataclass and its `CHECKS`; one
line below; the section in `rlframe/config/__init__.py` (`<name>: <Name>Settings`); a docs page. Importing this
module is cheap (no torch, no engine package's heavy dependency), so the config can read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlframe.workers.engine.deepspeed import settings as deepspeed
from rlframe.workers.engine.megatron import settings as megatron

Check = Callable[[Any, Callable[[bool, str, str], None]], None]  # rule(cfg, need): need(ok, key, message)


@dataclass(frozen=True)
class EngineEntry:
    engine: str  # "module:Class" of the engine
    settings: type | None = None  # its config section, named as the engine (cfg.<name>); None: no section
    checks: tuple[Check, ...] = ()  # rule(cfg, need), run by validate_config whatever the strategy
    model_checks: tuple[Callable, ...] = ()  # rule(cfg, need, hf_config), run when chosen and the model is on disk
    lora: bool = False  # implements LoRA adapters (workers/engine/lora.py)
    sharded_checkpoints: bool = False  # writes trainer.checkpoint_format=sharded


ENGINES: dict[str, EngineEntry] = {
    "fsdp": EngineEntry("rlframe.workers.engine.fsdp.engine:FSDPEngine", lora=True, sharded_checkpoints=True),
    "deepspeed": EngineEntry("rlframe.workers.engine.deepspeed.engine:DeepSpeedEngine", deepspeed.DeepSpeedSettings,
                             deepspeed.CHECKS),
    "megatron": EngineEntry("rlframe.workers.engine.megatron.engine:MegatronEngine", megatron.MegatronSettings,
                            megatron.CHECKS, megatron.MODEL_CHECKS),
}


def engine_class(strategy: str) -> type:
    """The engine class of `strategy` (imports its package's heavy dependencies)."""
    module, _, cls = ENGINES[strategy].engine.partition(":")
    return getattr(importlib.import_module(module), cls)


def engine_section(cfg, strategy: str):
    """The run config's section of `strategy` (cfg.deepspeed, cfg.megatron), or None for an engine without one."""
    return getattr(cfg, strategy) if ENGINES[strategy].settings is not None else None


def check_engines(cfg, need, model_dir: str | None = None) -> None:
    """Every engine's checks, then the chosen engine's model checks against `model_dir` (a local model
    folder with a config.json; None: not on this machine yet)."""
    for entry in ENGINES.values():
        for check in entry.checks:
            check(cfg, need)
    check_engine_model(cfg, need, model_dir)


def check_engine_model(cfg, need, model_dir: str | None) -> None:
    """The chosen engine's model checks against the HF config in `model_dir` (skipped when None)."""
    entry = ENGINES.get(cfg.actor.strategy)
    if entry is None or not entry.model_checks or model_dir is None:
        return
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    for check in entry.model_checks:
        check(cfg, need, model)
