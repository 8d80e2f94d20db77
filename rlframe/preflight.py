"""What a run checks before Ray starts, beyond its configuration: its data, built as its driver will build it.

`check_run_data(cfg, tokenizer, train_files, val_files)` reads, checks and tokenizes every row of the
stage's data with the loaders, options and prompt template its driver uses (rlframe/data/dataset.py,
rlframe/stages/data.py), so a bad file, row or template is a `DatasetError` naming the key or file, the
row and the fix before Ray or any worker starts; and it checks that the training rows fill one batch,
saying why when rows were dropped (data.overlong=filter, data.bad_rows=skip), and that the reward
functions' `data_sources` match the rows' `data_source` values. The prompt datasets built here (stage rl,
rft) are returned and handed to the stage's driver, which uses them instead of building them again.
"""

from __future__ import annotations

from rlframe.config import RLConfig
from rlframe.config.checks import ConfigError
from rlframe.data.dataset import RLDataset
from rlframe.data.files import DatasetError


def check_run_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> dict[str, RLDataset]:
    """The data checks of cfg.stage (stages whose data the project generates itself have none); the datasets
    built for them that the stage's driver takes (`datasets=`: "train", "val"), else {}."""
    check = STAGE_DATA.get(cfg.stage)
    if check is None:
        return {}
    return check(cfg, tokenizer, list(train_files), list(val_files)) or {}


def reward_sources_cover(cfg: RLConfig, datasets: list[RLDataset]) -> None:
    """Each reward function with `data_sources` matches some row's data_source, and every row is scored by some
    function: otherwise the function never runs, or the first batch with such a row stops the run (RewardError)."""
    functions = cfg.reward.functions
    if not functions:
        return
    found = sorted({row["data_source"] for dataset in datasets for row in dataset.rows})
    listed = ", ".join(map(repr, found[:10])) + (f" (+{len(found) - 10} more)" if len(found) > 10 else "")
    problems = []
    for i, fn in enumerate(functions):
        if fn.data_sources is not None and not set(fn.data_sources) & set(found):
            problems.append(f"reward.functions[{i}].data_sources: {list(fn.data_sources)} match none of the data's "
                            f"data_source values ({listed}); this function would score no sample. Fix: list some of "
                            f"those values, or data_sources=null (every row)")
    if not problems and all(fn.data_sources is not None for fn in functions):
        covered = {source for fn in functions for source in fn.data_sources}
        missing = [source for source in found if source not in covered]
        if missing:
            problems.append(f"reward.functions[*].data_sources: no reward function scores the rows whose data_source "
                            f"is {', '.join(map(repr, missing[:10]))}. Fix: add them to a function's data_sources, or "
                            f"data_sources=null on one function (every row)")
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {problem}" for problem in problems))


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


def prompt_data(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> dict[str, RLDataset]:
    """stage=rl: the prompt datasets (RLTrainer's options); the training prompts fill data.train_batch_size."""
    from rlframe.trainer.rl_trainer import dataset_options

    datasets = {"train": RLDataset(train_files, tokenizer, **dataset_options(cfg))}
    train = datasets["train"]
    fills_a_batch(len(train), "data.train_batch_size", cfg.data.train_batch_size, "prompts", train_files,
                  train.dropped_reason())
    if val_files:
        datasets["val"] = RLDataset(val_files, tokenizer, **dataset_options(cfg))
    reward_sources_cover(cfg, list(datasets.values()))
    return datasets


def sampled_prompts(cfg: RLConfig, tokenizer, train_files: list[str], val_files: list[str]) -> dict[str, RLDataset]:
    """stage=rft (and dpo / rm sampling their own pairs): the training prompts that samples are drawn for."""
    from rlframe.stages.dpo import pair_prompts

    prompts = pair_prompts(cfg, tokenizer, train_files)
    reward_sources_cover(cfg, [prompts])
    return {"train": prompts}


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
            sampled_prompts(cfg, tokenizer, train_files, val_files)  # (the DPO / RM drivers build their own)
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
