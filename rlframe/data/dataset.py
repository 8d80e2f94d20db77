"""The prompt dataset of an RL run: load, validate, template, tokenize; and collate into a batch.

Accepted files (one dataset may mix several):
  * ``.parquet`` (pyarrow), ``.jsonl`` / ``.json`` (one JSON object per line),
  * a folder written by ``datasets.Dataset.save_to_disk`` (loaded with ``datasets.load_from_disk``).

Row layout (the common verl layout; ``reward_fns`` and ``examples/data_preprocess`` use it)::

    prompt        list of chat messages [{"role": ..., "content": ...}], or a plain string
    reward_model  {"ground_truth": ...}            (or a plain column, with answer_key="answer")
    data_source   str (optional: defaults to the file's stem)
    extra_info    dict (optional)

Every row is checked when the dataset is built, so a bad row fails at start-up, not hours into a
run: a missing or malformed field raises ``DatasetError`` naming the file, the row number and the
field (``bad_rows="skip"`` drops such rows instead and reports how many). Prompts are rendered
with the tokenizer's chat template and tokenized once; a prompt longer than
``max_prompt_length`` tokens raises (``overlong="error"``), is dropped (``"filter"``) or keeps its
last ``max_prompt_length`` tokens (``"truncate_left"``), with the count logged.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlframe.data.files import DatasetError, is_hub_id, read_hub_rows, read_with_datasets
from rlframe.data.multimodal import (ImageProblem, VisionProcessor, decode_image, fit_pixels, image_list,
                                     split_placeholders)
from rlframe.data.audio import audio_list
from rlframe.data.video import video_list
from rlframe.protocol import DataProto

logger = logging.getLogger(__name__)

OVERLONG_POLICIES = ("error", "filter", "truncate_left")
BAD_ROW_POLICIES = ("error", "skip")


# ------------------------------------------------------------------ reading files


def read_rows(path: str | Path) -> list[dict]:
    """Read every row of a parquet / jsonl / json / csv / arrow file, a ``datasets`` folder or a hub
    dataset (``name@split``) as plain dicts."""
    if not Path(path).expanduser().exists() and is_hub_id(str(path)):
        return read_hub_rows(str(path))
    path = Path(path).expanduser()
    if not path.exists():
        raise DatasetError(f"data file not found: {path}")
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise DatasetError(f"{path}: not a folder written by datasets' save_to_disk "
                               f"({type(exc).__name__}: {exc})") from exc
        if isinstance(ds, datasets.DatasetDict):
            raise DatasetError(f"{path} holds a DatasetDict with splits {list(ds)}; point at one "
                               f"split's folder, e.g. {path / next(iter(ds))}")
        return ds.to_list()
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".csv", ".arrow") or (suffix == ".json" and _starts_with_bracket(path)):
        return read_with_datasets(path)
    if suffix in (".jsonl", ".json"):
        rows = []
        # Undecodable bytes become lone surrogates here and are reported per row and field by
        # RLDataset (instead of one UnicodeDecodeError for the whole file).
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}, line {line_number}: invalid JSON ({exc})") from exc
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}, line {line_number}: expected a JSON object, got "
                                       f"{type(row).__name__}")
                rows.append(row)
        return rows
    raise DatasetError(f"{path}: unsupported data file type {suffix!r}; use .parquet, .jsonl, .json, .csv, "
                       f".arrow, a datasets save_to_disk folder or a hub id name@split")


def _read_parquet(path: Path) -> list[dict]:
    """A parquet file's rows; an empty file or one of another format (a CSV named .parquet) is a DatasetError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: the file is empty. Fix: write the data into it, or point data.train_files / "
                           "data.val_files at the right file")
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        with open(path, "rb") as f:
            head = f.read(200).decode("utf-8", "replace").splitlines()[0][:80] if path.stat().st_size else ""
        raise DatasetError(f"{path}: not a parquet file ({exc}); it starts with {head!r}. Fix: convert it (e.g. "
                           "pandas.read_csv(...).to_parquet(...)) or give it its real suffix (.csv, .jsonl)") from None


