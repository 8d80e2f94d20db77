"""`python -m rlframe.eval`: score a model on a dataset with reward functions, as validation does.

    python -m rlframe.eval model=runs/x/hf_model data=~/data/gsm8k/test.parquet reward=reward_fns/gsm8k.py
    python -m rlframe.eval model=runs/x/checkpoints/step_10 data=... reward=my_reward.py:compute_score n=8 k=1,4,8 temperature=1.0
    python -m rlframe.eval run=runs/x        # the run's own validation: its exported model, data, reward, settings

Keys (key=value): model (HF folder, hub id, embedded model name, checkpoint folder or run directory:
its hf_model/), data (files as data.train_files takes them), reward (path or path:name; several
comma-separated), n (samples per prompt, default 1), k (pass@k / mean@k for these k, default n),
temperature (0 = greedy, the default; with n > 1 use > 0), top_p, top_k, engine (auto | vllm | hf),
max_prompt_length, max_response_length, max_samples (the first N prompts; default all), prompt_key,
answer_key, prompt_template, seed, out (a jsonl of every response with its reward; default
<run>/eval_samples.jsonl with run=, else none). `run=<run_dir>` takes every default from that run's
config.yaml, so the result reproduces the run's final validation (same data, prompts, engine, greedy).

The pieces are the trainer's own: RLDataset + collate_prompts for the prompts, the rollout engine
built from the same RolloutSettings (rlframe/trainer/worker_settings.py) and called through the
same generate_sequences, and the trainer's scorer (rlframe/trainer/scorer.py) for rewards and accuracy. It runs in this
process, without Ray.

Metrics: reward_mean, accuracy (mean over all responses = mean@n), and for each k: mean@k (the mean
accuracy of the first k samples of each prompt) and pass@k (the unbiased estimator of Chen et al.
2021: 1 - C(n-c, k) / C(n, k), c correct of n samples, averaged over prompts).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

KEYS = ("model", "data", "reward", "n", "k", "temperature", "top_p", "top_k", "engine", "max_prompt_length",
        "max_response_length", "max_samples", "prompt_key", "answer_key", "prompt_template", "seed", "out", "run")


class EvalUsageError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"error: {message}\n(usage: python -m rlframe.eval model=<hf folder or checkpoint> "
                         "data=<files> reward=<file[:name]> [n=1 k=1 temperature=0 engine=auto ...]; see "
                         "`python -m rlframe.eval --help`)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def parse_args(argv: list[str]) -> dict[str, str]:
    args: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("-")
        if not sep or key not in KEYS:
            import difflib

            close = difflib.get_close_matches(key, KEYS, n=2)
            raise EvalUsageError(f"'{arg}' is not key=value with a known key"
                                 + (f" (did you mean {' or '.join(close)}?)" if close else "")
                                 + f". Keys: {', '.join(KEYS)}")
        args[key] = value
    return args


def build_config(args: dict[str, str]):
    """An RLConfig for the evaluation: a run's config.yaml (run=) or the defaults, then the keys given."""
    from omegaconf import OmegaConf

    from rlframe.config import RLConfig, RewardFunctionConfig
    from rlframe.data.files import resolve_data_files
    from rlframe.reward.loader import split_path_name

    run_dir = Path(args["run"]).expanduser() if "run" in args else None
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise EvalUsageError(f"run={run_dir}: no config.yaml there (is it a run directory?)")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RLConfig),
                                                  OmegaConf.load(run_dir / "config.yaml")))
    else:
        cfg = RLConfig()
        cfg.data.val_max_samples = None
    cfg.trainer.loggers = []
    model = args.get("model") or (str(run_dir / "hf_model") if run_dir else None)
    if not model:
        raise EvalUsageError("model=<HF folder, hub id, checkpoint folder or run directory> is required")
    if "data" in args:
        files = resolve_data_files(args["data"].split(","))
    elif run_dir is not None:
        files = run_validation_files(cfg, run_dir)
    else:
        raise EvalUsageError("data=<file(s)> is required (parquet, jsonl, json, csv, ...; comma-separated)")
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise EvalUsageError(f"data: {', '.join(missing)} not found")
    if "reward" in args:
        cfg.reward.functions = []
        for item in args["reward"].split(","):
            path, name = split_path_name(item)
            cfg.reward.functions.append(RewardFunctionConfig(path=str(Path(path).expanduser()), name=name or "compute_score"))
    elif run_dir is None:
        raise EvalUsageError("reward=<file or file:function> is required")
    d, r = cfg.data, cfg.rollout
    d.max_prompt_length = int(args.get("max_prompt_length", d.max_prompt_length))
    d.max_response_length = int(args.get("max_response_length", d.max_response_length))
    if "max_samples" in args:
        d.val_max_samples = int(args["max_samples"])
    d.prompt_key = args.get("prompt_key", d.prompt_key)
    d.answer_key = args.get("answer_key", d.answer_key)
    d.prompt_template = args.get("prompt_template", d.prompt_template)
    r.engine = args.get("engine", r.engine)
    r.val_temperature = float(args.get("temperature", r.val_temperature))
    r.top_p = float(args.get("top_p", r.top_p))
    r.top_k = int(args.get("top_k", r.top_k))
    cfg.trainer.seed = int(args.get("seed", cfg.trainer.seed))
    return cfg, model, files, run_dir


