"""Scoring given sequences with a vLLM engine or an OpenAI-compatible server: the vllm and url backends of the
teacher role (teacher.backend=vllm | url).

Each sequence (the prompt without its padding + the sampled response) goes in as one prompt with
`prompt_logprobs=K`, `max_tokens=1`, temperature 1: vLLM returns, for every position but the first, the
log-prob of the token there and the K most likely tokens at it, from the model's raw logits (verl's and TRL's
server teachers read the same field). Position P_u + t of a row (P_u: its unpadded prompt length) is response
token t, so

    teacher_log_prob[b, t]          = prompt_logprobs[P_u + t][responses[b, t]]
    teacher_topk_ids / _log_probs   = the entries of rank 1..K at P_u + t

The engine is the rollout's own (VLLMRollout, in-process, prefix caching off: a cached prefix returns no
prompt log-probs), and sleeps between uses as the rollout's does. vLLM cannot score arbitrary ids (the
student's top-k): reverse_kl_student_topk needs teacher.backend=fsdp (checked in rlframe/config/teacher.py).
The url backend (URLScorer) sends the same request to <teacher.url>/completions; the reply's `prompt_logprobs`
(vLLM's OpenAI server; keys are token ids) is read the same way.
"""

from __future__ import annotations

import torch

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto

VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs (prompt_logprobs=K must not exceed it; the config checks it too)


def scoring_requests(data: DataProto) -> tuple[list[list[int]], list[int]]:
    """Per row: the token ids to score (the unpadded prompt + the response's present tokens) and P_u."""
    b = data.batch
    responses = b["responses"]
    prompt_width = b["input_ids"].shape[1] - responses.shape[1]
    present = b["attention_mask"].bool()
    sequences, prompt_lengths = [], []
    for row in range(len(responses)):
        prompt = b["input_ids"][row, :prompt_width][present[row, :prompt_width]].tolist()
        response = responses[row][present[row, prompt_width:]].tolist()
        sequences.append(prompt + response)
        prompt_lengths.append(len(prompt))
    return sequences, prompt_lengths


def tensors_from_prompt_logprobs(prompt_logprobs: list, data: DataProto, prompt_lengths: list[int],
                                 k: int) -> dict[str, torch.Tensor]:
    """vLLM's per-request prompt_logprobs (a list per position of {token id: Logprob(logprob, rank)}) ->
    teacher_log_prob [B, R], teacher_topk_ids [B, R, K] (int64), teacher_topk_log_probs [B, R, K] (float32).
    Positions past a response's end stay 0 (finite: the losses mask them)."""
    responses = data.batch["responses"]
    rows, width = responses.shape
    log_prob = torch.zeros(rows, width)
    topk_ids = torch.zeros(rows, width, k, dtype=torch.long)
    topk_log_probs = torch.zeros(rows, width, k)
    for row, (positions, start) in enumerate(zip(prompt_logprobs, prompt_lengths)):
        for t, entries in enumerate(positions[start:]):
            token = int(responses[row, t])
            log_prob[row, t] = entries[token].logprob
            ranked = sorted(((v.rank, token_id, v.logprob) for token_id, v in entries.items() if v.rank <= k))[:k]
            if len(ranked) < k:
                raise RuntimeError(f"vLLM returned {len(ranked)} top-k entries at row {row}, token {t} (asked {k})")
            topk_ids[row, t] = torch.tensor([token_id for _, token_id, _ in ranked])
            topk_log_probs[row, t] = torch.tensor([lp for _, _, lp in ranked])
    return {"teacher_log_prob": log_prob, "teacher_topk_ids": topk_ids, "teacher_topk_log_probs": topk_log_probs}


