"""Doctor checks of a multimodal model's placeholder tokens: config ids vs the processor's, and their counts.

For each modality the data uses (a row with images, videos or audios), two checks:

- ``media/<modality>_token_id``: the id the model's config.json looks for (``image_token_id``,
  ``video_token_id``, ``audio_token_index``) is the tokenizer's id of the token rlframe's processor expands
  (``<|image_pad|>``, ``<|video_pad|>``, ``<|AUDIO|>``), and a processor config in the folder that names the
  token (``image_token`` / ``video_token`` / ``audio_token``, which vLLM's processors read) names the same one.
  A wrong id makes the model scatter the encoder's output into other positions, or refuse the batch.
- ``media/<modality>_placeholder``: the data's placeholder (``<image>``, ``<video>``, ``<audio>``) goes the
  data path's way (rlframe/data/multimodal.py ``split_placeholders``, the chat template, the processor's
  ``encode``) on a small generated probe, and the prompt holds as many tokens of the config's id as the model's
  encoder returns features for it: Qwen2-VL's vision tower ``grid_thw.prod() // spatial_merge_size**2`` per
  image or video (the merge size from config.json), Qwen2-Audio's encoder (transformers'
  ``_get_feat_extract_output_lengths`` of the mel frames). The first training row of the modality is counted
  the same way, on its own token ids and features.

A text model with text data is skipped with the reason; so is a multimodal model with text data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlframe.config import RLConfig
from rlframe.doctor.result import CheckResult, failed, passed, skipped

GROUP = "media"


@dataclass(frozen=True)
class Modality:
    name: str  # image | video | audio
    placeholder: str  # the data's text: <image>
    token: str  # what rlframe's processor expands: <|image_pad|>
    config_keys: tuple[str, ...]  # where config.json keeps the token's id (first found wins)
    column: str  # the RLDataset row's key holding the items
    data_key: str  # the data.<key> naming the column
    family: str  # a model that reads it


MODALITIES = (
    Modality("image", "<image>", "<|image_pad|>", ("image_token_id", "image_token_index"), "images", "image_key",
             "Qwen2-VL / Qwen2.5-VL (e.g. Qwen/Qwen2.5-VL-3B-Instruct, or tiny-qwen2.5-vl)"),
    Modality("video", "<video>", "<|video_pad|>", ("video_token_id", "video_token_index"), "videos", "video_key",
             "Qwen2-VL / Qwen2.5-VL (e.g. Qwen/Qwen2.5-VL-3B-Instruct, or tiny-qwen2.5-vl)"),
    Modality("audio", "<audio>", "<|AUDIO|>", ("audio_token_index", "audio_token_id"), "audios", "audio_key",
             "Qwen2-Audio (e.g. Qwen/Qwen2-Audio-7B-Instruct, or tiny-qwen2-audio)"),
)
BY_NAME = {m.name: m for m in MODALITIES}
# Processor configs in a model folder that may name a modality's token (transformers' processors save
# image_token / video_token / audio_token; vLLM's multimodal processors read them).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def read_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoConfig  # a hub id: only its config is fetched

    return AutoConfig.from_pretrained(model_path).to_dict()


def config_token_id(config: dict, modality: Modality) -> tuple[str | None, int | None]:
    """(the key, the id) of the modality's token in config.json: top level, then a nested thinker or text
    config (Qwen2.5-Omni keeps them in thinker_config); (None, None) when the model names none."""
    for where, section in (("", config), ("thinker_config.", config.get("thinker_config") or {}),
                           ("text_config.", config.get("text_config") or {})):
        for key in modality.config_keys:
            if section.get(key) is not None:
                return where + key, int(section[key])
    return None, None


def data_modalities(dataset) -> list[Modality]:
    """The modalities whose column some row of `dataset` (an RLDataset) carries, in MODALITIES' order."""
    return [m for m in MODALITIES if any(m.column in row for row in dataset.rows)]