def run_validation_files(cfg, run_dir: Path) -> list[str]:
    """The validation files the run used: its data.val_files, or the arithmetic set it generated."""
    if cfg.data.source == "files":
        return list(cfg.data.val_files)
    from rlframe.main import prepare_data

    return prepare_data(cfg, run_dir)[1]  # seeded: the same files (rewritten identically)


def resolve_model(model: str, work_dir: Path) -> str:
    """A checkpoint (or a run with checkpoints but no hf_model) is exported once into work_dir."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        if (path / "hf_model" / "config.json").is_file():
            return str(path / "hf_model")
        from rlframe.export import export_checkpoint, resolve_checkpoint

        checkpoint = resolve_checkpoint(path)
        out = work_dir / f"exported_{checkpoint.name}"
        if not (out / "config.json").is_file():
            print(f"exporting {checkpoint} -> {out}", flush=True)
            export_checkpoint(checkpoint, out, merge=True)  # a LoRA checkpoint: its merged model
        return str(out)
    from rlframe.models.provision import resolve_model_path

    return resolve_model_path(model)


def evaluate(cfg, model_path: str, files: list[str], n: int = 1, ks: list[int] | None = None,
             out: Path | None = None) -> dict[str, float]:
    """Generate n responses per prompt and score them; the metrics (see the module docstring)."""
    import os

    import torch
    from transformers import AutoTokenizer

    from rlframe.data.dataset import RLDataset, collate_prompts
    from rlframe.trainer.phases import PhaseClock
    from rlframe.trainer.scorer import Scorer, validation_accuracy
    from rlframe.trainer.worker_settings import rollout_settings
    from rlframe.workers.rollout.base import generate_sequences
    from rlframe.workers.rollout.factory import build_rollout_engine

    data = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    dataset = RLDataset(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                        prompt_template=data.prompt_template, max_prompt_length=data.max_prompt_length,
                        overlong=data.overlong, bad_rows=data.bad_rows)
    count = min(len(dataset), data.val_max_samples or len(dataset))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = collate_prompts([dataset[i] for i in range(count)], pad)
    if n > 1:
        batch = batch.repeat(n, interleave=True)
    prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
    prompts.meta_info["validate"] = True
    settings = rollout_settings(cfg, model_path)
    profile = settings.device.profile()
    if profile.rollout_engine == "vllm" and not torch.distributed.is_initialized():
        # vLLM in this process (as in the trainer's workers) wants a process group of its own.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine = build_rollout_engine(settings, profile, 0, shares_devices=False)
    print(f"generating {len(prompts)} responses ({count} prompts x {n}) with {profile.rollout_engine}, "
          f"temperature {settings.validation.temperature}", flush=True)
    torch.manual_seed(cfg.trainer.seed)
    batch = batch.union(generate_sequences(engine, settings, prompts, 0))
    mask = batch.batch["response_mask"]
    nt = batch.non_tensor_batch
    scorer = Scorer(cfg, tokenizer, PhaseClock())  # the trainer's decoding and scoring, its accuracy as validation's
    try:
        texts = scorer.decode(batch)
        result, _, _ = scorer.rule_and_model_scores(batch, texts)
    finally:
        scorer.close()
    accuracy = validation_accuracy(result)
    correct = np.nan_to_num(accuracy.reshape(count, n)) >= 0.5
    metrics = {"reward_mean": float(np.mean(result.scores)), "accuracy": float(np.nanmean(accuracy)),
               "response_length": float(mask.sum(-1).float().mean()), "prompts": float(count), "n": float(n)}
    for k in ks or [n]:
        if not 1 <= k <= n:
            raise EvalUsageError(f"k={k}: must be in 1..n={n}")
        metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(1)]))
        metrics[f"mean@{k}"] = float(np.mean(np.nan_to_num(accuracy.reshape(count, n))[:, :k]))
    if out is not None:
        with open(out, "w") as f:
            for i, text in enumerate(texts):
                f.write(json.dumps({"prompt_index": i // n, "sample": i % n, "response": text,
                                    "ground_truth": str(nt["ground_truth"][i]), "score": float(result.scores[i]),
                                    "acc": float(accuracy[i])}) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    args = parse_args(argv)
    cfg, model, files, run_dir = build_config(args)
    n = int(args.get("n", 1))
    ks = [int(k) for k in args["k"].split(",")] if "k" in args else None
    if n > 1 and cfg.rollout.val_temperature == 0.0:
        print("note: n > 1 with temperature=0 (greedy) repeats one answer; set temperature=1.0 to sample", flush=True)
    work_dir = run_dir or Path.cwd()
    model_path = resolve_model(model, work_dir)
    out = Path(args["out"]) if "out" in args else (run_dir / "eval_samples.jsonl" if run_dir else None)
    metrics = evaluate(cfg, model_path, files, n=n, ks=ks, out=out)
    print("metrics: " + json.dumps(metrics), flush=True)  # one line, for scripts
    if out is not None:
        print(f"responses: {out}")
    return metrics


if __name__ == "__main__":
    main()
