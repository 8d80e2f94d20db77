"""Where metrics go: the console (progress with ETA), `<run_dir>/metrics.jsonl`, wandb, tensorboard.

Console: one progress line per step -- step / total, a bar, the ETA from the mean step time so far,
the reward, the main metrics and the seconds of each phase. On a terminal it is drawn with `rich`
(colours, a bar); when stdout is not a terminal (a log file, CI) the same facts are plain text.

wandb: online when a key is known (`WANDB_API_KEY`, or the one `wandb login` stored in ~/.netrc),
offline otherwise; `WANDB_MODE` set by the user always wins. Validation samples are logged as a table.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

CONSOLE_KEYS = ("critic/score/mean", "val/reward_mean", "val/accuracy", "actor/pg_loss", "actor/kl_loss",
                "rollout/logprob_abs_diff", "response_length/mean", "perf/mfu")
REWARD_KEYS = ("critic/score/mean", "reward/score_mean")


def wandb_mode() -> str:
    """online | offline (see the module docstring)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    return "online" if wandb_login_exists() else "offline"


def wandb_login_exists() -> bool:
    """`wandb login` writes the key to the netrc file under the API host's name."""
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


class Tracker:
    def __init__(self, run_dir: Path, loggers: list[str], project: str, experiment: str, config: dict,
                 total_steps: int | None = None, first_step: int = 0):
        self.run_dir = run_dir
        self.loggers = set(loggers)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if "jsonl" in self.loggers else None
        self.progress = Progress(total_steps, first_step) if "console" in self.loggers else None
        self.wandb = None
        self.tensorboard = None
        if "wandb" in self.loggers:
            import wandb

            mode = wandb_mode()
            print(f"wandb: {mode}" + ("" if mode == "online" else
                                      " (no key: `wandb login` or WANDB_API_KEY to log online; "
                                      f"`wandb sync {run_dir / 'wandb'}` uploads later)"), flush=True)
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
        if self.progress is not None:
            self.progress.show(step, clean)

    def rewind(self, step: int) -> None:
        """Forget the jsonl lines of the steps after `step` (-1: all) before they are trained again (a restart
        after a worker died): metrics.jsonl is rewritten without them and this tracker appends to the new file."""
        from rlframe.trainer.checkpoint import trim_metrics_log

        if self.jsonl is not None:
            self.jsonl.close()
        trim_metrics_log(self.run_dir, step)
        if self.jsonl is not None:
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def log_samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """Sample rollouts ({response, ground_truth, score}) as a wandb table (the report reads the jsonl)."""
        if self.wandb is None or not rows:
            return
        import wandb

        columns = ["step", "response", "ground_truth", "score"]
        table = wandb.Table(columns=columns, data=[[step, r["response"], str(r["ground_truth"]), r["score"]]
                                                   for r in rows])
        self.wandb.log({f"{kind}/samples": table}, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class Progress:
    """Step / total, ETA, reward and phase times: rich on a terminal, plain lines otherwise."""

    def __init__(self, total_steps: int | None, first_step: int = 0, stream=None):
        self.total = total_steps
        self.first_step = first_step
        self.step_times: list[float] = []
        self.stream = stream if stream is not None else sys.stdout
        self.started = time.monotonic()
        self.console = None
        if getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.console import Console

                self.console = Console(file=self.stream, highlight=False)
            except ImportError:  # pragma: no cover - rich is a dependency
                self.console = None

    def eta_seconds(self, step: int) -> float | None:
        if not self.total or not self.step_times:
            return None
        return max(self.total - step, 0) * sum(self.step_times) / len(self.step_times)

    def show(self, step: int, metrics: dict[str, float]) -> None:
        if "timing/step" in metrics:
            self.step_times.append(metrics["timing/step"])
        eta = self.eta_seconds(step)
        if self.console is not None:
            self.console.print(format_rich_line(step, self.total, eta, metrics))
        else:
            print(format_step_line(step, metrics, self.total, eta), file=self.stream, flush=True)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _bar(step: int, total: int, width: int = 20) -> str:
    done = min(max(step / total, 0.0), 1.0) if total else 0.0
    filled = int(round(done * width))
    return "#" * filled + "." * (width - filled)


def format_step_line(step: int, metrics: dict[str, float], total: int | None = None, eta: float | None = None) -> str:
    """The plain progress line: `step 3/14 [####....] 21% ETA 12m30s reward=0.33 ... | rollout=48.8s ...`."""
    parts = [f"step {step:>4}" + (f"/{total}" if total else "")]
    if total:
        parts.append(f"[{_bar(step, total)}] {100 * step / total:3.0f}%")
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    reward = next((metrics[k] for k in REWARD_KEYS if k in metrics), None)
    if reward is not None:
        parts.append(f"reward={reward:.4g}")
    parts += [f"{key}={metrics[key]:.4g}" for key in CONSOLE_KEYS if key in metrics and key not in REWARD_KEYS]
    timings = [f"{k.removeprefix('timing/')}={v:.1f}s" for k, v in metrics.items()
               if k.startswith("timing/") and not k.startswith("timing/startup/")]  # (its own line: run_loop)
    if timings:
        parts.append("| " + " ".join(timings))
    return "  ".join(parts)


def format_rich_line(step: int, total: int | None, eta: float | None, metrics: dict[str, float]):
    """The same facts as format_step_line, as rich Text with a bar and colours (terminal only)."""
    from rich.text import Text

    text = Text()
    text.append(f"step {step}" + (f"/{total}" if total else ""), style="bold")
    if total:
        done = int(round(20 * min(step / total, 1.0)))
        text.append("  ")
        text.append("━" * done, style="green")
        text.append("━" * (20 - done), style="grey37")
        text.append(f" {100 * step / total:3.0f}%")
    if eta is not None:
        text.append(f"  ETA {format_duration(eta)}", style="cyan")
    reward = next((metrics[k] for k in REWARD_KEYS if k in metrics), None)
    if reward is not None:
        text.append(f"  reward {reward:.4g}", style="bold magenta")
    for key in CONSOLE_KEYS:
        if key in metrics and key not in REWARD_KEYS:
            text.append(f"  {key}={metrics[key]:.4g}", style="yellow" if key.startswith("val/") else "")
    timings = [f"{k.removeprefix('timing/')} {v:.1f}s" for k, v in metrics.items()
               if k.startswith("timing/") and not k.startswith("timing/startup/")]
    if timings:
        text.append("  | " + "  ".join(timings), style="dim")
    return text
