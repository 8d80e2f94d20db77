"""Turn the original GSM8K jsonl files into the common parquet layout.

    python examples/data_preprocess/gsm8k.py --input_dir ../shared/data/gsm8k --output_dir data/gsm8k

reads ``train.jsonl`` and ``test.jsonl`` (each line: ``{"question": ..., "answer": "...#### 72"}``)
and writes ``train.parquet`` and ``test.parquet`` with one row per problem::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}     (commas removed: "1,000" -> "1000")
    extra_info    {"split": ..., "index": i, "question": ..., "answer": <the full solution>}

Score it with ``reward.path=reward_fns/gsm8k.py`` (strict ``#### N``) or ``reward_fns/math.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_ground_truth(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands separators."""
    match = re.search(r"####\s*(-?[0-9.,]+)\s*$", solution.strip())
    if match is None:
        raise ValueError(f"no '#### N' at the end of the solution: {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def convert_split(input_path: Path, output_path: Path, split: str,
                  max_rows: int | None = None) -> int:
    rows = []
    with open(input_path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if max_rows is not None and len(rows) >= max_rows:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            try:
                question, solution = record["question"], record["answer"]
                ground_truth = extract_ground_truth(solution)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{input_path}, line {line_number}: {exc}") from exc
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"split": split, "index": len(rows), "question": question,
                               "answer": solution},
            })
    output_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output_path)
    return len(rows)


def preprocess_gsm8k(input_dir: str | Path, output_dir: str | Path,
                     max_rows: int | None = None) -> dict[str, Path]:
    """Convert every split; ``max_rows`` keeps only the first rows of each (for quick tests)."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    written = {}
    for split in SPLITS:
        source = input_dir / f"{split}.jsonl"
        if not source.is_file():
            raise FileNotFoundError(f"{source} not found: --input_dir must hold the original "
                                    f"GSM8K train.jsonl and test.jsonl")
        target = output_dir / f"{split}.parquet"
        count = convert_split(source, target, split, max_rows)
        print(f"{split}: {count} rows -> {target}")
        written[split] = target
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="GSM8K jsonl -> parquet (verl layout)")
    parser.add_argument("--input_dir", default="../shared/data/gsm8k")
    parser.add_argument("--output_dir", default="data/gsm8k")
    parser.add_argument("--max_rows", type=int, default=None)
    args = parser.parse_args(argv)
    preprocess_gsm8k(args.input_dir, args.output_dir, args.max_rows)


if __name__ == "__main__":
    main()
