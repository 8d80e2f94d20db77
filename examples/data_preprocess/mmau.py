"""MMAU (audio question answering, multiple choice) in verl's audio layout, scored by the exact-answer math reward.

    python examples/data_preprocess/mmau.py --local_dir ~/data/mmau

loads ``lmms-lab/mmau`` through the ``datasets`` library (or ``--hf_dataset <a save_to_disk folder or another
hub id with the same columns>``) and writes one parquet per split (``--splits``, default ``test_mini``: MMAU
test-mini, 1000 questions on sound, music and speech clips, so ``test_mini.parquet``). MMAU's full ``test``
split (9000) is scored by the benchmark's own submission (lmms-eval writes a submission file for it): records
without an answer are skipped and counted, so ``--splits test_mini,test`` keeps whatever has answers.

The hub set's schema assumed here (lmms-lab/mmau's dataset card and lmms-eval's ``mmau`` task, read
2026-12-06): each record has ``id``, ``audio`` (a ``datasets`` Audio: the clip's file), ``question``,
``choices`` (a JSON list as a string, e.g. ``'["Man", "Woman", "Child", "Robot"]'``; a plain list is taken
too), ``answer`` (the text of the correct choice), ``dataset``, ``task`` (sound / music / speech), ``split``,
``category``, ``sub-category``, ``difficulty``. Rows written::

    data_source   "lmms-lab/mmau"
    prompt        [{"role": "user", "content": "<audio>" + question + "\\n1. Man\\n2. Woman\\n..." + INSTRUCTION}]
    audios        [{"bytes": <the .wav file>, "path": None}]
    ability       "audio"
    reward_model  {"style": "rule", "ground_truth": "2"}     (the correct option's number, 1-based)
    extra_info    {"split": ..., "index": i, "id": ..., "question": ..., "choices": [...], "answer": "Woman",
                   "task": ..., "category": ..., "sub-category": ..., "difficulty": ...}

The options are numbered so that the answer is a number: ``reward_fns/math.py`` scores ``\\boxed{2}`` exactly
(as the grpo_audio_tones and grpo_video_shapes recipes do). The audio column is read undecoded (the file's own
bytes, no resampling by ``datasets``); rlframe decodes .wav and resamples it to the model's 16 kHz once, when the
data is read (docs/vision.md#audio). A clip that is not a .wav file is converted to 16-bit PCM .wav when the
``soundfile`` package can decode it, else it is an error naming the record. Train on it with an audio model::

    python -m rlframe.main recipe=grpo_audio_tones model.path=Qwen/Qwen2-Audio-7B-Instruct \\
        data.train_files=~/data/mmau/test_mini.parquet data.max_prompt_length=1024 data.max_response_length=512

(MMAU is a benchmark: hold part of it out for validation, or train on another set written in this layout.
Qwen2-Audio hears at most 30 s: a longer clip is an error at start-up naming its row; ``data.bad_rows=skip``
drops such rows.)
"""

from __future__ import annotations

import argparse
import io
import json
import wave
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "lmms-lab/mmau"
INSTRUCTION = "Answer with the number of the correct option. End your reply with: The answer is \\boxed{your number}."
SPLITS = ("test_mini",)  # --splits test_mini,test reads MMAU's "test" (9000) too: its unanswered records are skipped
EXTRA_COLUMNS = ("id", "dataset", "task", "category", "sub-category", "difficulty")


def is_wav(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def pcm16_wav(samples, rate: int) -> bytes:
    """Float samples in [-1, 1] (shape (n,), or (channels, n) / (n, channels): averaged) -> the bytes of a mono
    16-bit PCM .wav file at ``rate`` Hz."""
    import numpy as np

    x = np.asarray(samples, dtype=np.float64)
    if x.ndim == 2:
        x = x.mean(axis=0 if x.shape[0] < x.shape[1] else 1)
    pcm = np.round(np.clip(x, -1.0, 1.0) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(rate))
        f.writeframes(pcm.tobytes())
    return out.getvalue()


def _other_format_to_wav(data: bytes) -> bytes:
    try:
        import soundfile
    except ImportError:
        raise ValueError(f"the audio is not a .wav file (it starts with {data[:4]!r}) and the soundfile package, which "
                         "would convert it, is not installed: pip install soundfile") from None
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except Exception as exc:  # soundfile's own error types
        raise ValueError(f"the audio is not a .wav file (it starts with {data[:4]!r}) and soundfile cannot decode it "
                         f"either ({type(exc).__name__}: {exc})") from None
    return pcm16_wav(samples, rate)


def audio_record(audio) -> dict:
    """A ``datasets`` Audio value -> {"bytes": a .wav file, "path": None}: undecoded ({"bytes", "path"}, how
    ``Audio(decode=False)`` and parquet give it), a decoded {"array", "sampling_rate"} dict, a decoder object
    with ``get_all_samples()`` (datasets 4 with torchcodec), raw bytes or a file path."""
    if isinstance(audio, dict) and audio.get("array") is not None:
        if not audio.get("sampling_rate"):
            raise ValueError("an audio array without a sampling_rate")
        return {"bytes": pcm16_wav(audio["array"], audio["sampling_rate"]), "path": None}
    if isinstance(audio, dict):
        if audio.get("bytes"):
            data = bytes(audio["bytes"])
        elif audio.get("path"):
            data = Path(audio["path"]).read_bytes()
        else:
            raise ValueError("an audio dict with none of 'array', 'bytes', 'path'")
    elif isinstance(audio, (bytes, bytearray)):
        data = bytes(audio)
    elif isinstance(audio, (str, Path)):
        data = Path(audio).read_bytes()
    elif hasattr(audio, "get_all_samples"):
        samples = audio.get_all_samples()
        return {"bytes": pcm16_wav(samples.data.numpy(), samples.sample_rate), "path": None}
    else:
        raise ValueError(f"unsupported audio value of type {type(audio).__name__}")
    return {"bytes": data if is_wav(data) else _other_format_to_wav(data), "path": None}


def parse_choices(value) -> list[str]:
    """MMAU's ``choices``: a JSON list in a string (or already a list) of at least two options."""
    choices = json.loads(value) if isinstance(value, str) else value
    if not isinstance(choices, (list, tuple)) or len(choices) < 2:
        raise ValueError(f"choices must be a list of at least 2 options (or a JSON string of one), got {value!r}")
    return [str(choice).strip() for choice in choices]


def to_row(record: dict, split: str, index: int) -> dict | None:
    """One MMAU record -> one row of verl's audio layout; None for a record without an answer (MMAU's test
    split). Raises ValueError when the answer is none of the choices (the row could never score)."""
    question, answer = str(record["question"]).strip(), str(record.get("answer") or "").strip()
    choices = parse_choices(record["choices"])
    if not answer:
        return None
    matches = [i for i, choice in enumerate(choices) if choice.lower() == answer.lower()]
    if len(matches) != 1:
        raise ValueError(f"answer {answer!r} is {'none' if not matches else 'more than one'} of the choices {choices}")
    options = "\n".join(f"{i}. {choice}" for i, choice in enumerate(choices, start=1))
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"<audio>{question}\n{options}\n{INSTRUCTION}"}],
        "audios": [audio_record(record["audio"])],
        "ability": "audio",
        "reward_model": {"style": "rule", "ground_truth": str(matches[0] + 1)},
        "extra_info": {"split": split, "index": index, "question": question, "choices": choices, "answer": answer,
                       **{key: str(record.get(key) or "") for key in EXTRA_COLUMNS}},
    }