def label(tokenizer, token_id: int) -> str:
    return f"{token_id} ({tokenizer.convert_ids_to_tokens(int(token_id))!r})" if 0 <= token_id < len(tokenizer) \
        else f"{token_id} (outside the vocabulary of {len(tokenizer)})"


def processor_token_names(model_path: str, modality: Modality) -> list[tuple[str, str]]:
    """(file, token) for each processor config of the folder that names the modality's token."""
    found = []
    for name in PROCESSOR_FILES:
        path = Path(model_path) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        value = data.get(f"{modality.name}_token")
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str):
            found.append((name, value))
    return found


def check_token_id(modality: Modality, tokenizer, config: dict, model_path: str) -> tuple[CheckResult, int | None]:
    """config.json's id of the modality's token == the tokenizer's id of the token the processor expands.
    Returns the result and the config's id (None when there is none)."""
    name = f"{modality.name}_token_id"
    key, config_id = config_token_id(config, modality)
    if key is None:
        keys = " / ".join(modality.config_keys)
        return failed(GROUP, name, f"the data has {modality.name}s but {model_path}/config.json names no {keys}: the "
                                   f"model reads no {modality.name}s",
                      f"a model.path that reads {modality.name}s: {modality.family}; or drop the "
                      f"'{modality.column}' column (data.{modality.data_key})"), None
    vocab = tokenizer.get_vocab()
    if modality.token not in vocab:
        return failed(GROUP, name, f"the tokenizer has no {modality.token!r}, the token rlframe's processor expands "
                                   f"for each {modality.placeholder}; config.json {key} = {label(tokenizer, config_id)}",
                      f"the model's own tokenizer (one with {modality.token!r} as a special token): "
                      f"{modality.family}"), config_id
    token_id = vocab[modality.token]
    others = [(file, token) for file, token in processor_token_names(model_path, modality) if token != modality.token]
    if config_id != token_id:
        return failed(GROUP, name, f"{modality.token!r}: config.json {key} = {label(tokenizer, config_id)} but the "
                                   f"tokenizer's {modality.token!r} is id {token_id}: the processor writes id {token_id} "
                                   f"for each {modality.name} token, the model looks for id {config_id} (it scatters "
                                   f"the {modality.name} features elsewhere, or refuses the batch)",
                      f"set \"{key.split('.')[-1]}\": {token_id} in {model_path}/config.json (the id of "
                      f"{modality.token!r}), or use the tokenizer the model was built with"), config_id
    if others:
        file, token = others[0]
        return failed(GROUP, name, f"{model_path}/{file} names {token!r} as the {modality.name}_token, but rlframe's "
                                   f"processor expands {modality.token!r} (id {token_id}, config.json {key}): vLLM's "
                                   "processor would expand another token than the trainer's",
                      f"set \"{modality.name}_token\": \"{modality.token}\" in {model_path}/{file}"), config_id
    named = "".join(f"; {file} {modality.name}_token {token!r}" for file, token in
                    processor_token_names(model_path, modality))
    return passed(GROUP, name, f"{modality.token!r}: tokenizer id {token_id} = config.json {key}{named}"), config_id


def probe(modality: Modality, cfg: RLConfig, processor) -> tuple[object, str]:
    """A small generated item of the modality, fitted as the data path fits one, and its description."""
    d = cfg.data
    if modality.name == "image":
        from PIL import Image

        from rlframe.data.multimodal import fit_pixels

        image = fit_pixels(Image.new("RGB", (112, 84), (200, 40, 40)), "probe", d.min_pixels, d.max_pixels,
                           d.resize_images)
        return image, f"{image.size[0]}x{image.size[1]} image"
    if modality.name == "video":
        from rlframe.data.video import Video, fit_frames

        frames = np.zeros((4, 56, 56, 3), dtype=np.uint8)
        frames[:, :, :, 1] = np.arange(4, dtype=np.uint8).reshape(4, 1, 1) * 60
        video = fit_frames(Video(frames, d.video_fps), "probe", d.video_min_pixels or d.min_pixels,
                           d.video_max_pixels or d.max_pixels, d.resize_images)
        return video, f"{len(video.frames)}-frame {video.frames.shape[2]}x{video.frames.shape[1]} video"
    rate = processor.sampling_rate
    t = np.arange(rate, dtype=np.float32) / rate
    return (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32), f"1 s audio at {rate} Hz"


