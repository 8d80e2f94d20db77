"""The `reward:` and `reward_model:` sections (rule-based reward functions, a model-based reward) and their checks."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlframe.bounds import bounded, one_of
from rlframe.config.checks import resolvable


@dataclass
class RewardFunctionConfig:
    # a Python file defining the reward function (reward_fns/ are ready ones); file.py:function also works
    path: str = "reward_fns/math.py"
    # the function in that file: (data_source, solution_str, ground_truth, extra_info) -> float or dict with score
    name: str = "compute_score"
    # its score is multiplied by this before the scores of all functions are summed
    weight: float = bounded(1.0, "finite")
    data_sources: Optional[list[str]] = None  # the rows it scores, by data_source; null: every row
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function (verl reward_kwargs)
    # sample | sequential (per sample) | batch (EasyR1); null: from the file's REWARD_TYPE, else by signature
    reward_type: Optional[str] = None


@dataclass
class JudgeCriterion:
    """One weighted criterion of a judge's rubric (reward.judge.criteria)."""

    name: str = ""  # what the judge writes before its rating: '<name>: <1-10>' (a word or two)
    description: str = ""  # what the criterion asks, shown to the judge
    weight: float = bounded(1.0, "> 0")  # its share of the one score: sum_c w_c (n_c - 1) / 9 / sum_c w_c


@dataclass
class JudgeConfig:
    """An LLM judge (rlframe/reward/judge.py) grading each response; its score, times weight, is added to the
    rule rewards (reward.functions=[]: the judge's score alone). Off while both model and url are empty.
    Wired in stage=rl (every estimator: GRPO, PPO, RLOO, ...) and stage=rft. A reply without a usable verdict
    is unscorable: in RL left out of its group's baseline with advantage 0 (reward/judge_unscorable_rate)."""

    model: str = ""  # the judge's model (embedded name / HF folder) on its own engine; with url: the served model name
    url: str = ""  # an OpenAI-compatible endpoint (http://host:port/v1) instead of a local engine
    rubric: str = ""  # "" -> rlframe.reward.judge.DEFAULT_RUBRIC
    # a rubric of weighted criteria, each rated 1-10 on its own line '<name>: <n>' and combined into one score
    # (weighted mean of (n - 1) / 9); a reply missing one is unscorable. []: no criteria
    criteria: list[JudgeCriterion] = field(default_factory=list)
    # a free-form verdict: a regular expression whose first group (or whole match; the last match counts) is
    # looked up in `verdicts`, or read as a number without them; no match: unscorable. "": not this mode
    pattern: str = ""
    verdicts: dict[str, float] = field(default_factory=dict)  # with pattern: verdict text -> score, e.g. {correct: 1}
    # fields {rubric} {criteria} {prompt} {response} {ground_truth}; "" -> the mode's default (rubric, verdict, 1-10)
    template: str = ""
    parser: str = ""  # "file.py:function" (judge text -> float | None); "" -> parse_score_1_to_10 ((n - 1) / 9)
    weight: float = 1.0  # the judge's score is multiplied by this and added to the rule rewards
    # stage=rft only: the score of a reply without a usable verdict (RL never makes one up: unscorable)
    fallback_score: float = 0.0
    max_new_tokens: int = 16  # tokens the judge may write per verdict
    max_model_len: int = 1024  # the local judge engine's context (prompt + verdict) in tokens
    engine: str = "auto"  # the local judge's engine: auto (vLLM on GPU, HF generate on CPU) | vllm | hf
    batch_size: int = 64  # judge prompts per call
    timeout_s: float = 600.0  # one call (with url: one request)
    api_key_env: str = "OPENAI_API_KEY"  # with url: the environment variable holding the key (may be unset)
    # with url: retries of a request that timed out, lost its connection or got 408/409/429/5xx (exponential
    # backoff from 0.5 s), and the requests in flight at once (rlframe/reward/judge.py)
    max_retries: int = bounded(3, ">= 0")  # with url: retries of a failed request
    max_concurrency: int = bounded(8, ">= 1")  # with url: requests in flight at once
    max_rpm: float = bounded(0.0, ">= 0", "0: no limit")  # with url: requests started per minute, evenly spaced


@dataclass
class SandboxConfig:
    """The code sandbox (rlframe/reward/sandbox.py) that reward_fns/code.py and the python tool run generated code
    in. It isolates as root (uid drop + namespaces) or, off root, in an unprivileged user namespace; where the kernel
    allows neither, only a Python audit hook would stand between the code and this machine's files, so a reward
    file that uses the sandbox is refused at the start unless this is true."""

    allow_unisolated: bool = False  # run code rewards where the kernel gives no isolation (audit hook only)


