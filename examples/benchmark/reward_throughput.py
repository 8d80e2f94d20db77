"""Samples scored per second for reward_fns/math.py and reward_fns/code.py through the RewardManager,
with 1 and 2 worker processes.

    python examples/benchmark/reward_throughput.py [--math-samples 512] [--code-samples 32]

math.py: a mix of correct, wrong, LaTeX and symbolic answers (sympy runs on some of them).
code.py: stdin/stdout programs with 3 test cases each (one sandboxed process per test case, up to
code.py's CONCURRENCY at a time per worker process), a third of them wrong.
The first batch warms the workers up (imports, sympy) and is not timed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlframe.reward.manager import RewardManager, RewardSpec

REPO = Path(__file__).resolve().parents[2]

MATH_CASES = [
    ("7 + 5 = 12, so \\boxed{12}", "12"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{13}", "12"),
    ("She has 72 clips.\n#### 72", "72"),
    ("The answer is $1,000.", "1000"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2"),
    ("I think it is 12", "12"),
]
CODE_TESTS = json.dumps({"inputs": ["1 2\n", "10 -3\n", "100 200\n"], "outputs": ["3\n", "7\n", "300\n"]})
CODE_CASES = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\nimport sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n```",
    "```python\na, b = map(int, input().split())\nprint(a - b)\n```",  # wrong
]


def measure(path: str, cases: list[tuple[str, str]], n: int, num_workers: int, timeout_s: float) -> float:
    responses = [cases[i % len(cases)][0] for i in range(n)]
    truths = [cases[i % len(cases)][1] for i in range(n)]
    with RewardManager([RewardSpec(path)], num_workers=num_workers, timeout_s=timeout_s) as manager:
        k = min(len(cases) * num_workers, n)
        manager.score(responses[:k], truths[:k], ["bench"] * k)  # warm-up
        start = time.perf_counter()
        result = manager.score(responses, truths, ["bench"] * n)
        elapsed = time.perf_counter() - start
    assert result.metrics["reward/failures"] == 0, result.failures[:1]
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--math-samples", type=int, default=512)
    parser.add_argument("--code-samples", type=int, default=32)
    args = parser.parse_args()
    math_path = str(REPO / "reward_fns" / "math.py")
    code_path = str(REPO / "reward_fns" / "code.py")
    code_cases = [(c, CODE_TESTS) for c in CODE_CASES]
    print(f"{'reward':<10}{'workers':>8}{'samples':>9}{'samples/s':>12}")
    for name, path, cases, n, timeout in (("math.py", math_path, MATH_CASES, args.math_samples, 10.0),
                                          ("code.py", code_path, code_cases, args.code_samples, 30.0)):
        for workers in (1, 2):
            rate = measure(path, cases, n, workers, timeout)
            print(f"{name:<10}{workers:>8}{n:>9}{rate:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
