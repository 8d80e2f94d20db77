"""SFT: the worked solutions, the loss mask, packing (no attention across packed samples), an update
that lowers the loss, bad rows named by file and row, and `recipe=sft_math` end to end (tiny model)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CPU_DEVICE, read_metrics, run_tiny
from rlframe.data.files import DatasetError
from rlframe.stages.data import Example, collate_sft, load_sft_examples
from rlframe.stages.sft import worked_solution


def policy_trainer(model_dir, *, packed="false", lr=1e-3, mini=4, micro=2):
    from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings, OptimSettings,
                                         PolicyLossSettings, UpdateLoop)

    engine = EngineSettings(model_path=str(model_dir), device=DeviceRequest(**CPU_DEVICE), use_remove_padding=packed,
                            optim=OptimSettings(lr=lr))
    return PolicyTrainerWorker(ActorSettings(engine=engine, loop=UpdateLoop(mini_batch_size=mini, micro_batch_size=micro),
                                             loss=PolicyLossSettings(), log_prob=ForwardSettings(), rollout=None))


def test_worked_solution_is_right_and_scores_full_marks():
    import importlib.util

    from conftest import REPO_ROOT

    text = worked_solution("Tom has 7 apples and buys 5 more. How many apples does Tom have now?", "12")
    assert text == "We add 5 to 7: 7 + 5 = 12. The answer is \\boxed{12}."
    assert worked_solution("What is 9 minus 4?", 5) == "We subtract 4 from 9: 9 - 4 = 5. The answer is \\boxed{5}."
    spec = importlib.util.spec_from_file_location("math_reward", REPO_ROOT / "reward_fns" / "math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = module.compute_score("arithmetic", text, "12")
    assert (score["score"] if isinstance(score, dict) else score) == pytest.approx(1.0)


def test_loss_mask_response_only_or_all_tokens():
    examples = [Example([5, 6, 7], [8, 9], "f", 0), Example([5], [8, 9, 10], "f", 1)]
    batch = collate_sft(examples, pad_token_id=0)
    # prompts left-padded to 3, replies right-padded to 3; the mask is the reply tokens only
    assert batch.batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 8, 9, 10]]
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    everything = collate_sft(examples, pad_token_id=0, loss_on="all")
    # every token but the first is a target: 4 and 3 targets
    assert everything.batch["response_mask"].sum(-1).tolist() == [4, 3]
    assert everything.batch["responses"][0].tolist() == [6, 7, 8, 9]


def _examples(vocab):
    g = torch.Generator().manual_seed(1)
    lengths = [(7, 5), (2, 9), (4, 1), (11, 3)]
    return [Example(torch.randint(3, vocab, (p,), generator=g).tolist(), torch.randint(3, vocab, (r,), generator=g).tolist(),
                    "f", i) for i, (p, r) in enumerate(lengths)]


def test_packed_sft_logits_equal_each_sample_alone(tiny_model_dir):
    """Packed rows (one sequence, position ids restarting per sample, varlen attention): every sample's
    per-token log-probs equal those of the sample run alone, so no token attends across samples."""
    from transformers import AutoConfig

    examples = _examples(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    packed = policy_trainer(tiny_model_dir, packed="true")
    assert packed.engine.packed
    batch = collate_sft(examples, pad_token_id=0)
    together = packed.engine.forward(batch, packed.settings.log_prob)["log_probs"]
    unpacked = policy_trainer(tiny_model_dir, packed="false")
    assert not unpacked.engine.packed
    for i, example in enumerate(examples):
        alone = unpacked.engine.forward(collate_sft([example], pad_token_id=0), unpacked.settings.log_prob)["log_probs"][0]
        n = len(example.response_ids)
        torch.testing.assert_close(together[i, :n], alone[:n], rtol=1e-4, atol=1e-5)
        assert together[i, n:].abs().sum() == 0


def test_sft_update_lowers_the_loss_and_reports_it(tiny_model_dir):
    from transformers import AutoConfig

    worker = policy_trainer(tiny_model_dir, packed="true", lr=3e-3)
    batch = collate_sft(_examples(AutoConfig.from_pretrained(tiny_model_dir).vocab_size), pad_token_id=0)
    nll = worker.compute_nll(batch)
    before = float(nll.batch["nll_sum"].sum() / nll.batch["nll_tokens"].sum())
    assert nll.batch["nll_tokens"].tolist() == [5, 9, 1, 3]
    metrics = worker.update_sft(batch).meta_info["metrics"]
    # the reported loss is the token-mean NLL of the batch before the step
    assert metrics["sft/loss"] == pytest.approx(before, rel=1e-4)
    for _ in range(3):
        worker.update_sft(batch)
    nll = worker.compute_nll(batch)
    assert float(nll.batch["nll_sum"].sum() / nll.batch["nll_tokens"].sum()) < before - 0.5


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bad_sft_rows_named_by_file_and_row(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    good = {"prompt": "What is 1 plus 1?", "response": "2"}
    path = _write_jsonl(tmp_path / "sft.jsonl", [good, {"prompt": "What is 2 plus 2?", "response": "  "},
                                                 {"prompt": "x " * 300, "response": "4"},
                                                 {"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}])
    with pytest.raises(DatasetError, match=r"sft.jsonl, row 1: field 'response': empty response"):
        load_sft_examples([path], tok, max_length=64)
    with pytest.raises(DatasetError, match=r"sft.jsonl, row 2: prompt \+ response are \d+ tokens, more than the limit 64"):
        load_sft_examples([path], tok, max_length=64, bad_rows="skip")
    kept = load_sft_examples([path], tok, max_length=64, bad_rows="skip", overlong="filter")
    assert [e.row for e in kept] == [0, 3]  # the conversation row's target is the last assistant message
    assert kept[1].response_ids[-1] == tok.eos_token_id


@pytest.mark.slow  # ~35 s: the recipe's plumbing (data, workers, validation, export) in its own process
def test_sft_math_recipe_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path):
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "sft_math", "data.arithmetic.n_train=32", "sft.batch_size=8",
                               "sft.micro_batch_size=4", "sft.max_length=256", "rollout.engine=hf", "sft.epochs=1")
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "sft/loss" in m]
    assert len(steps) == 2  # 32 rows / 8 per step = 4, capped by run_tiny's trainer.total_steps=2
    assert "note: trainer.total_steps=2 caps sft's 4 steps" in result.stdout
    assert all(m["sft/loss"] > 0 for m in steps)
    assert "val/loss" in metrics[0] and "val/accuracy" in metrics[0] and "val/loss" in metrics[-1]
    assert (run_dir / "hf_model" / "config.json").exists()
    assert "SFT: 32 training rows" in result.stdout


def test_unknown_stage_is_a_config_error():
    from rlframe.config import ConfigError, RLConfig, validate_config

    cfg = RLConfig()
    cfg.stage = "pretrain"
    cfg.sft.loss_on = "prompt"
    with pytest.raises(ConfigError, match="stage: 'pretrain' is not one of rl, pt, sft, dpo, rm, rft"):
        validate_config(cfg)
    cfg.stage = "sft"
    with pytest.raises(ConfigError, match="sft.loss_on: 'prompt' is not one of response, all"):
        validate_config(cfg)
