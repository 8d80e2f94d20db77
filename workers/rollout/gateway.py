"""An OpenAI-compatible endpoint over a rollout engine, recording every call token in, token out.

    gateway = Gateway(encoder, host="127.0.0.1", max_model_len=...)
    url = gateway.start()                      # http://127.0.0.1:<free port>/v1 (loopback by default)
    episode = gateway.open_episode(row, budget, seed, params)   # episode.key: its OPENAI_API_KEY
    while ...: gateway.serve_engine(engine)    # the engine is driven from the caller's thread only
    gateway.close_episode(episode); gateway.stop()              # the port is released

Endpoints: POST /v1/chat/completions and /v1/completions (streaming and not; `n`, `max_tokens` /
`max_completion_tokens`, `stop`, `logprobs` / `top_logprobs` (the sampled tokens'), `temperature`, `top_p`,
`tools` / `tool_choice` ("none" turns the parser off), `seed`), GET /v1/models. Any `model` name is accepted.
The key names the episode: a call with an unknown key is refused (401, counted), one after its episode ended
is refused (401, counted as a late call of that episode), a malformed one gets a 400 naming the field (counted);
a call past the episode's token budget gets a 400 `context_length_exceeded` (counted). A streamed response
comes in one content chunk once the completion is sampled (the engine samples whole completions).

Server: the standard library's ThreadingHTTPServer, one thread per connection, each waiting on its completion
while the caller's thread drives the engine. Chosen over fastapi + uvicorn: no event loop beside vLLM's engine
inside the Ray actor, nothing to import in the worker, and `stop()` joins the thread and closes the socket
deterministically (no port outlives a rollout).
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlframe.workers.rollout.gateway_chat import (
    ChatEncoder,
    RequestError,
    normalized,
    request_tools,
    same_assistant,
)
from rlframe.workers.rollout.gateway_engines import CallParams, Sampled

MAX_N = 16
GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class CallRecord:
    """One call as the engine saw it: the prompt ids, and per choice the sampled ids, their log-probs, why it
    stopped; `extends`: (call index, choice) whose prompt + sampled ids this prompt starts with, or None."""

    index: int
    endpoint: str
    prompt_ids: list[int]
    messages: list[dict] | None
    choices: list[dict] = field(default_factory=list)
    extends: tuple[int, int] | None = None
    policy_version: int = 0
    seconds: float = 0.0
    tool_calls: int = 0
    malformed_tool_calls: int = 0


@dataclass
class Episode:
    """One sample's agent run: its key, the row index, the response-token budget (per chain of calls)."""

    key: str
    row: int
    budget: int
    params: CallParams
    seed: int | None = None
    open: bool = True
    calls: list[CallRecord] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)  # code -> calls refused (malformed, late, over_budget, ...)
    lock: threading.Lock = field(default_factory=threading.Lock)


class PendingCall:
    """A call's n completions in flight: the handler thread waits; the engine's thread delivers."""

    def __init__(self, episode: Episode, prompt_ids: list[int], params: list[CallParams]):
        self.episode, self.prompt_ids, self.params = episode, prompt_ids, params
        self.results: list[Sampled | None] = [None] * len(params)
        self.done = threading.Event()

    def deliver(self, choice: int, sampled: Sampled) -> None:
        self.results[choice] = sampled
        if all(r is not None for r in self.results):
            self.done.set()


