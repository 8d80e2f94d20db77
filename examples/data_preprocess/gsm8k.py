"""GSM8K in the common parquet layout (the one verl users already have on disk).

    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k

loads GSM8K from the Hugging Face hub through the ``datasets`` library (``openai/gsm8k``, config
``main``; or ``--hf_dataset <a datasets folder or hub id>``), or from the original jsonl files with
``--input_dir <folder with train.jsonl and test.jsonl>`` (each line: ``{"question": ..., "answer":
"...#### 72"}``), and writes ``train.parquet`` and ``test.parquet`` into ``--local_dir`` with one row
per problem::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}     (commas removed: "1,000" -> "1000")
    extra_info    {"split": ..., "index": i, "question": ..., "answer": <the full solution>}

Score it with ``reward.functions=[{path: reward_fns/gsm8k.py}]`` (strict ``#### N``) or ``reward_fns/math.py``;
train on it with ``python -m rlframe.main recipe=grpo_gsm8k`` (which reads ~/data/gsm8k).
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


def to_row(record: dict, split: str, index: int) -> dict:
    question, solution = record["question"], record["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(solution)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
    }


def write_rows(records, output_path: Path, split: str, source: str, max_rows: int | None = None) -> int:
    """GSM8K records ({question, answer}) -> the parquet layout; errors name the source and record."""
    rows = []
    for number, record in enumerate(records, start=1):
        if max_rows is not None and len(rows) >= max_rows:
            break
        try:
            rows.append(to_row(record, split, len(rows)))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{source}, record {number}: {exc}") from exc
    output_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output_path)
    return len(rows)


def convert_split(input_path: Path, output_path: Path, split: str,
                  max_rows: int | None = None) -> int:
    def records():
        with open(input_path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    return write_rows(records(), output_path, split, str(input_path), max_rows)


def preprocess_from_hub(dataset: str, output_dir: str | Path, max_rows: int | None = None) -> dict[str, Path]:
    """Load GSM8K through `datasets` (a hub id such as openai/gsm8k, or a folder saved with save_to_disk)."""
    import datasets

    output_dir = Path(output_dir).expanduser()
    try:
        if Path(dataset).expanduser().is_dir():
            splits = datasets.load_from_disk(str(Path(dataset).expanduser()))
        else:
            splits = datasets.load_dataset(dataset, "main")
    except Exception as exc:
        raise SystemExit(f"error: could not load {dataset} through the datasets library ({type(exc).__name__}: "
                         f"{str(exc)[:300]}).\nWithout access to the Hugging Face hub, download GSM8K's train.jsonl "
                         "and test.jsonl (github.com/openai/grade-school-math) and run this script with "
                         "--input_dir <their folder>.") from None
    written = {}
    for split in SPLITS:
        target = output_dir / f"{split}.parquet"
        count = write_rows(splits[split], target, split, f"{dataset}[{split}]", max_rows)
        print(f"{split}: {count} rows -> {target}")
        written[split] = target
    return written


def preprocess_gsm8k(input_dir: str | Path, output_dir: str | Path,
                     max_rows: int | None = None) -> dict[str, Path]:
    """Convert every split; ``max_rows`` keeps only the first rows of each (for quick tests)."""
    input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
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
    parser = argparse.ArgumentParser(description="GSM8K -> parquet (verl layout)")
    parser.add_argument("--local_dir", "--local_save_dir", "--output_dir", dest="local_dir", default="~/data/gsm8k",
                        help="where train.parquet and test.parquet go (default ~/data/gsm8k, verl's)")
    parser.add_argument("--hf_dataset", default="openai/gsm8k",
                        help="hub id or a datasets save_to_disk folder (default openai/gsm8k)")
    parser.add_argument("--input_dir", default=None,
                        help="read the original train.jsonl / test.jsonl from this folder instead of the hub")
    parser.add_argument("--max_rows", type=int, default=None)
    args = parser.parse_args(argv)
    if args.input_dir:
        preprocess_gsm8k(args.input_dir, args.local_dir, args.max_rows)
    else:
        preprocess_from_hub(args.hf_dataset, args.local_dir, args.max_rows)


if __name__ == "__main__":
    main()
