# reward_fns/math.py as of commit 795c58f (before math-verify): tests/test_reward_compat.py checks that
# plain-integer answers (the main job's) are scored exactly as this version scored them.
"""Correctness + format reward for math answers (the per-sample verl form).

Point a run at this file with ``reward.functions=[{path: reward_fns/math.py}]``. It is written the way a user
writes a reward script: the standard library plus sympy (optional), no framework imports.

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict

returns ``{"score": float, "acc": 0.0|1.0, "format": 0.0|1.0, "pred": str | None}``.

1. Extract the final answer from the response, in this order (the last occurrence wins):
   - ``\\boxed{...}`` (balanced braces, so ``\\boxed{\\frac{1}{2}}`` works) -- the requested format;
   - ``#### X`` (the GSM8K convention), up to the end of the line;
   - ``The answer is X`` / ``answer: X``, up to the end of the sentence or line.
   There is deliberately NO fallback to "the last number in the text": a response that never
   commits to an answer gets no credit, otherwise the policy learns to spray numbers.
2. Compare it with the ground truth: first as numbers (ints, decimals, fractions ``3/4`` or
   ``\\frac{3}{4}``, thousands separators ``1,000``, ``$``, ``%``, and trailing units such as
   ``12 apples`` are tolerated). A numeric ground truth needs a numeric answer: an unevaluated
   expression such as ``\\boxed{7+5}`` does not count as 12 (the policy must do the arithmetic).
   Other ground truths (``\\sqrt{2}/2``, ``x^2+1``) are compared symbolically when sympy is
   installed (``sympy.simplify(a - b) == 0`` on sympify-able strings; any sympy error means
   "not equal").
3. Score: a correct answer earns 1.0 in the requested ``\\boxed{}`` format and 1.0 - FORMAT_SCORE
   in any other recognised form; a wrong or missing answer earns 0.0. The format credit rides on
   correctness on purpose: when it was paid for boxing any answer, a small policy learned to box
   one constant for every question (format credit, and right whenever the constant was). ``format``
   is 1.0 whenever a ``\\boxed{}`` answer was found.
"""

from __future__ import annotations

import re
from fractions import Fraction

try:  # sympy is optional: without it only the numeric comparison runs
    import sympy
except ImportError:  # pragma: no cover
    sympy = None

FORMAT_SCORE = 0.1  # share of a correct answer's score that depends on the requested \boxed{} format
CORRECT_SCORE = 1.0
MAX_SYMPY_CHARS = 100  # longer strings skip sympy (simplify can be very slow on big inputs)


# ---------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    # "\boxed 5" (no braces) -- take the next token
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None  # unbalanced: the response was cut off


_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"(?:the\s+(?:final\s+)?answer\s+is|answer\s*:)\s*:?\s*([^\n]+)",
                        re.IGNORECASE)


def _end_of_sentence(s: str) -> str:
    """Cut at the first sentence end: a period followed by a space or the end of the text."""
    m = re.search(r"\.(\s|$)", s)
    return (s[:m.start()] if m else s).strip()


