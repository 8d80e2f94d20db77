"""The Megatron-core engine (`actor.strategy=megatron`, workers/engine/megatron/) on CPU over gloo.

- conversion HF <-> Megatron GPT (fused QKV, gate/up, TP shards): hand-built layouts, exact round trips
  (Llama with grouped-query attention, Qwen2 with QKV biases, padded vocabulary), unsupported models named;
- config validation before any worker starts: TP not dividing the heads, PP not dividing the layers, the
  world size not divisible by TP x PP x CP, an unsupported architecture (sequence / context parallelism:
  tests/test_megatron_parallel.py);
- the critic (value head on the Megatron body) against the FSDP critic at TP=1 and TP=2, and its resume;
- the engine against the FSDP engine on the same HF weights and batch: log-probs (atol 1e-5, rtol 1e-4),
  one update's losses, grad norm (rel 1e-4) and updated weights converted back to HF names (atol 1e-5,
  rtol 1e-4) at TP=1 (1 rank, 2 micro-batches), TP=2 (2 ranks, 2 micro-batches) and TP=1 x DP=2;
- checkpoints: save, update, load, update again gives the same update; the checkpoint (HF names) resumes
  on the FSDP engine too.

Multi-rank runs go through real worker groups (Ray actors with a gloo process group), as in
tests/test_actor_data_parallel.py. Pipeline parallelism: tests/test_megatron_pipeline.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlframe.config import ConfigError, RLConfig, validate_config
from test_actor_data_parallel import synthetic_batch

pytest.importorskip("megatron.core")

from rlframe.workers.engine.megatron.convert import (GPTArch, architecture_problem, hf_state_from_shards,  # noqa: E402
                                                     hf_to_megatron, megatron_to_hf)


# ------------------------------------------------------------------------------------ conversion
def _arch(**overrides) -> GPTArch:
    fields = dict(architecture="LlamaForCausalLM", num_layers=1, hidden_size=1, ffn_hidden_size=4, num_heads=4,
                  num_query_groups=2, head_dim=1, vocab_size=5, max_position_embeddings=16, rope_theta=10000.0,
                  norm_eps=1e-6, qkv_bias=False, tie_embeddings=True)
    return GPTArch(**{**fields, **overrides})


def _column(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def test_fused_layouts_by_hand():
    """4 query heads in 2 groups, head_dim 1: q rows 0..3, k rows 10, 11, v rows 20, 21."""
    arch = _arch()
    prefix = "model.layers.0."
    hf = {prefix + "self_attn.q_proj.weight": _column(0, 1, 2, 3), prefix + "self_attn.k_proj.weight": _column(10, 11),
          prefix + "self_attn.v_proj.weight": _column(20, 21), prefix + "mlp.gate_proj.weight": _column(0, 1, 2, 3),
          prefix + "mlp.up_proj.weight": _column(10, 11, 12, 13),
          prefix + "mlp.down_proj.weight": torch.tensor([[0.0, 1.0, 2.0, 3.0]]),
          "model.embed_tokens.weight": _column(0, 1, 2, 3, 4)}
    qkv, fc1, fc2 = ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                     "decoder.layers.0.mlp.linear_fc2.weight")
    names = [qkv, fc1, fc2, "embedding.word_embeddings.weight"]
    whole = hf_to_megatron(hf, arch, 0, 1, names=names)
    assert whole[qkv].flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # per group: its q heads, k, v
    assert whole[fc1].flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]  # [gate; up]
    rank0, rank1 = (hf_to_megatron(hf, arch, r, 2, names=names) for r in (0, 1))
    assert rank0[qkv].flatten().tolist() == [0, 1, 10, 20] and rank1[qkv].flatten().tolist() == [2, 3, 11, 21]
    assert rank0[fc1].flatten().tolist() == [0, 1, 10, 11] and rank1[fc1].flatten().tolist() == [2, 3, 12, 13]
    assert rank1[fc2].tolist() == [[2.0, 3.0]]  # row parallel: split along the input
    # vocabulary of 5 over 2 ranks: padded to 6 with a zero row, dropped on the way back
    assert rank1["embedding.word_embeddings.weight"].flatten().tolist() == [3, 4, 0]
    back = megatron_to_hf("embedding.word_embeddings.weight",
                          [rank0["embedding.word_embeddings.weight"], rank1["embedding.word_embeddings.weight"]], arch)
    assert back[0][0] == "model.embed_tokens.weight" and back[0][1].flatten().tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_is_exact(architecture, tie):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class = LlamaConfig if architecture == "LlamaForCausalLM" else Qwen2Config
    config = config_class(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tie,
                          architectures=[architecture])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).state_dict()
    if tie:
        hf.pop("lm_head.weight")  # as a tied checkpoint stores it
    arch = GPTArch.from_hf(config)
    assert arch.qkv_bias == (architecture == "Qwen2ForCausalLM") and arch.num_query_groups == 2
    for tp in (1, 2):
        shards = [hf_to_megatron(hf, arch, r, tp) for r in range(tp)]
        back = hf_state_from_shards(shards, arch)
        assert back.keys() == hf.keys()
        for name in hf:
            assert torch.equal(back[name], hf[name]), (tp, name)
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (48, 64)  # (4 + 1 + 1) x 8 x 2 / 2


def test_unsupported_models_are_named():
    from transformers import GPT2Config, LlamaConfig

    assert "this model is GPT2LMHeadModel" in architecture_problem(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="GPT2LMHeadModel. Fix: actor.strategy=fsdp"):
        GPTArch.from_hf(GPT2Config(architectures=["GPT2LMHeadModel"]))
    scaled = LlamaConfig(architectures=["LlamaForCausalLM"],
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "rope scaling 'linear'" in architecture_problem(scaled)
    assert architecture_problem(LlamaConfig(architectures=["LlamaForCausalLM"])) is None


# ------------------------------------------------------------------------------------ validation
def megatron_cfg(model_dir, world_size=2, tp=2, pp=1, cp=1) -> RLConfig:
    cfg = RLConfig()
    cfg.model.path = str(model_dir)
    cfg.actor.strategy = "megatron"
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size = 4
    cfg.data.train_batch_size = 4
    cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size = tp, pp
    cfg.megatron.context_parallel_size = cp
    return cfg


def problems(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    return str(error.value)


def test_validation_names_bad_parallel_sizes(tiny_model_dir, tmp_path):
    validate_config(megatron_cfg(tiny_model_dir))  # the tiny Llama: 2 heads, 2 layers, TP=2 on 2 ranks
    from rlframe.main import compose_config

    from transformers import LlamaConfig

    smollm_like = tmp_path / "smollm_like"  # SmolLM2-135M's heads (the config only: validation reads no weights)
    LlamaConfig(architectures=["LlamaForCausalLM"], num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                num_hidden_layers=30).save_pretrained(smollm_like)
    tp2 = compose_config(["recipe=grpo_math_megatron", f"model.path={smollm_like}",
                          "megatron.tensor_model_parallel_size=2", "actor.world_size=2"])
    assert "megatron.tensor_model_parallel_size: 2 does not divide the model's 9 attention heads and 3" in problems(tp2)
    validate_config(compose_config(["recipe=grpo_math_megatron", f"model.path={smollm_like}"]))  # TP=3: fine
    message = problems(megatron_cfg(tiny_model_dir, world_size=4, tp=4, pp=3))
    assert "actor.world_size: 4 is not divisible by TP x PP x CP = 4 x 3 x 1 = 12" in message
    assert "megatron.tensor_model_parallel_size: 4 does not divide the model's 2 attention heads" in message
    assert "megatron.pipeline_model_parallel_size: 3 does not divide the model's 2 layers. Fix: a divisor of 2" in message
    validate_config(megatron_cfg(tiny_model_dir, world_size=2, tp=1, pp=2))  # pipeline parallelism runs
    validate_config(megatron_cfg(tiny_model_dir, world_size=4, tp=2, pp=2))
    validate_config(megatron_cfg(tiny_model_dir, tp=1, cp=2))  # context parallelism runs (test_megatron_parallel.py)
    ppo = megatron_cfg(tiny_model_dir)
    ppo.algorithm.adv_estimator = "gae"
    validate_config(ppo)  # the critic runs on Megatron too
    # an architecture the conversion does not know
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_head=2).save_pretrained(gpt2)
    assert "model.path: the megatron engine converts LlamaForCausalLM, Qwen2ForCausalLM" in problems(
        megatron_cfg(gpt2, tp=1))


def test_megatron_keys_reach_the_engine_settings(tiny_model_dir):
    from rlframe.main import compose_config
    from rlframe.trainer.worker_settings import actor_settings, ref_settings

    cfg = compose_config(["recipe=grpo_math_megatron", f"model.path={tiny_model_dir}"])
    assert cfg.actor.strategy == "megatron" and cfg.megatron.tensor_model_parallel_size == 3
    assert actor_settings(cfg, str(tiny_model_dir)).engine.section.tensor_model_parallel_size == 3
    assert ref_settings(cfg, str(tiny_model_dir)).engine.strategy == "megatron"


# ------------------------------------------------------------------------------------ equality with FSDP
def actor_config(model_dir, world_size: int, micro: int, strategy: str = "megatron", tp: int = 1,
                 pp: int = 1) -> RLConfig:
    """The update of tests/test_actor_data_parallel.py: 8 sequences, one optimiser step, KL loss."""
    cfg = RLConfig()
    cfg.model.path = str(model_dir)
    cfg.rollout.engine = "hf"
    cfg.rollout.n = 2
    cfg.actor.strategy = strategy
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size = 4  # x n=2 -> 8 sequences: the whole batch, one optimiser step
    cfg.actor.ppo_micro_batch_size_per_device = micro
    cfg.actor.optim.lr = 1e-3
    cfg.actor.shuffle = False
    cfg.actor.use_remove_padding = "false"
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.megatron.tensor_model_parallel_size = tp
    cfg.megatron.pipeline_model_parallel_size = pp
    return cfg


def plain_actor(cfg: RLConfig, model_dir):
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    return ActorRolloutWorker(dataclasses.replace(actor_settings(cfg, str(model_dir)), rollout=None))


def update(actor, batch, out_dir):
    """(metrics, saved HF weights, log-probs, entropy) of compute_log_prob + one update_actor."""
    from safetensors.torch import load_file

    forward = actor.compute_log_prob(batch)
    mask = batch.batch["response_mask"]
    metrics = actor.update_actor(batch).meta_info["metrics"]
    actor.save_hf(str(out_dir))
    return (metrics, load_file(str(out_dir / "model.safetensors")), forward.batch["old_log_probs"] * mask,
            forward.batch["entropy"] * mask)


def assert_same_as_fsdp(reference, ours, weight_atol=1e-5, start: dict | None = None):
    """log-probs and entropy atol 1e-5 / rtol 1e-4; losses and grad norm rel 1e-4; updated weights rtol 1e-4,
    atol `weight_atol`. (Under TP the row-parallel matmuls sum in another order; Adam's first step,
    lr * m / sqrt(v), turns that into up to ~1e-5 on the rare elements whose gradient is ~0: 1% of the
    step lr=1e-3 that a wrong gradient would show.)"""
    (m1, w1, lp1, e1), (m2, w2, lp2, e2) = reference, ours
    torch.testing.assert_close(lp1, lp2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(e1, e2, rtol=1e-4, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["actor/grad_norm"] > 0
    assert w1.keys() == w2.keys()
    start = load_tiny_weights() if start is None else start
    for name in w1:
        assert not torch.equal(w1[name], start[name]), f"{name} did not move"
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=weight_atol, msg=lambda m: f"{name}: {m}")


_TINY_WEIGHTS: dict = {}


def load_tiny_weights() -> dict:
    return _TINY_WEIGHTS["start"]


def tiny_batch(model_dir):
    from transformers import AutoConfig

    return synthetic_batch(AutoConfig.from_pretrained(model_dir).vocab_size)


@pytest.fixture(scope="module")
def fsdp_reference(tiny_model_dir, tmp_path_factory):
    """The FSDP engine as a plain object (world size 1, one micro-batch, padded rows)."""
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("fsdp_reference")
    _TINY_WEIGHTS["start"] = load_file(str(tiny_model_dir / "model.safetensors"))
    _TINY_WEIGHTS["start"]["lm_head.weight"] = _TINY_WEIGHTS["start"]["model.embed_tokens.weight"]
    return update(plain_actor(actor_config(tiny_model_dir, 1, 8, strategy="fsdp"), tiny_model_dir),
                  tiny_batch(tiny_model_dir), out)


def opposite_advantages(batch):
    """A second update that differs from the first (the advantages negated)."""
    other = batch[list(range(len(batch)))]
    other.batch["advantages"] = -other.batch["advantages"]
    return other


def assert_same_weights(first: dict, second: dict, rtol=1e-5, atol=1e-6):
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_tp1_one_rank_equals_fsdp(tiny_model_dir, tmp_path, fsdp_reference, recompute):
    """TP=1 in this process, 2 micro-batches: log-probs, entropy, losses, grad norm and weights as FSDP; also
    with model.gradient_checkpointing (each layer's activations recomputed in the backward)."""
    cfg = actor_config(tiny_model_dir, 1, 4)
    cfg.model.gradient_checkpointing = recompute
    actor = plain_actor(cfg, tiny_model_dir)
    assert actor.describe()["strategy"] == "megatron"
    assert all(hasattr(layer.forward, "__wrapped__") for layer in actor.engine.model.gpt.decoder.layers) == recompute
    assert_same_as_fsdp(fsdp_reference, update(actor, tiny_batch(tiny_model_dir), tmp_path / "tp1"))


def start_actor(cfg: RLConfig, model_dir, name: str):
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    settings = dataclasses.replace(actor_settings(cfg, str(model_dir)), rollout=None)  # no rollout engine needed
    pool = ResourcePool([cfg.actor.world_size], cpus_per_bundle=1, name=name)
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": settings})}, default_timeout_s=300)
    return pool, group, group.role("actor_rollout")


def update_on_ranks(cfg: RLConfig, model_dir, name: str, out_dir):
    """`update` on the tiny batch by a worker group of `cfg`'s layout, started and shut down here."""
    pool, group, actor = start_actor(cfg, model_dir, name)
    try:
        return update(actor, tiny_batch(model_dir), out_dir)
    finally:
        group.shutdown()
        pool.remove()


def test_tp2_update_equals_fsdp_and_checkpoint_resumes(ray_session, tiny_model_dir, tmp_path, fsdp_reference):
    """TP=2 on 2 ranks, 2 micro-batches: the same update as FSDP; then save, update, load, update again
    gives the same update, and the checkpoint (HF names) resumes on the FSDP engine at world size 1."""
    batch = tiny_batch(tiny_model_dir)
    second = opposite_advantages(batch)
    checkpoint = tmp_path / "checkpoint"
    pool, group, actor = start_actor(actor_config(tiny_model_dir, 2, 2, tp=2), tiny_model_dir, "megatron_tp2")
    try:
        assert actor.describe()[0]["strategy"] == "megatron"
        first = update(actor, batch, tmp_path / "tp2")
        actor.save_checkpoint(str(checkpoint))
        continued = actor.update_actor(second).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "continued"))
        assert actor.load_checkpoint(str(checkpoint))[0]["optimizer_steps"] == 1
        resumed = actor.update_actor(second).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "resumed"))
    finally:
        group.shutdown()
        pool.remove()
    assert_same_as_fsdp(fsdp_reference, first, weight_atol=2e-5)
    from safetensors.torch import load_file

    continued_weights = load_file(str(tmp_path / "continued" / "model.safetensors"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-6), key
    assert_same_weights(continued_weights, load_file(str(tmp_path / "resumed" / "model.safetensors")))
    fsdp = plain_actor(actor_config(tiny_model_dir, 1, 8, strategy="fsdp"), tiny_model_dir)
    fsdp.load_checkpoint(str(checkpoint))
    on_fsdp = fsdp.update_actor(second).meta_info["metrics"]
    fsdp.save_hf(str(tmp_path / "on_fsdp"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert on_fsdp[key] == pytest.approx(continued[key], rel=1e-4), key
    assert_same_weights(continued_weights, load_file(str(tmp_path / "on_fsdp" / "model.safetensors")), 1e-4, 1e-5)


@pytest.mark.slow  # (~20 s on a quiet machine; CI's budget goes to the TP=2 test above)
def test_data_parallel_two_ranks_equals_fsdp(ray_session, tiny_model_dir, tmp_path, fsdp_reference):
    """TP=1 x DP=2: gradients summed over the data-parallel group, normalisers global."""
    ours = update_on_ranks(actor_config(tiny_model_dir, 2, 2, tp=1), tiny_model_dir, "megatron_dp2", tmp_path / "dp2")
    assert_same_as_fsdp(fsdp_reference, ours)


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_grpo_two_steps_on_megatron_tp2(tmp_path, tiny_model_dir, placement):
    """`python -m rlframe.main recipe=grpo_math_megatron` at TP=2 on the tiny model: actor and reference
    policy on Megatron, HF rollout (one engine per rank, or one engine fed by the bucketed broadcast);
    weight sync proven by the log-prob agreement; the checkpoint exports."""
    grpo_two_steps(tmp_path, tiny_model_dir, placement, tp=2, pp=1)


def grpo_two_steps(tmp_path, tiny_model_dir, placement: str, tp: int, pp: int, *extra: str) -> None:
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    from conftest import read_metrics, run_tiny

    reward = Path(__file__).parent / "length_reward.py"  # varies per response: the weights really move
    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math_megatron", "rollout.engine=hf", "actor.world_size=2",
                          f"megatron.tensor_model_parallel_size={tp}", f"megatron.pipeline_model_parallel_size={pp}",
                          f"trainer.placement={placement}",
                          f"rollout.world_size={2 if placement == 'colocated' else 1}", "trainer.save_every=2", "actor.optim.lr=1e-3",
                          f"reward.functions=[{{path:{reward}}}]", *extra)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for step in metrics[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "timing/weight_sync"):
            assert math.isfinite(step[key]), key
        assert step["rollout/logprob_abs_diff"] < 1e-4  # the rollout engine holds the trained weights
        assert step["actor/grad_norm"] > 1e-3
    assert metrics[2]["actor/kl_loss"] > 0  # the reference policy (also on Megatron) differs after step 1
    assert "val/reward_mean" in json.loads((run_dir / "summary.json").read_text())["val_after"]
    export = subprocess.run([sys.executable, "-m", "rlframe.export", str(run_dir), str(tmp_path / "export")],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.isfinite(exported(torch.tensor([[5, 6, 7]])).logits).all()


# ------------------------------------------------------------------------------------ the critic
def critic_settings_for(model_dir, strategy: str, world_size: int, micro: int, tp: int = 1, pp: int = 1):
    from rlframe.trainer.worker_settings import critic_settings

    cfg = actor_config(model_dir, world_size=world_size, micro=micro, strategy=strategy, tp=tp, pp=pp)
    cfg.actor.ppo_mini_batch_size = 2  # x n=2 -> 4 sequences: the whole batch
    cfg.critic.ppo_micro_batch_size_per_device = micro
    cfg.critic.cliprange_value = 0.0
    return critic_settings(cfg, str(model_dir))


def critic_batch():
    from test_critic import _batch

    data = _batch()
    data.batch["values"] = torch.zeros(4, 4)  # the zero-initialised head's values
    data.batch["returns"] = torch.tensor([0.5, -0.2, 1.0, 0.1]).unsqueeze(1) * data.batch["response_mask"]
    return data


@pytest.fixture(scope="module")
def fsdp_critic_reference(tiny_model_dir):
    from rlframe.workers.roles.critic import CriticWorker

    fsdp = CriticWorker(critic_settings_for(tiny_model_dir, "fsdp", world_size=1, micro=4))
    metrics = fsdp.update_critic(critic_batch()).meta_info["metrics"]
    return metrics, fsdp.compute_values(critic_batch()).batch["values"]


def assert_same_critic_update(reference, metrics, values):
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert metrics[key] == pytest.approx(reference[0][key], rel=1e-4), key
    torch.testing.assert_close(values, reference[1], rtol=1e-4, atol=1e-6)
    assert values.abs().max() > 0  # the head moved off zero


def test_critic_tp1_equals_fsdp(tiny_model_dir, fsdp_critic_reference):
    """The value head (its own LR group) on the Megatron body, 2 micro-batches: the FSDP critic's update."""
    from rlframe.workers.roles.critic import CriticWorker

    critic = CriticWorker(critic_settings_for(tiny_model_dir, "megatron", world_size=1, micro=2))
    assert critic.compute_values(critic_batch()).batch["values"].abs().max() == 0  # the head starts at zero
    metrics = critic.update_critic(critic_batch()).meta_info["metrics"]
    assert_same_critic_update(fsdp_critic_reference, metrics, critic.compute_values(critic_batch()).batch["values"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_critic_two_ranks_equals_fsdp_and_checkpoint_resumes(ray_session, tiny_model_dir, tmp_path,
                                                              fsdp_critic_reference, parallel):
    """TP=2: the value head replicated over the tensor-parallel pair; PP=2: the head on the last stage, the
    body over 2 stages. Both: the FSDP critic's update, then a checkpoint round trip."""
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.workers.roles.critic import CriticWorker

    settings = critic_settings_for(tiny_model_dir, "megatron", world_size=2, micro=1, **parallel)
    pool = ResourcePool([2], cpus_per_bundle=1, name="megatron_critic")
    group = WorkerGroup(pool, {"critic": (CriticWorker, {"settings": settings})}, default_timeout_s=300)
    try:
        critic = group.role("critic")
        metrics = critic.update_critic(critic_batch()).meta_info["metrics"]
        assert_same_critic_update(fsdp_critic_reference, metrics, critic.compute_values(critic_batch()).batch["values"])
        critic.save_checkpoint(str(tmp_path / "critic"))
        continued = critic.update_critic(critic_batch()).meta_info["metrics"]
        critic.load_checkpoint(str(tmp_path / "critic"))
        resumed = critic.update_critic(critic_batch()).meta_info["metrics"]
    finally:
        group.shutdown()
        pool.remove()
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-6), key


def test_weight_view_matches_the_streamed_weights(tiny_model_dir):
    """The disaggregated broadcast plans its buckets from `merged_weight_view(engine.model)`: HF names,
    global shapes and dtypes in the order `iter_full_weights` streams them."""
    from rlframe.workers.engine.lora import merged_weight_view

    actor = plain_actor(actor_config(tiny_model_dir, 1, 4), tiny_model_dir)
    view = merged_weight_view(actor.engine.model)
    streamed = list(actor.engine.iter_full_weights())
    assert list(view) == [name for name, _ in streamed]
    assert all(view[name].shape == tensor.shape and view[name].dtype == tensor.dtype for name, tensor in streamed)


def test_fsdp_checkpoint_resumes_on_megatron(tiny_model_dir, tmp_path):
    """The other direction: an FSDP checkpoint (weights and Adam moments under HF names) resumes on Megatron."""
    batch = tiny_batch(tiny_model_dir)
    second = opposite_advantages(batch)
    fsdp = plain_actor(actor_config(tiny_model_dir, 1, 8, strategy="fsdp"), tiny_model_dir)
    fsdp.update_actor(batch)
    fsdp.save_checkpoint(str(tmp_path / "checkpoint"))
    continued = fsdp.update_actor(second).meta_info["metrics"]
    fsdp.save_hf(str(tmp_path / "continued"))
    megatron = plain_actor(actor_config(tiny_model_dir, 1, 4), tiny_model_dir)
    assert megatron.load_checkpoint(str(tmp_path / "checkpoint"))["optimizer_steps"] == 1
    resumed = megatron.update_actor(second).meta_info["metrics"]
    megatron.save_hf(str(tmp_path / "resumed"))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-4), key
    from safetensors.torch import load_file

    # the second step used the restored Adam moments (without them the step would differ by ~lr)
    assert_same_weights(load_file(str(tmp_path / "continued" / "model.safetensors")),
                        load_file(str(tmp_path / "resumed" / "model.safetensors")), 1e-4, 1e-5)


def test_megatron_groups_follow_a_new_default_process_group():
    """A test process whose default group was destroyed and made again (vLLM's shutdown destroys it) gets
    megatron groups of the new world, not the dead one's ('Group ... is not registered', CI of stop 48)."""
    import torch.distributed as dist

    from rlframe.workers.engine.megatron.parallel import import_megatron, init_model_parallel

    parallel_state = import_megatron()[0]
    init_model_parallel(1)
    dist.destroy_process_group()
    init_model_parallel(1)
    assert parallel_state.get_pipeline_model_parallel_rank() == 0
    assert dist.get_process_group_ranks(parallel_state.get_data_parallel_group()) == [0]