@dataclass
class RewardConfig:
    # the reward functions; a sample's score is the weighted sum of those that cover its data_source
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    num_workers: int = bounded(2, ">= 0", "0: score in the driver process")  # processes scoring samples
    timeout_s: float = bounded(10.0, "> 0")  # one sample's scoring
    batch_timeout_s: float = bounded(300.0, "> 0")  # one batch's scoring
    fallback_score: float = bounded(0.0, "finite")  # the score of a sample whose reward failed
    # a reward function that fails stops the run at once (false: the sample gets fallback_score, counted)
    fail_fast: bool = False
    # Score step k's samples in a background thread while the old-log-prob / reference / critic passes run;
    # the driver joins the scores before the advantage (timing/reward_wait_s: how long it blocked there).
    # Same scores, same failure messages and counts; false: score, then run those passes (the old order).
    # Steps that need the rewards before the log-probs (DAPO's dynamic sampling) always score first.
    overlap: bool = True
    # A reward file is first imported in a short-lived child process (before the driver imports it): an
    # import that ends its process (os._exit) or does not finish within this many seconds is an error
    # naming reward.functions[i], instead of a driver that exits silently or hangs.
    import_timeout_s: float = bounded(60.0, "> 0")
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # an LLM judge's reward (stage=rl and stage=rft)
    # What a reward worker process prints (stdout + stderr) reaches the driver's log up to this many bytes
    # per batch; the rest is dropped, with one line saying so.
    max_output_bytes: int = bounded(65536, ">= 0")
    # Stop the run when a reward function fails (raises, times out, returns a bad score) on more than this
    # fraction of the samples it scores in each of max_failure_steps training batches in a row; the error
    # names the function and its first failure. 1.0: never stop (the failed samples get fallback_score).
    max_failure_rate: float = bounded(0.95, "[0, 1]", "1: never stop")
    max_failure_steps: int = bounded(3, ">= 1")  # consecutive batches above max_failure_rate before the run stops
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # generated code's sandbox (reward_fns/code.py)


@dataclass
class RewardModelConfig:
    """A model-based reward (HF sequence-classification RM, num_labels=1) added to the rule rewards:
    score = sum of weighted reward functions + weight * rm_score. Runs colocated with the actor."""

    enable: bool = False  # add the reward model's score to the rule rewards (starts the reward-model role)
    # the reward model: an HF sequence-classification folder with num_labels=1 (stage=rm writes one: <run_dir>/hf_model)
    path: str = ""
    weight: float = bounded(1.0, "finite")  # its score is multiplied by this before it is added
    max_length: int = bounded(2048, ">= 1")  # prompt + response tokens it reads (longer: the left part is cut)
    micro_batch_size: int = bounded(8, ">= 1")  # sequences per forward
    # auto | float32 | bfloat16 | float16 (auto: as model.dtype resolves)
    dtype: str = one_of("auto", ("auto", "float32", "bfloat16", "float16"))
    trust_remote_code: bool = False  # run the reward model folder's own Python code


# ------------------------------------------------------------------------------------ checks
def reward_functions_load(cfg, need) -> None:
    """At least one reward function; each file exists and defines its function (loaded here, in the driver,
    before any worker). EasyR1's `file.py:function` in the path is split into path and name (in place)."""
    from rlframe.reward.loader import RewardLoadError, split_path_name
    from rlframe.reward.manager import RewardSpec, validate_reward_specs

    need(bool(cfg.reward.functions) or reward_comes_from_elsewhere(cfg), "reward.functions",
         "no reward function (and no multi-turn environment or reward model giving the reward). "
         "Fix: reward.functions=[{path: reward_fns/math.py}]")
    for i, fn in enumerate(cfg.reward.functions):
        fn.path, fn.name = split_path_name(fn.path, fn.name)  # EasyR1's file.py:function
        if not Path(fn.path).exists():
            need(False, f"reward.functions[{i}].path",
                 f"'{fn.path}' does not exist. Fix: point it at your reward script (e.g. reward_fns/math.py).")
            continue
        try:
            validate_reward_specs([RewardSpec(path=fn.path, name=fn.name, weight=fn.weight, data_sources=fn.data_sources,
                                              kwargs=dict(fn.kwargs), reward_type=fn.reward_type)],
                                  import_timeout_s=cfg.reward.import_timeout_s)
        except (RewardLoadError, ValueError) as error:  # (the loader's messages say reward.functions[i])
            need(False, f"reward.functions[{i}]", str(error).replace("reward.functions[i]", f"reward.functions[{i}]"))


def uses_sandbox(path: str) -> bool:
    """Does this reward file run code in rlframe's sandbox (reward_fns/code.py, or a file importing it)?"""
    try:
        return "rlframe.reward.sandbox" in Path(path).read_text(errors="replace")
    except OSError:
        return False