class Gateway:
    def __init__(self, encoder: ChatEncoder, *, host: str = "127.0.0.1", max_model_len: int = 4096,
                 max_tokens_per_call: int = 0, sampling_from_request: bool = False, policy_version: int = 0,
                 call_timeout_s: float = 600.0):
        self.encoder, self.host, self.max_model_len = encoder, host, max_model_len
        self.max_tokens_per_call, self.sampling_from_request = max_tokens_per_call, sampling_from_request
        self.policy_version, self.call_timeout_s = policy_version, call_timeout_s
        self.episodes: dict[str, Episode] = {}
        self.closed_keys: set[str] = set()
        self.unknown_key_calls = 0
        self.queue: queue.Queue[PendingCall] = queue.Queue()
        self.in_engine: dict[tuple[int, int], tuple[PendingCall, int]] = {}
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.tokenizer_lock = threading.Lock()

    # ------------------------------------------------------------------ life cycle
    def start(self) -> str:
        gateway = self

        class Handler(GatewayHandler):
            pass

        Handler.gateway = gateway
        self.server = ThreadingHTTPServer((self.host, 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True, name="rlframe-gateway")
        self.thread.start()
        return f"http://{self.host}:{self.server.server_address[1]}/v1"

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.server_address[1]

    def stop(self) -> None:
        for pending in list(self.in_engine.values()):
            pending[0].done.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None

    def open_episode(self, row: int, budget: int, params: CallParams, seed: int | None = None) -> Episode:
        episode = Episode(key=f"rlframe-episode-{secrets.token_hex(12)}", row=row, budget=budget, params=params,
                          seed=seed)
        self.episodes[episode.key] = episode
        return episode

    def close_episode(self, episode: Episode) -> None:
        """Its key is refused from now on (a call arriving later is counted as late); its waiting calls return."""
        episode.open = False
        self.closed_keys.add(episode.key)
        for pending, _ in list(self.in_engine.values()):
            if pending.episode is episode:
                pending.done.set()

    # ------------------------------------------------------------------ the engine side (caller's thread)
    def serve_engine(self, engine, wait_s: float = 0.01) -> int:
        """Submit the queued calls, step the engine once, deliver what finished; returns completions delivered.
        Waits up to `wait_s` for a call when the engine is idle."""
        try:
            pending = self.queue.get(timeout=wait_s) if not engine.busy else self.queue.get_nowait()
        except queue.Empty:
            pending = None
        while pending is not None:
            if pending.episode.open:
                for choice, params in enumerate(pending.params):
                    key = (id(pending), choice)
                    self.in_engine[key] = (pending, choice)
                    engine.submit(key, pending.prompt_ids, params)
            else:
                pending.done.set()
            try:
                pending = self.queue.get_nowait()
            except queue.Empty:
                pending = None
        ended = [key for key, (pending, _) in self.in_engine.items() if not pending.episode.open]
        if ended:  # an ended (killed, crashed) episode's completions are not generated further
            engine.abort(ended)
            for key in ended:
                self.in_engine.pop(key)[0].done.set()
        if not engine.busy:
            return 0
        delivered = 0
        for sampled in engine.step():
            entry = self.in_engine.pop(sampled.key, None)
            if entry is not None:
                entry[0].deliver(entry[1], sampled)
                delivered += 1
        return delivered

    # ------------------------------------------------------------------ requests (handler threads)
    def episode_for(self, authorization: str | None) -> Episode:
        key = (authorization or "").removeprefix("Bearer ").strip()
        episode = self.episodes.get(key)
        if episode is None:
            self.unknown_key_calls += 1
            raise RequestError("unknown API key: the gateway gives each episode its own OPENAI_API_KEY",
                               code="unknown_key", status=401)
        if not episode.open:
            with episode.lock:
                episode.refused["late"] += 1
            raise RequestError("this episode has ended: its key no longer takes calls", code="episode_ended",
                               status=401)
        return episode

    def complete(self, episode: Episode, endpoint: str, body: dict) -> tuple[CallRecord, list[dict]]:
        """One call: prompt ids (continuing an earlier call where it can), the engine's completions, the record."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        tools = request_tools(body.get("tools")) if endpoint == "chat" else {}
        if body.get("tool_choice") == "none":
            tools_for_parse = {}
        else:
            tools_for_parse = tools
        with self.tokenizer_lock:
            if endpoint == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise RequestError("'messages' must be a non-empty list", param="messages")
                prompt_ids, extends = self.chat_prompt(episode, messages, tools)
            else:
                messages = None
                prompt_ids, extends = self.completion_prompt(episode, body.get("prompt"))
        params = self.call_params(episode, body, prompt_ids, extends)
        started = time.monotonic()
        pending = PendingCall(episode, prompt_ids, params)
        self.queue.put(pending)
        if not pending.done.wait(self.call_timeout_s) or any(r is None for r in pending.results):
            raise RequestError("the episode ended while this call was generating", code="episode_ended", status=409)
        with episode.lock:
            record = CallRecord(index=len(episode.calls), endpoint=endpoint, prompt_ids=prompt_ids, messages=messages,
                                extends=extends, policy_version=self.policy_version,
                                seconds=time.monotonic() - started)
            choices = []
            for c, sampled in enumerate(pending.results):
                with self.tokenizer_lock:
                    text = self.encoder.tokenizer.decode(sampled.ids, skip_special_tokens=True)
                    if sampled.stop_hit and sampled.stop_hit in text:
                        text = text[: text.index(sampled.stop_hit)]
                    message, malformed = (self.encoder.assistant_message(text, tools_for_parse, f"call-{record.index}-{c}")
                                          if endpoint == "chat" else (None, 0))
                record.tool_calls += len((message or {}).get("tool_calls") or [])
                record.malformed_tool_calls += malformed
                finish = "tool_calls" if message and message.get("tool_calls") else sampled.finish_reason
                record.choices.append({"ids": sampled.ids, "log_probs": sampled.log_probs, "finish_reason": finish,
                                       "text": text, "message": message})
                choices.append(record.choices[-1])
            episode.calls.append(record)
        return record, choices

    def chat_prompt(self, episode: Episode, messages: list[dict], tools) -> tuple[list[int], tuple[int, int] | None]:
        """The prompt ids of a chat call: an earlier call's prompt + sampled ids + the new messages' ids when the
        messages continue that call (its messages, then the assistant message returned for it), else fresh."""
        keys = [normalized(m) for m in messages]
        if keys[-1]["role"] == "assistant":
            raise RequestError("the last message is the assistant's: continuing a partial assistant message is not "
                               "supported", param="messages")
        for call in reversed(episode.calls):
            if call.messages is None or len(call.messages) >= len(messages):
                continue
            k = len(call.messages)
            if [normalized(m) for m in call.messages] != keys[:k]:
                continue
            for c, choice in enumerate(call.choices):
                if not same_assistant(messages[k], choice["message"]):
                    continue
                closed = bool(choice["ids"]) and choice["ids"][-1] == self.encoder.tokenizer.eos_token_id
                suffix = self.encoder.continuation_ids(messages, k, tools, closed)
                if suffix is not None:
                    return call.prompt_ids + choice["ids"] + suffix, (call.index, c)
        return self.encoder.fresh_ids(messages, tools), None

    def completion_prompt(self, episode: Episode, prompt) -> tuple[list[int], tuple[int, int] | None]:
        """A /v1/completions prompt: token ids as given (token in), or text tokenized once; it continues an earlier
        call when its ids start with that call's prompt + sampled ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = self.encoder.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt per call)",
                               param="prompt")
        for call in reversed(episode.calls):
            for c, choice in enumerate(call.choices):
                done = call.prompt_ids + choice["ids"]
                if len(ids) > len(done) and ids[: len(done)] == done:
                    return ids, (call.index, c)
        return ids, None

    def chain_root(self, episode: Episode, extends: tuple[int, int] | None) -> list[int]:
        """The first prompt of the chain this call continues (its own prompt when it starts one)."""
        while extends is not None:
            call = episode.calls[extends[0]]
            if call.extends is None:
                return call.prompt_ids
            extends = call.extends
        return []

    def call_params(self, episode: Episode, body: dict, prompt_ids: list[int], extends) -> list[CallParams]:
        """Per choice: max new tokens within the episode's budget (the chain's tokens after its first prompt) and the
        engine's context; the run's sampling unless the request's is honoured; a seed per (episode, call, choice)."""
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestError(f"'n' must be a whole number in [1, {MAX_N}], got {n!r}", param="n")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise RequestError(f"'max_tokens' must be a whole number >= 1, got {asked!r}", param="max_tokens")
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise RequestError("'stop' must be a string or a list of at most 4 strings", param="stop")
        root = self.chain_root(episode, extends) if extends is not None else prompt_ids
        remaining = min(episode.budget - (len(prompt_ids) - len(root)), self.max_model_len - len(prompt_ids))
        if remaining < 1:
            with episode.lock:
                episode.refused["over_budget"] += 1
            raise RequestError(f"this call's prompt ({len(prompt_ids)} tokens) leaves no room in the episode's budget "
                               f"({episode.budget} tokens after the first prompt, {self.max_model_len} in all)",
                               code="context_length_exceeded", param="messages")
        cap = min(remaining, self.max_tokens_per_call or remaining, asked or remaining)
        base = replace(episode.params, max_new_tokens=cap, stop=stops)
        if self.sampling_from_request:
            for key in ("temperature", "top_p"):
                value = body.get(key)
                if value is not None:
                    if not isinstance(value, (int, float)) or value < 0:
                        raise RequestError(f"'{key}' must be a number >= 0", param=key)
                    base = replace(base, **{key: float(value)})
        calls = len(episode.calls)
        seed = None if episode.seed is None else episode.seed + (calls + 1) * GOLDEN
        return [replace(base, seed=None if seed is None else (seed + c * 7919) & (2**63 - 1)) for c in range(n)]


