"""Code reward (the per-sample verl form): run the generated program against test cases, sandboxed.

Point a run at it with ``reward.functions=[{path: reward_fns/code.py}]``. Unlike the other files in this folder it
imports one piece of the framework, ``rlframe.reward.sandbox`` (standard library only), because
running hostile code safely is not something a reward script should re-implement. Give the reward
manager a per-sample timeout that covers all of a sample's test cases (``reward.timeout_s``, about
``ceil(tests / CONCURRENCY) * TIME_LIMIT_S`` plus a second or two).

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict

1. The program is the LAST fenced code block of the response (```` ```python ````, ```` ```py ````
   or a bare ```` ``` ````; a block tagged with another language is ignored). No block: score 0,
   ``format`` 0.
2. ``ground_truth`` is the stdin/stdout test suite, as a dict or its JSON string::

       {"inputs": ["1 2\\n", "3 4\\n"], "outputs": ["3\\n", "7\\n"]}

   Each case runs the program in a fresh sandbox (time, memory, process, file-size limits, no
   network, no environment; see ``rlframe/reward/sandbox.py``) with that stdin; it passes when the
   program exits 0 and its stdout matches (trailing whitespace and trailing blank lines ignored).
   At most MAX_TESTS cases run (the first ones).
3. Score: the fraction of cases passed, or with ``ALL_OR_NOTHING = True`` 1.0 only when every
   case passes. Extras: ``format`` (a code block was found), ``pass_rate``, ``passed``, ``total``,
   ``verdict`` (the first non-passing case's verdict, or "passed") and ``sandbox_isolated`` (1.0 when the
   programs ran in an allow-list root of their own: the run's ``reward/sandbox_isolated_mean``).

Isolation: the sandbox isolates as root, or off root in an unprivileged user namespace. Where neither is possible
it refuses to run (``SandboxUnisolatedError``, naming ``reward.sandbox.allow_unisolated``) unless that key is true;
the mode it got (``Sandbox.isolation``) is printed once per process (the run's console).
"""

import json
import re
import sys

from rlframe.reward.sandbox import Sandbox, SandboxLimits

ALL_OR_NOTHING = False
MAX_TESTS = 16
CONCURRENCY = 4          # sandboxed processes per reward worker process
TIME_LIMIT_S = 4.0       # wall clock per test case (CPU time: the same)
MEMORY_BYTES = 512 << 20

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "python3", "py"}
_SANDBOX = None  # one per process, made on first use


def extract_program(text):
    """The last fenced Python (or untagged) code block, or None."""
    blocks = [body for tag, body in _FENCE.findall(text or "") if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def parse_tests(ground_truth):
    """(inputs, outputs) from the dict / JSON ground truth; ValueError when malformed."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
        raise ValueError('ground_truth must be {"inputs": [...], "outputs": [...]}')
    inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"ground_truth has {len(inputs)} inputs and {len(outputs)} outputs")
    return [str(x) for x in inputs], [str(y) for y in outputs]


def _sandbox():
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = Sandbox(max_concurrency=CONCURRENCY,
                           limits=SandboxLimits(wall_time_s=TIME_LIMIT_S, cpu_time_s=TIME_LIMIT_S,
                                                memory_bytes=MEMORY_BYTES))
        isolation = _SANDBOX.isolation
        print(f"code reward: sandbox isolation mode={isolation['mode']} root={isolation['root']} "
              f"memory={isolation['memory']} disk={isolation['disk']}"
              + ("" if _SANDBOX.isolated else " -- NOT ISOLATED (reward.sandbox.allow_unisolated=true)"),
              file=sys.stderr, flush=True)
    return _SANDBOX


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    inputs, outputs = parse_tests(ground_truth)  # a bad test suite is a data error: let it raise
    inputs, outputs = inputs[:MAX_TESTS], outputs[:MAX_TESTS]
    program = extract_program(solution_str)
    if program is None:
        return {"score": 0.0, "format": 0.0, "pass_rate": 0.0, "passed": 0.0,
                "total": float(len(inputs)), "verdict": "no_code", "sandbox_isolated": float(_sandbox().isolated)}
    results = _sandbox().run_many([{"code": program, "stdin": x, "expected_stdout": y}
                                   for x, y in zip(inputs, outputs)])
    passed = sum(r.passed for r in results)
    pass_rate = passed / len(results)
    if ALL_OR_NOTHING:
        score = 1.0 if passed == len(results) else 0.0
    else:
        score = pass_rate
    first_bad = next((r.verdict for r in results if not r.passed), "passed")
    return {"score": score, "format": 1.0, "pass_rate": pass_rate, "passed": float(passed),
            "total": float(len(results)), "verdict": first_bad, "sandbox_isolated": float(_sandbox().isolated)}
