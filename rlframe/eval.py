"""`python -m rlframe.eval`: score a model on a dataset with reward functions, as validation does, with intervals.

    python -m rlframe.eval model=runs/x/hf_model data=~/data/gsm8k/test.parquet reward=reward_fns/gsm8k.py
    python -m rlframe.eval model=runs/x/hf_model data=... reward=... n=8 k=1,8 temperature=1.0 repeats=3
    python -m rlframe.eval run=runs/x        # the run's own validation: its exported model, data, reward, settings
    python -m rlframe.eval run=runs/x checkpoints=0,all                  # every checkpoint, one engine: table + curve
    python -m rlframe.eval run=runs/x method=all n=8 temperature=1.0 constrain=boxed   # inference-time methods
    python -m rlframe.eval model=runs/x/hf_model harness=my_task harness_include=tasks/   # lm-evaluation-harness

Keys (key=value): model (HF folder, hub id, embedded model name, checkpoint folder or run directory:
its hf_model/), data (files as data.train_files takes them), reward (path or path:name; several
comma-separated), n (samples per prompt, default 1), k (pass@k / mean@k / maj@k for these k, default n),
temperature (0 = greedy, the default; with n > 1 use > 0), top_p, top_k, engine (auto | vllm | hf),
max_prompt_length, max_response_length, max_samples (the first N prompts; default all), prompt_key,
answer_key, prompt_template, seed, out (a jsonl of every response with its reward; default
<run>/eval_samples.jsonl with run=, else none). `run=<run_dir>` takes every default from that run's
config.yaml, so the result reproduces the run's final validation (same data, prompts, engine, greedy).
Statistics: repeats (R sampling seeds: seed, seed+1, ...; the spread over them), bootstrap (resamples of the
95% interval over prompts, default 1000), extractor (path:function(text) -> answer for maj@k; default the
reward's `pred`, else the last \\boxed{}), table (write the markdown table to this file).
Inference-time methods (rlframe/evaluation/methods.py): method (comma-separated: plain, cot, self_consistency,
self_check, constrained, or all; each row next to the plain policy with its gain), cot_instruction,
check_instruction, constrain (boxed | a regex | regex:<re> | a JSON schema | json:<schema> | file.json).
checkpoints (with run=: all, step numbers, 0 = the starting model; rlframe/evaluation/checkpoints.py).
LLM judge (docs/judge.md): judge (a URL, http://host:port/v1, or `run` with run=: the run's reward.judge, which must
be a URL here) and judge_model (the served name): every response is also graded by the judge as training grades it
(its rubric, verdict pattern or parser); judge_score_mean (over the scorable responses) and judge_unscorable_rate
join the metrics, and each response's judge reply and score join the out= rows.
Teacher (docs/distillation.md; rlframe/evaluation/teacher.py): teacher (an HF folder, or `run` with run=: the run's
teacher.path) scores every response under the teacher too, at temperature 1, by an HF forward in this process:
teacher_reverse_kl (per token, mean over the response tokens of log pi - log pi_teacher on the sampled tokens),
teacher_log_prob_mean and teacher_model_log_prob_mean join the metrics, each response's values the out= rows. The
teacher's tokenizer and chat template must be the model's (checked as training checks them).
Images, videos, audios in the prompts (docs/vision.md): read with the run's data.image_key / video_key / audio_key
and size settings (the defaults: images, videos, audios) and passed to generation and scoring as validation passes
them; method=cot, self_check and constrained are text-only.
harness (lm-eval task names, comma-separated), harness_include (a folder of task YAMLs), harness_fewshot,
harness_backend (hf | vllm; rlframe/evaluation/harness.py).

The pieces are the trainer's own: RLDataset + collate_prompts for the prompts, the rollout engine
built from the same RolloutSettings (rlframe/trainer/worker_settings.py) and called through the
same generate_sequences, and the trainer's scorer (rlframe/trainer/scorer.py) for rewards and accuracy. It runs in this
process, without Ray (rlframe/evaluation/core.py).

Metrics (rlframe/evaluation/stats.py): reward_mean, accuracy (mean over all responses = mean@n), and for each
k: mean@k (the mean accuracy of the first k samples of each prompt), pass@k (the unbiased estimator of
Chen et al. 2021: 1 - C(n-c, k) / C(n, k), c correct of n samples, averaged over prompts) and maj@k (the
majority answer of the first k samples is right; ties to the answer seen first); each rate with a 95%
percentile-bootstrap interval over prompts (`<key>_ci_low`, `<key>_ci_high`), and the seeds used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlframe.evaluation.stats import pass_at_k  # noqa: F401  (the estimator, re-exported)

KEYS = ("model", "data", "reward", "n", "k", "temperature", "top_p", "top_k", "engine", "max_prompt_length",
        "max_response_length", "max_samples", "prompt_key", "answer_key", "prompt_template", "seed", "out", "run",
        "repeats", "bootstrap", "extractor", "table", "method", "cot_instruction", "check_instruction", "constrain",
        "checkpoints", "harness", "harness_include", "harness_fewshot", "harness_backend", "judge", "judge_model", "teacher")


class EvalUsageError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"error: {message}\n(usage: python -m rlframe.eval model=<hf folder or checkpoint> "
                         "data=<files> reward=<file[:name]> [n=1 k=1 temperature=0 engine=auto ...]; see "
                         "`python -m rlframe.eval --help`)")


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
    configure_judge(cfg, args)
    configure_teacher(cfg, args)
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


def configure_judge(cfg, args: dict[str, str]) -> None:
    """judge= / judge_model=: cfg.reward.judge as the evaluation uses it (off without judge=; a URL only: the
    evaluation runs without Ray, so a judge on its own engine cannot start here)."""
    judge = cfg.reward.judge
    if "judge" not in args:
        judge.url = judge.model = ""  # (a run's judge is not asked unless judge= says so)
        return
    if args["judge"] != "run":
        if not args["judge"].startswith(("http://", "https://")):
            raise EvalUsageError(f"judge={args['judge']}: give the judge's OpenAI-compatible URL "
                                 "(http://host:port/v1), or judge=run with run=<run_dir> for the run's own judge")
        judge.url = args["judge"]
        judge.model = args.get("judge_model", judge.model if judge.url else "") or "judge"
    elif "judge_model" in args:
        judge.model = args["judge_model"]
    if not judge.url:
        raise EvalUsageError("judge=run: the run has no reward.judge.url (rlframe.eval asks a judge through its URL; "
                             "serve the run's judge model, e.g. `vllm serve <model>`, and give judge=http://host:port/v1)")


def configure_teacher(cfg, args: dict[str, str]) -> None:
    """teacher=: cfg.teacher as the evaluation uses it (off without teacher=; a run's teacher is not asked unless
    teacher=run says so). Always a forward in this process (teacher.backend=fsdp), one teacher for every row (a
    run's `teachers:` routes are not applied)."""
    teacher = cfg.teacher
    run_teacher = teacher.path
    teacher.backend, teacher.url, teacher.temperature = "fsdp", None, 1.0
    cfg.teachers = {}
    if "teacher" not in args:
        teacher.path = None
        return
    if args["teacher"] != "run":
        teacher.path = str(Path(args["teacher"]).expanduser())
        return
    if "run" not in args:
        raise EvalUsageError("teacher=run: needs run=<run_dir> (the run whose teacher.path to use); or give "
                             "teacher=<the teacher's HF folder>")
    if not run_teacher:
        raise EvalUsageError(f"teacher=run: the run {args['run']} has no teacher.path (it did not distil). Fix: "
                             "teacher=<the teacher's HF folder>")
    teacher.path = run_teacher


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


def options_from_args(args: dict[str, str]):
    """EvalOptions from the command line's keys (n, k, method, repeats, constrain, ...)."""
    from rlframe.evaluation.constraints import ConstraintError, parse_constraint
    from rlframe.evaluation.core import EvalOptions
    from rlframe.evaluation.methods import CHECK_INSTRUCTION, COT_INSTRUCTION, parse_methods

    def integer(key: str, default: int, low: int = 1) -> int:
        try:
            value = int(args.get(key, default))
        except ValueError:
            raise EvalUsageError(f"{key}={args[key]}: not an integer") from None
        if value < low:
            raise EvalUsageError(f"{key}={value}: must be >= {low}")
        return value

    n = integer("n", 1)
    try:
        ks = [int(k) for k in args["k"].split(",")] if "k" in args else None
    except ValueError:
        raise EvalUsageError(f"k={args['k']}: not a comma-separated list of integers") from None
    for k in ks or []:
        if not 1 <= k <= n:
            raise EvalUsageError(f"k={k}: must be in 1..n={n} (pass@k and maj@k choose k of the n samples per "
                                 "prompt; raise n= or lower k=)")
    try:
        methods = parse_methods(args.get("method", "plain"))
    except ValueError as error:
        raise EvalUsageError(f"method={args['method']}: {error}") from None
    constraint = None
    if "constrain" in args:
        try:
            constraint = parse_constraint(args["constrain"])
        except ConstraintError as error:
            raise EvalUsageError(f"constrain={args['constrain']}: {error}") from None
        if "constrained" not in methods:
            methods.append("constrained")
    extractor = None
    if "extractor" in args:
        from rlframe.reward.loader import split_path_name

        path, name = split_path_name(args["extractor"])
        if not name:
            raise EvalUsageError(f"extractor={args['extractor']}: give path:function (a function text -> answer)")
        extractor = load_function(path, name, "extractor")
    return EvalOptions(n=n, ks=ks, methods=methods, repeats=integer("repeats", 1), constraint=constraint,
                       judge="judge" in args, teacher="teacher" in args,
                       cot_instruction=args.get("cot_instruction", COT_INSTRUCTION),
                       check_instruction=args.get("check_instruction", CHECK_INSTRUCTION), extractor=extractor,
                       resamples=integer("bootstrap", 1000, low=10))


def load_function(path: str, name: str, key: str):
    """`name` from the Python file at `path` (a user's file, loaded as a module)."""
    import importlib.util

    file = Path(path).expanduser()
    if not file.is_file():
        raise EvalUsageError(f"{key}={path}:{name}: {file} not found")
    spec = importlib.util.spec_from_file_location(f"rlframe_eval_{key}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise EvalUsageError(f"{key}={path}:{name}: {file} has no function {name}")
    return getattr(module, name)


def evaluate(cfg, model_path: str, files: list[str], options, out: Path | None = None,
             table: Path | None = None) -> dict[str, float]:
    """Every method of `options` on one model: the flat metrics (rlframe/evaluation/tables.py); prints the table."""
    from rlframe.evaluation.core import Evaluator
    from rlframe.evaluation.tables import flat_metrics, method_table, write_samples

    evaluator = Evaluator(cfg, model_path, files, options)
    try:
        print(f"generating {evaluator.count} prompts x {options.n} with {evaluator.engine_name}, temperature "
              f"{evaluator.settings.validation.temperature}, methods {', '.join(options.methods)}, "
              f"{options.repeats} seed(s)", flush=True)
        results = evaluator.evaluate()
    finally:
        evaluator.close()
    seed = cfg.trainer.seed
    metrics = flat_metrics(results, evaluator.count, options.n, seed, options.resamples)
    lines = method_table(results, options.ks, evaluator.count, options.n, seed, options.resamples)
    print("\n".join(lines), flush=True)
    if table is not None:
        table.write_text("\n".join(lines) + "\n")
    if out is not None:
        write_samples(out, results, options.n)
    return metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    args = parse_args(argv)
    if "harness" in args:
        from rlframe.evaluation.harness import HarnessError, run_harness

        if "model" not in args:
            raise EvalUsageError("harness=...: model=<HF folder or checkpoint> is required")
        if "teacher" in args:
            raise EvalUsageError("harness=... and teacher=...: the teacher scores rlframe.eval's own generations; "
                                 "run them as two commands")
        try:
            return run_harness(args, resolve_model(args["model"], Path.cwd()))
        except HarnessError as error:
            raise EvalUsageError(str(error)) from None
    cfg, model, files, run_dir = build_config(args)
    options = options_from_args(args)
    if options.n > 1 and cfg.rollout.val_temperature == 0.0:
        print("note: n > 1 with temperature=0 (greedy) repeats one answer; set temperature=1.0 to sample", flush=True)
    from rlframe.evaluation.checkpoints import CheckpointSpecError, checkpoint_points, evaluate_checkpoints
    from rlframe.evaluation.constraints import ConstraintError
    from rlframe.evaluation.core import EvalInputError

    try:
        if "checkpoints" in args:
            if run_dir is None:
                raise EvalUsageError("checkpoints=...: needs run=<run_dir> (the run whose checkpoints to evaluate)")
            points = checkpoint_points(run_dir, args["checkpoints"], cfg.model.path)
            rows, paths = evaluate_checkpoints(cfg, run_dir, points, files, options, resolve_model, cfg.trainer.seed)
            print(paths[1].read_text(), flush=True)
            print(f"checkpoints: {', '.join(str(p) for p in paths)}", flush=True)
            metrics = {"checkpoints": [{"step": r["step"], **r["metrics"]} for r in rows]}
            print("metrics: " + json.dumps(metrics), flush=True)
            return metrics
        work_dir = run_dir or Path.cwd()
        model_path = resolve_model(model, work_dir)
        out = Path(args["out"]) if "out" in args else (run_dir / "eval_samples.jsonl" if run_dir else None)
        metrics = evaluate(cfg, model_path, files, options, out=out,
                           table=Path(args["table"]) if "table" in args else None)
    except ConstraintError as error:
        raise EvalUsageError(f"constrain={args.get('constrain')}: {error}") from None
    except (EvalInputError, CheckpointSpecError) as error:
        raise EvalUsageError(str(error)) from None
    print("metrics: " + json.dumps(metrics), flush=True)  # one line, for scripts
    if out is not None:
        print(f"responses: {out}")
    return metrics


if __name__ == "__main__":
    main()
