"""A calculator tool: evaluates an arithmetic expression safely (numbers, + - * / // % **, parentheses).

    rollout.multi_turn.tools=[{path: tools/calculator.py, name: calculator}]

No `eval`: the expression is parsed with `ast` and only arithmetic nodes are evaluated; exponents and
results are bounded so that a call cannot run away.
"""

import ast
import operator

TOOL_SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as '12 * (3 + 4)'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression"}},
                "required": ["expression"],
            },
        },
    }
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_MAGNITUDE = 10 ** 18


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """The value of `expression` as text (integers without a trailing .0)."""
    value = _evaluate(ast.parse(expression.replace("^", "**").replace("x", "*").strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
