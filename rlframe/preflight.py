"""What a run checks before Ray starts, beyond its configuration: its data, built as its driver will build it.

`check_run_data(cfg, tokenizer, train_files, val_files)` reads, checks and tokenizes every row of the
stage's data with the loaders, options and prompt template its driver uses (rlframe/data/dataset.py,
rlframe/stages/data.py), so a bad file, row or template is a `DatasetError` naming the key or file, the
row and the fix before Ray or any worker starts; and it checks that the training rows fill one batch,
saying why when rows were dropped (data.overlong=filter, data.bad_rows=skip). The drivers build the same
data again when they start (the same result: nothing here changes what they read).
"""

from __future__ import annotations

from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset
from rlframe.data.files import DatasetError


def check_run_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> None:
    """The data checks of cfg.stage (stages whose data the project generates itself have none)."""
    check = STAGE_DATA.get(cfg.stage)
    if check is not None:
        check(cfg, tokenizer, list(train_files), list(val_files))


def fills_a_batch(rows: int, batch_key: str, batch_size: int, unit: str, files: list[str], dropped: str = "") -> None:
    """At least one batch of `batch_size` rows; the message says why rows are missing when some were dropped."""
    if rows >= batch_size:
        return
    fix = f"Fix: lower {batch_key}, or give more rows"
    if "data.overlong=filter" in dropped:
        fix += ", or raise data.max_prompt_length (or data.overlong=truncate_left)"
    if "data.bad_rows=skip" in dropped:
        fix += ", or repair the malformed rows (data.bad_rows=error names each)"
    raise DatasetError(f"{batch_key}={batch_size} needs {batch_size} {unit} per step, but {', '.join(files)} yield only "
                       f"{rows} usable ones{dropped}. {fix}")


def prompt_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> None:
    """stage=rl: the prompt datasets (RLTrainer's options); the training prompts fill data.train_batch_size."""
    from rlframe.trainer.rl_trainer import dataset_options

    train = RLDataset(train_files, tokenizer, **dataset_options(cfg))
    fills_a_batch(len(train), "data.train_batch_size", cfg.data.train_batch_size, "prompts", train_files,
                  train.dropped_reason())
    if val_files:
        RLDataset(val_files, tokenizer, **dataset_options(cfg))


def sampled_prompts(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> None:
    """stage=rft (and dpo / rm sampling their own pairs): the training prompts that samples are drawn for."""
    from rlframe.stages.dpo import pair_prompts

    pair_prompts(cfg, tokenizer, train_files)


def sft_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> None:
    """stage=sft on files (the arithmetic default's rows are written by the driver): rows fill sft.batch_size."""
    if cfg.data.source != "files":
        return
    from rlframe.stages.data import load_sft_examples

    sft = cfg.sft
    options = dict(prompt_key=cfg.data.prompt_key, response_key=sft.response_key, messages_key=sft.messages_key,
                   max_length=sft.max_length, overlong=cfg.data.overlong, bad_rows=cfg.data.bad_rows)
    examples = load_sft_examples(train_files, tokenizer, **options)
    fills_a_batch(len(examples), "sft.batch_size", sft.batch_size, "SFT rows", train_files)
    if val_files:
        load_sft_examples(val_files, tokenizer, **options)


def pair_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> None:
    """stage=dpo / rm on pair files (chosen/rejected rows); on prompt files, the prompts pairs are sampled for."""
    from rlframe.stages.dpo import needs_pair_generation

    if needs_pair_generation(cfg, train_files):
        if cfg.data.source == "files":
            sampled_prompts(cfg, tokenizer, train_files, val_files)
        return
    if cfg.stage == "dpo" and cfg.dpo.loss == "kto":
        return  # unpaired rows (rlframe/stages/unpaired_data.py), read by the driver
    from rlframe.stages.data import load_pairs

    dpo = cfg.dpo
    # stage=rm scores the rendered conversation (its length is checked by the driver): here, the rows' fields
    max_length = dpo.max_length if cfg.stage == "dpo" else 10**9
    pairs = load_pairs(train_files, tokenizer, prompt_key=cfg.data.prompt_key, chosen_key=dpo.chosen_key,
                       rejected_key=dpo.rejected_key, max_length=max_length, overlong=cfg.data.overlong,
                       bad_rows=cfg.data.bad_rows)
    if cfg.stage == "dpo":
        fills_a_batch(len(pairs), "dpo.batch_size", dpo.batch_size, "pairs", train_files)


STAGE_DATA = {"rl": prompt_data, "sft": sft_data, "dpo": pair_data, "rm": pair_data, "rft": sampled_prompts}
