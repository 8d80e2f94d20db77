"""One evaluation: generate n responses per prompt with each method, score them as validation does, and
turn the scores into per-prompt metrics with intervals.

    evaluator = Evaluator(cfg, model_path, files, options)      # the dataset, ONE rollout engine, the scorer
    table = evaluator.evaluate()                                # {method: MethodResult}, over options.repeats seeds
    evaluator.load_model(other_model_path)                      # the same engine, new weights (checkpoints=all)

The pieces are the trainer's own (RLDataset with the trainer's dataset options + collate_prompts, validation's
split_prompts, which hands the rows' images, videos and audios to the engine, the rollout engine from
RolloutSettings through generate_sequences, the Scorer and validation's accuracy rule; with teacher= the teacher
role's forward engines, rlframe/evaluation/teacher.py), in this process, without Ray.

Sampling seeds: repeat r uses seed = trainer.seed + r: `torch.manual_seed(seed)` (HF generate) and one vLLM
generator per sample seeded with seed * 1_000_003 + row (vLLM), so a result does not depend on the batch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlframe.evaluation.constraints import Constraint, compile_constraint, generate_constrained
from rlframe.evaluation.methods import (CHECK_INSTRUCTION, COT_INSTRUCTION, extracted_answers, second_turn,
                                        turn_pieces, with_instruction)
from rlframe.evaluation.stats import BOOTSTRAP_RESAMPLES, Estimate, Spread, per_prompt_metrics
from rlframe.evaluation.teacher import (TeacherInputError, TeacherScorer, TeacherScores, check_teacher,
                                        response_means, teacher_extras)

# What each method is judged by (its "score" column); every gain is that minus plain's accuracy, per prompt.
HEADLINE = {"plain": "accuracy", "cot": "accuracy", "self_consistency": "maj@{n}", "self_check": "accuracy",
            "constrained": "accuracy"}
INSTRUCTION_TOKENS = 64  # room for a method's instruction (CoT, self-check) in the prompt


@dataclass
class EvalOptions:
    """What to generate and how to report it (the command line's n, k, method, repeats, ... keys)."""

    n: int = 1
    ks: list[int] | None = None  # None: [n]
    methods: list[str] = field(default_factory=lambda: ["plain"])
    repeats: int = 1
    constraint: Constraint | None = None
    cot_instruction: str = COT_INSTRUCTION
    check_instruction: str = CHECK_INSTRUCTION
    extractor: Callable[[str], str | None] | None = None
    resamples: int = BOOTSTRAP_RESAMPLES
    judge: bool = False  # grade every response with cfg.reward.judge too (judge_score_mean, judge_unscorable_rate)
    teacher: bool = False  # score every response under cfg.teacher.path too (rlframe/evaluation/teacher.py)

    def __post_init__(self):
        self.ks = list(self.ks or [self.n])


@dataclass
class Samples:
    """One generation pass over the P x n rows (row i * n + j: sample j of prompt i)."""

    raw_prompts: list[str]
    truths: list[str]
    texts: list[str]
    scores: np.ndarray
    accuracy: np.ndarray
    answers: list
    lengths: np.ndarray
    judge_scores: np.ndarray | None = None  # the LLM judge's score of each response (NaN: unscorable); None: no judge
    judge_replies: list[str] | None = None
    teacher: TeacherScores | None = None  # the responses under the teacher (teacher=); None: no teacher
    # the engine's own mean log-prob of each response (its sampling distribution; 0 under HF constrained decoding):
    # beside teacher.model_log_prob, the check that generation and scoring saw the same inputs (media included)
    engine_log_prob: np.ndarray | None = None


@dataclass
class MethodResult:
    """A method over R seeds: per-prompt values (averaged over the seeds), per-seed means, a few extras."""

    name: str
    headline: str
    per_prompt: dict[str, np.ndarray]
    per_seed: dict[str, list[float]]
    seeds: list[int]
    extra: dict[str, float] = field(default_factory=dict)
    samples: Samples | None = None  # the first seed's

    def estimate(self, key: str, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
        return Estimate.of(self.per_prompt[key], seed, resamples)

    def spread(self, key: str) -> Spread:
        return Spread.of(self.per_seed[key], self.seeds)


class EvalInputError(ValueError):
    """Bad evaluation input found once the model is known (a method that needs what is not there)."""


class Evaluator:
    judge = None  # a JudgeReward with options.judge
    teacher = None  # a TeacherScorer with options.teacher

    def __init__(self, cfg, model_path: str, files: list[str], options: EvalOptions):
        from transformers import AutoTokenizer

        from rlframe.data.dataset import RLDataset
        from rlframe.trainer.phases import PhaseClock
        from rlframe.trainer.rl_trainer import dataset_options
        from rlframe.trainer.scorer import Scorer
        from rlframe.trainer.worker_settings import rollout_settings

        self.cfg, self.options = cfg, options
        check_options(options, cfg.rollout.val_temperature)
        data = cfg.data
        if options.teacher:  # the teacher's folder and tokenizer, before anything is built
            try:
                check_teacher(cfg, model_path)
            except TeacherInputError as error:
                raise EvalInputError(str(error)) from None
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
        # training's data path: images, videos and audios read, decoded and encoded as the trainer's datasets do
        dataset = RLDataset(files, self.tokenizer, **dataset_options(cfg))
        self.count = min(len(dataset), data.val_max_samples or len(dataset))
        tok = self.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.rows = [dataset[i] for i in range(self.count)]
        check_media_methods(self.rows, options.methods, cfg.data)
        settings = rollout_settings(cfg, model_path)
        if {"cot", "self_check"} & set(options.methods):  # longer prompts: an instruction (and the first answer)
            extra = INSTRUCTION_TOKENS + (data.max_response_length if "self_check" in options.methods else 0)
            settings = dataclasses.replace(settings, max_model_len=settings.max_model_len + extra)
        self.settings = settings
        self.pieces = turn_pieces(tok) if {"cot", "self_check"} & set(options.methods) else None
        self.compiled = None
        if "constrained" in options.methods:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code).vocab_size
            self.compiled = compile_constraint(options.constraint, tok, max(vocab, len(tok)))
        self.engine, self.engine_name = build_engine(settings)
        self.scorer = Scorer(cfg, tok, PhaseClock())  # the trainer's decoding and scoring
        if options.judge:  # the URL judge (rlframe/eval.py configure_judge), as training asks it
            from rlframe.reward.judge import build_judge

            self.judge = build_judge(cfg, None)
        if options.teacher:  # the teacher and the model as forward-only engines (teacher=)
            self.teacher = TeacherScorer(cfg, model_path)

    def load_model(self, model_path: str) -> int:
        """Stream `model_path`'s weights into the one engine (same engine, same settings); tensors loaded."""
        from safetensors import safe_open

        def tensors():
            for file in sorted(Path(model_path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        if self.teacher is not None:
            self.teacher.load_model(model_path)
        return self.engine.load_weights(tensors())

    # -------------------------------------------------------------- generation

    def generate(self, raw_prompts: list[str], seed: int, constrained: bool = False,
                 input_ids: list[list[int]] | None = None) -> Samples:
        """Generate one response per row (prompt texts already repeated n times) and score it."""
        from rlframe.data.dataset import collate_prompts
        from rlframe.trainer.scorer import validation_accuracy
        from rlframe.trainer.validation import split_prompts
        from rlframe.workers.rollout.base import generate_sequences

        n = self.options.n
        if input_ids is None:
            input_ids = self.tokenizer(raw_prompts, add_special_tokens=False)["input_ids"]
        rows = [{**self.rows[i // n], "input_ids": list(ids), "raw_prompt": text}
                for i, (ids, text) in enumerate(zip(input_ids, raw_prompts))]
        batch = collate_prompts(rows, self.pad)
        prompts = split_prompts(batch, self.cfg)  # validation's: the ids, masks and the rows' media for the engine
        prompts.meta_info["validate"] = True
        prompts.non_tensor_batch["sample_seed"] = np.array([seed * 1_000_003 + i for i in range(len(rows))],
                                                           dtype=object)
        torch.manual_seed(seed)
        if constrained:
            out = generate_constrained(self.engine, prompts, self.settings.validation, self.options.constraint,
                                       self.compiled)
        else:
            out = generate_sequences(self.engine, self.settings, prompts, 0)
        batch = batch.union(out)
        texts = self.scorer.decode(batch)
        result, _, _ = self.scorer.rule_and_model_scores(batch, texts)
        truths = [str(t) for t in batch.non_tensor_batch["ground_truth"]]
        judged = None
        if self.judge is not None:
            from rlframe.reward.judge import prompt_text
            from rlframe.trainer.scorer import chat_unwrapper

            unwrap = chat_unwrapper(self.tokenizer)
            judged = self.judge.score([unwrap(prompt_text(p)) for p in raw_prompts], texts,
                                      list(batch.non_tensor_batch["ground_truth"]))
        teacher = None if self.teacher is None else self.teacher.score(batch)
        return Samples(raw_prompts=list(raw_prompts), truths=truths, texts=texts, scores=np.asarray(result.scores, dtype=float),
                       accuracy=validation_accuracy(result).astype(float),
                       answers=extracted_answers(texts, result.extras, self.options.extractor),
                       lengths=batch.batch["response_mask"].sum(-1).numpy().astype(float),
                       judge_scores=None if judged is None else judged.scores, judge_replies=None if judged is None
                       else judged.outputs, teacher=teacher,
                       engine_log_prob=response_means(batch.batch["rollout_log_probs"], batch.batch["response_mask"]))

    def method_samples(self, method: str, seed: int, plain: Samples | None) -> Samples:
        """The samples a method is judged on (self_consistency votes on plain's; self_check revises them)."""
        n, options = self.options.n, self.options
        raw = [self.rows[i // n]["raw_prompt"] for i in range(self.count * n)]
        if method == "plain":
            return self.generate(raw, seed, input_ids=[self.rows[i // n]["input_ids"] for i in range(len(raw))])
        if method == "self_consistency":
            return plain
        if method == "cot":
            return self.generate([with_instruction(text, options.cot_instruction, self.pieces) for text in raw], seed)
        if method == "self_check":
            turns = [second_turn(text, answer, options.check_instruction, self.pieces)
                     for text, answer in zip(plain.raw_prompts, plain.texts)]
            return self.generate(turns, seed)
        if method == "constrained":
            return self.generate(raw, seed, constrained=True,
                                 input_ids=[self.rows[i // n]["input_ids"] for i in range(len(raw))])
        raise ValueError(method)

    def evaluate(self) -> dict[str, MethodResult]:
        """Every method, over options.repeats seeds (trainer.seed, trainer.seed + 1, ...)."""
        options, n = self.options, self.options.n
        seeds = [self.cfg.trainer.seed + r for r in range(options.repeats)]
        runs: dict[str, list[tuple[dict[str, np.ndarray], Samples]]] = {m: [] for m in options.methods}
        for seed in seeds:
            plain = None
            for method in options.methods:
                samples = self.method_samples(method, seed, plain)
                plain = samples if method == "plain" else plain
                runs[method].append((self.per_prompt(samples), samples))
        results = {}
        for method, per_seed in runs.items():
            keys = per_seed[0][0].keys()
            result = MethodResult(
                name=method, headline=HEADLINE[method].format(n=n),
                per_prompt={key: np.mean([values[key] for values, _ in per_seed], axis=0) for key in keys},
                per_seed={key: [float(np.mean(values[key])) for values, _ in per_seed] for key in keys},
                seeds=seeds, samples=per_seed[0][1])
            if method == "self_check":
                result.extra.update(revision_flips(runs["plain"][0][1].accuracy, per_seed[0][1].accuracy))
            if self.judge is not None and method != "self_consistency":
                result.extra.update(judge_extras([samples for _, samples in per_seed]))
            if self.teacher is not None and method != "self_consistency":
                result.extra.update(teacher_extras([samples.teacher for _, samples in per_seed]))
            results[method] = result
        return results

    def per_prompt(self, samples: Samples) -> dict[str, np.ndarray]:
        """Per-prompt metrics of one pass: per_prompt_metrics, plus reward_mean and response_length."""
        shape = (self.count, self.options.n)
        answers = [samples.answers[i * shape[1]:(i + 1) * shape[1]] for i in range(shape[0])]
        out = per_prompt_metrics(samples.accuracy.reshape(shape), answers, self.options.ks)
        out["reward_mean"] = samples.scores.reshape(shape).mean(axis=1)
        out["response_length"] = samples.lengths.reshape(shape).mean(axis=1)
        return out

    def close(self) -> None:
        self.scorer.close()
        self.teacher = None
        if self.judge is not None:
            self.judge.close()


def judge_extras(passes: list[Samples]) -> dict[str, float]:
    """The judge's mean score over the scorable responses of every seed's pass, and the unscorable share."""
    scores = np.concatenate([samples.judge_scores for samples in passes])
    scorable = ~np.isnan(scores)
    return {"judge_score_mean": float(scores[scorable].mean()) if scorable.any() else float("nan"),
            "judge_unscorable_rate": float(1.0 - scorable.mean()) if len(scores) else 0.0}


MEDIA_COLUMNS = {"image": "image_key", "video": "video_key", "audio": "audio_key"}  # multi_modal_data -> data.<key>
TEXT_ONLY_METHODS = ("cot", "self_check", "constrained")


def check_media_methods(rows: list[dict], methods: list[str], data) -> None:
    """Rows with images, videos or audios are generated and scored as validation does (plain; self_consistency
    votes on plain's samples); cot and self_check re-tokenize an edited prompt text (which holds the media
    placeholders, not their processor-expanded tokens) and constrained decodes without the media inputs: refused."""
    text_only = [m for m in methods if m in TEXT_ONLY_METHODS]
    if not text_only:
        return
    for i, row in enumerate(rows):
        for modality in (row.get("multi_modal_data") or {}):
            key = MEDIA_COLUMNS.get(modality, "image_key")
            raise EvalInputError(
                f"method={','.join(text_only)}: row {i} has {modality} input (column '{getattr(data, key)}', "
                f"data.{key}); {', '.join(TEXT_ONLY_METHODS)} are text-only in rlframe.eval (they re-tokenize the "
                "prompt text or decode without the media). Fix: method=plain (or self_consistency) on this data")


def check_options(options: EvalOptions, temperature: float) -> None:
    """Refuse what cannot be measured: k outside 1..n, a vote over one sample, a constraint-less constrained."""
    for k in options.ks:
        if not 1 <= k <= options.n:
            raise EvalInputError(f"k={k}: must be in 1..n={options.n} (pass@k and maj@k choose k of the n "
                                 f"samples per prompt; raise n= or lower k=)")
    if "self_consistency" in options.methods and (options.n < 2 or temperature == 0.0):
        raise EvalInputError(f"method=self_consistency: votes over n samples; needs n >= 2 and temperature > 0 "
                             f"(got n={options.n}, temperature={temperature}). Fix: n=8 temperature=1.0")
    if "constrained" in options.methods and options.constraint is None:
        raise EvalInputError("method=constrained: needs constrain=<regex | JSON schema | boxed>")


def revision_flips(before: np.ndarray, after: np.ndarray) -> dict[str, float]:
    """Self-check's answers compared sample by sample: the share fixed (wrong -> right) and broken (right -> wrong)."""
    first, second = np.nan_to_num(before) >= 0.5, np.nan_to_num(after) >= 0.5
    return {"fixed": float(np.mean(~first & second)), "broken": float(np.mean(first & ~second))}


def build_engine(settings):
    """The rollout engine of `settings` in this process (vLLM wants a process group of its own here)."""
    from rlframe.workers.rollout.factory import build_rollout_engine

    profile = settings.device.profile()
    if profile.rollout_engine == "vllm" and not torch.distributed.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return build_rollout_engine(settings, profile, 0, shares_devices=False), profile.rollout_engine
