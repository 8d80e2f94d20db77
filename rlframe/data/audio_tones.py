"""A generated audio dataset: short clips of sine tones, and the question how many beeps there are or which
of two tones is higher.

Each clip is a mono 16-bit PCM ``.wav`` file at ``rate`` Hz (8000 by default: the data set's reader
resamples it to the model's 16000 Hz) written next to the parquet files. Two kinds of question, half each:

- count: 1 to 4 beeps of one tone (``beep`` s each, ``gap`` s of silence between) -> the count;
- higher: two tones of ``beep`` s with a ``gap`` between, frequencies a semitone ratio >= 2**(4/12) apart
  -> 1 when the first is higher, 2 when the second is.

Tones are 220..880 Hz, amplitude 0.5, with 5 ms linear fades (no clicks). The answer is a number, so the
ordinary math reward scores it::

    <audio>How many beeps do you hear? Answer with a number.  -> 3

in verl's multimodal layout (one ``<audio>`` placeholder per audio; the audio a path relative to the
data file)::

    data_source   "audio_tones"
    prompt        [{"role": "user", "content": "<audio>" + question + " " + INSTRUCTION}]
    audios        ["audios/train_00000.wav"]
    ability       "audio"
    reward_model  {"style": "rule", "ground_truth": "3"}
    extra_info    {"split": "train", "index": 0, "kind": "count", "frequencies": [440.0, ...]}

Seeded and deterministic; the validation split uses a different seed stream.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from rlframe.data.audio import write_wav
from rlframe.data.parquet_rows import write_rows
from rlframe.data.shapes import INSTRUCTION

DATA_SOURCE = "audio_tones"
KINDS = ("count", "higher")
LOW_HZ, HIGH_HZ = 220.0, 880.0
FADE_SECONDS = 0.005


def beep(freq: float, seconds: float, rate: int) -> np.ndarray:
    """0.5 sin(2 pi f t) for `seconds`, with FADE_SECONDS linear fades in and out."""
    n = int(round(seconds * rate))
    x = 0.5 * np.sin(2 * np.pi * freq * np.arange(n) / rate)
    fade = min(n // 2, int(FADE_SECONDS * rate))
    if fade:
        ramp = np.linspace(0.0, 1.0, fade, endpoint=False)
        x[:fade] *= ramp
        x[n - fade:] *= ramp[::-1]
    return x


def clip(frequencies: list[float], beep_seconds: float, gap_seconds: float, rate: int) -> np.ndarray:
    """The beeps one after the other, `gap_seconds` of silence between (and before and after)."""
    gap = np.zeros(int(round(gap_seconds * rate)))
    parts = [gap]
    for freq in frequencies:
        parts += [beep(freq, beep_seconds, rate), gap]
    return np.concatenate(parts)


def tones_rows(out_dir: Path, n: int, seed: int, split: str, rate: int, beep_seconds: float,
               gap_seconds: float) -> list[dict]:
    rng = random.Random(f"audio-tones-{split}-{seed}")
    (out_dir / "audios").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n):
        kind = KINDS[index % 2] if n > 1 else rng.choice(KINDS)
        if kind == "count":
            count = rng.randint(1, 4)
            frequencies = [rng.uniform(LOW_HZ, HIGH_HZ)] * count
            question, answer = "How many beeps do you hear? Answer with a number.", str(count)
        else:
            low = rng.uniform(LOW_HZ, HIGH_HZ / 2 ** (4 / 12))
            high = rng.uniform(low * 2 ** (4 / 12), HIGH_HZ)
            first_higher = rng.random() < 0.5
            frequencies = [high, low] if first_higher else [low, high]
            question = "Which tone is higher, the first or the second? Answer 1 for the first, 2 for the second."
            answer = "1" if first_higher else "2"
        name = f"audios/{split}_{index:05d}.wav"
        write_wav(out_dir / name, clip(frequencies, beep_seconds, gap_seconds, rate), rate)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"<audio>{question} {INSTRUCTION}"}],
            "audios": [name],
            "ability": "audio",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "kind": kind,
                           "frequencies": [round(f, 2) for f in frequencies]},
        })
    return rows


def generate_audio_tones_dataset(out_dir: str | Path, n_train: int = 64, n_val: int = 16, seed: int = 0,
                                 rate: int = 8000, beep_seconds: float = 0.15,
                                 gap_seconds: float = 0.1) -> tuple[Path, Path]:
    """Write train.parquet, val.parquet and their clips (audios/*.wav) into `out_dir`; returns the parquet paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rows = tones_rows(out_dir, n, s, name, rate, beep_seconds, gap_seconds)
        paths.append(write_rows(rows, out_dir / f"{name}.parquet"))
    return paths[0], paths[1]
