"""On-policy preference pairs from the command line (the generation itself: rlframe/stages/pair_generation.py).

    python -m rlframe.pairs recipe=dpo_math [model.path=...] [pairs.n=4 pairs.prompts=256] out=pairs.jsonl

samples pairs.n responses for pairs.prompts of the recipe's training prompts (data.source /
data.train_files, as an RL run) with our rollout engine, scores them with the recipe's reward
functions and writes the (best, worst) pairs whose scores differ by at least pairs.min_score_gap, so
DPO (`data.train_files=pairs.jsonl`) runs from the same prompt files and reward scripts as GRPO.
Rows: prompt (chat messages), chosen, rejected, chosen_score, rejected_score, ground_truth, data_source.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """Start the recipe's policy with its rollout engine, generate the pairs, write them to out=..."""
    argv = sys.argv[1:] if argv is None else argv
    from rlframe.cli_help import handle_info_flags

    if handle_info_flags("rlframe.pairs", argv):  # --help / -h, --keys [prefix]
        return
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("out=")), "pairs.jsonl")
    argv = [a for a in argv if not a.startswith("out=")]
    from rlframe.main import UsageError, compose_config, init_ray, prepare_data
    from rlframe.config import ConfigError, validate_config

    cfg = compose_config(argv)
    cfg.stage = "dpo"
    try:
        validate_config(cfg)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    from transformers import AutoTokenizer

    from rlframe.models.provision import resolve_model_path
    from rlframe.stages.dpo import PairSampler
    from rlframe.stages.pair_generation import generate_pairs

    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    work = Path(out).resolve().parent
    train_files, _ = prepare_data(cfg, work / "pairs_prompts")
    init_ray(cfg, work)  # the workers' output to <out's folder>/logs/, as rlframe.main's quiet console does
    sampler = PairSampler(cfg, model_path, tokenizer, work)
    try:
        generate_pairs(sampler, sampler.prompt_set(train_files), Path(out).resolve())
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
