"""Audio in prompts: reading it from a row (verl's and LLaMA-Factory/EasyR1's layouts), resampling, and an
audio-language model's features (Qwen2-Audio).

The row layouts read unchanged::

    verl            audios  ["clip.wav"]  or  [{"array": [...], "sampling_rate": 8000}]     <audio> in the prompt
    LLaMA-Factory   audios  ["clip.wav"]                                                   <audio> in the prompt
    datasets Audio  audios  [{"bytes": b"RIFF...", "path": "clip.wav"}]                    (how parquet stores one)

An audio is a .wav file path (relative paths are taken from the data file's folder), the bytes of a
.wav file, a ``{"bytes", "path"}`` dict or a ``{"array", "sampling_rate"}`` dict (a decoded
``datasets`` Audio feature). WAV is decoded with ``scipy.io.wavfile`` (PCM 8/16/24/32-bit, float):
integer PCM is scaled to [-1, 1] (``x / 2**(bits - 1)``, 8-bit: ``(x - 128) / 128``); several channels
are averaged to one.

Resampling to the processor's rate (16000 Hz for Whisper features): ``g = gcd(rate, target)``,
``up = target / g``, ``down = rate / g``; ``scipy.signal.resample_poly(x, up, down)`` (a polyphase
FIR low-pass, Kaiser window), which gives ``ceil(n * up / down)`` samples. An audio already at the
target rate is kept as is.

An audio is decoded and resampled ONCE, when the data set is read (before Ray starts): a file that
cannot be decoded is an error naming the file, the row and the column (``AudioProblem`` -> RLDataset
adds the file and row); the waveform (float32, at the target rate) is kept with the row.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from rlframe.data.multimodal import ImageProblem

AUDIO_PLACEHOLDER = "<audio>"
TARGET_RATE = 16000  # Whisper's (and Qwen2-Audio's) feature extractor rate


class AudioProblem(ImageProblem):
    """A row's audio field is unusable; `field` names it (e.g. ``audios[0]``)."""


def audio_list(row: dict, audio_key: str) -> list:
    """The row's audios as a list ([] when the column is absent or null)."""
    value = row.get(audio_key)
    if value is None:
        return []
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.tolist()
    if isinstance(value, (str, Path, dict, bytes)):
        return [value]  # one audio given bare
    return list(value)


def pcm_to_float(data: np.ndarray) -> np.ndarray:
    """WAV samples -> float32 mono in [-1, 1] (module docstring: integer PCM / 2**(bits-1); channels averaged)."""
    if data.dtype == np.uint8:
        x = (data.astype(np.float32) - 128.0) / 128.0
    elif np.issubdtype(data.dtype, np.integer):
        x = data.astype(np.float32) / float(2 ** (8 * data.dtype.itemsize - 1))
    else:
        x = data.astype(np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1)
    return x


