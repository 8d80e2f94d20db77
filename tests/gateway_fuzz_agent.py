"""A hostile agent for tests/test_gateway_fuzz.py: random and malformed requests against its own gateway, then an
ordinary episode (two chained calls through the openai client).

`fuzz(row)` sends GATEWAY_FUZZ_REQUESTS requests over raw sockets from 6 threads: valid calls, valid calls with one
field replaced by junk, out-of-vocabulary token ids, NaN / infinite / out-of-range sampling values, bodies that are
not JSON (bytes, truncated, nested 5000 deep, a 5000-digit number), bad Content-Length values (negative, not a
number, 10**12, over the body cap, two different ones, chunked), bad keys, malformed HTTP, and slow clients (half
the headers, half the body, a byte every 0.15 s). Each answer's status and time go to
$GATEWAY_TEST_OUT/fuzz-<row index>.json as [category, status (None: no answer), seconds].
"""

from __future__ import annotations

import http.client
import json
import os
import random
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

JUNK = [None, True, False, 0, -1, 1, 2**70, 1.5, float("nan"), float("inf"), float("-inf"), "", "x", "NaN", [], [1],
        ["x"], [None], {}, {"a": 1}, [[1, 2]], "a" * 300, -5, 1e308, [{"role": "user"}], {"type": "function"}]
FIELDS = ["messages", "model", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens", "stop",
          "temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "prompt"]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def valid(rng: random.Random, messages: list[dict], vocab: int) -> tuple[str, dict]:
    if rng.random() < 0.5:
        body = {"model": rng.choice(["m", "gpt-4o-mini"]), "messages": list(messages), "max_tokens": 2}
        if rng.random() < 0.3:
            body["tools"] = TOOLS
        if rng.random() < 0.2:
            body.update(stream=True, stream_options={"include_usage": True})
        if rng.random() < 0.2:
            body["logprobs"] = True
        return "chat/completions", body
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 10))] if rng.random() < 0.7 else "2 plus 3 is"
    body = {"prompt": prompt, "max_tokens": 2}
    if rng.random() < 0.3:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = ["\n"]
    return "completions", body