def sandbox_isolates(cfg, need) -> None:
    """A reward file that runs generated code in the sandbox: say which isolation this machine gives (the
    console), and refuse to start where there is none unless reward.sandbox.allow_unisolated=true. The choice
    reaches the reward worker processes (started later from this one) through RLFRAME_SANDBOX_ALLOW_UNISOLATED;
    each code reward also reports reward/sandbox_isolated_mean (1: isolated) in the run's metrics."""
    import logging

    users = [f"reward.functions[{i}]" for i, fn in enumerate(cfg.reward.functions) if uses_sandbox(fn.path)]
    if not users:
        return
    from rlframe.reward.sandbox import ALLOW_UNISOLATED_ENV, isolation_mode, unisolated_message

    mode = isolation_mode()
    logging.getLogger(__name__).info("%s run generated code in the sandbox: isolation mode %s (%s)", ", ".join(users),
                                     mode, {"root": "uid drop + namespaces + allow-list root",
                                            "userns": "unprivileged user namespace + allow-list root",
                                            "none": "audit hook only: NOT isolated"}[mode])
    if mode == "none" and cfg.reward.sandbox.allow_unisolated:
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    need(mode != "none" or cfg.reward.sandbox.allow_unisolated, "reward.sandbox.allow_unisolated",
         f"{', '.join(users)}: " + unisolated_message({"mode": mode}))


def reward_comes_from_elsewhere(cfg) -> bool:
    """No reward function is needed when a multi-turn environment, a reward model or an LLM judge gives the reward."""
    mt = cfg.rollout.multi_turn
    judge = cfg.reward.judge
    return bool(mt.enable and mt.environment.path) or bool(cfg.reward_model.enable) or bool(judge.model or judge.url)


def reward_model_resolves(cfg, need) -> None:
    rm = cfg.reward_model
    need(not rm.enable or (bool(rm.path) and resolvable(rm.path)), "reward_model.path",
         f"'{rm.path}' is not a model folder or hub id. Fix: reward_model.path=/path/to/rm")


JUDGE_STAGES = ("rl", "rft")  # the stages that score samples with reward.judge


def judge_valid(cfg, need) -> None:
    """reward.judge: a model or a URL, a template the judge can be asked with, a parser / rubric / verdict
    pattern that works; in a stage that uses it (rl, rft)."""
    import re

    judge = cfg.reward.judge
    if not (judge.model or judge.url):
        return
    from rlframe.reward.judge import load_parser, template_problem

    need(not judge.url or bool(judge.model), "reward.judge.model",
         "an OpenAI-compatible endpoint needs the served model's name. Fix: reward.judge.model=<name>")
    need(judge.url or resolvable(judge.model), "reward.judge.model",
         f"'{judge.model}' is neither a folder, an embedded model nor a hub id. Fix: reward.judge.model=smollm2-135m-instruct "
         "(or reward.judge.url=http://host:port/v1)")
    need(not judge.url or judge.url.startswith(("http://", "https://")), "reward.judge.url",
         f"'{judge.url}' is not an http(s) URL. Fix: reward.judge.url=http://host:port/v1")
    problem = template_problem(judge.template) if judge.template else None
    need(problem is None, "reward.judge.template", f"{problem}. Fix: e.g. 'Rate {{response}} for {{prompt}}: Score: <1-10>'")
    modes = [name for name, on in (("criteria", bool(judge.criteria)), ("pattern", bool(judge.pattern)),
                                   ("parser", bool(judge.parser))) if on]
    need(len(modes) <= 1, "reward.judge", f"{' and '.join(modes)} are both set: the reply is read one way. "
         "Fix: keep one of reward.judge.criteria / pattern / parser")
    for i, criterion in enumerate(judge.criteria):
        need(bool(criterion.name.strip()), f"reward.judge.criteria[{i}].name",
             "a criterion needs a name (the judge writes '<name>: <1-10>'). Fix: {name: correctness, description: ...}")
        need(criterion.weight > 0, f"reward.judge.criteria[{i}].weight", f"{criterion.weight} is not > 0")
    names = [c.name.strip().lower() for c in judge.criteria]
    need(len(set(names)) == len(names), "reward.judge.criteria", f"two criteria share a name: {names}")
    if judge.pattern:
        try:
            re.compile(judge.pattern)
        except re.error as error:
            need(False, "reward.judge.pattern", f"'{judge.pattern}' is not a regular expression ({error}). "
                 "Fix: e.g. 'Verdict:\\s*(correct|incorrect)'")
    need(not judge.verdicts or bool(judge.pattern), "reward.judge.verdicts",
         "verdicts are read through reward.judge.pattern, which is empty. Fix: reward.judge.pattern='Verdict:\\s*(\\w+)'")
    if judge.parser:
        try:
            load_parser(judge.parser)
        except Exception as error:
            need(False, "reward.judge.parser", f"{error}")
    need(judge.engine in ("auto", "vllm", "hf"), "reward.judge.engine", f"'{judge.engine}' is not auto, vllm or hf")
    need(judge.max_new_tokens >= 1 and judge.batch_size >= 1, "reward.judge.max_new_tokens",
         "reward.judge.max_new_tokens and batch_size must be >= 1")
    need(cfg.stage in JUDGE_STAGES, "reward.judge",
         f"the judge reward scores samples in stage=rl and stage=rft; stage={cfg.stage} would ignore it. "
         "Fix: remove reward.judge")


CHECKS = (reward_model_resolves, reward_functions_load, judge_valid, sandbox_isolates)