class VLLMScorer:
    """A frozen vLLM engine that scores sequences (prompt_logprobs); sleeps between uses (`offload`)."""

    def __init__(self, model_path: str, profile: DeviceProfile, *, top_k: int, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, cpu_kv_cache_gib: float = 0.5, offload: bool = True,
                 trust_remote_code: bool = False):
        from rlframe.workers.rollout.vllm_rollout import VLLMRollout

        if top_k > VLLM_MAX_LOGPROBS:
            raise ValueError(f"top_k={top_k} exceeds vLLM's max_logprobs ({VLLM_MAX_LOGPROBS})")
        self.top_k = top_k
        self.engine = VLLMRollout(model_path, profile, max_model_len=max_model_len, seed=seed, pad_token_id=0,
                                  gpu_memory_utilization=gpu_memory_utilization, cpu_kv_cache_gib=cpu_kv_cache_gib,
                                  enable_prefix_caching=False, enable_sleep_mode=offload,
                                  trust_remote_code=trust_remote_code)
        self.offload = offload
        if offload:
            self.engine.sleep()

    def score(self, data: DataProto) -> dict[str, torch.Tensor]:
        """The teacher outputs of `data` (see the module's docstring)."""
        from vllm import SamplingParams

        sequences, prompt_lengths = scoring_requests(data)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=self.top_k, detokenize=False)
        self.engine.wake_up(tags=["weights", "kv_cache"])
        try:
            outputs = self.engine.llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
        finally:
            if self.offload:
                self.engine.sleep()
        return tensors_from_prompt_logprobs([o.prompt_logprobs for o in outputs], data, prompt_lengths, self.top_k)


# ----------------------------------------------------------------------------------------------
# an OpenAI-compatible server (teacher.backend=url): the same prompt_logprobs, over HTTP


class ServedLogprob:
    """One entry of a served prompt_logprobs position ({"logprob": .., "rank": ..}), read as vLLM's Logprob."""

    __slots__ = ("logprob", "rank")

    def __init__(self, entry: dict):
        self.logprob, self.rank = float(entry["logprob"]), int(entry["rank"])


def served_prompt_logprobs(choice: dict) -> list:
    """A /v1/completions choice's `prompt_logprobs` (vLLM's and SGLang's extension: per position None or
    {"<token id>": {"logprob", "rank", ..}}) as {int id: ServedLogprob} per position."""
    positions = choice.get("prompt_logprobs")
    if not isinstance(positions, list):
        raise ValueError("the reply has no prompt_logprobs: the server must support the prompt_logprobs extension "
                         "of /v1/completions (vLLM's OpenAI server does)")
    return [None if p is None else {int(token): ServedLogprob(entry) for token, entry in p.items()} for p in positions]


class URLScorer:
    """Scores sequences on an OpenAI-compatible server: POST <url>/completions with the token ids as the prompt,
    max_tokens 1, temperature 1, prompt_logprobs K; requests in parallel (max_concurrency), each retried with
    exponential backoff on a connection error, a timeout, 429 or 5xx (max_retries), then an error naming the url."""

    def __init__(self, url: str, model: str, *, top_k: int, timeout_s: float = 60.0, max_concurrency: int = 8,
                 max_retries: int = 3, backoff_s: float = 0.5, api_key: str = ""):
        if top_k > VLLM_MAX_LOGPROBS:
            raise ValueError(f"top_k={top_k} exceeds the servers' usual max_logprobs ({VLLM_MAX_LOGPROBS})")
        self.url = url.rstrip("/") + "/completions"
        self.model, self.top_k, self.timeout_s = model, top_k, timeout_s
        self.max_concurrency, self.max_retries, self.backoff_s, self.api_key = max_concurrency, max_retries, backoff_s, api_key

    def request(self, token_ids: list[int]) -> dict:
        import json
        import time
        import urllib.error
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0,
                           "prompt_logprobs": self.top_k}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return json.loads(reply.read())["choices"][0]
            except urllib.error.HTTPError as error:
                last = f"HTTP {error.code}: {error.read()[:300].decode(errors='replace')}"
                if error.code != 429 and error.code < 500:
                    break  # a refused request stays refused
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                last = f"{type(error).__name__}: {error}"
        raise RuntimeError(f"the teacher at {self.url} did not score a sequence after {attempt + 1} tries: {last}. "
                           "Fix: teacher.url (a running OpenAI-compatible server with prompt_logprobs), teacher.model")

    def score(self, data: DataProto) -> dict[str, torch.Tensor]:
        from concurrent.futures import ThreadPoolExecutor

        sequences, prompt_lengths = scoring_requests(data)
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            choices = list(pool.map(self.request, sequences))
        return tensors_from_prompt_logprobs([served_prompt_logprobs(c) for c in choices], data, prompt_lengths,
                                            self.top_k)
