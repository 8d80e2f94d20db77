"""Doctor checks of the data: rows read, columns mapped, prompt lengths against data.max_prompt_length."""

from __future__ import annotations

import numpy as np

from rlframe.config import RLConfig
from rlframe.data.files import DatasetError
from rlframe.doctor.result import CheckResult, failed, passed, warned

GROUP = "data"
UNLIMITED = 10**9


def read_unlimited(files: list[str], tokenizer, cfg: RLConfig, bad_rows: str):
    """The dataset as the run reads it, but without the length limit (every prompt's length is measured)."""
    from rlframe.data.dataset import RLDataset
    from rlframe.trainer.rl_trainer import dataset_options

    options = dict(dataset_options(cfg), max_prompt_length=UNLIMITED, overlong="error", bad_rows=bad_rows)
    return RLDataset(files, tokenizer, **options)


def first_bad_row(files: list[str], tokenizer, cfg: RLConfig) -> str:
    """The first malformed row's message, as the run raises it (file, row, field)."""
    try:
        read_unlimited(files, tokenizer, cfg, bad_rows="error")
    except DatasetError as error:
        return str(error)
    return ""


def check_rows(split: str, files: list[str], tokenizer, cfg: RLConfig) -> tuple[CheckResult, object]:
    """Every row read and mapped (prompt_key, the ground truth); malformed rows counted and the first named."""
    d = cfg.data
    where = f"prompt from '{d.prompt_key}', ground truth from '{d.answer_key or 'reward_model.ground_truth'}'"
    try:
        dataset = read_unlimited(files, tokenizer, cfg, bad_rows="skip")
    except DatasetError as error:
        return failed(GROUP, f"{split}_rows", f"{error}; {first_bad_row(files, tokenizer, cfg)}",
                      f"fix the files or the column keys ({where}: data.prompt_key, data.answer_key)"), None
    if dataset.num_skipped:
        measured = (f"{len(dataset)} rows usable, {dataset.num_skipped} malformed; "
                    f"{first_bad_row(files, tokenizer, cfg)}")
        if d.bad_rows == "error":
            return failed(GROUP, f"{split}_rows", measured, "fix those rows, or data.bad_rows=skip to drop them"), dataset
        return warned(GROUP, f"{split}_rows", measured, "the run drops them (data.bad_rows=skip)"), dataset
    return passed(GROUP, f"{split}_rows", f"{len(dataset)} rows from {len(files)} file(s); {where}; every row has "
                                          "its ground truth"), dataset


def length_summary(lengths: np.ndarray) -> str:
    return (f"prompt tokens p50 {int(np.percentile(lengths, 50))}, p95 {int(np.percentile(lengths, 95))}, "
            f"max {int(lengths.max())}")


def check_prompt_lengths(split: str, dataset, cfg: RLConfig) -> CheckResult:
    """How many prompts exceed data.max_prompt_length, and what data.overlong does with them."""
    limit, policy = cfg.data.max_prompt_length, cfg.data.overlong
    lengths = np.array([len(row["input_ids"]) for row in dataset.rows])
    over = int((lengths > limit).sum())
    measured = f"{length_summary(lengths)} vs data.max_prompt_length={limit}: {over} of {len(lengths)} over"
    raise_to = int(lengths.max())
    if over == len(lengths):
        return failed(GROUP, f"{split}_prompt_lengths", measured + " (every prompt)",
                      f"data.max_prompt_length={raise_to} (the longest prompt), or shorter prompts")
    if over and policy == "error":
        return failed(GROUP, f"{split}_prompt_lengths", measured + " (data.overlong=error: the run refuses to start)",
                      f"data.max_prompt_length={raise_to}, or data.overlong=filter / truncate_left")
    if over:
        done = "dropped" if policy == "filter" else "cut from the left"
        return warned(GROUP, f"{split}_prompt_lengths", measured + f" ({done}, data.overlong={policy})",
                      f"data.max_prompt_length={raise_to} keeps every prompt whole")
    return passed(GROUP, f"{split}_prompt_lengths", measured)


def check_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> tuple[list[CheckResult], object]:
    """Rows and prompt lengths of the training and validation files; returns (results, the training dataset)."""
    results, train = [], None
    for split, files in (("train", train_files), ("val", val_files)):
        if not files:
            continue
        rows, dataset = check_rows(split, files, tokenizer, cfg)
        results.append(rows)
        if dataset is not None:
            results.append(check_prompt_lengths(split, dataset, cfg))
        if split == "train":
            train = dataset
    return results, train