def mutated(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    where = rng.random()
    if where < 0.6:
        body[rng.choice(FIELDS)] = rng.choice(JUNK)
    elif where < 0.8 and "messages" in body:
        message = body["messages"][0]
        message[rng.choice(["role", "content", "tool_calls", "name", "tool_call_id"])] = rng.choice(JUNK)
    elif "messages" in body:
        body["messages"].append({"role": "assistant", "content": None, "tool_calls": rng.choice(JUNK)})
        body["messages"].append({"role": "tool", "tool_call_id": "c", "content": "5"})
    else:
        body["prompt"] = rng.choice(JUNK)
    return body


def request(path: str, data: bytes, key: str | None, length: str | None = "auto", extra: str = "") -> bytes:
    head = f"POST /v1/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    if length is not None:
        head += f"Content-Length: {len(data) if length == 'auto' else length}\r\n"
    return (head + "\r\n").encode() + data


def case(rng: random.Random, key: str, vocab: int, messages: list[dict]) -> tuple[str, bytes, str]:
    """(category, the bytes, how they are sent: all / stall (then wait) / trickle (a byte every 0.15 s))."""
    path, body = valid(rng, messages, vocab)
    roll = rng.random()
    dumps = lambda b: json.dumps(b).encode()  # (NaN and Infinity written as JSON5-style literals, as clients can)
    if roll < 0.10:
        return "valid", request(path, dumps(body), key), "all"
    if roll < 0.45:
        return "wrong_shape", request(path, dumps(mutated(rng, body)), key), "all"
    if roll < 0.53:
        bad = rng.choice([-1, -(2**40), vocab, vocab + rng.randrange(1000), 2**40, 1.0, True, "7"])
        ids = [rng.randrange(vocab) for _ in range(3)]
        ids.insert(rng.randrange(4), bad)
        return "out_of_vocabulary", request("completions", dumps({"prompt": ids, "max_tokens": 2}), key), "all"
    if roll < 0.63:
        field = rng.choice(["temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "n", "max_tokens"])
        body[field] = rng.choice([float("nan"), float("inf"), float("-inf"), -1, -0.5, 0, 2.5, 1e9, 2**63, "1"])
        return "bad_sampling", request(path, dumps(body), key), "all"
    if roll < 0.71:
        data = rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))), dumps(body)[:-3], b"{nope",
                           b"[" * 5000 + b"]" * 5000, b"1" * 5000, b"\xff\xfe{}", b"", b"null", b"[]", b'"s"', b"12",
                           b'{"messages": NaN}'])
        return "bad_json", request(path, data, key), "all"
    if roll < 0.79:
        data = dumps(body)
        variant = rng.randrange(7)
        if variant == 0:
            return "content_length", request(path, b"", key, rng.choice(["-1", "abc", "1e12", "0x10", "+5", "", "1 2"])), "all"
        if variant == 1:
            return "content_length", request(path, b"", key, str(rng.choice([10**12, 5 << 20, 2**64]))), "all"
        if variant == 2:
            return "content_length", request(path, data, key, extra=f"Content-Length: {len(data) + 1}\r\n"), "all"
        if variant == 3:
            return "content_length", request(path, b"", key, None, extra="Transfer-Encoding: chunked\r\n"), "all"
        if variant == 4:
            return "content_length", request(path, data, key, str(max(1, len(data) // 2))), "all"
        if variant == 5:
            return "content_length", request(path, data, key, None), "all"
        return "content_length", request(path, data, key, str(len(data) + 50)), "stall"
    if roll < 0.86:
        header = rng.choice([None, "wrong", "", "rlframe-episode-000000000000000000000000", key + "x", key[:-1]])
        if header is None:
            return "bad_key", request(path, dumps(body), None), "all"
        data = request(path, dumps(body), None, extra=f"Authorization: {rng.choice(['Bearer ', 'Basic ', ''])}{header}\r\n")
        return "bad_key", data, "all"
    if roll < 0.94:
        data = rng.choice([b"GARBAGE\r\n\r\n", b"GET\r\n\r\n", b"POST /v1/completions\r\n\r\n",
                           b"GET /v1/models HTTP/2.0\r\n\r\n", b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                           b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                           b"POST /v1/embeddings HTTP/1.1\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n",
                           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
                           b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n"])
        return "bad_http", data, "all"
    data = request(path, dumps(body), key)
    cut = rng.choice([rng.randrange(5, data.index(b"\r\n\r\n")), rng.randrange(data.index(b"\r\n\r\n") + 4, len(data))])
    return "slow", data[:cut], rng.choice(["stall", "trickle"])


def send(port: int, category: str, data: bytes, how: str) -> list:
    """[category, the answer's status (None: none), seconds]."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            if how == "trickle":
                for k in range(len(data)):
                    s.sendall(data[k:k + 1])
                    if select.select([s], [], [], 0.15)[0]:
                        break
            else:
                s.sendall(data)
            response = http.client.HTTPResponse(s)
            response.begin()
            response.read()
            status, detail = response.status, ""
    except (OSError, http.client.HTTPException) as error:
        status, detail = None, f"{type(error).__name__}: {error}"
    return [category, status, time.monotonic() - start, detail, data[:300].decode(errors="replace")]


def fuzz(row: dict):
    from openai import OpenAI

    out, base, key = os.environ["GATEWAY_TEST_OUT"], os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    vocab, count = int(os.environ["GATEWAY_FUZZ_VOCAB"]), int(os.environ["GATEWAY_FUZZ_REQUESTS"])
    rng = random.Random(1000 + row["index"])
    cases = [case(rng, key, vocab, row["prompt"]) for _ in range(count)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda c: send(port, *c), cases))
    with open(os.path.join(out, f"fuzz-{row['index']}.json"), "w") as f:
        json.dump(results, f)
    from openai import APIStatusError

    client = OpenAI(max_retries=0)  # then an ordinary episode: two chained calls
    refused = []  # its calls the gateway refused: a body slower than the test's 0.5 s read timeout on a loaded machine

    def create(**kwargs):
        for _ in range(5):
            try:
                return client.chat.completions.create(model="m", max_tokens=4, **kwargs)
            except APIStatusError as error:
                if error.status_code != 408:
                    raise
                refused.append(error.status_code)
        raise RuntimeError(f"5 calls refused with 408: {refused}")

    messages = list(row["prompt"])
    reply = create(messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    final = create(messages=messages)
    with open(os.path.join(out, f"ordinary-{row['index']}.json"), "w") as f:
        json.dump(refused, f)
    return {"answer": final.choices[0].message.content or "", "reward": 0.0}
