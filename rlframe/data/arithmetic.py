"""A procedurally generated arithmetic word-problem dataset: the embedded default task.

SmolLM2-135M-Instruct gets almost nothing right on GSM8K, but it can learn, with RL on a CPU in
minutes, to answer short one-step word problems such as

    Tom has 7 apples and buys 5 more. How many apples does Tom have now?

and to put the answer in the requested ``\\boxed{N}`` format. This module writes such problems in the
common verl parquet layout (one row per problem)::

    data_source   "arithmetic"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "12"}
    extra_info    {"split": "train", "index": 0, "question": ..., "answer": "12"}

Generation is seeded and deterministic. Train and validation problems are disjoint (no question
text appears in both splits). Difficulty is set by ``max_operand`` (operands are drawn from
``0..max_operand``) and ``ops`` ("+" and/or "-"; subtraction results are never negative).

CLI::

    python -m rlframe.data.arithmetic --out data/arithmetic [--n-train 2000 --n-val 200 --seed 0]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"

# Appended to every question. Recipes and tests import it instead of repeating the text.
# No concrete number in the example: with "for example \\boxed{5}" the policy learned to answer
# \\boxed{5} to everything (format credit, and right whenever the answer is 5). Measured with
# SmolLM2-135M on 64 problems: this wording gives 23% greedy accuracy and 15% at temperature 0.5
# (vs 8% and 5% for the "for example \\boxed{5}" wording), a denser signal for GRPO.
INSTRUCTION = "End your reply with: The answer is \\boxed{your number}."

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Emma", "Leo", "Zoe"]
OBJECTS = ["apples", "books", "coins", "pencils", "cookies", "stickers", "marbles", "cards"]

# Templates per operation; {n} is a name, {o} an object, {a} and {b} the operands.
ADDITION_TEMPLATES = [
    "{n} has {a} {o} and buys {b} more. How many {o} does {n} have now?",
    "{n} had {a} {o}. A friend gave {n} {b} more {o}. How many {o} does {n} have in total?",
    "There are {a} {o} in a box and {b} {o} on the table. How many {o} are there altogether?",
    "What is {a} plus {b}?",
]
SUBTRACTION_TEMPLATES = [
    "{n} has {a} {o} and gives away {b}. How many {o} does {n} have left?",
    "{n} had {a} {o} and lost {b} of them. How many {o} does {n} have now?",
    "There were {a} {o} in a jar. {n} took {b} {o} out. How many {o} are still in the jar?",
    "What is {a} minus {b}?",
]
TEMPLATES = {"+": ADDITION_TEMPLATES, "-": SUBTRACTION_TEMPLATES}


def _draw_problem(rng: random.Random, max_operand: int, ops: tuple[str, ...]) -> tuple[str, int]:
    """Draw one (question, answer) pair."""
    op = rng.choice(ops)
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    if op == "-" and b > a:
        a, b = b, a  # keep the result non-negative
    answer = a + b if op == "+" else a - b
    template = rng.choice(TEMPLATES[op])
    question = template.format(n=rng.choice(NAMES), o=rng.choice(OBJECTS), a=a, b=b)
    return question, answer


def _make_row(question: str, answer: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": str(answer)},
    }


def generate_problems(n: int, *, seed: int = 0, max_operand: int = 20,
                      ops: tuple[str, ...] = ("+", "-")) -> list[tuple[str, int]]:
    """Return ``n`` distinct (question, answer) pairs, deterministic for a given seed."""
    ops = tuple(ops)
    unknown = [op for op in ops if op not in TEMPLATES]
    if not ops or unknown:
        raise ValueError(f"ops must be a non-empty subset of {sorted(TEMPLATES)}, got {ops!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[tuple[str, int]] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"could not draw {n} distinct problems with max_operand={max_operand} and "
                f"ops={ops}; raise max_operand or ask for fewer problems")
        question, answer = _draw_problem(rng, max_operand, ops)
        if question not in seen:
            seen.add(question)
            problems.append((question, answer))
    return problems


def generate_arithmetic_dataset(out_dir: str | Path, n_train: int = 2000, n_val: int = 200,
                                seed: int = 0, max_operand: int = 20,
                                ops: tuple[str, ...] = ("+", "-")) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; return their paths.

    The two splits are drawn together as one pool of distinct questions, so they never share a
    question. The same arguments always give byte-identical rows.
    """
    problems = generate_problems(n_train + n_val, seed=seed, max_operand=max_operand, ops=ops)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, chunk in (("train", problems[:n_train]), ("val", problems[n_train:])):
        rows = [_make_row(q, a, split, i) for i, (q, a) in enumerate(chunk)]
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--ops", default="+-", help='operations to use, e.g. "+" or "+-"')
    args = parser.parse_args(argv)
    train, val = generate_arithmetic_dataset(args.out, args.n_train, args.n_val, args.seed,
                                             args.max_operand, tuple(args.ops))
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
