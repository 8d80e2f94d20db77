"""Parameter names as vLLM's model classes load them, for the architectures whose vLLM class renames nothing.

The trainer streams its weights under transformers' in-memory names (`iter_full_weights`). vLLM's Qwen2-VL and
Qwen2.5-VL classes carry an `hf_to_vllm_mapper` that turns those names into their own; its Qwen2-Audio class
(vllm 0.32: vllm/model_executor/models/qwen2_audio.py) has none, and loads with an `AutoWeightsLoader` that
knows only its own parameter names: `audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.*` (the layout of the hub's Qwen2-Audio checkpoints). Three layouts reach it:

- the hub's (Qwen/Qwen2-Audio-7B-Instruct): vLLM's own, nothing to do;
- the trainer's memory (transformers 5), which a run's export (`<run_dir>/hf_model`) also holds:
  `model.audio_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`;
- a folder transformers 5's `save_pretrained` wrote (the tiny model): `audio_tower.*`,
  `multi_modal_projector.*`, `language_model.model.model.*` (sic), `language_model.lm_head.*`.

`vllm_name_mapper` returns the function that maps any of them to vLLM's (None for every other architecture:
their names pass unchanged). The rollout uses it twice: on each weight sync, and at engine start, when the
model folder itself is not in vLLM's layout (`folder_needs_renaming`): vLLM then starts with dummy weights and
the folder's tensors are streamed in through the same mapping (`iter_folder_weights`), one at a time, so
that no renamed copy of the checkpoint is written anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

# (prefix in some layout, vLLM's prefix), the longest first: the first that matches is applied.
QWEN2_AUDIO_PREFIXES = (
    ("language_model.model.model.", "language_model.model."),  # transformers 5's save_pretrained
    ("model.language_model.", "language_model.model."),  # the trainer's memory
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def qwen2_audio_vllm_name(name: str) -> str:
    """A Qwen2-Audio parameter name in any of the three layouts -> vLLM's (a vLLM name comes back unchanged)."""
    for prefix, target in QWEN2_AUDIO_PREFIXES:
        if name.startswith(prefix):
            return target + name[len(prefix):]
    return name


_MAPPERS: dict[str, Callable[[str], str]] = {
    "Qwen2AudioForConditionalGeneration": qwen2_audio_vllm_name,
}


def vllm_name_mapper(architectures: list[str] | None) -> Callable[[str], str] | None:
    """The name mapping for a model of these `architectures` (its config's), or None where vLLM's class
    takes transformers' names itself (every text-only model, Qwen2-VL / Qwen2.5-VL)."""
    for architecture in architectures or ():
        if architecture in _MAPPERS:
            return _MAPPERS[architecture]
    return None


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The folder's safetensors shards: those its index names, else every *.safetensors in it."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    return sorted(folder.glob("*.safetensors"))


def folder_weight_names(model_path: str | Path) -> list[str]:
    """Every tensor name in the folder's safetensors (headers only: no tensor is read)."""
    from safetensors import safe_open

    names = []
    for shard in safetensors_files(model_path):
        with safe_open(str(shard), framework="pt") as f:
            names += list(f.keys())
    return names


def folder_needs_renaming(model_path: str | Path, rename: Callable[[str], str] | None) -> bool:
    """Whether vLLM would refuse the folder's names: some name is not in vLLM's layout. False for a folder
    that is not local safetensors (a hub id, .bin files): vLLM loads those as it always did."""
    if rename is None or not Path(model_path).is_dir():
        return False
    return any(rename(name) != name for name in folder_weight_names(model_path))


def iter_folder_weights(model_path: str | Path) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) of every tensor in the folder's safetensors, read one at a time, under the folder's names."""
    from safetensors import safe_open

    for shard in safetensors_files(model_path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