def _starts_with_bracket(path: Path) -> bool:
    """A .json file holding one JSON array (rather than one object per line)."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


# ------------------------------------------------------------------ checking rows


class _BadRow(ValueError):
    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r}: {problem}")


def _get_field(row: dict, dotted: str, key: str = "") -> Any:
    """row["a"]["b"] for "a.b"; a missing column is named with the row's columns and `key`, the config key to set."""
    value: Any = row
    for depth, part in enumerate(dotted.split(".")):
        if not isinstance(value, dict) or part not in value:
            if depth == 0:
                columns = ", ".join(map(str, row)) or "none"
                fix = f" Fix: {key}=<the column that holds it>" if key else ""
                raise _BadRow(dotted, f"missing (the row's columns: {columns}).{fix}")
            raise _BadRow(dotted, "missing")
        value = value[part]
    return value


def _find_bad_text(value: Any, field: str) -> None:
    """Raise _BadRow naming the first (nested) field whose text is not valid UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start]
            byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
            raise _BadRow(field, f"not valid UTF-8 text{byte} at character {exc.start}") from None
    elif isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadRow(field, f"not valid UTF-8 text (byte 0x{value[exc.start]:02x} at {exc.start})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _find_bad_text(item, f"{field}.{key}" if field else str(key))
    elif isinstance(value, (list, tuple, np.ndarray)):
        for j, item in enumerate(value):
            _find_bad_text(item, f"{field}[{j}]")


def _finite(value: Any) -> bool:
    """False when `value` is, or holds, a NaN or infinite float."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