def build_processor(modality: Modality, cfg: RLConfig, tokenizer, model_path: str):
    """rlframe's processor of the modality, as RLDataset builds it."""
    d = cfg.data
    if modality.name == "audio":
        from rlframe.data.audio import AudioProcessor

        return AudioProcessor(model_path, tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    from rlframe.data.multimodal import VisionProcessor

    return VisionProcessor(model_path, tokenizer, d.min_pixels, d.max_pixels,
                           trust_remote_code=cfg.model.trust_remote_code, video_min_pixels=d.video_min_pixels,
                           video_max_pixels=d.video_max_pixels)


def audio_output_lengths(frames: list[int]) -> list[int]:
    """Qwen2-Audio's encoder: tokens for each audio's mel frames (transformers' own rule; rlframe's
    audio_token_count where that transformers lacks it)."""
    import torch

    try:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        _, out = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, torch.as_tensor(frames))
    except (ImportError, AttributeError):
        from rlframe.data.audio import audio_token_count

        return [audio_token_count(int(n)) for n in frames]
    return [int(n) for n in torch.as_tensor(out).reshape(-1).tolist()]


def model_feature_counts(modality: Modality, config: dict, inputs: dict) -> tuple[list[int], str]:
    """The features the model's encoder returns per item of `inputs` (the processor's tensors), and the rule."""
    if modality.name == "audio":
        frames = inputs["feature_attention_mask"].sum(-1).tolist()
        return audio_output_lengths(frames), f"Qwen2-Audio's encoder on {frames} mel frames"
    vision = config.get("vision_config") or (config.get("thinker_config") or {}).get("vision_config") or {}
    merge = int(vision.get("spatial_merge_size", 2))
    grids = inputs["image_grid_thw" if modality.name == "image" else "video_grid_thw"]
    counts = (grids.prod(-1) // merge ** 2).tolist()
    return [int(n) for n in counts], f"grid {grids.tolist()} / spatial_merge_size {merge}^2"


def encode(modality: Modality, processor, raw: str, items: list) -> tuple[list[int], dict]:
    if modality.name == "image":
        return processor.encode(raw, items)
    if modality.name == "video":
        return processor.encode(raw, [], items)
    return processor.encode(raw, [], [], items)


def first_row(dataset, modality: Modality) -> int | None:
    return next((i for i, row in enumerate(dataset.rows) if modality.column in row), None) if dataset else None


def check_placeholder(modality: Modality, cfg: RLConfig, tokenizer, model_path: str, config: dict,
                      config_id: int | None, dataset=None) -> CheckResult:
    """The data's placeholder -> the chat template -> the processor's expansion, counted against the model's
    encoder (module docstring)."""
    from rlframe.data.multimodal import split_placeholders

    name = f"{modality.name}_placeholder"
    if config_id is None:
        return skipped(GROUP, name, f"the model has no {modality.name} token (see {GROUP}/{modality.name}_token_id)")
    counts = {m.name: int(m is modality) for m in MODALITIES}
    messages = split_placeholders([{"role": "user", "content": f"{modality.placeholder}What is in it?"}],
                                  counts["image"], "prompt", "images", counts["video"], "videos", counts["audio"],
                                  "audios")
    try:
        raw = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as error:
        return failed(GROUP, name, f"the chat template fails on a {{'type': '{modality.name}'}} content entry (what "
                                   f"{modality.placeholder} becomes): {type(error).__name__}: {error}",
                      f"the model's own chat template (one that renders {{'type': '{modality.name}'}} entries)")
    rendered = raw.count(modality.token)
    if rendered != 1:
        return failed(GROUP, name, f"one {modality.placeholder} renders through the chat template as {rendered} "
                                   f"{modality.token!r} (1 expected): {raw!r}",
                      f"a chat template that renders a {{'type': '{modality.name}'}} content entry with one "
                      f"{modality.token} (the model's own template; tokenizer.chat_template in {model_path})")
    try:
        processor = build_processor(modality, cfg, tokenizer, model_path)
        item, what = probe(modality, cfg, processor)
        ids, inputs = encode(modality, processor, raw, [item])
    except ValueError as error:
        return failed(GROUP, name, f"rlframe's processor cannot encode a {modality.placeholder} prompt: {error}",
                      f"a model.path that reads {modality.name}s: {modality.family}")
    expected, rule = model_feature_counts(modality, config, inputs)
    found = ids.count(config_id)
    window = raw[max(raw.index(modality.token) - 40, 0): raw.index(modality.token) + len(modality.token) + 20]
    rendered = f"{modality.placeholder} renders as ...{window!r}..."
    measured = (f"a {what} expands to {found} token{'s' * (found != 1)} of id {config_id}, the model's encoder "
                f"returns {sum(expected)} features ({rule})")
    if found != sum(expected):
        return failed(GROUP, name, f"{measured}: the model's forward fails (or misplaces the {modality.name}) on "
                                   f"every such prompt; {rendered}",
                      f"config.json's id {config_id} is not the tokenizer's {modality.token!r}: see "
                      f"{GROUP}/{modality.name}_token_id" if tokenizer.get_vocab().get(modality.token) != config_id else
                      f"rlframe's processor, the tokenizer's {modality.token!r} and config.json must agree: a "
                      f"{modality.family} model folder, unchanged")
    index = first_row(dataset, modality)
    if index is not None:
        row = dataset.rows[index]
        row_expected, row_rule = model_feature_counts(modality, config, dataset[index]["multi_modal_inputs"])
        row_found = list(row["input_ids"]).count(config_id)
        items = f"{len(row[modality.column])} {modality.name}(s)"
        if row_found != sum(row_expected):
            return failed(GROUP, name, f"row {index} of {row['file']} ({items}): {row_found} tokens of id {config_id} "
                                       f"in its prompt, the model's encoder returns {sum(row_expected)} features "
                                       f"({row_rule})",
                          f"one {modality.placeholder} per {modality.name} in the prompt text, nothing else writing "
                          f"{modality.token!r}")
        measured += f"; row {index} of {Path(row['file']).name} ({items}): {row_found} = {sum(row_expected)}"
    measured += f"; {rendered}"
    return passed(GROUP, name, measured)


def check_modality(modality: Modality | str, cfg: RLConfig, tokenizer, model_path: str,
                   dataset=None) -> list[CheckResult]:
    """Both checks of one modality (`modality`: a Modality or its name)."""
    modality = BY_NAME[modality] if isinstance(modality, str) else modality
    config = read_config(model_path)
    ids, config_id = check_token_id(modality, tokenizer, config, model_path)
    return [ids, check_placeholder(modality, cfg, tokenizer, model_path, config, config_id, dataset)]


def check_media(cfg: RLConfig, tokenizer, model_path: str, dataset) -> list[CheckResult]:
    """The checks of every modality the training data uses; one skip when it uses none (or was not read)."""
    if dataset is None:
        return [skipped(GROUP, "placeholders", "no training rows read (see data/train_rows): the modalities the data "
                                               "uses are unknown")]
    used = data_modalities(dataset)
    if not used:
        config = read_config(model_path)
        known = [f"{m.name} ({key})" for m in MODALITIES for key in [config_token_id(config, m)[0]] if key]
        why = (f"the model reads {', '.join(known)}, but the data has no {', '.join(m.column for m in MODALITIES)}"
               if known else "text model (config.json names no image_token_id, video_token_id or "
                             "audio_token_index) and text data: no placeholder tokens")
        return [skipped(GROUP, "placeholders", why)]
    results = []
    for modality in used:
        results += check_modality(modality, cfg, tokenizer, model_path, dataset)
    return results
