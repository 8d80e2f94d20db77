"""What the gateway accepts: every field of a request checked (shape, type, range) before it is rendered or reaches
an engine; a refusal is a RequestError (HTTP 400) naming the field and what it takes.

    check_request("chat", body, vocab_size=len(tokenizer), max_model_len=4096)

Checked: `messages` (a non-empty list, at most MAX_MESSAGES, of objects with a role in ROLES, string / text-part
content, `tool_calls` a list of {id, type, function: {name, arguments}}), `tools` (a list, at most MAX_TOOLS, of
{type: function, function: {name, parameters}}), `tool_choice`, `prompt` (a string, or token ids each in
[0, vocab_size)), `n`, `max_tokens` / `max_completion_tokens`, `stop`, `temperature`, `top_p`, `top_k`, `seed`,
`logprobs` / `top_logprobs`, the penalties, `stream` / `stream_options`, `model`. Numbers must be finite (JSON
`NaN` / `Infinity` are refused). The prompt's text is bounded before any rendering: more than
CHARS_PER_TOKEN characters per token of the engine's context cannot fit it, so it is refused as
`context_length_exceeded` without taking the tokenizer (one lock for every episode) at all.
Unknown fields are ignored, as OpenAI's servers ignore them.
"""

from __future__ import annotations

import math

from rlframe.workers.rollout.gateway_chat import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_N = 16
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_NAME_CHARS = 256
CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per token of context cannot fit it


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_request(endpoint: str, body, vocab_size: int, max_model_len: int) -> None:
    """Refuse (RequestError, naming the field) anything in `body` the gateway or an engine cannot take."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    max_chars = CHARS_PER_TOKEN * max_model_len
    if endpoint == "chat":
        check_messages(body.get("messages"), max_chars)
        check_tools(body.get("tools"))
        check_tool_choice(body.get("tool_choice"))
    else:
        check_prompt(body.get("prompt"), vocab_size, max_model_len, max_chars)
    check_sampling(endpoint, body, vocab_size)


def check_sampling(endpoint: str, body: dict, vocab_size: int) -> None:
    """n, max_tokens, stop, temperature, top_p, top_k, seed, logprobs, penalties, stream, model."""
    n = body.get("n")
    if n is not None and (not _whole(n) or not 1 <= n <= MAX_N):
        raise RequestError(f"'n' must be a whole number in [1, {MAX_N}], got {n!r}"[:200], param="n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _whole(value) or value < 1):
            raise RequestError(f"'{key}' must be a whole number >= 1, got {value!r}"[:200], param=key)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                           f"{MAX_STOP_CHARS} characters", param="stop")
    ranges = {"temperature": (0.0, 2.0, "[0, 2]"), "top_p": (0.0, 1.0, "(0, 1]"),
              "presence_penalty": (-2.0, 2.0, "[-2, 2]"), "frequency_penalty": (-2.0, 2.0, "[-2, 2]")}
    for key, (lo, hi, text) in ranges.items():
        value = body.get(key)
        if value is None:
            continue
        if not _number(value) or not (value > lo if key == "top_p" else value >= lo) or value > hi:
            raise RequestError(f"'{key}' must be a finite number in {text}, got {value!r}"[:200], param=key)
    top_k = body.get("top_k")
    if top_k is not None and (not _whole(top_k) or not (top_k == -1 or 1 <= top_k <= vocab_size)):
        raise RequestError(f"'top_k' must be -1 (off) or a whole number in [1, {vocab_size}], got {top_k!r}"[:200],
                           param="top_k")
    seed = body.get("seed")
    if seed is not None and (not _whole(seed) or not -2**63 <= seed < 2**64):
        raise RequestError(f"'seed' must be a whole number (64-bit), got {seed!r}"[:200], param="seed")
    logprobs = body.get("logprobs")
    if endpoint == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError(f"'logprobs' must be true or false, got {logprobs!r}"[:200], param="logprobs")
    elif logprobs is not None and (not _whole(logprobs) or not 0 <= logprobs <= 5):
        raise RequestError(f"'logprobs' must be a whole number in [0, 5], got {logprobs!r}"[:200], param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _whole(top) or not 0 <= top <= 20):
        raise RequestError(f"'top_logprobs' must be a whole number in [0, 20], got {top!r}"[:200], param="top_logprobs")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestError("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or
                                not isinstance(options.get("include_usage", False), bool)):
        raise RequestError("'stream_options' must be an object {include_usage: true|false}", param="stream_options")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("'model' must be a string (any name is accepted)", param="model")


def check_messages(messages, max_chars: int) -> None:
    """A non-empty list of {role, content, tool_calls?, tool_call_id?, name?}, at most `max_chars` of text in all."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES}", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object {{role, content}}, got {type(message).__name__}",
                               param="messages")
        if message.get("role") not in ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {message.get('role')!r}"[:300],
                               param="messages")
        chars += content_chars(message.get("content"), f"{where}.content")
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_NAME_CHARS):
                raise RequestError(f"'{where}.{key}' must be a string of at most {MAX_NAME_CHARS} characters",
                                   param="messages")
        chars += check_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        if chars > max_chars:
            raise RequestError(f"the messages hold more than {max_chars} characters, more than the engine's context "
                               "can take", code="context_length_exceeded", kind="over_budget", param="messages")