def write_rows(records, output_path: Path, split: str, source: str,
               max_rows: int | None = None) -> tuple[int, int]:
    """MMAU records -> parquet at ``output_path`` (not written when no record has an answer); returns (rows
    written, records skipped for want of an answer). Errors name the source and the record."""
    rows, unanswered = [], 0
    for number, record in enumerate(records):
        if max_rows is not None and len(rows) >= max_rows:
            break
        try:
            row = to_row(record, split, len(rows))
        except (KeyError, ValueError, OSError) as exc:
            raise ValueError(f"{source}, record {number}: {type(exc).__name__}: {exc}") from exc
        if row is None:
            unanswered += 1
        else:
            rows.append(row)
    if rows:
        output_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), output_path)
    return len(rows), unanswered


def load_splits(dataset: str, splits: tuple[str, ...]) -> dict:
    """The requested splits of a hub id (only those are downloaded) or of a ``save_to_disk`` folder."""
    import datasets

    folder = Path(dataset).expanduser()
    try:
        if folder.is_dir():
            saved = datasets.load_from_disk(str(folder))
            missing = [split for split in splits if split not in saved]
            if missing:
                raise KeyError(f"no split {', '.join(missing)} in {folder} (it has {', '.join(saved)}): "
                               "pass --splits with those it has")
            return {split: saved[split] for split in splits}
        return {split: datasets.load_dataset(dataset, split=split) for split in splits}
    except Exception as exc:
        raise SystemExit(f"error: could not load {dataset} through the datasets library ({type(exc).__name__}: "
                         f"{str(exc)[:300]}).\nWithout access to the Hugging Face hub, download it once elsewhere "
                         f"(datasets.load_dataset('{DATA_SOURCE}', split='test_mini').save_to_disk(FOLDER)) and pass "
                         "--hf_dataset FOLDER.") from None


def preprocess(dataset: str, output_dir: str | Path, max_rows: int | None = None,
               splits: tuple[str, ...] = SPLITS) -> dict[str, Path]:
    import datasets

    output_dir = Path(output_dir).expanduser()
    written = {}
    for split, records in load_splits(dataset, splits).items():
        if isinstance(records.features.get("audio"), datasets.Audio):  # the file's bytes, not decoded arrays
            records = records.cast_column("audio", datasets.Audio(decode=False))
        target = output_dir / f"{split}.parquet"
        count, unanswered = write_rows(records, target, split, f"{dataset}[{split}]", max_rows)
        skipped = f" ({unanswered} without an answer skipped)" if unanswered else ""
        print(f"{split}: {count} rows -> {target}{skipped}" if count else f"{split}: no answered rows{skipped}")
        if count:
            written[split] = target
    if not written:
        raise SystemExit(f"error: no answered rows in {dataset} ({', '.join(splits)})")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="MMAU (audio multiple-choice QA) -> parquet (verl audio layout)")
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/mmau")
    parser.add_argument("--hf_dataset", default=DATA_SOURCE, help="hub id or a datasets save_to_disk folder")
    parser.add_argument("--splits", default=",".join(SPLITS),
                        help=f"comma-separated splits to convert (default {','.join(SPLITS)})")
    parser.add_argument("--max_rows", type=int, default=None)
    args = parser.parse_args(argv)
    splits = tuple(split.strip() for split in args.splits.split(",") if split.strip())
    preprocess(args.hf_dataset, args.local_dir, args.max_rows, splits)


if __name__ == "__main__":
    main()
