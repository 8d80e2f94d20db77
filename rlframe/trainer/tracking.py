"""Where metrics go: the console, `<run_dir>/metrics.jsonl`, wandb (offline without a key), tensorboard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

CONSOLE_KEYS = ("critic/score/mean", "val/reward_mean", "val/accuracy", "actor/pg_loss", "actor/kl_loss",
                "rollout/logprob_abs_diff", "response_length/mean")


class Tracker:
    def __init__(self, run_dir: Path, loggers: list[str], project: str, experiment: str, config: dict):
        self.run_dir = run_dir
        self.loggers = set(loggers)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if "jsonl" in self.loggers else None
        self.wandb = None
        self.tensorboard = None
        if "wandb" in self.loggers:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir), mode=mode)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.tensorboard is not None:
            for key, value in clean.items():
                self.tensorboard.add_scalar(key, value, step)
        if "console" in self.loggers:
            print(format_step_line(step, clean), flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def format_step_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step:>4}"]
    parts += [f"{key}={metrics[key]:.4g}" for key in CONSOLE_KEYS if key in metrics]
    timings = [f"{k.removeprefix('timing/')}={v:.1f}s" for k, v in metrics.items() if k.startswith("timing/")]
    if timings:
        parts.append("| " + " ".join(timings))
    return "  ".join(parts)
