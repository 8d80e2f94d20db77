"""The stage a recipe selects (`stage:`) -> its driver; `rlframe.main` calls `make_trainer`."""

from __future__ import annotations

from pathlib import Path

from rlframe.config import RLConfig


def make_trainer(cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
    """RLTrainer for stage=rl; SFTTrainer / DPOTrainer / RewardModelTrainer for the others."""
    if cfg.stage == "sft":
        from rlframe.stages.sft import SFTTrainer, write_arithmetic_sft_data

        if cfg.data.source == "arithmetic":  # the project writes the worked solutions of its problems
            train_files, val_files = write_arithmetic_sft_data(train_files[0], val_files[0], run_dir / "data")
        return SFTTrainer(cfg, model_path, tokenizer, train_files, val_files, run_dir)
    if cfg.stage == "dpo":
        from rlframe.stages.dpo import DPOTrainer

        return DPOTrainer(cfg, model_path, tokenizer, train_files, val_files, run_dir)
    if cfg.stage == "rm":
        from rlframe.stages.reward_model import RewardModelTrainer

        return RewardModelTrainer(cfg, model_path, tokenizer, train_files, val_files, run_dir)
    from rlframe.trainer.rl_trainer import RLTrainer

    return RLTrainer(cfg, model_path, tokenizer, train_files, val_files, run_dir)
