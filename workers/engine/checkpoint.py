"""Saving and loading a training engine's state inside its worker processes (all ranks together).

Layout written under `<checkpoint>/actor/` or `critic/` (see rlframe/trainer/checkpoint.py for the folder):

- `model.safetensors`: the full, unsharded weights with their HF names (rank 0 writes), plus the
  model's `config.json` and the tokenizer, so the folder loads in `transformers` as it is and the
  checkpoint resumes or exports at any data-parallel world size;
- `optimizer.pt`: the full optimizer state keyed by parameter name (tensors, numbers, lists only;
  loaded with `torch.load(weights_only=True)`);
- `rank_<r>.pt`: what each rank owns: LR scheduler, optimiser step / skip counters, and the RNG
  states (python, numpy, torch) that the next step's sampling and shuffling draw from.

Under LoRA (`engine.lora`), the model part is a peft adapter folder instead of the full weights:
`adapter_config.json` + `adapter_model.safetensors` (the trainable adapters only; the frozen base
is the model at `base_model_name_or_path`), and `optimizer.pt` holds the adapters' state only.

With `checkpoint_format="sharded"` (trainer.checkpoint_format) nothing is gathered: every rank
writes its own shards of the weights and optimizer state into `sharded/` with
torch.distributed.checkpoint (DCP: `.metadata` + one `.distcp` file per rank), next to `config.json`,
the tokenizer and the `rank_<r>.pt` files. DCP reshards on load, so it resumes at another world size
too; `python -m rlframe.export` reads it in one process into an HF folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from rlframe.rng import capture_rng_state, restore_rng_state
from rlframe.workers.distributed import barrier, rank as _rank, world_size
from rlframe.workers.engine.lora import (is_adapter_folder, iter_adapter_weights, read_adapter_state,
                                        write_adapter_folder)
from rlframe.workers.hf_folder import WEIGHTS_FILE as MODEL_FILE, write_hf_folder

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint folder of a sharded checkpoint


def _distributed(model) -> bool:
    return dist.is_initialized() and any(hasattr(p, "full_tensor") for p in model.parameters())


def save_engine_state(engine, out_dir: str | Path, tokenizer_source: str | None = None) -> None:
    """Write `engine` (a TrainingEngine with an optimizer) into `out_dir` (every rank calls)."""
    out = Path(out_dir)
    rank = _rank()
    lora = getattr(engine, "lora", None)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if getattr(engine.settings, "checkpoint_format", "full") == "sharded":
        _save_sharded(engine, out, tokenizer_source)
    elif lora is not None:
        # Only the trainable adapters (the frozen base is the model on disk), gathered one by one (a
        # collective); bitsandbytes' 4-bit state (QLoRA) never goes through torch's state-dict helpers.
        model_state = {key: tensor.cpu() for key, tensor in iter_adapter_weights(engine.model)}
    else:
        model_state = get_model_state_dict(engine.model, options=full)
    if getattr(engine.settings, "checkpoint_format", "full") != "sharded":
        optim_state = get_optimizer_state_dict(engine.model, engine.optimizer, options=full)
        if rank == 0 and lora is not None:
            write_adapter_folder(out, model_state, engine.peft_config, tokenizer_source)
        elif rank == 0:
            write_hf_folder(out, model_state, engine.model.config, tokenizer_source)
        if rank == 0:
            torch.save(optim_state, out / OPTIMIZER_FILE)
    barrier()  # out/ exists for every rank below
    save_rank_state(engine, out)


def save_rank_state(engine, out: Path) -> None:
    """This rank's `rank_<r>.pt` (LR scheduler, step / skip counters, RNG states), then a barrier.
    Every engine's checkpoint writes it the same way."""
    own = {"scheduler": engine.scheduler.state_dict(), "optimizer_steps": engine.optimizer_steps,
           "consecutive_skips": engine.consecutive_skips, "rng": capture_rng_state(), "world_size": world_size()}
    torch.save(own, Path(out) / f"rank_{_rank()}.pt")
    barrier()


