"""The stage a recipe selects (`stage:`) -> its driver; `rlframe.main` calls `make_trainer`.

Adding a stage: its driver (a `RunLoop` subclass) in a module here, one line in DRIVERS, its config section
(rlframe/stages/config.py, with its name in STAGES) and checks (rlframe/config/stages.py), and a recipe.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from rlframe.config import RLConfig

DRIVERS = {  # stage -> "module:Class", imported only when chosen
    "rl": "rlframe.trainer.rl_trainer:RLTrainer",
    "pt": "rlframe.stages.pt:PretrainTrainer",
    "sft": "rlframe.stages.sft:SFTTrainer",
    "dpo": "rlframe.stages.dpo:DPOTrainer",
    "rm": "rlframe.stages.reward_model:RewardModelTrainer",
    "rft": "rlframe.stages.rft:RFTTrainer",
}


def make_trainer(cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path, datasets: dict | None = None):
    """The driver of cfg.stage, built on the run's data files; `datasets`: those the pre-Ray checks built from
    them (rlframe/preflight.py: stage rl and rft), which the driver takes instead of building them again."""
    module, name = DRIVERS[cfg.stage].split(":")
    driver = getattr(importlib.import_module(module), name)
    if datasets:
        return driver(cfg, model_path, tokenizer, train_files, val_files, run_dir, datasets=datasets)
    return driver(cfg, model_path, tokenizer, train_files, val_files, run_dir)
