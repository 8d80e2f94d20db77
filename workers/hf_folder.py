"""The one writer of Hugging Face model folders: weights + config + tokenizer + generation config.

Checkpoints (`engine.save_state`), the end-of-run export (`save_hf`) and `python -m rlframe.export`
all write through `write_hf_folder`, so every folder we produce loads the same way in
`transformers` and vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def write_hf_folder(out_dir: str | Path, state: Mapping[str, torch.Tensor], config, tokenizer_source: str | Path | None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write `state` (full tensors, HF names) as safetensors, with `config`, and the tokenizer and
    generation config found at `tokenizer_source` (when given). Tied tensors are stored as copies."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        if tensor.data_ptr() in seen:  # tied weights share storage; safetensors refuses shared tensors
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if dtype is not None:
        config.torch_dtype = dtype
    config.save_pretrained(out)
    if tokenizer_source is not None:
        copy_tokenizer(tokenizer_source, out)
    return out


def copy_tokenizer(source: str | Path, out: Path) -> None:
    """The tokenizer and (when the source has one) the generation config: EOS ids, sampling defaults."""
    from transformers import AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    # vision-language models: their image processor; audio-language ones: their feature extractor (either file)
    for name in ("preprocessor_config.json", "processor_config.json"):
        processor = Path(source) / name
        if processor.is_file():
            (out / name).write_bytes(processor.read_bytes())
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(out)
    except OSError:
        pass
