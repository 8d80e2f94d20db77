"""Countdown numbers game reward (the per-sample verl form), as in TinyZero / the R1-Zero recipes.

Point a run at it with ``reward.functions=[{path: reward_fns/countdown.py}]``. Standard library only.

The task: given ``numbers`` and a ``target``, write an arithmetic expression with ``+ - * /`` and
parentheses that uses the numbers and equals the target. ``ground_truth`` is a dict (or its JSON
string) ``{"target": 24, "numbers": [1, 2, 3, 4]}``; sequences such as numpy arrays (as parquet
files store them) are fine.

Rules, as constants:
- ``USE_ALL_NUMBERS = True`` (the TinyZero dataset's rule): every given number exactly once.
  ``False`` (the TV game's rule): each given number at most once. Repeated numbers in the list may
  be used as often as they are listed either way.
- ``INTEGER_STEPS = False``: intermediate results may be fractions (TinyZero). ``True`` (the TV
  game): every intermediate result must be a positive integer.
- Only number literals, the four operations and parentheses: no unary minus, no powers, no names.
  The expression is parsed with ``ast`` and evaluated exactly with ``fractions.Fraction``; it is
  never passed to ``eval``.

Extraction: the last ``<answer>...</answer>`` (else the last ``\\boxed{...}``); a trailing
``= 24`` is allowed and ignored (the value must reach the target by itself).

Score: 1.0 when valid and equal to the target; FORMAT_SCORE when an expression was given but is
invalid or misses the target; 0.0 when there is no answer. Extras: ``acc``, ``format``, ``reason``.
"""

import ast
import json
import re
from collections import Counter
from fractions import Fraction

USE_ALL_NUMBERS = True
INTEGER_STEPS = False
FORMAT_SCORE = 0.1
CORRECT_SCORE = 1.0
MAX_EXPRESSION_CHARS = 200

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


class InvalidExpression(ValueError):
    pass


def extract_expression(text):
    """The expression in the last <answer> (or \\boxed{}), without a trailing '= target'."""
    found = _ANSWER.findall(text or "") or _BOXED.findall(text or "")
    if not found:
        return None
    expression = found[-1].strip()
    if "=" in expression:
        expression = expression.split("=")[0].strip()
    return expression


def evaluate(expression):
    """(value as Fraction, list of the number literals used); InvalidExpression if not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise InvalidExpression("too long")
    expression = expression.replace("×", "*").replace("÷", "/").replace("x", "*")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise InvalidExpression(f"not an expression: {exc.msg}") from None
    used = []

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise InvalidExpression("division by zero")
            value = _OPS[type(node.op)](left, right)
            if INTEGER_STEPS and (value.denominator != 1 or value <= 0):
                raise InvalidExpression(f"intermediate result {value} is not a positive integer")
            return value
        what = type(node.op if isinstance(node, ast.BinOp) else node).__name__
        raise InvalidExpression(f"{what} is not allowed (only numbers, + - * / "
                                f"and parentheses)")

    return walk(tree.body), used


def _parse_ground_truth(ground_truth):
    if isinstance(ground_truth, (str, bytes)):
        ground_truth = json.loads(ground_truth)
    return int(ground_truth["target"]), [int(x) for x in ground_truth["numbers"]]


def numbers_ok(used, numbers):
    """Does ``used`` respect the game's rule for ``numbers``?"""
    used_count, available = Counter(used), Counter(numbers)
    if USE_ALL_NUMBERS:
        return used_count == available
    return all(used_count[x] <= available[x] for x in used_count)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    target, numbers = _parse_ground_truth(ground_truth)
    expression = extract_expression(solution_str)
    if not expression:
        return {"score": 0.0, "acc": 0.0, "format": 0.0, "reason": "no answer"}
    try:
        value, used = evaluate(expression)
    except InvalidExpression as exc:
        reason = f"invalid: {exc}"
    else:
        if not numbers_ok(used, numbers):
            reason = f"numbers used {sorted(used)} do not fit {sorted(numbers)}"
        elif value != target:
            reason = f"reaches {value}, not {target}"
        else:
            return {"score": CORRECT_SCORE, "acc": 1.0, "format": 1.0, "reason": "correct"}
    return {"score": FORMAT_SCORE, "acc": 0.0, "format": 1.0, "reason": reason}
