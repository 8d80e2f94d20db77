"""model.lora.kind: DoRA and rsLoRA through peft, their merged weights equal to the adapted model (the weight
sync's log-prob gap), and the kinds that cannot run here refused before any worker starts."""

import math

import pytest
import torch

from rlframe.workers.engine.lora import (adapter_kind_problem, apply_lora, from_peft_key, iter_merged_weights,
                                         lora_layers, to_peft_key)
from rlframe.workers.settings import LoraSettings


def _lora(kind: str, **kwargs) -> LoraSettings:
    return LoraSettings(rank=4, alpha=8.0, kind=kind, **kwargs)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _log_probs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_rslora_scales_by_the_square_root_of_the_rank(tiny_model_dir):
    model = _model(tiny_model_dir)
    apply_lora(model, _lora("rslora"))
    layer = next(iter(lora_layers(model).values()))
    assert layer.scaling["default"] == pytest.approx(8.0 / math.sqrt(4))  # plain LoRA: 8 / 4


def test_dora_merged_weights_give_the_trained_log_probs(tiny_model_dir):
    """The sync path: the adapted (trained) model's log-probs vs a plain model loaded with iter_merged_weights."""
    model = _model(tiny_model_dir)
    apply_lora(model, _lora("dora"))
    dora = lora_layers(model)
    assert dora and all("default" in layer.lora_magnitude_vector for layer in dora.values())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=g)
    base_lp = _log_probs(model, ids)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(3):  # a few real updates: B leaves zero, the magnitudes move
        optimizer.zero_grad()
        nll = -torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
        nll.backward()
        optimizer.step()
    trained_lp = _log_probs(model, ids)
    assert (trained_lp - base_lp).abs().max() > 1e-2  # the adapters changed the policy
    magnitude = next(iter(dora.values())).lora_magnitude_vector["default"].weight
    engine = _model(tiny_model_dir)  # what the rollout engine holds: the base model's names and shapes
    merged = dict(iter_merged_weights(model))
    assert set(merged) == set(engine.state_dict())
    engine.load_state_dict(merged)
    gap = (_log_probs(engine, ids) - trained_lp).abs().max().item()
    assert gap < 1e-4, f"DoRA sync gap {gap}"  # fp32 on both sides: the usual gap is ~1e-6
    assert magnitude.requires_grad


def test_dora_magnitude_keys_round_trip_peft_names():
    key = "model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight"
    assert to_peft_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    assert from_peft_key(to_peft_key(key)) == key
    a = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert from_peft_key(to_peft_key(a)) == a


def test_kinds_that_cannot_run_are_refused_with_the_reason():
    assert adapter_kind_problem("lora") is None and adapter_kind_problem("rslora", "adapter") is None
    assert "weight_sync=merged" in adapter_kind_problem("dora", "adapter")
    assert "update_and_allocate" in adapter_kind_problem("adalora")
    assert "low-rank A/B" in adapter_kind_problem("ia3")
    assert "not an adapter kind peft has" in adapter_kind_problem("lorax")
    assert "does not wire" in adapter_kind_problem("loha")  # peft has LoHa; rlframe does not carry it


def test_an_unknown_kind_is_a_config_error_before_workers():
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    with pytest.raises(ConfigError, match=r"model.lora.kind: 'lorax' is not an adapter kind peft has\. "
                                          r"Fix: model.lora.kind=one of lora, dora, rslora"):
        validate_config(compose_config(["recipe=grpo_math_lora", "model.lora.kind=lorax"]))
    with pytest.raises(ConfigError, match="model.lora.kind: DoRA adapters cannot be synced as adapters"):
        validate_config(compose_config(["recipe=grpo_math_lora", "model.lora.kind=dora", "model.lora.weight_sync=adapter"]))
    validate_config(compose_config(["recipe=grpo_math_lora", "model.lora.kind=dora"]))


@pytest.mark.slow  # ~40 s: the LoRA recipe again, with DoRA (the recipe itself runs in test_recipes)
def test_the_lora_rl_recipe_runs_with_dora(tiny_model_dir, tmp_path):
    from conftest import read_metrics, run_tiny

    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math_lora", "model.lora.kind=dora", "rollout.engine=hf",
                          "reward.functions=[{path: tests/length_reward.py, name: compute_score}]")
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert steps and all("actor/pg_loss" in m for m in steps)
    gaps = [m["rollout/logprob_abs_diff"] for m in steps if "rollout/logprob_abs_diff" in m]
    assert gaps and max(gaps) < 1e-3, gaps  # the merged DoRA weights reach the engine: the usual sync gap
