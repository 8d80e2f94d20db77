"""The gateway's trust boundary (issue 39, findings 2 and 4 and the gateway's low items), on the real HF engine.

Each test is an attack on a served Gateway over real sockets: out-of-vocabulary token ids and NaN / out-of-range
sampling (they crashed the step in the engine), an engine that refuses or fails a request, `tools: ["x"]` and
`tool_calls: [1]` (they dropped the connection), a wrong key with a body that never comes, bad Content-Length
values, slow and idle clients, more connections than allowed, a huge message while the tokenizer is busy, an
episode past its calls and tokens, a non-loopback host. Each answer is checked (status, the field named), each
refusal counted, and the engine's driver (`serve_engine` in a thread) never sees an exception.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from test_gateway import calculator_every_turn, engine  # noqa: F401 (the module's HF engine fixture)

MESSAGES = [{"role": "user", "content": "What is 2 plus 3?"}]


@contextmanager
def served(engine, requests=None, **kwargs):
    """A started Gateway over the HF engine, one open episode, the engine driven in a thread that records what
    `serve_engine` raises (the step would see it) instead of dying silently."""
    from rlframe.workers.rollout.gateway import Gateway
    from rlframe.workers.rollout.gateway_chat import ChatEncoder
    from rlframe.workers.rollout.gateway_engines import CallParams, request_engine

    rollout, tokenizer, eos, pad = engine
    gateway = Gateway(ChatEncoder(tokenizer, calculator_every_turn, "hermes"), max_model_len=kwargs.pop(
        "max_model_len", 1024), call_timeout_s=30, **kwargs)
    episode = gateway.open_episode(0, budget=64, params=CallParams(max_new_tokens=64, temperature=1.0), seed=3)
    requests = requests or request_engine(rollout, tokenizer, eos, pad)
    stop, raised = threading.Event(), []

    def pump():
        while not stop.is_set():
            try:
                gateway.serve_engine(requests)
            except Exception as error:  # what would have reached the training step
                raised.append(error)
                return

    url = gateway.start()
    thread = threading.Thread(target=pump, name="test-pump")
    thread.start()
    try:
        yield gateway, episode, gateway.port, raised
    finally:
        stop.set()
        thread.join()
        gateway.stop()


def send(port: int, data: bytes, timeout: float = 3.0) -> tuple[int | None, dict | None, float]:
    """Raw bytes to the gateway; (status, JSON body, seconds) of its answer, or (None, None, s) when the connection
    closed or stalled without one."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(data)
            response = http.client.HTTPResponse(s)
            response.begin()
            body = response.read()
    except (OSError, http.client.HTTPException):
        return None, None, time.monotonic() - start
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    return response.status, payload, time.monotonic() - start


def post(port: int, path: str, body, key: str | None, extra: bytes = b"", timeout: float = 5.0):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = f"POST /v1/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    return send(port, head.encode() + extra + f"Content-Length: {len(data)}\r\n\r\n".encode() + data, timeout)