def content_chars(content, where: str) -> int:
    """The characters of a message's content: None, a string, or a list of parts {type, text?}."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type", "text"), str) or \
                    not isinstance(part.get("text", ""), str):
                raise RequestError(f"'{where}' parts must be objects {{type: text, text: <string>}}", param="messages")
            total += len(part.get("text", ""))
        return total
    raise RequestError(f"'{where}' must be a string or a list of parts, got {type(content).__name__}",
                       param="messages")


def check_tool_calls(calls, where: str) -> int:
    """An assistant message's `tool_calls`: a list of {id, type, function: {name, arguments}}; their characters."""
    if calls is None:
        return 0
    if not isinstance(calls, list):
        raise RequestError(f"'{where}' must be a list of {{id, type: function, function: {{name, arguments}}}}",
                           param="messages")
    total = 0
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(call.get("id", ""), (str, type(None))):
            raise RequestError(f"'{where}[{k}]' must be {{id, type: function, function: {{name, arguments}}}}, got "
                               f"{call!r}"[:300], param="messages")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise RequestError(f"'{where}[{k}].function.arguments' must be a JSON string (or an object)",
                               param="messages")
        total += len(function["name"]) + len(str(arguments or ""))
    return total


def check_tools(tools) -> None:
    """`tools`: a list of {type: function, function: {name (a string), parameters (an object)?}}."""
    if tools is None:
        return
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} {{type: function, function: {{name, "
                           "parameters}}}}", param="tools")
    for i, schema in enumerate(tools):
        function = schema.get("function") if isinstance(schema, dict) and schema.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or \
                not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"'tools[{i}]' must be {{type: function, function: {{name, parameters}}}}, got "
                               f"{schema!r}"[:300], param="tools")


def check_tool_choice(choice) -> None:
    if choice is None or choice in ("none", "auto", "required"):
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"'tool_choice' must be none, auto, required or {{type: function, function: {{name}}}}, "
                           f"got {choice!r}"[:300], param="tool_choice")


def check_prompt(prompt, vocab_size: int, max_model_len: int, max_chars: int) -> None:
    """A /v1/completions prompt: a non-empty string, or token ids each in [0, vocab_size), or a list of one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if len(prompt) > max_chars:
            raise RequestError(f"the prompt holds {len(prompt)} characters, more than the engine's context can take",
                               code="context_length_exceeded", kind="over_budget", param="prompt")
        return
    if not isinstance(prompt, list) or not prompt or not all(_whole(t) for t in prompt):
        raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt per call)",
                           param="prompt")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"'prompt' holds token id {bad}, outside the vocabulary [0, {vocab_size})"[:200],
                           param="prompt")
    if len(prompt) >= max_model_len:
        raise RequestError(f"the prompt has {len(prompt)} tokens; the engine's context is {max_model_len}",
                           code="context_length_exceeded", kind="over_budget", param="prompt")