def _check_messages(value: Any, field: str) -> list[dict]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise _BadRow(field, f"expected a non-empty list of chat messages or a string, got "
                             f"{type(value).__name__}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise _BadRow(f"{field}[{j}]", f"expected a dict with 'role' and 'content', got "
                                           f"{type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _BadRow(f"{field}[{j}].{key}", "missing or not a string")
        if not message["content"].strip():  # the model would be prompted with nothing in that turn
            raise _BadRow(f"{field}[{j}].content", f"empty ({message['role']} message); fill it or drop the message")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


# ------------------------------------------------------------------ the dataset


class RLDataset:
    """Tokenized prompts with their ground truths; ``ds[i]`` is a dict (see ``__getitem__``).

    Args:
        files: data files (parquet, jsonl, datasets folders), concatenated in order.
        tokenizer: a Hugging Face tokenizer with a chat template.
        prompt_key: the prompt column (chat list or plain string).
        answer_key: a plain ground-truth column (e.g. "answer"); None reads
            ``reward_model.ground_truth``.
        max_prompt_length: the longest prompt, in tokens, after the chat template.
        overlong: "error" | "filter" | "truncate_left".
        bad_rows: "error" | "skip".
        prompt_template: a Jinja template file applied to plain-string prompts; it sees the
            prompt as ``{{ prompt }}`` (also ``{{ question }}``) and the row as ``{{ row }}``,
            and renders the user message. Chat-list prompts are used as they are.
        file_weights: relative sampling weights of the files. Each file then contributes
            ``round(total_rows * w / sum(w))`` rows to the index space (rows repeated or dropped
            by a seeded permutation), so a uniform sampler draws the files in those proportions.
        default_data_source: data_source of rows that have none (default: the file's stem).
        seed: seed of the file_weights resampling.
        image_key: the column of a row's images (verl/EasyR1 layout: a list of bytes, {"bytes", "path"}
            dicts, file paths or PIL images, one ``<image>`` placeholder per image in the prompt text;
            rlframe/data/multimodal.py). Rows without it are text rows, handled exactly as before.
        min_pixels, max_pixels, resize_images: image size limits (``fit_pixels``).
        video_key: the column of a row's videos (verl's ``[{"video": path, "fps", "max_frames"}]`` or
            EasyR1's ``[path]``, a path or a list of frame images, one ``<video>`` placeholder per video;
            rlframe/data/video.py). Each video is decoded once, here, and its sampled frames kept.
        video_fps, video_max_frames: frames sampled per second and at most per video (a row's item
            ``fps`` / ``max_frames`` overrides them).
        video_min_pixels, video_max_pixels: the size limits of one frame (None: min_pixels / max_pixels).
        audio_key: the column of a row's audios (a .wav path, .wav bytes, {"bytes", "path"} or
            {"array", "sampling_rate"}; one ``<audio>`` placeholder per audio; rlframe/data/audio.py). Each
            audio is decoded and resampled to the processor's rate once, here, and its waveform kept.
        processor: a ``VisionProcessor``; None builds one from the tokenizer's folder when a row has images.
    """

    def __init__(self, files: list[str] | str, tokenizer, *, prompt_key: str = "prompt",
                 answer_key: str | None = None, max_prompt_length: int = 256,
                 overlong: str = "error", bad_rows: str = "error",
                 prompt_template: str | None = None, file_weights: list[float] | None = None,
                 default_data_source: str | None = None, seed: int = 0, image_key: str = "images",
                 min_pixels: int = 28 * 28, max_pixels: int = 1280 * 28 * 28, resize_images: bool = True,
                 processor: VisionProcessor | None = None, video_key: str = "videos", video_fps: float = 2.0,
                 video_max_frames: int = 32, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, audio_key: str = "audios"):
        if isinstance(files, (str, Path)):
            files = [files]
        files = [str(f) for f in files]
        if not files:
            raise DatasetError("no data files given")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
        if bad_rows not in BAD_ROW_POLICIES:
            raise ValueError(f"bad_rows must be one of {BAD_ROW_POLICIES}, got {bad_rows!r}")
        if file_weights is not None and (len(file_weights) != len(files)
                                         or any(w < 0 for w in file_weights)
                                         or sum(file_weights) <= 0):
            raise ValueError(f"file_weights must be {len(files)} non-negative numbers with a "
                             f"positive sum, got {file_weights!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DatasetError("the tokenizer has no chat template: use an instruct/chat "
                               "model's tokenizer or set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.files = files
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.max_prompt_length = max_prompt_length
        self.overlong = overlong
        self.bad_rows = bad_rows
        self.default_data_source = default_data_source
        self.image_key, self.min_pixels, self.max_pixels = image_key, min_pixels, max_pixels
        self.resize_images, self.processor = resize_images, processor
        self.video_key, self.video_fps, self.video_max_frames = video_key, video_fps, video_max_frames
        self.video_min_pixels = video_min_pixels or min_pixels
        self.video_max_pixels = video_max_pixels or max_pixels
        self.video_decode_seconds = 0.0  # time spent decoding videos (read once, when the files are read)
        self.num_videos = 0
        self.audio_key, self.audio_processor = audio_key, None
        self.audio_decode_seconds = 0.0  # time spent decoding and resampling audios (once, when read)
        self.num_audios = 0
        self._template = self._load_template(prompt_template)

        self.num_skipped = 0     # malformed rows dropped (bad_rows="skip")
        self.num_filtered = 0    # overlong prompts dropped (overlong="filter")
        self.num_truncated = 0   # overlong prompts cut (overlong="truncate_left")
        self.num_read = 0        # rows read from the files
        per_file: list[list[dict]] = [self._load_file(path) for path in files]
        if file_weights is not None:
            per_file = _resample_files(per_file, file_weights, seed)
        self.rows: list[dict] = [row for rows in per_file for row in rows]
        if not self.rows:
            raise DatasetError(f"no usable rows in {', '.join(files)}{self.dropped_reason()}")
        if self.num_filtered or self.num_truncated:
            logger.info("RLDataset: %d prompts longer than max_prompt_length=%d were %s",
                        self.num_filtered or self.num_truncated, max_prompt_length,
                        "filtered out" if self.num_filtered else "left-truncated")
        logger.info("RLDataset: %d rows from %d file(s)", len(self.rows), len(files))

    def dropped_reason(self) -> str:
        """Why rows were dropped, for an error that counts too few: "; data.overlong=filter dropped 6 of 8 rows ..."."""
        reasons = []
        if self.num_filtered:
            reasons.append(f"data.overlong=filter dropped {self.num_filtered} of {self.num_read} rows longer than "
                           f"data.max_prompt_length={self.max_prompt_length} tokens")
        if self.num_skipped:
            reasons.append(f"data.bad_rows=skip dropped {self.num_skipped} of {self.num_read} malformed rows")
        return ("; " + "; ".join(reasons)) if reasons else ""

    @staticmethod
    def _load_template(path: str | None):
        if path is None:
            return None
        import jinja2

        # A file (EasyR1's format_prompt: a .jinja file) or the template text itself ("{{ content }} ...").
        template_path = Path(path).expanduser()
        if "{{" in path:
            text = path
        elif template_path.is_file():
            text = template_path.read_text()
        else:
            raise DatasetError(f"prompt_template file not found: {path} (data.prompt_template takes a Jinja file "
                               "or the template text, e.g. '{{ content }} Put the answer in \\boxed{}.')")
        try:
            return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False).from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            where = str(template_path) if text is not path else "the template text"
            raise DatasetError(f"data.prompt_template: {where}, line {exc.lineno}: Jinja syntax error: {str(exc.message).rstrip('.')}. "
                               "Fix: e.g. data.prompt_template='{{ content }} Put the answer in \\boxed{}.'") from None

    def _load_file(self, path: str) -> list[dict]:
        raw_rows = read_rows(path)
        self.num_read += len(raw_rows)
        examples, texts, skipped, first_problem = [], [], 0, None
        for number, row in enumerate(raw_rows):
            try:
                example = self._check_row(row, path)
            except _BadRow as exc:
                message = f"{path}, row {number}: {exc}"
                if self.bad_rows == "error":
                    raise DatasetError(message + " (data.bad_rows=skip drops such rows)") from None
                skipped += 1
                first_problem = first_problem or message
                continue
            example["row"] = number
            examples.append(example)
            if not _has_media(example):  # image/video rows were tokenized by _check_row (with their vision tokens)
                texts.append(example["raw_prompt"])
        if skipped:
            logger.warning("RLDataset: skipped %d malformed rows of %s; the first: %s",
                           skipped, path, first_problem)
        self.num_skipped += skipped

        token_ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        kept = []
        for example in examples:
            ids = example.pop("input_ids") if _has_media(example) else next(token_ids)
            if len(ids) > self.max_prompt_length:
                if self.overlong == "error":
                    raise DatasetError(
                        f"{path}, row {example['row']}: field {self.prompt_key!r}: the prompt has {len(ids)} tokens, more "
                        f"than data.max_prompt_length={self.max_prompt_length}. Fix: raise data.max_prompt_length, or "
                        "data.overlong=filter (drop such rows) / truncate_left (keep their last tokens)")
                if self.overlong == "filter" or _has_media(example):  # image/video tokens are never cut
                    self.num_filtered += 1
                    continue
                ids = ids[-self.max_prompt_length:]
                example["raw_prompt"] = self.tokenizer.decode(ids)
                self.num_truncated += 1
            example["input_ids"] = list(ids)
            kept.append(example)
        return kept

    def _check_row(self, row: dict, path: str) -> dict:
        """Validate one row and build its example (everything but the token ids of a text row)."""
        images = image_list(row, self.image_key) if self.image_key in row else None
        videos = video_list(row, self.video_key) if self.video_key in row else None
        audios = audio_list(row, self.audio_key) if self.audio_key in row else None
        media_keys = {self.image_key if images is not None else None, self.video_key if videos is not None else None,
                      self.audio_key if audios is not None else None}
        _find_bad_text({k: v for k, v in row.items() if k not in media_keys}, "")
        prompt = _get_field(row, self.prompt_key, "data.prompt_key")
        if isinstance(prompt, bytes):  # a parquet binary column holding (valid, checked above) UTF-8
            prompt = prompt.decode("utf-8")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise _BadRow(self.prompt_key, "empty string")
            content = prompt
            if self._template is not None:
                try:
                    content = self._template.render(content=prompt, prompt=prompt, question=prompt, row=row)
                except Exception as exc:
                    raise _BadRow(self.prompt_key, f"data.prompt_template failed on it: {type(exc).__name__}: {exc} "
                                                   "(the template sees content, prompt, question and row)") from None
            messages = [{"role": "user", "content": content}]
        else:
            messages = _check_messages(prompt, self.prompt_key)

        answer_field = self.answer_key or "reward_model.ground_truth"
        ground_truth = _get_field(row, answer_field, "data.answer_key")
        if isinstance(ground_truth, bytes):
            ground_truth = ground_truth.decode("utf-8")
        if isinstance(ground_truth, np.ndarray):
            ground_truth = ground_truth.tolist()
        if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
            raise _BadRow(answer_field, "empty")
        if not isinstance(ground_truth, (str, int, float, list, dict)) or isinstance(ground_truth, bool):
            raise _BadRow(answer_field, f"expected a string, number, list or dict, got "
                                        f"{type(ground_truth).__name__}")
        if not _finite(ground_truth):  # a parquet float column's missing value reads as NaN
            raise _BadRow(answer_field, f"{ground_truth!r} is not a finite number (a missing answer?)")

        data_source = row.get("data_source")
        if data_source is None:
            data_source = self.default_data_source or Path(path).stem
        elif not isinstance(data_source, str):
            raise _BadRow("data_source", f"expected a string, got {type(data_source).__name__}")

        extra_info = row.get("extra_info")
        if extra_info is None:
            extra_info = {}
        elif not isinstance(extra_info, dict):
            raise _BadRow("extra_info", f"expected a dict, got {type(extra_info).__name__}")

        fitted, decoded, waves = [], [], []
        if images is not None or videos is not None or audios is not None:
            try:
                messages = split_placeholders(messages, len(images or ()), self.prompt_key, self.image_key,
                                              len(videos or ()), self.video_key, len(audios or ()), self.audio_key)
                fitted = [self._image(value, f"{self.image_key}[{j}]", path) for j, value in enumerate(images or ())]
                decoded = [self._video(value, f"{self.video_key}[{j}]", path) for j, value in enumerate(videos or ())]
                waves = [self._audio(value, f"{self.audio_key}[{j}]", path) for j, value in enumerate(audios or ())]
                if waves:
                    self._audio_processor().check_lengths(waves, self.audio_key)
            except ImageProblem as exc:
                raise _BadRow(exc.field, exc.problem) from None
        try:
            raw_prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            tokenize=False)
        except Exception as exc:
            raise _BadRow(self.prompt_key, f"the chat template failed: {exc}") from None
        example = {"raw_prompt": raw_prompt, "ground_truth": ground_truth,
                   "data_source": data_source, "extra_info": extra_info, "file": path}
        if waves:
            try:
                example["input_ids"], _ = self._audio_processor().encode(raw_prompt, fitted, decoded, waves)
            except ValueError as exc:
                raise _BadRow(self.audio_key, str(exc)) from None
            example["audios"] = waves  # decoded and resampled once: float32 samples at the processor's rate
        elif fitted or decoded:
            try:
                example["input_ids"], _ = self._vision().encode(raw_prompt, fitted, decoded)
            except ValueError as exc:
                raise _BadRow(self.image_key if fitted else self.video_key, str(exc)) from None
            if fitted:
                example["images"] = images  # the sources; decoded again per batch (no decoded copies kept)
            if decoded:
                example["videos"] = decoded  # decoded once: the sampled frames (uint8) and their rate
        return example

    def _video(self, value, field: str, path: str):
        import time

        from rlframe.data.video import decode_video, fit_frames

        start = time.perf_counter()
        base_dir = None if is_hub_id(path) else Path(path).parent
        video = decode_video(value, field, base_dir, self.video_fps, self.video_max_frames)
        video = fit_frames(video, field, self.video_min_pixels, self.video_max_pixels, self.resize_images)
        self.video_decode_seconds += time.perf_counter() - start
        self.num_videos += 1
        return video

    def _audio(self, value, field: str, path: str):
        import time

        from rlframe.data.audio import decode_audio, resample

        start = time.perf_counter()
        base_dir = None if is_hub_id(path) else Path(path).parent
        samples, rate = decode_audio(value, field, base_dir, target=None)  # (a bad file is named whatever the model)
        samples = resample(samples, rate, self._audio_processor().sampling_rate)
        self.audio_decode_seconds += time.perf_counter() - start
        self.num_audios += 1
        return samples

    def _audio_processor(self):
        if self.audio_processor is None:
            from rlframe.data.audio import AudioProcessor

            try:
                self.audio_processor = AudioProcessor(self.tokenizer.name_or_path, self.tokenizer)
            except ValueError as exc:
                raise ImageProblem(self.audio_key, str(exc)) from None
        return self.audio_processor

    def _image(self, value, field: str, path: str):
        base_dir = None if is_hub_id(path) else Path(path).parent
        return fit_pixels(decode_image(value, field, base_dir), field, self.min_pixels, self.max_pixels,
                          self.resize_images)

    def _vision(self) -> VisionProcessor:
        if self.processor is None:
            self.processor = VisionProcessor(self.tokenizer.name_or_path, self.tokenizer, self.min_pixels,
                                             self.max_pixels, video_min_pixels=self.video_min_pixels,
                                             video_max_pixels=self.video_max_pixels)
        return self.processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        """``input_ids`` (list[int], unpadded), ``raw_prompt`` (the templated text),
        ``ground_truth``, ``data_source``, ``extra_info``, ``index`` (= i); an image row adds
        ``multi_modal_data`` ({"image": [PIL images, size-fitted]}: what a rollout engine takes) and
        ``multi_modal_inputs`` ({"pixel_values", "image_grid_thw"}: what the model's forward takes)."""
        row = self.rows[i]
        item = {"input_ids": row["input_ids"], "raw_prompt": row["raw_prompt"],
                "ground_truth": row["ground_truth"], "data_source": row["data_source"],
                "extra_info": row["extra_info"], "index": i}
        if "audios" in row:
            audios = row["audios"]
            rate = self._audio_processor().sampling_rate
            item["multi_modal_data"] = {"audio": [(x, rate) for x in audios]}
            item["multi_modal_inputs"] = self._audio_processor().audio_inputs(audios)
        elif _has_media(row):
            images = [self._image(value, f"{self.image_key}[{j}]", row["file"]) for j, value in enumerate(row.get("images", ()))]
            videos = row.get("videos", [])
            item["multi_modal_data"] = {**({"image": images} if images else {}),
                                        **({"video": [v.frames for v in videos]} if videos else {})}
            item["multi_modal_inputs"] = self._vision().inputs(images, videos)
        return item


