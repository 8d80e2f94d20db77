"""The reward's "try it": the dataset's own answers and corrupted ones scored, so a broken reward shows now.

    result = try_reward(args, scratch)    # TryResult(table, verdict, error)

It is the doctor's check (rlframe/doctor/reward_checks.py): the first rows of the training data as the run
reads them, each row's ground truth written as an answer in the usual formats and a corrupted one
(`corrupt`: a number + 7, other text reversed), scored by the configured reward functions in their process
pool (`best_scores`: a row's best format). A reward that raises is counted and its first traceback shown, with
the user's own frames only (`own_frames`: rlframe's reward worker and loader frames left out).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

TRY_ROWS = 8
FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in ')


@dataclass
class TryResult:
    table: pd.DataFrame
    verdict: str
    error: str = ""


def reward_rows(cfg, scratch) -> list[dict]:
    """The first TRY_ROWS training rows, read and templated as the run (and the doctor) reads them."""
    from transformers import AutoTokenizer

    from rlframe.doctor.data_checks import read_unlimited
    from rlframe.main import prepare_data
    from rlframe.models.provision import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path),
                                              trust_remote_code=cfg.model.trust_remote_code)
    scratch.mkdir(parents=True, exist_ok=True)
    train_files, _ = prepare_data(cfg, scratch)
    dataset = read_unlimited(train_files, tokenizer, cfg, bad_rows="skip")
    return [dataset[i] for i in range(min(TRY_ROWS, len(dataset)))]


def first_failure(manager, rows: list[dict]) -> str:
    """The reward's own error on the first row (the process pool keeps each failure's message)."""
    from rlframe.doctor.reward_checks import ANSWER_FORMATS

    r = rows[0]
    result = manager.score([ANSWER_FORMATS[0].format(r["ground_truth"])], [r["ground_truth"]], [r["data_source"]],
                           [r["extra_info"]])
    return result.failures[0] if result.failures else ""


def internal_dirs() -> tuple[str, ...]:
    """The folders of rlframe's own code (the package and its workers), each ending in a separator."""
    import rlframe
    import rlframe.workers

    return tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (rlframe, rlframe.workers))


def own_frames(text: str) -> str:
    """A failure's text with the traceback frames of rlframe's own files (the reward worker calling the function)
    left out: what remains is the message, the user's frames and the exception."""
    internal, out, skipping, hidden = internal_dirs(), [], False, 0
    for line in text.splitlines():
        frame = FRAME.match(line)
        if frame:
            skipping = str(Path(frame.group(1)).resolve()).startswith(internal)
            hidden += skipping
            if not skipping:
                out.append(line)
            continue
        if skipping and line.startswith("    "):  # the frame's source line and its ^^^ marks
            continue
        skipping = False
        out.append(line.replace("Traceback (most recent call last):",
                                "Traceback (most recent call last; rlframe's own frames left out):"))
    return "\n".join(out) if hidden else text


def empty_table() -> pd.DataFrame:
    """The scores table with no row (what the page shows beside an error)."""
    return pd.DataFrame(columns=["ground truth", "own answer score", "corrupted answer", "its score"])


def try_reward(args: list[str], scratch) -> TryResult:
    """Score own vs corrupted answers with the reward of `args` (the train form's overrides)."""
    from rlframe.board.preview import PREVIEW_LOCK, compose, usage_text
    from rlframe.doctor.reward_checks import best_scores, corrupt
    from rlframe.main import usage_errors
    from rlframe.trainer.scorer import reward_manager

    empty = empty_table()
    try:
        with PREVIEW_LOCK:
            cfg, _ = compose(args)
        if not cfg.reward.functions:
            return TryResult(empty, "", "error: no reward function configured. Fix: pick one from reward_fns/ or upload a .py")
        rows = reward_rows(cfg, scratch)
        if not rows:
            return TryResult(empty, "", "error: the training data has no usable rows to score (see the preview)")
        manager = reward_manager(cfg)
        try:
            wrong_answers = [corrupt(r["ground_truth"]) for r in rows]
            own, own_m = best_scores(manager, [str(r["ground_truth"]) for r in rows], rows)
            wrong, wrong_m = best_scores(manager, wrong_answers, rows)
            failures = int(own_m.get("reward/failures", 0) + wrong_m.get("reward/failures", 0))
            error = own_frames(first_failure(manager, rows)) if failures else ""
        finally:
            manager.close()
    except (SystemExit, *usage_errors()) as err:
        return TryResult(empty, "", usage_text(err))
    table = pd.DataFrame({"ground truth": [str(r["ground_truth"]) for r in rows], "own answer score": own.round(4),
                          "corrupted answer": wrong_answers, "its score": wrong.round(4)})
    apart = int((own > wrong).sum())
    verdict = (f"{apart}/{len(rows)} rows: the own answer scores above the corrupted one "
               f"(own mean {own.mean():.3f}, corrupted mean {wrong.mean():.3f})")
    if failures:
        error = (f"error: the reward function raised on {failures} calls (each scored reward.fallback_score). "
                 f"Fix: correct the reward file; its first error:\n{error}")
    elif own.max() == own.min() == wrong.max() == wrong.min():
        verdict += f"; every response scores {own[0]:.3f}: the reward ignores the response or the ground truth"
    return TryResult(table, verdict, error)
