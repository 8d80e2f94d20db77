"""The checks of `stage` and its sections sft / dpo / rm / pairs (the dataclasses: rlframe/stages/config.py)."""

from __future__ import annotations

from rlframe.stages.config import STAGES


def stage_known(cfg, need) -> None:
    need(cfg.stage in STAGES, "stage", f"'{cfg.stage}' is not one of {', '.join(STAGES)}")


def _world(cfg) -> int:
    return max(cfg.actor.world_size, 1)


def sft_section_valid(cfg, need) -> None:
    if cfg.stage != "sft":
        return
    sft, world = cfg.sft, _world(cfg)
    need(sft.loss_on in ("response", "all"), "sft.loss_on", f"'{sft.loss_on}' is not response or all")
    need(sft.epochs >= 1, "sft.epochs", "must be >= 1")
    need(sft.max_length >= 2, "sft.max_length", "must be >= 2")
    need(sft.batch_size >= world and sft.batch_size % world == 0, "sft.batch_size",
         f"{sft.batch_size} sequences do not split over actor.world_size={world} ranks. Fix: a multiple of it")
    need(sft.micro_batch_size >= 1, "sft.micro_batch_size", "must be >= 1")


def pair_stage_sections_valid(cfg, need) -> None:
    """stage=dpo / rm: the batch of pairs splits over the ranks; epochs; how pairs are generated."""
    if cfg.stage not in ("dpo", "rm"):
        return
    dpo, rm, pairs, world = cfg.dpo, cfg.rm, cfg.pairs, _world(cfg)
    batch = dpo.batch_size if cfg.stage == "dpo" else rm.batch_size
    need(batch >= world and batch % world == 0, f"{cfg.stage}.batch_size",
         f"{batch} pairs do not split over actor.world_size={world} ranks. Fix: a multiple of it")
    need((dpo.epochs if cfg.stage == "dpo" else rm.epochs) >= 1, f"{cfg.stage}.epochs", "must be >= 1")
    need(pairs.n >= 2, "pairs.n", "a pair needs at least 2 samples per prompt")
    need(pairs.prompts >= 0 and pairs.batch_size >= 1, "pairs.prompts", "pairs.prompts >= 0, pairs.batch_size >= 1")


def dpo_loss_valid(cfg, need) -> None:
    if cfg.stage != "dpo":
        return
    from rlframe.algos.preference import PREFERENCE_LOSSES

    dpo = cfg.dpo
    need(dpo.loss in PREFERENCE_LOSSES, "dpo.loss", f"'{dpo.loss}' is not one of {', '.join(PREFERENCE_LOSSES)}")
    need(dpo.beta > 0, "dpo.beta", "must be > 0")
    need(0.0 <= dpo.label_smoothing < 0.5, "dpo.label_smoothing", "must be in [0, 0.5)")
    need(dpo.label_smoothing == 0.0 or dpo.loss == "sigmoid", "dpo.label_smoothing",
         f"only the sigmoid loss reads it (dpo.loss={dpo.loss}). Fix: dpo.label_smoothing=0")


def other_stages_full_weights_colocated(cfg, need) -> None:
    if cfg.stage == "rl":
        return
    need(cfg.model.lora.rank == 0, "model.lora.rank", f"stage={cfg.stage} trains full weights here. Fix: model.lora.rank=0")
    need(cfg.trainer.placement == "colocated", "trainer.placement",
         f"stage={cfg.stage} runs colocated. Fix: trainer.placement=colocated")


CHECKS = (stage_known, sft_section_valid, pair_stage_sections_valid, dpo_loss_valid, other_stages_full_weights_colocated)
