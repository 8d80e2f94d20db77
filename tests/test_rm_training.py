"""Reward-model training: Bradley-Terry steps on the value engine separate chosen from rejected, and the
exported folder loads into the reward-model worker (workers/roles/reward_model.py) unchanged and gives
the very scores the trainer computed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CPU_DEVICE


def _write_pairs(path):
    rows = [{"prompt": f"Is {i} a number?", "chosen": f"Yes, {i} is a number, good.", "rejected": f"No {i} bad bad."}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trained_rm_loads_into_the_reward_model_worker_and_scores(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlframe.protocol import DataProto
    from rlframe.stages.data import collate_scored, load_scored_pairs
    from rlframe.stages.reward_model import rm_render
    from rlframe.workers.roles.reward_model import RewardModelWorker
    from rlframe.workers.roles.reward_trainer import RewardTrainerSettings, RewardTrainerWorker
    from rlframe.workers.settings import DeviceRequest, EngineSettings, OptimSettings, RewardModelSettings

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pairs = load_scored_pairs([_write_pairs(tmp_path / "pairs.jsonl")], rm_render(tok), tok, max_length=128)
    batch = collate_scored([ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)], pad)
    engine = EngineSettings(model_path=str(tiny_model_dir), head="value", device=DeviceRequest(**CPU_DEVICE),
                            optim=OptimSettings(lr=1e-3, head_lr=1e-2))
    trainer = RewardTrainerWorker(RewardTrainerSettings(engine=engine))
    first = trainer.update_rm(batch).meta_info["metrics"]
    assert first["rm/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the head starts at zero: all scores 0
    for _ in range(5):
        metrics = trainer.update_rm(batch).meta_info["metrics"]
    assert metrics["rm/loss"] < 0.5 and metrics["rm/accuracy"] == 1.0
    scores = trainer.compute_scores(batch).batch["rm_scores"]
    out = trainer.save_reward_model(str(tmp_path / "rm"), pad)

    config = json.loads(open(f"{out}/config.json").read())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    worker = RewardModelWorker(RewardModelSettings(model_path=out, device=DeviceRequest(**CPU_DEVICE), dtype="float32"))
    rows = [json.loads(line) for line in open(tmp_path / "pairs.jsonl")]
    data = DataProto.from_dict(non_tensors={"raw_prompt": [r["prompt"] for r in rows for _ in range(2)],
                                            "responses_text": [r[k] for r in rows for k in ("chosen", "rejected")]})
    rm_scores = worker.compute_rm_score(data).batch["rm_scores"]
    torch.testing.assert_close(rm_scores, scores, rtol=1e-4, atol=1e-4)
    assert (rm_scores[0::2] > rm_scores[1::2]).all()


def test_bradley_terry_objective_by_hand():
    from rlframe.protocol import DataProto
    from rlframe.workers.roles.reward_trainer import BradleyTerryObjective

    values = torch.tensor([[2.0], [1.0], [0.0], [0.0]])
    out = BradleyTerryObjective(margin=0.0)({"values": values}, DataProto.from_dict(tensors={"x": torch.zeros(4)}),
                                            {"num_seqs": 4.0})
    # (log(1 + e^-1) + log 2) / 2 pairs
    assert out.loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 2)
    assert out.stats["rm/accuracy"] == 0.5


@pytest.mark.slow  # ~90 s: pair generation with the HF engine, then the reward-model trainer in its own process
def test_rm_math_recipe_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path):
    from conftest import read_metrics, run_tiny

    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "rm_math", "rollout.engine=hf", "pairs.prompts=24", "pairs.n=3",
                               "pairs.min_score_gap=0.01", "rm.batch_size=2", "rm.epochs=1",
                               "reward.functions=[{path: tests/length_reward.py, name: compute_score}]")
    metrics = read_metrics(run_dir)
    assert [m for m in metrics if "rm/loss" in m][0]["rm/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert "val/rm_accuracy" in metrics[-1]
    config = json.loads((run_dir / "hf_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert "reward_model.path=" in result.stdout


def test_rm_stage_hands_the_engine_its_own_section_megatron_tp2(tiny_model_dir):
    """stage=rm builds its engine settings through the one function every role uses: the Megatron layout
    (and offload, checkpoint format) reach the reward trainer (they were dropped by a hand-built copy)."""
    from rlframe.config import validate_config
    from rlframe.main import compose_config
    from rlframe.stages.reward_model import reward_trainer_settings

    cfg = compose_config(["recipe=rm_math", f"model.path={tiny_model_dir}", "actor.strategy=megatron",
                          "actor.world_size=2", "megatron.tensor_model_parallel_size=2",
                          "rm.head_lr=0.5"])
    validate_config(cfg)
    engine = reward_trainer_settings(cfg, str(tiny_model_dir)).engine
    assert engine.strategy == "megatron" and engine.head == "value"
    assert engine.section.tensor_model_parallel_size == 2
    assert engine.optim.head_lr == 0.5
