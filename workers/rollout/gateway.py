"""An OpenAI-compatible endpoint over a rollout engine, recording every call token in, token out.

    gateway = Gateway(encoder, host="127.0.0.1", max_model_len=..., limits=GatewayLimits())
    url = gateway.start()                      # http://127.0.0.1:<free port>/v1 (loopback unless allow_remote)
    episode = gateway.open_episode(row, budget, seed, params)   # episode.key: its OPENAI_API_KEY
    while ...: gateway.serve_engine(engine)    # the engine is driven from the caller's thread only
    gateway.close_episode(episode); gateway.stop()              # the port is released, every connection closed

Endpoints: POST /v1/chat/completions and /v1/completions (streaming and not; `n`, `max_tokens` /
`max_completion_tokens`, `stop`, `logprobs` / `top_logprobs` (the sampled tokens'), `temperature`, `top_p`,
`top_k`, `tools` / `tool_choice` ("none" turns the parser off), `seed`), GET /v1/models. Any `model` name is
accepted.

The trust boundary (docs/gateway.md, "What is checked"): the key is checked from the headers, before the body is
read (unknown: 401; its episode ended: 401 `episode_ended`, counted late); `Content-Length` must be a whole number
up to `max_body_bytes` (else 400 / 413, the body not read, the connection closed); a request not received within
`read_timeout_s` gets 408 and its connection is closed (idle keep-alive connections too); at most
`max_connections` connections are open (one more: 503); every field is checked before anything is rendered or
reaches an engine (gateway_checks.py: 400 naming the field); an episode takes at most `max_calls_per_episode`
calls and `max_episode_tokens` prompt + completion tokens (429); a call past the episode's chain budget gets a
400 `context_length_exceeded`. An engine that refuses a request (its `submit` raises) answers that call 400
`engine_refused`; an engine step that raises answers the calls in flight 500 `engine_error`; neither reaches the
caller of `serve_engine`. Every refusal is counted under its kind (episode.refused, or gateway.refused when no
episode is known): gateway/refused/<kind> in the step's metrics. A streamed response comes in one content chunk
once the completion is sampled (the engine samples whole completions).

Server: the standard library's ThreadingHTTPServer, one thread per connection (at most `max_connections`), each
waiting on its completion while the caller's thread drives the engine. Chosen over fastapi + uvicorn: no event
loop beside vLLM's engine inside the Ray actor, nothing to import in the worker, and `stop()` closes every
connection, joins its thread and closes the socket deterministically (no port or thread outlives a rollout).
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer

from rlframe.workers.rollout.gateway_chat import (
    ChatEncoder,
    RequestError,
    normalized,
    request_tools,
    same_assistant,
)
from rlframe.workers.rollout.gateway_checks import MAX_N, check_request  # noqa: F401 (MAX_N re-exported)
from rlframe.workers.rollout.gateway_engines import CallParams, Sampled
from rlframe.workers.rollout.gateway_http import GatewayHandler, GatewayServer, shut

logger = logging.getLogger(__name__)

GOLDEN = 0x9E3779B97F4A7C15
EPISODE_TOKENS_PER_CONTEXT = 32  # max_episode_tokens=0: this many times the engine's context


@dataclass(frozen=True)
class GatewayLimits:
    """What one connection, request and episode may use (the rollout.agent_program keys of the same names)."""

    max_body_bytes: int = 4 << 20  # a larger Content-Length: 413, the body never read
    read_timeout_s: float = 10.0  # a request (line, headers, body) not received by then: 408, connection closed
    max_connections: int = 64  # connections open at once; one more is answered 503 and closed
    max_calls_per_episode: int = 128  # calls past it: 429 call_limit
    max_episode_tokens: int = 0  # prompt + completion tokens of all an episode's calls (0: 32 x max_model_len)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_problem(host: str, allow_remote: bool) -> str | None:
    """Why the gateway may not listen on `host` (None: it may): plain HTTP, keys in headers, so loopback only
    unless remote agents are asked for explicitly."""
    if allow_remote or is_loopback(host):
        return None
    return (f"host {host!r} is not a loopback address: the gateway serves plain HTTP (the episodes' keys in clear) to "
            "every machine that can reach it. Fix: rollout.agent_program.host=127.0.0.1, or, for agents on other "
            "machines of a trusted network, rollout.agent_program.allow_remote=true")


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
    """One sample's agent run: its key, the row index, the response-token budget (per chain of calls); the calls
    admitted and the tokens they used or reserved (the per-episode limits)."""

    key: str
    row: int
    budget: int
    params: CallParams
    seed: int | None = None
    open: bool = True
    calls: list[CallRecord] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)  # kind -> calls refused (malformed, late, over_budget, ...)
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls_admitted: int = 0
    tokens_used: int = 0  # prompt + completion tokens of its calls (a call in flight: its max_tokens reserved)


class PendingCall:
    """A call's n completions in flight: the handler thread waits; the engine's thread delivers (or fails it)."""

    def __init__(self, episode: Episode, prompt_ids: list[int], params: list[CallParams]):
        self.episode, self.prompt_ids, self.params = episode, prompt_ids, params
        self.results: list[Sampled | None] = [None] * len(params)
        self.error: RequestError | None = None
        self.done = threading.Event()

    def deliver(self, choice: int, sampled: Sampled) -> None:
        self.results[choice] = sampled
        if all(r is not None for r in self.results):
            self.done.set()

    def fail(self, error: RequestError | None) -> None:
        """Answer the call with `error` (None: its episode ended) instead of completions."""
        if self.error is None:
            self.error = error
        self.done.set()


class Gateway:
    def __init__(self, encoder: ChatEncoder, *, host: str = "127.0.0.1", max_model_len: int = 4096,
                 max_tokens_per_call: int = 0, sampling_from_request: bool = False, policy_version: int = 0,
                 call_timeout_s: float = 600.0, vocab_size: int | None = None, allow_remote: bool = False,
                 limits: GatewayLimits | None = None):
        problem = host_problem(host, allow_remote)
        if problem is not None:
            raise ValueError(problem)
        self.encoder, self.host, self.max_model_len = encoder, host, max_model_len
        self.max_tokens_per_call, self.sampling_from_request = max_tokens_per_call, sampling_from_request
        self.policy_version, self.call_timeout_s = policy_version, call_timeout_s
        # token ids a request may hold: the ones both the tokenizer and the engine's embedding know
        self.vocab_size = vocab_size or len(encoder.tokenizer)
        self.limits = limits or GatewayLimits()
        self.episode_tokens = self.limits.max_episode_tokens or EPISODE_TOKENS_PER_CONTEXT * max_model_len
        self.episodes: dict[str, Episode] = {}
        self.closed_keys: set[str] = set()
        self.refused: Counter = Counter()  # kind -> refusals with no episode known (unknown_key, busy, timeout, ...)
        self.queue: queue.Queue[PendingCall] = queue.Queue()
        self.in_engine: dict[tuple[int, int], tuple[PendingCall, int]] = {}
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.tokenizer_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.connections: dict[GatewayHandler, float | None] = {}  # open connection -> its read deadline (or None)
        self.connection_threads: set[threading.Thread] = set()
        self.connections_lock = threading.Lock()

    @property
    def unknown_key_calls(self) -> int:
        return self.refused["unknown_key"]

    # ------------------------------------------------------------------ life cycle
    def start(self) -> str:
        gateway = self

        class Handler(GatewayHandler):
            # a socket read or write stalled this long ends the connection (reads: after the deadline's reaper,
            # which answers 408 with what it knows of the request; this bounds a write to a client not reading)
            timeout = 2 * gateway.limits.read_timeout_s + 1

        Handler.gateway = gateway
        self.server = GatewayServer((self.host, 0), Handler)
        self.server.gateway = self
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True, name="rlframe-gateway")
        self.thread.start()
        return f"http://{self.host}:{self.server.server_address[1]}/v1"

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.server_address[1]

    def stop(self) -> None:
        """Stop accepting, answer every waiting call, close every connection and join its thread, free the port."""
        if self.server is None:
            return
        self.server.shutdown()
        deadline = time.monotonic() + 5
        while True:  # (repeated: a handler may queue a call while the others are answered)
            for pending, _ in list(self.in_engine.values()):
                pending.fail(None)
            self.drain_queue()
            with self.connections_lock:
                handlers = list(self.connections)
                threads = [t for t in self.connection_threads if t.is_alive()]
            for handler in handlers:
                shut(handler.connection, socket.SHUT_RDWR)
            if not threads or time.monotonic() > deadline:
                break
            threads[0].join(timeout=0.05)
        self.server.server_close()
        self.thread.join(timeout=5)
        self.server = None

    def drain_queue(self) -> None:
        while True:
            try:
                self.queue.get_nowait().fail(None)
            except queue.Empty:
                return

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
                pending.fail(None)

    # ------------------------------------------------------------------ connections (server and handler threads)
    def reading(self, handler: GatewayHandler, reading: bool) -> None:
        """A connection starts (True) or ends (False) receiving a request: it has `read_timeout_s` to arrive."""
        handler.receiving = reading
        with self.connections_lock:
            self.connections[handler] = time.monotonic() + self.limits.read_timeout_s if reading else None

    def forget(self, handler: GatewayHandler) -> None:
        with self.connections_lock:
            self.connections.pop(handler, None)

    def reap_slow(self) -> None:
        """Connections past their read deadline stop receiving (their handler answers 408 and closes)."""
        now = time.monotonic()
        with self.connections_lock:
            late = [h for h, deadline in self.connections.items() if deadline is not None and now > deadline]
            for handler in late:
                self.connections[handler] = None
        for handler in late:
            handler.timed_out = True
            shut(handler.connection, socket.SHUT_RD)

    def count(self, episode: Episode | None, error: RequestError) -> None:
        if not error.kind:
            return
        if episode is None:
            with self.connections_lock:
                self.refused[error.kind] += 1
        else:
            with episode.lock:
                episode.refused[error.kind] += 1

    # ------------------------------------------------------------------ the engine side (caller's thread)
    def serve_engine(self, engine, wait_s: float = 0.01) -> int:
        """Submit the queued calls, step the engine once, deliver what finished; returns completions delivered.
        Waits up to `wait_s` for a call when the engine is idle. What the engine raises answers the calls it
        concerns (400 engine_refused from `submit`, 500 engine_error from `step`) and goes no further."""
        try:
            pending = self.queue.get(timeout=wait_s) if not engine.busy else self.queue.get_nowait()
        except queue.Empty:
            pending = None
        while pending is not None:
            self.submit(engine, pending)
            try:
                pending = self.queue.get_nowait()
            except queue.Empty:
                pending = None
        ended = [key for key, (pending, _) in self.in_engine.items() if not pending.episode.open]
        if ended:  # an ended (killed, crashed) episode's completions are not generated further
            self.drop(engine, ended, None)
        if not engine.busy:
            return 0
        try:
            finished = engine.step()
        except Exception as error:  # the engine failed on the batch in flight: those calls fail, the step goes on
            logger.warning("gateway: the engine's step failed (%s: %s); its %d requests in flight are answered 500",
                           type(error).__name__, error, len(self.in_engine), exc_info=True)
            self.drop(engine, list(self.in_engine), RequestError(
                f"the engine failed on this call: {type(error).__name__}: {error}"[:500], code="engine_error",
                status=500))
            return 0
        delivered = 0
        for sampled in finished:
            entry = self.in_engine.pop(sampled.key, None)
            if entry is not None:
                entry[0].deliver(entry[1], sampled)
                delivered += 1
        return delivered

    def submit(self, engine, pending: PendingCall) -> None:
        """The call's choices into the engine; one the engine refuses answers the whole call 400 engine_refused."""
        if not pending.episode.open:
            pending.fail(None)
            return
        keys = []
        try:
            for choice, params in enumerate(pending.params):
                key = (id(pending), choice)
                self.in_engine[key] = (pending, choice)
                keys.append(key)
                engine.submit(key, pending.prompt_ids, params)
        except Exception as error:
            self.drop(engine, keys, RequestError(
                f"the engine refused this call: {type(error).__name__}: {error}"[:500], code="engine_refused"))

    def drop(self, engine, keys: list, error: RequestError | None) -> None:
        """Abort these requests in the engine; their calls are answered with `error` (None: their episode ended)."""
        try:
            engine.abort(keys)
        except Exception as failure:
            logger.warning("gateway: aborting %d requests failed: %s: %s", len(keys), type(failure).__name__, failure)
        for key in keys:
            entry = self.in_engine.pop(key, None)
            if entry is not None:
                entry[0].fail(error)

    # ------------------------------------------------------------------ requests (handler threads)
    def episode_for(self, authorization: str | None) -> Episode:
        key = (authorization or "").removeprefix("Bearer ").strip()
        episode = self.episodes.get(key)
        if episode is None:
            raise RequestError("unknown API key: the gateway gives each episode its own OPENAI_API_KEY",
                               code="unknown_key", status=401)
        if not episode.open:
            with episode.lock:
                episode.refused["late"] += 1
            raise RequestError("this episode has ended: its key no longer takes calls", code="episode_ended",
                               status=401, kind="")
        return episode

    def admit(self, episode: Episode) -> None:
        """One more call of this episode, within max_calls_per_episode (else 429 call_limit)."""
        with episode.lock:
            if episode.calls_admitted >= self.limits.max_calls_per_episode:
                raise RequestError(f"this episode has made its {self.limits.max_calls_per_episode} calls "
                                   "(rollout.agent_program.max_calls_per_episode)", code="call_limit", status=429)
            episode.calls_admitted += 1

    def complete(self, episode: Episode, endpoint: str, body: dict) -> tuple[CallRecord, list[dict]]:
        """One call: checked, admitted, prompt ids (continuing an earlier call where it can), the engine's
        completions, the record."""
        check_request(endpoint, body, self.vocab_size, self.max_model_len)
        self.admit(episode)
        tools = request_tools(body.get("tools")) if endpoint == "chat" else {}
        tools_for_parse = {} if body.get("tool_choice") == "none" else tools
        with self.tokenizer_lock:  # (the text is bounded by check_request: rendering it is bounded too)
            if endpoint == "chat":
                messages = body["messages"]
                prompt_ids, extends = self.chat_prompt(episode, messages, tools)
            else:
                messages = None
                prompt_ids, extends = self.completion_prompt(episode, body.get("prompt"))
        params = self.call_params(episode, body, prompt_ids, extends)
        reserved = sum(p.max_new_tokens for p in params)
        used = 0
        try:
            started = time.monotonic()
            pending = PendingCall(episode, prompt_ids, params)
            self.queue.put(pending)
            if not pending.done.wait(self.call_timeout_s) and pending.error is None:
                pending.error = RequestError("the call was not generated within the episode's time",
                                             code="episode_ended", status=409, kind="")
            if pending.error is not None or any(r is None for r in pending.results):
                raise pending.error or RequestError("the episode ended while this call was generating",
                                                    code="episode_ended", status=409, kind="")
            used = sum(len(r.ids) for r in pending.results)
        finally:
            with episode.lock:
                episode.tokens_used -= reserved - used
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
        """A /v1/completions prompt (checked by check_request): token ids as given (token in), or text tokenized
        once; it continues an earlier call when its ids start with that call's prompt + sampled ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ids = self.encoder.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
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
        """Per choice: max new tokens within the chain's budget (its tokens after its first prompt), the engine's
        context and the episode's tokens left (reserved here: the prompt and n x max new tokens); the run's
        sampling unless the request's is honoured; a seed per (episode, call, choice). The fields are checked."""
        n = body.get("n") or 1
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        root = self.chain_root(episode, extends) if extends is not None else prompt_ids
        remaining = min(episode.budget - (len(prompt_ids) - len(root)), self.max_model_len - len(prompt_ids))
        if remaining < 1:
            raise RequestError(f"this call's prompt ({len(prompt_ids)} tokens) leaves no room in the episode's budget "
                               f"({episode.budget} tokens after the first prompt, {self.max_model_len} in all)",
                               code="context_length_exceeded", param="messages", kind="over_budget")
        cap = min(remaining, self.max_tokens_per_call or remaining, asked or remaining)
        with episode.lock:
            left = (self.episode_tokens - episode.tokens_used - len(prompt_ids)) // n
            if left < 1:
                raise RequestError(f"this episode has used {episode.tokens_used} of its {self.episode_tokens} tokens "
                                   f"(prompt + completion, all calls); this call needs {len(prompt_ids) + n} or more "
                                   "(rollout.agent_program.max_episode_tokens)", code="token_budget", status=429)
            cap = min(cap, left)
            episode.tokens_used += len(prompt_ids) + n * cap
        base = replace(episode.params, max_new_tokens=cap, stop=stops)
        if self.sampling_from_request:
            for key in ("temperature", "top_p", "top_k"):
                value = body.get(key)
                if value is not None:
                    base = replace(base, **{key: int(value) if key == "top_k" else float(value)})
        calls = len(episode.calls)
        seed = None if episode.seed is None else episode.seed + (calls + 1) * GOLDEN
        return [replace(base, seed=None if seed is None else (seed + c * 7919) & (2**63 - 1)) for c in range(n)]