# ------------------------------------------------------------------ finding 2: nothing reaches the engine unchecked
def test_out_of_vocabulary_ids_and_bad_sampling_are_400_before_the_engine(engine):
    """Token ids past the vocabulary and NaN / out-of-range sampling values (honoured: sampling_from_request) are
    refused naming the field and counted; the engine's driver raises nothing and a good call still works.
    On main the out-of-vocabulary id reached HF generate (IndexError in serve_engine: the call never answered)."""
    vocab = len(engine[1])
    with served(engine, sampling_from_request=True) as (gateway, episode, port, raised):
        key = episode.key
        bad = [("completions", {"prompt": [1, 2, vocab + 5], "max_tokens": 2}, "prompt"),
               ("completions", {"prompt": [-1], "max_tokens": 2}, "prompt"),
               ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
               ("chat", {"messages": MESSAGES, "top_p": 0}, "top_p"),
               ("chat", {"messages": MESSAGES, "temperature": -1}, "temperature"),
               ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
               ("chat", {"messages": MESSAGES, "top_k": 0}, "top_k"),
               ("chat", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
               ("chat", {"messages": MESSAGES, "n": 17}, "n"),
               ("completions", {"prompt": [1, 2], "logprobs": 9}, "logprobs"),
               ("chat", {"messages": MESSAGES, "stop": ["x"] * 5}, "stop")]
        for path, body, field in bad:
            status, answer, _ = post(port, f"{path.replace('chat', 'chat/completions')}", body, key)
            assert status == 400 and answer["error"]["param"] == field, (body, status, answer)
        status, answer, _ = post(port, "completions", {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.7}, key)
        assert status == 200 and answer["usage"]["completion_tokens"] <= 2
    assert raised == [] and episode.refused == {"malformed": len(bad)}


def test_engine_refusal_is_400_and_engine_failure_500_counted_step_survives(engine):
    """An engine that refuses a request in `submit` (as vLLM refuses an id it does not know) answers that call 400
    engine_refused; an engine step that raises (HF generate on an id past its embedding, let through by a vocab
    larger than the model's) answers the calls in flight 500 engine_error; the driver raises nothing either way and
    the next call is served. On main both exceptions left serve_engine (the step)."""
    from rlframe.workers.rollout.gateway_engines import HFRequests

    rollout, tokenizer, eos, pad = engine
    vocab = len(tokenizer)

    class RefusingHFRequests(HFRequests):  # the engine's own check, as vLLM's processor makes it in add_request
        def submit(self, key, prompt_ids, params):
            if 7 in prompt_ids:
                raise ValueError("Token id 7 is refused by this engine")
            super().submit(key, prompt_ids, params)

    requests = RefusingHFRequests(rollout, tokenizer, eos, pad)
    with served(engine, requests=requests, vocab_size=vocab + 100) as (gateway, episode, port, raised):
        status, answer, _ = post(port, "completions", {"prompt": [1, vocab + 50], "max_tokens": 2}, episode.key)
        assert status == 500 and answer["error"]["code"] == "engine_error", answer
        status, answer, _ = post(port, "completions", {"prompt": [1, 7], "max_tokens": 2, "n": 2}, episode.key)
        assert status == 400 and answer["error"]["code"] == "engine_refused" and "Token id 7" in answer["error"]["message"]
        status, answer, _ = post(port, "completions", {"prompt": [1, 2], "max_tokens": 2}, episode.key)
        assert status == 200
        assert not gateway.in_engine and not requests.busy  # nothing of the failed calls left in the engine
    assert raised == [] and episode.refused == {"engine_error": 1, "engine_refused": 1}


# ------------------------------------------------------------------ the low items: shapes that dropped the connection
def test_malformed_tools_messages_and_tool_calls_are_answered_400_and_counted(engine):
    """`tools: ["x"]`, `tool_calls: [1]`, a message that is not an object, a role outside the known set, content
    that is an object, `stream_options: []`: each a 400 naming the field (on main several dropped the connection
    without an answer or a count)."""
    with served(engine) as (gateway, episode, port, raised):
        bad = [({"messages": MESSAGES, "tools": ["x"]}, "tools"),
               ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools"),
               ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [1]},
                              {"role": "tool", "content": "5"}]}, "messages"),
               ({"messages": [1]}, "messages"),
               ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
               ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages"),
               ({"messages": [{"role": "user", "content": [1, 2]}]}, "messages"),
               ({"messages": MESSAGES, "stream": True, "stream_options": []}, "stream_options"),
               ({"messages": MESSAGES, "tool_choice": 5}, "tool_choice")]
        for body, field in bad:
            status, answer, _ = post(port, "chat/completions", body, episode.key)
            assert status == 400 and answer["error"]["param"] == field, (body, status, answer)
    assert raised == [] and episode.refused == {"malformed": len(bad)}


# ------------------------------------------------------------------ finding 4: bounds on bodies, time, connections
def test_key_checked_before_the_body_and_bad_lengths_refused_unread(engine):
    """A wrong key with a body that never comes is answered 401 at once (on main the gateway waited for the body);
    Content-Length -1, not a number, 10**12 or over max_body_bytes: 400 / 413 without reading."""
    with served(engine) as (gateway, episode, port, raised):
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n"
        status, answer, seconds = send(port, head.format("wrong", 1_000_000).encode(), timeout=3)
        assert status == 401 and answer["error"]["code"] == "unknown_key" and seconds < 1
        for length, expect in [("-1", 400), ("abc", 400), ("1e12", 400), (str(10**12), 413), (str(5 << 20), 413)]:
            status, answer, seconds = send(port, head.format(episode.key, length).encode(), timeout=3)
            assert status == expect and answer["error"]["param"] == "Content-Length" and seconds < 1, (length, answer)
        status, answer, _ = send(port, head.format(episode.key, "5").encode() + b"{", timeout=3)  # then closes
    assert raised == [] and gateway.refused == {"unknown_key": 1}
    assert episode.refused == {"malformed": 3, "too_large": 2, "timeout": 1} or episode.refused == {
        "malformed": 4, "too_large": 2}  # (the short body: 408 once the deadline passes, or 400 on the client's EOF)