def extract_answer(text: str) -> tuple[str | None, bool]:
    """Return ``(answer, boxed)``: the extracted final answer (or None) and whether it was boxed."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    matches = _HASHES.findall(text)
    if matches:
        return matches[-1].strip(), False
    matches = _ANSWER_IS.findall(text)
    if matches:
        answer = _end_of_sentence(matches[-1])
        return (answer or None), False
    return None, False


# ---------------------------------------------------------------------------- comparison


def _strip_latex(s: str) -> str:
    """Remove formatting that never changes the value of a final answer."""
    s = s.strip().replace("\u2212", "-")  # unicode minus
    s = re.sub(r"\\text\{([^{}]*)\}", r" \1 ", s)        # \text{ apples} -> apples
    s = re.sub(r"\\mathrm\{([^{}]*)\}", r" \1 ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}", "\\$",
                  "$", "\\%", "%"):
        s = s.replace(token, " " if token.startswith("\\") and len(token) == 2 else "")
    s = s.replace("\\cdot", "*").replace("\\times", "*")
    s = re.sub(r"(?<=\d),(?=\d{3}(\D|$))", "", s)        # 1,000 -> 1000
    s = s.strip().rstrip(".").strip()
    # "x = 5" -> "5" (a single variable name on the left)
    m = re.fullmatch(r"[A-Za-z]\w*\s*=\s*(.+)", s)
    if m:
        s = m.group(1).strip()
    return s


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"


def to_number(s: str) -> Fraction | None:
    """Parse an integer, decimal or fraction (``3/4``, ``(3)/(4)``), tolerating trailing units."""
    s = _strip_latex(s).replace(" ", "") if s is not None else ""
    s = re.sub(r"\((" + _NUMBER + r")\)", r"\1", s)      # (3)/(4) -> 3/4
    m = re.fullmatch(rf"({_NUMBER})(?:/({_NUMBER}))?", s)
    if m is None:
        # "12apples" / "12 apples" / "5.0 dollars": a number followed only by letters
        m = re.fullmatch(rf"({_NUMBER})(?:/({_NUMBER}))?[A-Za-z]+", s)
    if m is None:
        return None
    try:
        value = Fraction(m.group(1))
        if m.group(2) is not None:
            value /= Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return value


# sympy's parser evaluates Python: only simple math text is ever handed to it.
_SAFE_CHARS = re.compile(r"[0-9A-Za-z+\-*/^().,{}\\\s=]*")
_KNOWN_WORDS = {"sqrt", "frac", "pi", "sin", "cos", "tan", "log", "ln", "exp", "infty", "cdot",
                "times", "left", "right"}


def _replace_frac(s: str) -> str:
    """``\\frac{a}{b}`` -> ``((a)/(b))`` for nested braces too."""
    while (start := s.find("\\frac{")) >= 0:
        parts, i = [], start + len("\\frac")
        for _ in range(2):
            if i >= len(s) or s[i] != "{":
                return s
            depth, j = 0, i
            while j < len(s):
                depth += {"{": 1, "}": -1}.get(s[j], 0)
                if depth == 0:
                    break
                j += 1
            parts.append(s[i + 1:j])
            i = j + 1
        s = s[:start] + f"(({parts[0]})/({parts[1]}))" + s[i:]
    return s


def _to_sympy(s: str):
    """Parse a (lightly LaTeX-ish) expression: ``\\sqrt{2}/2``, ``2x^2 + 1``, ``\\pi r^2``."""
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, standard_transformations)
    if not _SAFE_CHARS.fullmatch(s) or re.search(r"\.(?!\d)|(?<!\d)\.", s):
        raise ValueError("not a plain math expression")
    if any(len(w) > 2 and w not in _KNOWN_WORDS for w in re.findall(r"[A-Za-z]+", s)):
        raise ValueError("unknown word")
    s = _replace_frac(s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\infty", "oo").replace("{", "(").replace("}", ")").replace("\\", "")
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(s, transformations=transformations, evaluate=True)


def _sympy_equal(a: str, b: str) -> bool:
    if sympy is None or len(a) > MAX_SYMPY_CHARS or len(b) > MAX_SYMPY_CHARS:
        return False
    try:
        return bool(sympy.simplify(_to_sympy(a) - _to_sympy(b)) == 0)
    except Exception:  # anything sympy cannot parse or compare is "not equal"
        return False


def is_equiv(pred: str, ground_truth: str) -> bool:
    """True when the two answers denote the same value (numerically, then symbolically)."""
    pred, ground_truth = str(pred), str(ground_truth)
    a, b = to_number(pred), to_number(ground_truth)
    if b is not None:
        # A numeric ground truth needs a numeric answer: "\\boxed{7+5}" does not count as 12,
        # otherwise a policy learns to copy the question instead of doing the arithmetic.
        return a is not None and a == b
    sa, sb = _strip_latex(pred), _strip_latex(ground_truth)
    if sa == sb and sa != "":
        return True
    return _sympy_equal(sa, sb)


# ---------------------------------------------------------------------------- reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """Score one response; see the module docstring."""
    pred, boxed = extract_answer(solution_str or "")
    correct = pred is not None and is_equiv(pred, ground_truth)
    if not correct:
        score = 0.0
    else:
        score = CORRECT_SCORE if boxed else CORRECT_SCORE - FORMAT_SCORE
    return {"score": score, "acc": float(correct), "format": float(boxed), "pred": pred}
