"""The gateway's HTTP side (gateway.py): the server, the request handler, and the OpenAI response bodies.

`GatewayServer` (the standard library's ThreadingHTTPServer) refuses a connection past `max_connections` with 503;
`GatewayHandler` checks the key from the headers and `Content-Length` before it reads a body, then hands each call
to its `Gateway` and writes the answer (`response_body`, or `stream_events` for a streamed one). It does not import
gateway.py (which imports it): the server and handler get their Gateway as an attribute, and `record` below is
gateway.py's CallRecord. What is checked,
and the codes of each refusal: gateway.py's docstring and docs/gateway.md.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlframe.workers.rollout.gateway_chat import RequestError

logger = logging.getLogger(__name__)

_DIGITS = re.compile(r"[0-9]{1,20}")


def shut(connection, how: int) -> None:
    try:
        connection.shutdown(how)
    except OSError:
        pass


class GatewayServer(ThreadingHTTPServer):
    """A thread per connection up to max_connections (one more: 503 and closed); slow requests reaped each poll."""

    daemon_threads = True
    block_on_close = False  # stop() closes the connections and joins their threads itself
    request_queue_size = 256  # the listen backlog (the standard library's 5 drops bursts of connects: 1 s retries)
    gateway = None  # the Gateway (gateway.py) served: set by Gateway.start

    def process_request(self, request, client_address):
        gateway = self.gateway
        if not gateway.slots.acquire(blocking=False):
            gateway.count(None, RequestError("busy", code="busy", status=503))
            refuse_busy(request, gateway.limits.max_connections)
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True,
                                  name="rlframe-gateway-connection")
        with gateway.connections_lock:
            gateway.connection_threads.add(thread)
        thread.start()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gateway.slots.release()
            with self.gateway.connections_lock:
                self.gateway.connection_threads.discard(threading.current_thread())

    def service_actions(self):
        self.gateway.reap_slow()

    def shutdown_request(self, request):
        """A lingering close: the answer's end sent, what the client still sends (a body refused unread) drained
        for up to 0.5 s, then closed (closing with unread data resets the connection, and the client may lose the
        answer before reading it)."""
        shut(request, socket.SHUT_WR)
        deadline, drained = time.monotonic() + 0.5, 0
        try:
            while drained < self.gateway.limits.max_body_bytes and (left := deadline - time.monotonic()) > 0:
                request.settimeout(left)
                data = request.recv(1 << 16)
                if not data:
                    break
                drained += len(data)
        except OSError:
            pass
        self.close_request(request)

    def handle_error(self, request, client_address):  # a connection's unexpected error: logged, not printed
        logger.debug("gateway: connection from %s failed", client_address, exc_info=True)


def refuse_busy(request, limit: int) -> None:
    """503 on a connection past max_connections, written from the server's thread without reading the request."""
    data = json.dumps({"error": {"message": f"the gateway has {limit} connections open "
                                            "(rollout.agent_program.max_connections); retry later",
                                 "type": "server_error", "param": None, "code": "busy"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\nRetry-After: 1\r\n\r\n").encode()
    try:
        request.settimeout(0.2)
        request.sendall(head + data)
        request.setblocking(False)
        request.recv(1 << 16)  # what the client sent so far (closing with it unread would reset the connection)
    except OSError:
        pass


class GatewayHandler(BaseHTTPRequestHandler):
    """HTTP/1.1: JSON in, JSON (or server-sent events, chunked) out; errors in OpenAI's {"error": {...}} form."""

    gateway = None  # the Gateway (gateway.py): set on the per-server subclass
    protocol_version = "HTTP/1.1"
    timeout = 21.0  # set on the per-server subclass from limits.read_timeout_s

    def log_message(self, format, *args):  # noqa: A002 (quiet: the record and the metrics say what happened)
        pass

    def setup(self):
        self.timed_out, self.episode, self.receiving = False, None, False
        super().setup()

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.gateway.forget(self)

    def handle_one_request(self):
        """One request, received within read_timeout_s (else 408 and the connection closed; an idle keep-alive
        connection is closed without an answer)."""
        self.gateway.reading(self, True)
        self.episode, self.raw_requestline = None, b""
        self.requestline, self.command, self.request_version = "", "", "HTTP/1.1"  # (what an early answer needs)
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                return self.send_error(414, "the request line is longer than 65536 bytes")
            if not self.raw_requestline.endswith(b"\n"):
                self.close_connection = True
                return self.refuse_slow() if self.raw_requestline else None
            if not self.parse_request():
                return
            if self.request_version == "HTTP/0.9":
                self.request_version = "HTTP/1.1"
                return self.send_error(400, "an HTTP/0.9 request: send HTTP/1.0 or HTTP/1.1")
            if self.timed_out:
                return self.refuse_slow()
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                return self.send_error(405, f"unsupported method {self.command!r}: the gateway takes GET and POST")
            method()
            self.wfile.flush()
        except TimeoutError:  # a read the deadline's reaper missed (answered 408), or a write to a client not reading
            self.close_connection = True
            if self.receiving:
                self.refuse_slow()
        except OSError:  # the client went away
            self.close_connection = True

    def refuse_slow(self) -> None:
        self.close_connection = True
        error = RequestError(f"the request was not received within {self.gateway.limits.read_timeout_s} s "
                             "(rollout.agent_program.read_timeout_s)", code="timeout", status=408)
        self.gateway.count(self.episode, error)
        try:
            self.send_error_json(error)
        except OSError:
            pass

    def send_error(self, code, message=None, explain=None):
        """The standard library's refusals of a malformed HTTP request (an HTTP/2 line's 505 as a 400), as JSON,
        counted."""
        error = RequestError(message or "malformed HTTP request", code="malformed", status=code if code < 500 else 400)
        if self.request_version == "HTTP/0.9":  # (an answer with a status line)
            self.request_version = "HTTP/1.1"
        self.gateway.count(None, error)
        self.send_error_json(error)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "rlframe-policy", "object": "model",
                                                                     "owned_by": "rlframe"}]})
        error = RequestError(f"no such endpoint: GET {self.path}", code="not_found", status=404)
        self.gateway.count(None, error)
        self.send_error_json(error)

    def do_POST(self):
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(self.path.rstrip("/"))
        try:
            self.episode = self.gateway.episode_for(self.headers.get("Authorization"))
            if endpoint is None:
                raise RequestError(f"no such endpoint: POST {self.path} (the gateway serves /v1/chat/completions "
                                   "and /v1/completions)", code="not_found", status=404)
            raw = self.read_body()
            try:
                body = json.loads(raw or b"null")
            except (ValueError, RecursionError) as error:  # (not JSON, not UTF-8, nested too deep, a huge number)
                raise RequestError(f"the body is not JSON ({type(error).__name__}: {error})"[:300]) from None
            record, choices = self.gateway.complete(self.episode, endpoint, body)
            if body.get("stream"):
                return self.send_stream(endpoint, body, record, choices)
            payload = response_body(endpoint, body, record, choices, self.gateway.encoder.tokenizer)
        except RequestError as error:
            self.gateway.count(self.episode, error)
            return self.send_error_json(error)
        except OSError:
            raise
        except Exception as error:  # a bug of the gateway's: answered and counted, never a dropped connection
            logger.warning("gateway: a call failed inside the gateway", exc_info=True)
            error = RequestError(f"the gateway failed on this call: {type(error).__name__}"[:300], code="internal",
                                 status=500)
            self.gateway.count(self.episode, error)
            return self.send_error_json(error)
        self.send_json(200, payload)

    def read_body(self) -> bytes:
        """The body by a checked Content-Length (a whole number up to max_body_bytes; else refused unread: every
        refusal closes the connection), received within the request's deadline (else 408)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding"):
            raise RequestError("a chunked body is not taken: send a Content-Length", code="malformed", status=411,
                               param="Content-Length")
        if not lengths:
            self.gateway.reading(self, False)
            return b""
        if len(set(lengths)) != 1 or not _DIGITS.fullmatch(lengths[0].strip()):
            raise RequestError(f"Content-Length must be one whole number of bytes, got {', '.join(lengths)!r}"[:200],
                               param="Content-Length")
        length = int(lengths[0])
        limit = self.gateway.limits.max_body_bytes
        if length > limit:
            raise RequestError(f"the body is {length} bytes; at most {limit} (rollout.agent_program.max_body_bytes)",
                               code="too_large", status=413, param="Content-Length")
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            raw = None
        if raw is None or len(raw) < length:
            if raw is None or self.timed_out:
                raise RequestError(f"the body was not received within {self.gateway.limits.read_timeout_s} s "
                                   "(rollout.agent_program.read_timeout_s)", code="timeout", status=408)
            raise RequestError(f"the body ended after {len(raw)} of its {length} bytes", param="Content-Length")
        self.gateway.reading(self, False)
        return raw

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, error: RequestError) -> None:
        """The refusal in OpenAI's form; the connection then closes (what the client sent past it is never read
        as another request)."""
        self.close_connection = True
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
            error.status, "server_error" if error.status >= 500 else "invalid_request_error")
        self.send_json(error.status, {"error": {"message": str(error), "type": kind, "param": error.param,
                                                "code": error.code}})

    def send_stream(self, endpoint: str, body: dict, record, choices: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in stream_events(endpoint, body, record, choices):
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


def usage(record, choices: list[dict]) -> dict:
    completion = sum(len(c["ids"]) for c in choices)
    return {"prompt_tokens": len(record.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(record.prompt_ids) + completion}


def token_logprobs(choice: dict, tokenizer) -> list[dict]:
    return [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode()),
             "top_logprobs": []} for t, lp in zip(choice["ids"], choice["log_probs"])]


def response_body(endpoint: str, body: dict, record, choices: list[dict], tokenizer) -> dict:
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


def stream_events(endpoint: str, body: dict, record, choices: list[dict]) -> list[str]:
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