def _has_media(example: dict) -> bool:
    return "images" in example or "videos" in example or "audios" in example


def _resample_files(per_file: list[list[dict]], weights: list[float], seed: int) -> list[list[dict]]:
    total = sum(len(rows) for rows in per_file)
    weight_sum = float(sum(weights))
    rng = np.random.default_rng(seed)
    out = []
    for rows, weight in zip(per_file, weights):
        target = int(round(total * weight / weight_sum))
        if not rows or target == 0:
            out.append([])
            continue
        repeats = -(-target // len(rows))
        order = np.concatenate([rng.permutation(len(rows)) for _ in range(repeats)])[:target]
        out.append([rows[j] for j in order])
    return out


# ------------------------------------------------------------------ batching


def collate_prompts(rows: list[dict], pad_token_id: int,
                    max_prompt_length: int | None = None) -> DataProto:
    """Stack dataset items into a DataProto with LEFT-padded prompts.

    Tensors (all long, [B, P]): ``input_ids``, ``attention_mask``, ``position_ids`` (the count of
    real tokens before each position: ``cumsum(mask) - 1`` clipped at 0). P is
    ``max_prompt_length`` when given (fixed shapes), else the longest prompt of the batch.
    Non-tensors: ``raw_prompt``, ``ground_truth``, ``data_source``, ``extra_info``, ``index``.
    """
    if not rows:
        raise ValueError("collate_prompts got an empty batch")
    longest = max(len(r["input_ids"]) for r in rows)
    width = longest if max_prompt_length is None else max_prompt_length
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens, more than max_prompt_length={width}")
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids = row["input_ids"]
        if ids:
            input_ids[b, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[b, width - len(ids):] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    non_tensors = {key: [row[key] for row in rows]
                   for key in ("raw_prompt", "ground_truth", "data_source", "extra_info", "index")}
    if any("multi_modal_inputs" in row for row in rows):  # image rows (text rows in the batch get None)
        for key in ("multi_modal_data", "multi_modal_inputs"):
            non_tensors[key] = [row.get(key) for row in rows]
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": position_ids},
        non_tensors=non_tensors, meta_info={})