class GatewayHandler(BaseHTTPRequestHandler):
    """HTTP/1.1: JSON in, JSON (or server-sent events, chunked) out; errors in OpenAI's {"error": {...}} form."""

    gateway: Gateway = None  # set on the per-server subclass
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 (quiet: the record and the metrics say what happened)
        pass

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "rlframe-policy", "object": "model",
                                                                     "owned_by": "rlframe"}]})
        self.send_error_json(RequestError(f"no such endpoint: GET {self.path}", code="not_found", status=404))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(self.path.rstrip("/"))
        episode = None
        try:
            episode = self.gateway.episode_for(self.headers.get("Authorization"))
            if endpoint is None:
                raise RequestError(f"no such endpoint: POST {self.path} (the gateway serves /v1/chat/completions "
                                   "and /v1/completions)", code="not_found", status=404)
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise RequestError(f"the body is not JSON ({error})") from None
            record, choices = self.gateway.complete(episode, endpoint, body)
        except RequestError as error:
            if episode is not None and error.code not in ("episode_ended", "context_length_exceeded"):
                with episode.lock:
                    episode.refused[error.code] += 1
            return self.send_error_json(error)
        if body.get("stream"):
            return self.send_stream(endpoint, body, record, choices)
        self.send_json(200, response_body(endpoint, body, record, choices, self.gateway.encoder.tokenizer))

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, error: RequestError) -> None:
        kind = "authentication_error" if error.status == 401 else "invalid_request_error"
        self.send_json(error.status, {"error": {"message": str(error), "type": kind, "param": error.param,
                                                "code": error.code}})

    def send_stream(self, endpoint: str, body: dict, record: CallRecord, choices: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in stream_events(endpoint, body, record, choices):
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


def usage(record: CallRecord, choices: list[dict]) -> dict:
    completion = sum(len(c["ids"]) for c in choices)
    return {"prompt_tokens": len(record.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(record.prompt_ids) + completion}


def token_logprobs(choice: dict, tokenizer) -> list[dict]:
    return [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode()),
             "top_logprobs": []} for t, lp in zip(choice["ids"], choice["log_probs"])]