def resample(x: np.ndarray, rate: int, target: int = TARGET_RATE) -> np.ndarray:
    """`x` at `rate` Hz -> at `target` Hz (polyphase, ``ceil(n * up / down)`` samples; module docstring)."""
    rate, target = int(rate), int(target)
    if rate == target:
        return np.asarray(x, dtype=np.float32)
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return resample_poly(np.asarray(x, dtype=np.float64), target // g, rate // g).astype(np.float32)


def _read_wav(source, what: str, field: str) -> tuple[np.ndarray, int]:
    from scipy.io import wavfile

    try:
        rate, data = wavfile.read(source)
    except (ValueError, OSError, EOFError) as exc:
        text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the audio", str(exc)) or type(exc).__name__
        raise AudioProblem(field, f"cannot decode the audio ({what}): {text}. Fix: store it as a PCM .wav file "
                                  "(e.g. ffmpeg -i IN -ar 16000 -ac 1 OUT.wav), or as {'array': [...], "
                                  "'sampling_rate': N}") from None
    if data.size == 0:
        raise AudioProblem(field, f"the audio ({what}) has no samples")
    return pcm_to_float(data), int(rate)


def decode_audio(value: Any, field: str, base_dir: str | Path | None, target: int | None = TARGET_RATE):
    """A row's audio (any form of the module docstring) -> float32 mono samples at `target` Hz (None: the
    samples and their own rate, ``(x, rate)``)."""
    x, rate = _decode(value, field, base_dir)
    return (x, rate) if target is None else resample(x, rate, target)


def _decode(value: Any, field: str, base_dir: str | Path | None) -> tuple[np.ndarray, int]:
    if isinstance(value, dict):
        if value.get("array") is not None:
            rate = value.get("sampling_rate")
            if not rate or float(rate) <= 0:
                raise AudioProblem(field, "an {'array': ...} audio needs a positive 'sampling_rate' (Hz)")
            x = np.asarray(value["array"], dtype=np.float32)
            if x.ndim == 2:  # [channels, n] as datasets gives several channels
                x = x.mean(axis=0)
            if x.ndim != 1 or x.size == 0:
                raise AudioProblem(field, f"an audio array must be 1-D and non-empty, got shape {x.shape}")
            if not np.isfinite(x).all():
                raise AudioProblem(field, "the audio array holds NaN or infinite samples")
            return x, int(rate)
        data, path = value.get("bytes"), value.get("path")
        value = data if data else path
        if value is None:
            raise AudioProblem(field, "an audio dict with none of 'array', 'bytes', 'path'")
    if isinstance(value, (bytes, bytearray, memoryview)):
        x, rate = _read_wav(io.BytesIO(bytes(value)), f"{len(value)} bytes", field)
    elif isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise AudioProblem(field, f"audio file not found: {path}")
        x, rate = _read_wav(str(path), str(path), field)
    else:
        raise AudioProblem(field, f"expected a .wav path, .wav bytes, a {{'bytes', 'path'}} or an {{'array', "
                                  f"'sampling_rate'}} dict, got {type(value).__name__}")
    return x, rate


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> Path:
    """Write float samples in [-1, 1] as a 16-bit PCM .wav file."""
    from scipy.io import wavfile

    path = Path(path)
    wavfile.write(str(path), int(rate), (np.clip(samples, -1.0, 1.0) * 32767).astype(np.int16))
    return path


def audio_token_count(num_frames: int) -> int:
    """Qwen2-Audio's tokens for `num_frames` mel frames: the conv stride 2 then the pooling stride 2,
    ``((num_frames - 1) // 2 + 1 - 2) // 2 + 1``."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


class AudioProcessor:
    """An audio-language model's feature extractor + its tokenizer: prompt text and audios -> token ids and
    the forward's inputs (Qwen2-Audio: ``input_features`` [audios, mel bins, frames], padded to the
    extractor's window, and ``feature_attention_mask`` [audios, frames]; audio i takes
    ``audio_token_count(feature_attention_mask[i].sum())`` ``<|AUDIO|>`` tokens)."""

    AUDIO_TOKEN = "<|AUDIO|>"

    def __init__(self, model_path: str, tokenizer, trust_remote_code: bool = False):
        from transformers import AutoFeatureExtractor

        try:
            self.feature_extractor = AutoFeatureExtractor.from_pretrained(model_path,
                                                                          trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the data has audios but model.path={model_path} has no audio feature extractor "
                             f"(preprocessor_config.json): {str(exc)[:200]}. Fix: an audio-language model "
                             "(e.g. Qwen/Qwen2-Audio-7B-Instruct, or tiny-qwen2-audio for a smoke run)") from None
        self.tokenizer = tokenizer
        if self.AUDIO_TOKEN not in tokenizer.get_vocab():
            raise ValueError(f"the tokenizer of {model_path} has no {self.AUDIO_TOKEN} token: rlframe's audio "
                             "prompts support the Qwen2-Audio family")
        self.audio_token_id = tokenizer.convert_tokens_to_ids(self.AUDIO_TOKEN)
        self.sampling_rate = int(self.feature_extractor.sampling_rate)
        self.max_seconds = float(self.feature_extractor.n_samples) / self.sampling_rate

    def audio_inputs(self, audios: list[np.ndarray]) -> dict:
        """{"input_features", "feature_attention_mask"} (torch tensors) of a row's audios (float32 at the rate)."""
        out = self.feature_extractor(audios, sampling_rate=self.sampling_rate, return_attention_mask=True,
                                     padding="max_length", return_tensors="pt")
        return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}

    def check_lengths(self, audios: list[np.ndarray], field: str) -> None:
        """Each audio fits the window (else the extractor would cut it) and gives at least 2 tokens (one
        lone <|AUDIO|> makes Qwen2-Audio's forward take the prompt for an unexpanded one)."""
        hop = int(self.feature_extractor.hop_length)
        for j, x in enumerate(audios):
            if audio_token_count(-(-len(x) // hop)) < 2:
                raise AudioProblem(f"{field}[{j}]", f"the audio lasts {len(x) / self.sampling_rate:.3f} s, too short "
                                                    f"for 2 audio tokens (at least {7 * hop / self.sampling_rate:.3f} "
                                                    "s). Fix: drop the row, or pad the audio with silence")
            if len(x) > self.feature_extractor.n_samples:
                raise AudioProblem(f"{field}[{j}]", f"the audio lasts {len(x) / self.sampling_rate:.2f} s, longer "
                                                    f"than the model's window of {self.max_seconds:g} s (its "
                                                    "feature extractor would cut it). Fix: split or trim the audio")

    def expand(self, raw_prompt: str, feature_attention_mask) -> str:
        """Each ``<|AUDIO|>`` of `raw_prompt` -> as many as that audio has tokens (``audio_token_count``)."""
        counts = [] if feature_attention_mask is None else feature_attention_mask.sum(-1).tolist()
        found = raw_prompt.count(self.AUDIO_TOKEN)
        if found != len(counts):
            raise ValueError(f"the chat template rendered {found} {self.AUDIO_TOKEN} for {len(counts)} audios")
        tokens = iter(audio_token_count(int(n)) for n in counts)
        pieces = raw_prompt.split(self.AUDIO_TOKEN)
        return pieces[0] + "".join(self.AUDIO_TOKEN * next(tokens) + piece for piece in pieces[1:])

    def inputs(self, images: list, videos: list | None = None, audios: list | None = None) -> dict:
        if images or videos:
            raise ValueError("this model reads audio only: rows with images or videos need a vision-language "
                             "model.path")
        return self.audio_inputs(audios) if audios else {}

    def encode(self, raw_prompt: str, images: list, videos: list | None = None,
               audios: list | None = None) -> tuple[list[int], dict]:
        inputs = self.inputs(images, videos, audios)
        text = self.expand(raw_prompt, inputs.get("feature_attention_mask"))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], inputs