def test_slow_idle_and_excess_connections_are_dropped_and_bounded(engine):
    """read_timeout_s bounds the time a request may take to arrive (a client sending half its headers gets 408, an
    idle connection is closed), max_connections the connections open at once (one more: 503 at once), and stop()
    leaves no thread behind."""
    from rlframe.workers.rollout.gateway import GatewayLimits

    before = threading.active_count()
    with served(engine, limits=GatewayLimits(read_timeout_s=0.5, max_connections=4)) as (gateway, episode, port, _):
        started = time.monotonic()
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.1)
        status, answer, seconds = send(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and answer["error"]["code"] == "busy" and seconds < 0.5
        slow.settimeout(3)
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 1.5, reply
        for s in idle:  # closed by the gateway without an answer
            s.settimeout(3)
            assert s.recv(10) == b""
            s.close()
        slow.close()
        time.sleep(0.2)
        status, _, _ = post(port, "completions", {"prompt": [1, 2], "max_tokens": 2}, episode.key)
        assert status == 200  # the slots were freed
        assert gateway.refused == {"busy": 1, "timeout": 1}
    assert threading.active_count() == before


def test_huge_message_refused_without_the_tokenizer(engine):
    """The tokenizer lock (shared by every episode) is never taken for unbounded text: a message longer than the
    context could hold is refused before rendering, here while another thread holds the lock (on main the call
    waited for the lock, then rendered and tokenized all of it)."""
    with served(engine) as (gateway, episode, port, raised):
        with gateway.tokenizer_lock:
            status, answer, seconds = post(port, "chat/completions", {"messages": [
                {"role": "user", "content": "7 plus 3 " * 40_000}]}, episode.key, timeout=3)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded" and seconds < 1
    assert raised == [] and episode.refused == {"over_budget": 1}


def test_episode_call_limit_and_token_budget_are_429_counted(engine):
    """max_calls_per_episode and max_episode_tokens bound an episode over all its calls, chained or not (on main
    the budget was per chain and calls were unlimited); the refusals reach the step's metrics."""
    import numpy as np
    import torch

    from rlframe.trainer.agent_metrics import gateway_metrics
    from rlframe.workers.rollout.gateway import GatewayLimits

    with served(engine, limits=GatewayLimits(max_calls_per_episode=3)) as (gateway, episode, port, raised):
        codes = [post(port, "completions", {"prompt": [1, 2, 3], "max_tokens": 2}, episode.key)[0] for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
    assert raised == [] and episode.refused == {"call_limit": 2}
    with served(engine, limits=GatewayLimits(max_episode_tokens=20)) as (gateway, episode, port, raised):
        answers = [post(port, "completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4}, episode.key)
                   for _ in range(4)]
        assert [a[0] for a in answers][:2] == [200, 200] and answers[-1][0] == 429
        assert answers[-1][1]["error"]["code"] == "token_budget"
        assert episode.tokens_used <= 20 and episode.refused["token_budget"] >= 1
    metrics = gateway_metrics({"gateway_calls": [2], "gateway_unmerged_calls": [0], "gateway_failed": [""],
                               "gateway_refused": [dict(episode.refused)], "gateway_tool_calls": [0],
                               "gateway_prompt_tokens": [10], "gateway_completion_tokens": [8],
                               "gateway_seconds": [1.0], "gateway_unknown_key_calls": [0],
                               "gateway_server_refused": np.array([{"busy": 2}], dtype=object)},
                              torch.ones(1, 4), torch.ones(1, 8))
    assert metrics["gateway/refused/token_budget"] == episode.refused["token_budget"]
    assert metrics["gateway/refused/busy"] == 2 and metrics["gateway/refused/engine_error"] == 0


# ------------------------------------------------------------------ the low item: the host
def test_host_is_loopback_unless_allow_remote(tmp_path):
    """host=0.0.0.0 (plain HTTP to the network) is refused by the Gateway and by the config check, naming
    rollout.agent_program.allow_remote (on main it served the network)."""
    from rlframe.config.rollout import agent_program_well_formed
    from rlframe.main import compose_config
    from rlframe.workers.rollout.gateway import Gateway
    from rlframe.workers.rollout.gateway_chat import ChatEncoder

    from helpers_tokenizer import build_tokenizer

    encoder = ChatEncoder(build_tokenizer(), calculator_every_turn, "hermes")
    with pytest.raises(ValueError, match="allow_remote=true"):
        Gateway(encoder, host="0.0.0.0")
    Gateway(encoder, host="0.0.0.0", allow_remote=True)  # asked for explicitly
    Gateway(encoder, host="::1")
    agent = tmp_path / "a.py"
    agent.write_text("def solve(row):\n    return 'x'\n")

    def problems(*overrides):
        cfg = compose_config(["recipe=grpo_math", f"rollout.agent_program.path={agent}",
                              "rollout.agent_program.name=solve", *overrides])
        found = []
        agent_program_well_formed(cfg, lambda ok, key, message: found.append((key, message)) if not ok else None)
        return found

    (key, message), = problems("rollout.agent_program.host=0.0.0.0")
    assert key == "rollout.agent_program.host" and "rollout.agent_program.allow_remote=true" in message
    assert problems("rollout.agent_program.host=0.0.0.0", "rollout.agent_program.allow_remote=true") == []
    assert problems("rollout.agent_program.host=localhost") == []