def load_engine_state(engine, in_dir: str | Path) -> dict:
    """Restore what `save_engine_state` wrote (every rank calls); returns a short description."""
    src = Path(in_dir)
    if (src / SHARDED_DIR).is_dir():
        _load_sharded(engine, src)
    else:
        _load_full(engine, src)
    return load_rank_state(engine, src)


def load_rank_state(engine, src: Path) -> dict:
    """Restore `save_rank_state`'s file into `engine` (then a barrier); returns a short description.
    Resumed at a larger world size, a rank without a file uses rank 0's scheduler and keeps its RNG."""
    src, rank = Path(src), _rank()
    own_file = src / f"rank_{rank}.pt"
    if not own_file.exists():  # resumed at a larger world size: this rank has no saved RNG
        logger.warning("%s is missing (the checkpoint was saved with fewer ranks): rank %d keeps its seeded "
                       "RNG and uses rank 0's scheduler state; sampling will not match the saved run exactly",
                       own_file, rank)
        own_file, keep_rng = src / "rank_0.pt", False
    else:
        keep_rng = True
    own = torch.load(own_file, weights_only=True)
    engine.scheduler.load_state_dict(own["scheduler"])
    engine.optimizer_steps = int(own["optimizer_steps"])
    engine.consecutive_skips = int(own["consecutive_skips"])
    if keep_rng:
        restore_rng_state(own["rng"])
    barrier()
    return {"rank": rank, "optimizer_steps": engine.optimizer_steps, "saved_world_size": own["world_size"]}


def _load_full(engine, src: Path) -> None:
    from safetensors.torch import load_file

    distributed = _distributed(engine.model)
    # Every rank reads the full files (a checkpoint sits on a shared or local disk); the set_*
    # calls keep only each rank's shard.
    adapters = is_adapter_folder(src)  # LoRA: the adapters only, the frozen base stays as built
    options = StateDictOptions(full_state_dict=True, cpu_offload=False, strict=not adapters)
    model_state = read_adapter_state(src) if adapters else load_file(str(src / MODEL_FILE))
    if not distributed:
        model_state = {k: v.to(next(engine.model.parameters()).device) for k, v in model_state.items()}
    set_model_state_dict(engine.model, model_state, options=options)
    optim_state = torch.load(src / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    set_optimizer_state_dict(engine.model, engine.optimizer, optim_state, options=options)


def _sharded_state(engine) -> dict:
    """This rank's shards (DTensors under FSDP2, plain tensors on one rank), keyed by HF names."""
    options = StateDictOptions(full_state_dict=False)
    return {"model": get_model_state_dict(engine.model, options=options),
            "optim": get_optimizer_state_dict(engine.model, engine.optimizer, options=options)}


def _save_sharded(engine, out: Path, tokenizer_source: str | None) -> None:
    """Every rank writes its own shards (no gather); rank 0 adds the config and tokenizer."""
    import torch.distributed.checkpoint as dcp

    from rlframe.workers.hf_folder import copy_tokenizer

    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        engine.model.config.save_pretrained(out)
        if tokenizer_source is not None:
            copy_tokenizer(tokenizer_source, out)
    barrier()
    dcp.save(_sharded_state(engine), checkpoint_id=str(out / SHARDED_DIR), no_dist=not dist.is_initialized())


def _load_sharded(engine, src: Path) -> None:
    """DCP reads into this rank's shards (resharding when the world size changed), then the state is set."""
    import torch.distributed.checkpoint as dcp

    state = _sharded_state(engine)
    dcp.load(state, checkpoint_id=str(src / SHARDED_DIR), no_dist=not dist.is_initialized())
    options = StateDictOptions(full_state_dict=False)
    set_model_state_dict(engine.model, state["model"], options=options)
    set_optimizer_state_dict(engine.model, engine.optimizer, state["optim"], options=options)


def read_sharded_model_state(folder: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint in one process: `template` (name -> an empty tensor
    of the full shape, e.g. from a model built on `config.json`) is filled in place and returned."""
    import torch.distributed.checkpoint as dcp

    state = {"model": template}
    dcp.load(state, checkpoint_id=str(Path(folder) / SHARDED_DIR), no_dist=True)
    return state["model"]
