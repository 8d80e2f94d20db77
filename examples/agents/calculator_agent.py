"""An agent written with the OpenAI SDK, the way a team already has one: a calculator tool, a loop to an answer.

Train it unchanged:

    python -m rlframe.main recipe=grpo_gateway_math     # rollout.agent_program={path: <this file>, name: solve}

or as a command (the row as JSON on stdin, the answer on stdout):

    rollout.agent_program={command: "python examples/agents/calculator_agent.py"}

`OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment: during training they point at
rlframe's gateway over the policy being trained (any `model` name is accepted); outside training, at any
OpenAI-compatible server. Nothing here knows about rlframe.
"""

import ast
import json
import operator
import os
import sys

from openai import BadRequestError, OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 7 + 5 * 2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "3"))
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """+ - * / on numbers only (no names, no calls)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        return f"error: {error}"
    return str(int(result)) if float(result).is_integer() else str(result)


def solve(row: dict) -> str:
    """The question's messages -> the model's final answer, calling the calculator when it asks to."""
    client = OpenAI()
    messages = list(row["prompt"])
    answer = ""
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=256)
        except BadRequestError:  # e.g. the conversation no longer fits the context: answer with what we have
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or answer
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = calculator(**arguments) if call.function.name == "calculator" else "error: unknown tool"
            except (TypeError, json.JSONDecodeError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


if __name__ == "__main__":
    print(solve(json.load(sys.stdin)))
