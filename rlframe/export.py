"""Export a checkpoint's actor as a Hugging Face model folder.

    python -m rlframe.export <run_dir>/checkpoints/step_N <out_dir>
    python -m rlframe.export <run_dir> <out_dir>          # the newest complete checkpoint of the run
    python -m rlframe.export <lora checkpoint> <out_dir>  # LoRA: the peft adapter folder
    python -m rlframe.export <lora checkpoint> <out_dir> --merge   # LoRA: a merged HF model

The checkpoint holds the full (unsharded) weights whatever the data-parallel world size of the run
was, so this needs no process group and no Ray: it checks the checkpoint against its manifest,
loads the weights into a model built from the saved config, and writes safetensors + config +
tokenizer that `transformers` and vLLM load.

A LoRA run's checkpoint holds the adapters (peft format) over the base model it names
(`base_model_name_or_path`); the export copies that adapter folder (`PeftModel.from_pretrained`,
`AutoModelForCausalLM.from_pretrained` with peft installed, or vLLM's LoRARequest load it), or
with `--merge` writes the base with W + (alpha / r) B A folded in: a plain HF model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlframe.trainer.checkpoint import MANIFEST, find_latest_complete, verify


RUN_FILES = ("checkpoints", "config.yaml", "metrics.jsonl", "hf_model")  # what a run directory holds (prepare_run)


def is_run_dir(path: Path) -> bool:
    """A run directory (not a checkpoint: those hold a manifest and live in checkpoints/)."""
    return (path / "checkpoints").is_dir() or (
        not (path / MANIFEST).exists() and path.parent.name != "checkpoints"
        and any((path / name).exists() for name in RUN_FILES))


def no_checkpoint(run_dir: Path) -> str:
    """What to use instead when a run directory has no complete checkpoint."""
    saved = run_dir / "checkpoints"
    if saved.is_dir() and any(saved.iterdir()):
        return f"error: no complete checkpoint in {saved} (each save was interrupted before its manifest)"
    said = (f"error: the run {run_dir} saved no checkpoint (trainer.save_every=0, the default, or it stopped "
            "before its first save)")
    hf_model = run_dir / "hf_model"
    if (hf_model / "config.json").is_file():
        return (f"{said}; its trained model is already an HF model folder: {hf_model} (trainer.export_hf): load it "
                "as it is, nothing to export")
    return (f"{said} and exported no model (trainer.export_hf=false, or it did not finish). Fix: run it again with "
            "trainer.export_hf=true (the folder hf_model/), or trainer.save_every=N to export a checkpoint")


def resolve_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if is_run_dir(path):
        latest = find_latest_complete(path) if (path / "checkpoints").is_dir() else None
        if latest is None:
            raise SystemExit(no_checkpoint(path))
        return latest.path
    problem = verify(path)
    if problem is not None:
        raise SystemExit(f"error: {path} is not a usable checkpoint: {problem}")
    return path


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None, merge: bool = False,
                      base: str | None = None) -> Path:
    """Write the actor of `checkpoint` as an HF folder at `out_dir`; returns out_dir.

    LoRA checkpoints: the adapter folder, or (`merge`) the merged model; `base` overrides the base
    model path recorded in the adapter config. Full-weights checkpoints ignore `merge`."""
    from rlframe.workers.engine.lora import is_adapter_folder

    actor = resolve_checkpoint(checkpoint) / "actor"
    if is_adapter_folder(actor):
        return export_adapter(actor, out_dir, dtype, merge, base)
    if base:
        raise SystemExit(f"error: --base is for LoRA checkpoints; {actor} holds full weights (export it without)")
    # (--merge on a full-weights checkpoint: it is already a plain model)
    return export_actor_folder(actor, out_dir, dtype)


def export_actor_folder(actor: Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """A checkpoint's full-weights actor folder (gathered safetensors or DCP shards) -> an HF folder."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlframe.workers.engine.checkpoint import SHARDED_DIR, read_sharded_model_state
    from rlframe.workers.hf_folder import WEIGHTS_FILE, write_hf_folder

    actor = Path(actor)
    config = AutoConfig.from_pretrained(actor)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if (actor / SHARDED_DIR).is_dir():  # trainer.checkpoint_format=sharded: read every rank's shards here
        template = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in model.state_dict().items()
                    if name not in _tied_names(model)}
        state = read_sharded_model_state(actor, template)
    else:
        state = load_file(str(actor / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if k not in _tied_names(model)]:
        raise SystemExit(f"error: the checkpoint's weights do not fit {config.model_type}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if (actor / SHARDED_DIR).is_dir():  # tied weights (an LM head sharing the embeddings) written as copies too
        model.tie_weights()
        state = dict(model.state_dict())
    return write_hf_folder(out_dir, state, config, actor, dtype=getattr(torch, dtype) if dtype else None)


def export_adapter(actor: Path, out_dir: str | Path, dtype: str | None, merge: bool, base: str | None) -> Path:
    """A LoRA checkpoint's adapter folder, copied as it is (peft format), or merged into its base."""
    import shutil

    import torch

    from rlframe.workers.engine.lora import ADAPTER_CONFIG_FILE, adapter_base_path, plain_config
    from rlframe.workers.hf_folder import copy_tokenizer, write_hf_folder

    base = base or adapter_base_path(actor)
    if not merge:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for path in actor.iterdir():  # adapter, its config, tokenizer (not the optimizer or RNG state)
            if path.is_file() and not path.name.endswith(".pt"):
                shutil.copy2(path, out / path.name)
        if dtype is not None:
            print("note: --dtype applies to merged exports only; the adapter keeps its saved dtype")
        if not (out / ADAPTER_CONFIG_FILE).is_file():
            raise SystemExit(f"error: {actor} has no {ADAPTER_CONFIG_FILE}")
        return out
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not Path(base).expanduser().is_dir() and base.startswith(("/", ".", "~")):
        raise SystemExit(f"error: the base model {base} (base_model_name_or_path in {actor / ADAPTER_CONFIG_FILE}) "
                         "is not on this machine. Fix: --base /path/to/the/base/model")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(actor)).merge_and_unload()  # W + (alpha / r) B A, in fp32
    out = write_hf_folder(out_dir, merged.state_dict(), plain_config(merged.config), None,
                          dtype=getattr(torch, dtype) if dtype else None)
    copy_tokenizer(actor, out)
    return out


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
    parser.add_argument("--merge", action="store_true",
                        help="LoRA checkpoints: write the base with the adapters merged (a plain HF model) "
                             "instead of the peft adapter folder")
    parser.add_argument("--base", default=None,
                        help="LoRA checkpoints: the base model folder (default: the one the run trained over)")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, merge=args.merge, base=args.base)
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