def response_body(endpoint: str, body: dict, record: CallRecord, choices: list[dict], tokenizer) -> dict:
    created, model = int(time.time()), body.get("model") or "rlframe-policy"
    if endpoint == "chat":
        out = [{"index": i, "message": c["message"], "finish_reason": c["finish_reason"],
                "logprobs": {"content": token_logprobs(c, tokenizer)} if body.get("logprobs") else None}
               for i, c in enumerate(choices)]
        return {"id": f"chatcmpl-{record.index}", "object": "chat.completion", "created": created, "model": model,
                "choices": out, "usage": usage(record, choices)}
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = [tokenizer.decode([t]) for t in c["ids"]]
            logprobs = {"tokens": tokens, "token_logprobs": c["log_probs"], "top_logprobs": None,
                        "text_offset": [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]}
        out.append({"index": i, "text": c["text"], "finish_reason": c["finish_reason"], "logprobs": logprobs})
    return {"id": f"cmpl-{record.index}", "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage(record, choices)}


def stream_events(endpoint: str, body: dict, record: CallRecord, choices: list[dict]) -> list[str]:
    """The server-sent events of a streamed response: per choice its content (and tool calls) in one chunk, then
    its finish reason; the usage chunk when stream_options.include_usage; [DONE]."""
    created, model = int(time.time()), body.get("model") or "rlframe-policy"
    events = []
    for i, c in enumerate(choices):
        if endpoint == "chat":
            delta = {"role": "assistant", "content": c["message"]["content"]}
            if c["message"].get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(c["message"]["tool_calls"])]
            chunks = [{"index": i, "delta": delta, "finish_reason": None},
                      {"index": i, "delta": {}, "finish_reason": c["finish_reason"]}]
            kind, prefix = "chat.completion.chunk", "chatcmpl"
        else:
            chunks = [{"index": i, "text": c["text"], "finish_reason": None, "logprobs": None},
                      {"index": i, "text": "", "finish_reason": c["finish_reason"], "logprobs": None}]
            kind, prefix = "text_completion", "cmpl"
        events += [json.dumps({"id": f"{prefix}-{record.index}", "object": kind, "created": created, "model": model,
                               "choices": [chunk]}) for chunk in chunks]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(json.dumps({"id": f"chatcmpl-{record.index}", "object": "chat.completion.chunk",
                                  "created": created, "model": model, "choices": [], "usage": usage(record, choices)}))
    return events + ["[DONE]"]
