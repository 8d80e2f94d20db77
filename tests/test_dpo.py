"""DPO: one step at world size 1 and 2 gives the same update; the first loss is log 2 (policy = reference);
bad pairs are named by file and row; `recipe=dpo_math` with on-policy pair generation end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CPU_DEVICE, local_ray, read_metrics, run_tiny
from rlframe.data.files import DatasetError
from rlframe.stages.data import Pair, collate_pairs, load_pairs


def _pairs(vocab: int, n: int = 4) -> list[Pair]:
    g = torch.Generator().manual_seed(3)
    draw = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731
    return [Pair(draw(3 + i), draw(2 + i % 3), draw(4 - i % 2), "f", i) for i in range(n)]


def _settings(model_dir, world_size: int = 1, strategy: str = "fsdp"):
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings, OptimSettings,
                                         PolicyLossSettings, UpdateLoop)

    engine = EngineSettings(model_path=str(model_dir), strategy=strategy, device=DeviceRequest(**CPU_DEVICE),
                            optim=OptimSettings(lr=1e-3))
    return ActorSettings(engine=engine, loop=UpdateLoop(), loss=PolicyLossSettings(), log_prob=ForwardSettings(),
                         rollout=None)


def _batch(model_dir):
    from transformers import AutoConfig

    pairs = _pairs(AutoConfig.from_pretrained(model_dir).vocab_size)
    batch = collate_pairs(pairs, pad_token_id=0)
    return pairs, batch


def test_collate_pairs_interleaves_chosen_and_rejected():
    batch = collate_pairs([Pair([1, 2], [3], [4, 5], "f", 0), Pair([6], [7, 8], [9], "f", 1)], pad_token_id=0)
    assert batch.batch["input_ids"].tolist() == [[1, 2, 3, 0], [1, 2, 4, 5], [0, 6, 7, 8], [0, 6, 9, 0]]
    assert batch.batch["response_mask"].tolist() == [[1, 0], [1, 1], [1, 1], [1, 0]]


def test_first_dpo_step_is_log2_and_moves_the_margin(tiny_model_dir):
    from rlframe.algos.preference import sequence_log_probs
    from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings

    worker = PolicyTrainerWorker(_settings(tiny_model_dir), PreferenceSettings(loss_type="sigmoid", beta=0.5))
    _, batch = _batch(tiny_model_dir)
    token_lp = worker.engine.forward(batch, worker.settings.log_prob)["log_probs"]
    batch.batch["ref_logps"] = sequence_log_probs(token_lp, batch.batch["response_mask"])  # reference = policy
    first = worker.update_dpo(batch).meta_info["metrics"]
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-5)
    for _ in range(3):
        metrics = worker.update_dpo(batch).meta_info["metrics"]
    assert metrics["dpo/loss"] < first["dpo/loss"] - 0.05
    assert metrics["dpo/reward_margin"] > 0.1 and metrics["dpo/reward_accuracy"] > 0.5


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(4, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}):
        yield


def _dpo_step(model_dir, world_size: int, tmp_path, strategy: str = "fsdp"):
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings

    _, batch = _batch(model_dir)
    # a fixed reference: the rewards and the loss are not at their symmetric point
    batch.batch["ref_logps"] = -torch.arange(len(batch), dtype=torch.float32) - 20.0
    batch.meta_info["step"] = 1
    pool = ResourcePool([world_size], cpus_per_bundle=1, name=f"dpo{world_size}{strategy}")
    group = WorkerGroup(pool, {"actor_rollout": (PolicyTrainerWorker, {
        "settings": _settings(model_dir, world_size, strategy), "preference": PreferenceSettings(beta=0.1)})},
        default_timeout_s=300)
    try:
        actor = group.role("actor_rollout")
        metrics = actor.update_dpo(batch).meta_info["metrics"]
        out = tmp_path / f"dpo_ws{world_size}_{strategy}"
        actor.save_hf(str(out))
    finally:
        group.shutdown()
        pool.remove()
    from safetensors.torch import load_file

    return metrics, load_file(str(out / "model.safetensors"))


def test_dpo_step_same_at_world_size_1_and_2(ray_session, tiny_model_dir, tmp_path):
    (m1, w1), (m2, w2) = _dpo_step(tiny_model_dir, 1, tmp_path), _dpo_step(tiny_model_dir, 2, tmp_path)
    for key in ("dpo/loss", "actor/grad_norm", "dpo/reward_margin", "dpo/reward_accuracy"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["actor/grad_norm"] > 0
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # ~60 s: DeepSpeed's start-up
def test_dpo_step_on_deepspeed_zero2_at_2_ranks_equals_fsdp_at_1(ray_session, tiny_model_dir, tmp_path):
    (m1, w1), (m2, w2) = _dpo_step(tiny_model_dir, 1, tmp_path), _dpo_step(tiny_model_dir, 2, tmp_path, "deepspeed")
    for key in ("dpo/loss", "actor/grad_norm", "dpo/reward_margin"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bad_pairs_named_by_file_and_row(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    good = {"prompt": "What is 1 plus 1?", "chosen": "2", "rejected": "3"}
    rows = [good, {"prompt": "What is 1 plus 2?", "chosen": "3", "rejected": "3"},
            {"prompt": "What is 1 plus 3?", "chosen": "4", "rejected": ""},
            {"prompt": "What is 1 plus 4?", "chosen": "5 " * 200, "rejected": "6"},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]}]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DatasetError, match=r"pairs.jsonl, row 1: fields 'chosen' and 'rejected' are identical"):
        load_pairs([path], tok, max_length=64)
    with pytest.raises(DatasetError, match=r"p2.jsonl, row 1: field 'rejected': empty response"):
        load_pairs([_write_jsonl(tmp_path / "p2.jsonl", [good, rows[2]])], tok, max_length=64)
    with pytest.raises(DatasetError, match=r"pairs.jsonl, row 3: prompt \+ response are \d+ tokens, more than the limit 64"):
        load_pairs([path], tok, max_length=64, bad_rows="skip")
    kept = load_pairs([path], tok, max_length=64, bad_rows="skip", overlong="filter")
    assert [p.row for p in kept] == [0, 4]


def test_select_pair_best_and_worst():
    from rlframe.stages.pair_generation import select_pair

    assert select_pair([0.0, 1.0, 0.9, 0.0], 0.5) == (1, 0)
    assert select_pair([0.9, 1.0], 0.5) is None  # both correct: no preference worth learning
    assert select_pair([0.0, 0.0], 0.0) == (0, 0)  # (the caller also drops identical texts)


@pytest.mark.slow
def test_dpo_math_recipe_with_pair_generation_end_to_end(tiny_model_dir, tmp_path):
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "dpo_math", "rollout.engine=hf", "pairs.prompts=8",
                               "pairs.n=3", "pairs.min_score_gap=0.01", "dpo.batch_size=2", "dpo.epochs=1",
                               "dpo.max_length=256",
                               "reward.functions=[{path: tests/length_reward.py, name: compute_score}]")
    pairs = [json.loads(line) for line in open(run_dir / "data" / "pairs.jsonl")]
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "dpo/loss" in m]
    assert len(steps) == min(2, len(pairs) // 2)  # dpo.epochs=1 x (pairs // 2), capped by trainer.total_steps=2
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at step 1
    assert "pairs/pairs" in metrics[0] and (run_dir / "hf_model" / "config.json").exists()


@pytest.mark.slow  # ~60 s: the pairs command in its own process (HF engine)
def test_pairs_command_writes_scored_pairs(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "pairs.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "rlframe.pairs", "recipe=dpo_math", f"model.path={tiny_model_dir}", "rollout.engine=hf",
         "data.arithmetic.n_train=64", "data.max_response_length=16", "pairs.prompts=6", "pairs.n=3",
         "pairs.min_score_gap=0.01", "trainer.num_cpus=4", f"out={out}",
         "reward.functions=[{path: tests/length_reward.py, name: compute_score}]"],
        cwd=tmp_path, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["chosen_score"] - r["rejected_score"] >= 0.01 and r["chosen"] != r["rejected"] for r in rows)
    assert isinstance(rows[0]["prompt"], list) and rows[0]["prompt"][0]["role"] == "user"
    assert list((tmp_path / "logs").glob("worker-*.log"))  # the quiet console: the workers' output went to files


def test_unpaired_rows_for_kto(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlframe.stages.unpaired_data import load_unpaired

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "What is 1 plus 1?", "completion": "2", "label": True},
            {"prompt": "What is 1 plus 2?", "completion": "4", "label": "false"},
            {"prompt": "What is 1 plus 3?", "chosen": "4", "rejected": "5"}]  # a pair: one row of each label
    examples = load_unpaired([_write_jsonl(tmp_path / "kto.jsonl", rows)], tok, max_length=64)
    assert [(e.row, e.extra["label"]) for e in examples] == [(0, True), (1, False), (2, True), (2, False)]
    assert examples[0].response_ids[-1] == tok.eos_token_id
    bad = _write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"prompt": "x", "completion": "y", "label": "maybe"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl, row 1: field 'label': 'maybe' is not a label"):
        load_unpaired([bad], tok, max_length=64)


def test_kto_update_on_the_worker(tiny_model_dir):
    """KTO at policy = reference: every row's loss is 1 - s(0) = 0.5; it goes down in 3 steps."""
    from rlframe.algos.preference import sequence_log_probs
    from rlframe.stages.data import collate_sft
    from rlframe.stages.data import Example
    from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings

    pairs, _ = _batch(tiny_model_dir)
    rows = [Example(p.prompt_ids, reply, "f", i, {"label": good}) for i, p in enumerate(pairs)
            for reply, good in ((p.chosen_ids, True), (p.rejected_ids, False))]
    batch = collate_sft(rows, pad_token_id=0)
    batch.batch["kto_label"] = torch.tensor([float(e.extra["label"]) for e in rows])
    kto = PolicyTrainerWorker(_settings(tiny_model_dir), PreferenceSettings(loss_type="kto", beta=0.5))
    token_lp = kto.engine.forward(batch, kto.settings.log_prob)["log_probs"]
    batch.batch["ref_logps"] = sequence_log_probs(token_lp, batch.batch["response_mask"])
    first = kto.update_dpo(batch).meta_info["metrics"]
    assert first["dpo/loss"] == pytest.approx(0.5, abs=1e-5) and first["dpo/kl"] == pytest.approx(0.0, abs=1e-5)
    for _ in range(3):
        last = kto.update_dpo(batch).meta_info["metrics"]
    assert last["dpo/loss"] < first["dpo/loss"] - 0.02 and last["dpo/rewards_chosen"] > last["dpo/rewards_rejected"]


def test_orpo_update_on_the_worker(tiny_model_dir):
    """ORPO without a reference: the loss (chosen NLL + the odds-ratio term) falls, the margin grows."""
    from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings

    orpo = PolicyTrainerWorker(_settings(tiny_model_dir), PreferenceSettings(loss_type="orpo", beta=0.1,
                                                                              length_normalize=True))
    _, pair_batch = _batch(tiny_model_dir)
    first = orpo.update_dpo(pair_batch).meta_info["metrics"]
    for _ in range(3):
        last = orpo.update_dpo(pair_batch).meta_info["metrics"]
    assert last["dpo/loss"] < first["dpo/loss"] - 0.1 and last["dpo/reward_margin"] > first["dpo/reward_margin"]
