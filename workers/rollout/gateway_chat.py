"""Chat requests -> the prompt token ids the engine sees, and sampled text -> the assistant message returned.

Token in, token out. A request whose messages continue an earlier call of the same episode (that call's
messages, then the assistant message the gateway returned for it, then new messages) is encoded as

    that call's prompt ids + the ids it sampled + ids(the text the template puts after that assistant message)

so the model's earlier turns are never decoded and re-tokenized: the trainer scores exactly the sampled ids, and
the episode's calls chain into one trajectory (rows=merged). The text after the assistant message is found as
the built-in agent loop finds it (agent_loop.ObservationRenderer): the template rendered around a sentinel
assistant message; a template that rewrites earlier turns breaks the chain (the call is encoded afresh).
Any other request is rendered with the tokenizer's chat template and tokenized once.

Tools: the request's `tools` (OpenAI function schemas) go to the template when it renders tools, else into a
system message (tools.tool_prompt, the built-in loop's); the sampled text is parsed by the configured tool-call
parser (tools.get_parser) into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re

from rlframe.workers.rollout.tools import Tool, ToolCall, tool_prompt

SENTINEL = "\u2063ASSISTANT\u2063"
_HERMES_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """A request the gateway refuses (HTTP 400 unless `status` says otherwise): `code` names it in the answer, `kind`
    in the counts (gateway/refused/<kind>; the code unless given, "" for a refusal counted elsewhere or not at all),
    the message says why."""

    def __init__(self, message: str, code: str = "malformed", param: str | None = None, status: int = 400,
                 kind: str | None = None):
        super().__init__(message)
        self.code, self.param, self.status = code, param, status
        self.kind = code if kind is None else kind


def content_text(content) -> str:
    """A message's content as text: a string, a list of text parts (OpenAI's content parts), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise RequestError(f"a message's content must be a string or a list of parts, got {type(content).__name__}",
                       param="messages")


def normalized(message: dict) -> dict:
    """What identifies a message for prefix matching: role, text, tool calls (name + parsed arguments), tool id."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError("every message must be an object with a 'role'", param="messages")
    out = {"role": message["role"], "content": content_text(message.get("content")).strip()}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c.get("id"), c.get("function", {}).get("name"), _arguments(c)) for c in calls]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _arguments(call: dict):
    raw = call.get("function", {}).get("arguments")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat template takes them: text content; an assistant's tool calls as the template's
    `tool_calls` (arguments as objects, which Qwen/Hermes templates dump), tool results with their id."""
    out = []
    for m in messages:
        item = {"role": m["role"], "content": content_text(m.get("content"))}
        if m.get("tool_calls"):
            item["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                "name": c.get("function", {}).get("name"), "arguments": _arguments(c)}} for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            item["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            item["name"] = m["name"]
        out.append(item)
    return out


def request_tools(tools) -> dict[str, Tool]:
    """The request's `tools` as the parsers' Tool objects (schema only: the agent runs its own tools)."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of {type: function, function: {name, parameters}}", param="tools")
    out = {}
    for schema in tools:
        name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
        if schema.get("type") != "function" or not isinstance(name, str) or not name:
            raise RequestError(f"a tool must be {{type: function, function: {{name, parameters}}}}, got {schema!r}"[:300],
                               param="tools")
        out[name] = Tool(name=name, function=None, schema=schema)
    return out


class ChatEncoder:
    """Renders chat requests to ids (token in) and sampled text to assistant messages (token out)."""

    def __init__(self, tokenizer, parse, tool_format: str):
        self.tokenizer, self.parse, self.tool_format = tokenizer, parse, tool_format
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_takes_tools = "tools" in str(template)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def with_tools(self, messages: list[dict], tools: dict[str, Tool]) -> tuple[list[dict], dict]:
        """(messages, template kwargs): tools to the template, or a system message describing them."""
        if not tools:
            return messages, {}
        if self.template_takes_tools:
            return messages, {"tools": [t.schema for t in tools.values()]}
        text = tool_prompt(tools, self.tool_format)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], {}
        return [{"role": "system", "content": text}, *messages], {}

    def render(self, messages: list[dict], tools: dict[str, Tool], generation_prompt: bool = True) -> str:
        convo, kwargs = self.with_tools(template_messages(messages), tools)
        try:
            return self.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **kwargs)
        except Exception as error:  # the template refuses these messages (a role it lacks, ...)
            raise RequestError(f"the chat template cannot render these messages: {type(error).__name__}: {error}",
                               code="template", param="messages") from None

    def fresh_ids(self, messages: list[dict], tools: dict[str, Tool]) -> list[int]:
        return self.encode(self.render(messages, tools))

    def continuation_ids(self, messages: list[dict], k: int, tools: dict[str, Tool], closed: bool) -> list[int] | None:
        """The ids the template puts after the assistant message messages[k] (sampled earlier, kept as ids) up to
        the next generation prompt; `closed`: the sampled ids end with the end-of-turn token (else it is context
        here). None when the template rewrites what came before (not append-only)."""
        sentinel = [*messages[:k], {"role": "assistant", "content": SENTINEL}]
        before = self.render(sentinel, tools, generation_prompt=False)
        after = self.render([*sentinel, *messages[k + 1:]], tools)
        if not after.startswith(before) or SENTINEL not in before:
            return None
        tail = before[before.index(SENTINEL) + len(SENTINEL):]
        eos = self.tokenizer.eos_token or ""
        if closed and eos and tail.startswith(eos):
            tail = tail[len(eos):]
        return self.encode(tail + after[len(before):])

    def assistant_message(self, text: str, tools: dict[str, Tool], call_id: str) -> tuple[dict, int]:
        """(the OpenAI assistant message for sampled `text`, the number of malformed tool calls in it)."""
        calls: list[ToolCall] = []
        if tools:
            try:
                calls = self.parse(text, tools)
            except Exception:  # a parser's bug: the text goes back as content
                calls = []
        good = [c for c in calls if c.arguments is not None and c.name in tools]
        message: dict = {"role": "assistant", "content": text}
        if good:
            content = _HERMES_BLOCK.sub("", text).strip() if self.tool_format == "hermes" else text.strip()
            message["content"] = content or None
            message["tool_calls"] = [{"id": f"{call_id}-{i}", "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(good)]
        return message, len(calls) - len(good)


def same_assistant(sent: dict, returned: dict) -> bool:
    """Whether the agent's assistant message is the one the gateway returned (tool call ids, else the text)."""
    a, b = normalized(sent), normalized(returned)
    if a["role"] != "assistant":
        return False
    if b.get("tool_calls"):
        return [c[0] for c in a.get("tool_calls", [])] == [c[0] for c in b["tool_calls"]]
    return a["content"] == b["content"] and not a.get("tool_calls")
