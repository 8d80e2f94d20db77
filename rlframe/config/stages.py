"""The checks of `stage` and its sections pt / sft / dpo / rm / rft / pairs (the dataclasses: rlframe/stages/config.py)."""

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
    need(sft.batch_size < 1 or (sft.batch_size >= world and sft.batch_size % world == 0), "sft.batch_size",
         f"{sft.batch_size} sequences do not split over actor.world_size={world} ranks. Fix: a multiple of it")


def pair_stage_sections_valid(cfg, need) -> None:
    """stage=dpo / rm: the batch of pairs splits over the ranks (the counts: their bounds, rlframe/stages/config.py)."""
    if cfg.stage not in ("dpo", "rm"):
        return
    dpo, rm, world = cfg.dpo, cfg.rm, _world(cfg)
    batch = dpo.batch_size if cfg.stage == "dpo" else rm.batch_size
    need(batch < 1 or batch >= world and batch % world == 0, f"{cfg.stage}.batch_size",
         f"{batch} pairs do not split over actor.world_size={world} ranks. Fix: a multiple of it")


def dpo_loss_valid(cfg, need) -> None:
    if cfg.stage != "dpo":
        return
    from rlframe.algos.preference import PREFERENCE_LOSSES

    dpo = cfg.dpo
    need(dpo.loss in PREFERENCE_LOSSES, "dpo.loss", f"'{dpo.loss}' is not one of {', '.join(PREFERENCE_LOSSES)}")
    need(dpo.label_smoothing == 0.0 or dpo.loss == "sigmoid", "dpo.label_smoothing",
         f"only the sigmoid loss reads it (dpo.loss={dpo.loss}). Fix: dpo.label_smoothing=0")


def pt_section_valid(cfg, need) -> None:
    """stage=pt: packed rows need the packed forward (position ids keep documents apart); sizes; a text column."""
    if cfg.stage != "pt":
        return
    pt, world = cfg.pt, _world(cfg)
    need(str(cfg.actor.use_remove_padding).lower() != "false" and cfg.model.attn_implementation != "eager",
         "actor.use_remove_padding", "stage=pt packs several documents into each row and keeps them apart with the "
         "packed (padding-free) forward. Fix: actor.use_remove_padding=auto (and not model.attn_implementation=eager)")
    need(cfg.actor.strategy in ("fsdp", "deepspeed"), "actor.strategy",
         f"stage=pt runs the packed forward of the fsdp and deepspeed engines; {cfg.actor.strategy} is not wired "
         "for it. Fix: actor.strategy=fsdp")
    need(pt.max_length >= 2, "pt.max_length", "must be >= 2")
    need(pt.epochs >= 1, "pt.epochs", "must be >= 1")
    need(pt.batch_size >= world and pt.batch_size % world == 0, "pt.batch_size",
         f"{pt.batch_size} rows do not split over actor.world_size={world} ranks. Fix: a multiple of it")
    need(pt.micro_batch_size >= 1, "pt.micro_batch_size", "must be >= 1")
    need(0.0 <= pt.val_fraction < 1.0, "pt.val_fraction", "must be in [0, 1)")
    if cfg.data.source == "files":
        from rlframe.data.files import resolve_data_files
        from rlframe.stages.pt_data import text_column_problem

        for path in resolve_data_files(cfg.data.train_files) + resolve_data_files(cfg.data.val_files):
            problem = text_column_problem(path, pt.text_key)
            need(problem is None, "pt.text_key", str(problem))


def rft_section_valid(cfg, need) -> None:
    if cfg.stage != "rft":
        return
    rft, world = cfg.rft, _world(cfg)
    need(rft.rounds >= 1, "rft.rounds", "must be >= 1")
    need(rft.n >= 1, "rft.n", "must be >= 1")
    need(rft.prompts_per_round >= 1, "rft.prompts_per_round", "must be >= 1")
    need(rft.keep_top_k >= 0, "rft.keep_top_k", "must be >= 0 (0: every sample at or above rft.min_score)")
    need(rft.loss in ("sft", "rrhf"), "rft.loss", f"'{rft.loss}' is not sft or rrhf")
    need(rft.loss != "rrhf" or rft.n >= 2, "rft.n", "rft.loss=rrhf ranks the samples of a prompt: it needs rft.n >= 2")
    need(rft.epochs >= 1, "rft.epochs", "must be >= 1")
    need(rft.batch_size >= world and rft.batch_size % world == 0, "rft.batch_size",
         f"{rft.batch_size} rows do not split over actor.world_size={world} ranks. Fix: a multiple of it")
    need(rft.micro_batch_size >= 1 and rft.generation_batch_size >= 1, "rft.micro_batch_size",
         "rft.micro_batch_size and rft.generation_batch_size must be >= 1")
    need(bool(cfg.reward.functions), "reward.functions", "stage=rft keeps the samples the reward scores best: it "
         "needs reward functions")


def other_stages_full_weights_colocated(cfg, need) -> None:
    if cfg.stage == "rl":
        return
    need(cfg.model.lora.rank == 0, "model.lora.rank", f"stage={cfg.stage} trains full weights here. Fix: model.lora.rank=0")
    need(cfg.trainer.placement == "colocated", "trainer.placement",
         f"stage={cfg.stage} runs colocated. Fix: trainer.placement=colocated")


CHECKS = (stage_known, sft_section_valid, pair_stage_sections_valid, dpo_loss_valid, pt_section_valid, rft_section_valid,
          other_stages_full_weights_colocated)
