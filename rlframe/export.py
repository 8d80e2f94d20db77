"""Export a checkpoint's actor as a Hugging Face model folder.

    python -m rlframe.export <run_dir>/checkpoints/step_N <out_dir>
    python -m rlframe.export <run_dir> <out_dir>          # the newest complete checkpoint of the run

The checkpoint holds the full (unsharded) weights whatever the data-parallel world size of the run
was, so this needs no process group and no Ray: it checks the checkpoint against its manifest,
loads the weights into a model built from the saved config, and writes safetensors + config +
tokenizer that `transformers` and vLLM load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlframe.trainer.checkpoint import find_latest_complete, verify


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if (path / "checkpoints").is_dir():  # a run directory
        latest = find_latest_complete(path)
        if latest is None:
            raise SystemExit(f"error: no complete checkpoint in {path / 'checkpoints'}")
        return latest.path
    problem = verify(path)
    if problem is not None:
        raise SystemExit(f"error: {path} is not a usable checkpoint: {problem}")
    return path


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the actor of `checkpoint` as an HF folder at `out_dir`; returns out_dir."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlframe.workers.hf_folder import WEIGHTS_FILE, write_hf_folder

    actor = resolve_checkpoint(checkpoint) / "actor"
    config = AutoConfig.from_pretrained(actor)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = load_file(str(actor / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if k not in _tied_names(model)]:
        raise SystemExit(f"error: the checkpoint's weights do not fit {config.model_type}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return write_hf_folder(out_dir, state, config, actor, dtype=getattr(torch, dtype) if dtype else None)


def _tied_names(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(keys, dict):
        keys = list(keys)
    return set(keys) if model.config.tie_word_embeddings else set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlframe.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step_N) or a run directory (its newest)")
    parser.add_argument("out_dir", help="where to write the HF model folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast the weights (default: as saved, fp32 master weights)")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
