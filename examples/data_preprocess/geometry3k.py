"""Geometry3K (geometry problems with a diagram) in the multimodal parquet layout verl and EasyR1 use.

    python examples/data_preprocess/geometry3k.py --local_dir ~/data/geometry3k

loads ``hiyouga/geometry3k`` through the ``datasets`` library (or ``--hf_dataset <a save_to_disk
folder or another hub id>``; each record: ``images`` (a list of images), ``problem`` (text with one
``<image>`` placeholder per image) and ``answer``) and writes ``train.parquet``, ``validation.parquet``
and ``test.parquet`` with one row per problem::

    data_source   "hiyouga/geometry3k"
    prompt        [{"role": "user", "content": problem + " " + INSTRUCTION}]    (<image> kept in place)
    images        [{"bytes": <PNG>, "path": None}, ...]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": answer}
    extra_info    {"split": ..., "index": i, "question": problem, "answer": answer}

Train on it with a vision-language model, e.g.::

    python -m rlframe.main recipe=grpo_vlm_shapes model.path=Qwen/Qwen2.5-VL-3B-Instruct rollout.engine=auto \\
        data.train_files=~/data/geometry3k/train.parquet data.val_files=~/data/geometry3k/test.parquet \\
        data.max_prompt_length=1024 data.max_response_length=1024 data.max_pixels=1003520

(the answers are numbers or short LaTeX expressions: reward_fns/math.py compares ``\\boxed{...}``).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = ("Think about the problem step by step, then give the final answer inside \\boxed{}.")
SPLITS = ("train", "validation", "test")


def image_record(image) -> dict:
    """A PIL image, image bytes or a datasets Image dict -> {"bytes": PNG (or the original bytes), "path": None}."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return {"bytes": bytes(image["bytes"]), "path": None}
        if image.get("path"):
            return {"bytes": Path(image["path"]).read_bytes(), "path": None}
        raise ValueError("an image dict with neither bytes nor path")
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    if hasattr(image, "save"):  # a PIL image (datasets decodes Image features to PIL)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return {"bytes": out.getvalue(), "path": None}
    raise ValueError(f"unsupported image value of type {type(image).__name__}")


def to_row(record: dict, split: str, index: int) -> dict:
    """One Geometry3K record -> one row of the multimodal layout. Raises ValueError when the
    placeholders and images disagree (the trainer would refuse the row anyway)."""
    problem, answer = record["problem"], str(record["answer"])
    images = list(record.get("images") or [])
    if problem.count("<image>") != len(images):
        raise ValueError(f"{problem.count('<image>')} <image> placeholder(s) for {len(images)} image(s)")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": [image_record(image) for image in images],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": problem, "answer": answer},
    }


def write_rows(records, output_path: Path, split: str, source: str, max_rows: int | None = None) -> int:
    rows = []
    for number, record in enumerate(records):
        if max_rows is not None and len(rows) >= max_rows:
            break
        try:
            rows.append(to_row(record, split, len(rows)))
        except (KeyError, ValueError, OSError) as exc:
            raise ValueError(f"{source}, record {number}: {exc}") from exc
    output_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output_path)
    return len(rows)


def preprocess(dataset: str, output_dir: str | Path, max_rows: int | None = None) -> dict[str, Path]:
    import datasets

    output_dir = Path(output_dir).expanduser()
    try:
        if Path(dataset).expanduser().is_dir():
            splits = datasets.load_from_disk(str(Path(dataset).expanduser()))
        else:
            splits = datasets.load_dataset(dataset)
    except Exception as exc:
        raise SystemExit(f"error: could not load {dataset} through the datasets library ({type(exc).__name__}: "
                         f"{str(exc)[:300]}).\nWithout access to the Hugging Face hub, download it once elsewhere "
                         "(datasets.load_dataset('hiyouga/geometry3k').save_to_disk(FOLDER)) and pass "
                         "--hf_dataset FOLDER.") from None
    written = {}
    for split in SPLITS:
        if split not in splits:
            continue
        target = output_dir / f"{split}.parquet"
        count = write_rows(splits[split], target, split, f"{dataset}[{split}]", max_rows)
        print(f"{split}: {count} rows -> {target}")
        written[split] = target
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Geometry3K -> parquet (verl / EasyR1 multimodal layout)")
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/geometry3k")
    parser.add_argument("--hf_dataset", default=DATA_SOURCE, help="hub id or a datasets save_to_disk folder")
    parser.add_argument("--max_rows", type=int, default=None)
    args = parser.parse_args(argv)
    preprocess(args.hf_dataset, args.local_dir, args.max_rows)


if __name__ == "__main__":
    main()
