"""Mixture-of-experts models (Qwen2-MoE, Mixtral) on the Megatron-core engine, on CPU over gloo.

Tiny random-init models (2 layers, 4 experts, top-2; Qwen2-MoE with its sigmoid-gated shared expert):
- conversion HF <-> Megatron (router, per-expert gate/up fused into fc1 and down as fc2, the shared expert
  and its gate) exact both ways at TP 1 / 2 and EP 1 / 2;
- megatron-core's MoELayer (local spec, SequentialMLP experts, all-gather token dispatcher, no load-balancing
  loss) against transformers' forward: logits within 1e-5 (Qwen2-MoE with norm_topk_prob False and True,
  Mixtral);
- the engine against the FSDP engine on the Qwen2-MoE model: log-probs and one update (losses, grad norm,
  updated weights in HF names) at EP=1 on one rank and at EP=2 on 2 ranks (slow: the experts split over the
  two data-parallel ranks, tokens all-gathered by the dispatcher), with test_megatron.py's tolerances.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron import actor_config, assert_same_as_fsdp, plain_actor, start_actor, update  # noqa: E402


def moe_config(kind: str, norm_topk_prob: bool = False, vocab: int = 101):
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                              num_experts=4, norm_topk_prob=norm_topk_prob, architectures=["Qwen2MoeForCausalLM"])
    return MixtralConfig(**common, intermediate_size=16, num_local_experts=4, architectures=["MixtralForCausalLM"])


def saved_state(config, folder):
    """The checkpoint as it is on disk (transformers writes the experts one by one)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model, load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_moe_round_trip_is_exact(kind, tmp_path):
    from rlframe.workers.engine.megatron.convert import GPTArch, hf_state_from_shards, hf_to_megatron

    config = moe_config(kind)
    _, hf = saved_state(config, tmp_path)
    arch = GPTArch.from_hf(config)
    assert arch.num_experts == 4 and arch.shared_expert_ffn_hidden_size == (24 if kind == "qwen2_moe" else 0)
    for tp in (1, 2):
        for ep in (1, 2):
            per_ep = [[hf_to_megatron(hf, arch, r, tp, ep_rank=e, ep=ep) for r in range(tp)] for e in range(ep)]
            back = hf_state_from_shards(per_ep[0], arch, per_ep[1:])
            assert back.keys() == hf.keys(), (tp, ep, sorted(set(hf) ^ set(back))[:4])
            for name in hf:
                assert torch.equal(back[name], hf[name]), (tp, ep, name)
    local = hf_to_megatron(hf, arch, 0, 1, ep_rank=1, ep=2)  # EP rank 1 holds experts 2 and 3 as its 0 and 1
    up = "model.layers.0." + ("mlp.experts.2.up_proj.weight" if kind == "qwen2_moe" else "block_sparse_moe.experts.2.w3.weight")
    torch.testing.assert_close(local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"][16:], hf[up])


@pytest.mark.parametrize("kind,norm_topk_prob", [("qwen2_moe", False), ("qwen2_moe", True), ("mixtral", False)])
def test_moe_logits_equal_transformers(kind, norm_topk_prob, tmp_path):
    from rlframe.device import detect_profile
    from rlframe.workers.engine.megatron.convert import GPTArch, hf_to_megatron
    from rlframe.workers.engine.megatron.model import MegatronCausalLM, build_gpt, load_local_state
    from rlframe.workers.engine.megatron.parallel import init_model_parallel

    config = moe_config(kind, norm_topk_prob)
    hf_model, state = saved_state(config, tmp_path)
    arch = GPTArch.from_hf(config)
    init_model_parallel(1)
    gpt = build_gpt(arch, 1, detect_profile("cpu", "float32"))
    params = dict(gpt.named_parameters())
    load_local_state(params, hf_to_megatron(state, arch, names=list(params)))
    model = MegatronCausalLM(gpt, config, arch).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(ids, positions, mask)
        reference = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(ours[mask.bool()], reference[mask.bool()], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory, tiny_model_dir):
    """A tiny Qwen2-MoE with the tiny Llama's tokenizer (the engines read its vocabulary size only)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_qwen2_moe")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    saved_state(moe_config("qwen2_moe", vocab=len(tokenizer)), folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_fsdp_reference(moe_model_dir, tmp_path_factory):
    from safetensors.torch import load_file
    from test_megatron import tiny_batch

    start = load_file(str(moe_model_dir / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    in_memory = AutoModelForCausalLM.from_pretrained(moe_model_dir).state_dict()
    assert all(torch.equal(tensor, start[name]) for name, tensor in unfused(in_memory).items())  # (the layout)
    out = tmp_path_factory.mktemp("moe_fsdp")
    result = update(plain_actor(actor_config(moe_model_dir, 1, 8, strategy="fsdp"), moe_model_dir),
                    tiny_batch(moe_model_dir), out)
    return result, start


def unfused(state: dict) -> dict:
    """transformers' in-memory fused experts (`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]:
    what the FSDP engine saves) -> the per-expert checkpoint names (what the Megatron engine streams)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e, down in enumerate(tensor):
                out[f"{base}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def assert_moe_update(reference, ours):
    (metrics, weights, log_probs, entropy), start = reference
    assert_same_as_fsdp((metrics, unfused(weights), log_probs, entropy), ours, weight_atol=2e-5, start=start)


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_moe_ep1_update_equals_fsdp(moe_model_dir, tmp_path, moe_fsdp_reference, recompute):
    """EP=1 on one rank, 2 micro-batches: FSDP's log-probs and update (router, experts, shared expert); also with
    model.gradient_checkpointing (the MoE layers recomputed in the backward)."""
    from test_megatron import tiny_batch

    cfg = actor_config(moe_model_dir, 1, 4)
    cfg.model.gradient_checkpointing = recompute
    actor = plain_actor(cfg, moe_model_dir)
    assert_moe_update(moe_fsdp_reference, update(actor, tiny_batch(moe_model_dir), tmp_path / "ep1"))


@pytest.mark.slow  # (~40 s on a quiet machine)
def test_moe_ep2_two_ranks_equals_fsdp_and_checkpoint_resumes(ray_session, moe_model_dir, tmp_path, moe_fsdp_reference):
    """EP=2 on 2 ranks (each holds 2 of the 4 experts; the ranks are data-parallel for everything else): FSDP's
    update; then save (experts and their Adam moments gathered over EP), update, load, update again: the same."""
    from safetensors.torch import load_file
    from test_megatron import assert_same_weights, opposite_advantages, tiny_batch

    cfg = actor_config(moe_model_dir, 2, 2)
    cfg.megatron.expert_model_parallel_size = 2
    batch = tiny_batch(moe_model_dir)
    pool, group, actor = start_actor(cfg, moe_model_dir, "megatron_ep2")
    try:
        ours = update(actor, batch, tmp_path / "ep2")
        actor.save_checkpoint(str(tmp_path / "checkpoint"))
        continued = actor.update_actor(opposite_advantages(batch)).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "continued"))
        actor.load_checkpoint(str(tmp_path / "checkpoint"))
        resumed = actor.update_actor(opposite_advantages(batch)).meta_info["metrics"]
        actor.save_hf(str(tmp_path / "resumed"))
    finally:
        group.shutdown()
        pool.remove()
    assert_moe_update(moe_fsdp_reference, ours)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(continued[key], rel=1e-6), key
    assert_same_weights(load_file(str(tmp_path / "continued" / "model.safetensors")),
                        load_file(str(tmp_path / "resumed" / "model.safetensors")))


def test_moe_validation(moe_model_dir, tiny_model_dir):
    from test_megatron import megatron_cfg, problems

    from rlframe.config import validate_config

    cfg = megatron_cfg(moe_model_dir, world_size=2, tp=1)
    cfg.megatron.expert_model_parallel_size = 2
    validate_config(cfg)  # 4 experts over 2 ranks
    cfg.megatron.expert_model_parallel_size = 3
    message = problems(cfg)
    assert "megatron.expert_model_parallel_size: 3: the experts are split over EP ranks taken from the data" in message
    assert "megatron.expert_model_parallel_size: 3 does not divide the model's 4 routed experts. Fix: a divisor" in message
    dense = megatron_cfg(tiny_model_dir, world_size=2, tp=1)
    dense.megatron.expert_model_parallel_size = 2
    assert "2 does not divide the model's 0 routed experts (a dense model). Fix: 1" in problems(dense)
    with_cp = megatron_cfg(moe_model_dir, world_size=4, tp=1, cp=2)
    with_cp.megatron.expert_model_parallel_size = 2
    assert "expert parallelism under context parallelism is not run here" in problems(with_cp)
    tp2 = megatron_cfg(moe_model_dir, world_size=2, tp=2)
    assert "megatron.sequence_parallel: false with an MoE model at TP=2" in problems(tp2)
    tp2.megatron.sequence_parallel = True
    tp2.rollout.engine = "vllm"
    validate_config(tp2)
    tp2.rollout.engine = "hf"
    assert "rollout.engine: hf (the HF engine) with an MoE model on the megatron engine" in problems(tp2)


@pytest.mark.slow  # (4 ranks on the 2 cores: ~1-2 min each)
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}], ids=["ep2_tp2_sp", "ep2_pp2"])
def test_moe_ep2_four_ranks_equals_fsdp(ray_session, moe_model_dir, tmp_path, moe_fsdp_reference, parallel):
    """EP=2 with TP=2 + sequence parallelism (the experts' fc1 / fc2 split over TP as the dense MLP; megatron-core
    refuses MoE x TP without SP in training) and with PP=2 (one MoE layer per stage)."""
    from test_megatron import update_on_ranks

    cfg = actor_config(moe_model_dir, 4, 2, **parallel)
    cfg.megatron.expert_model_parallel_size = 2
    cfg.megatron.sequence_parallel = "tp" in parallel
    ours = update_on_ranks(cfg, moe_model_dir, "megatron_ep2_four", tmp_path / "ep2_four")
    assert_moe_update(moe_fsdp_reference, ours)


def test_moe_critic_equals_fsdp(moe_model_dir):
    """PPO's critic on the MoE body (the value head on the Megatron MoE decoder), 2 micro-batches: the FSDP
    critic's update on the same Qwen2-MoE checkpoint."""
    from test_megatron import assert_same_critic_update, critic_batch, critic_settings_for

    from rlframe.workers.roles.critic import CriticWorker

    fsdp = CriticWorker(critic_settings_for(moe_model_dir, "fsdp", world_size=1, micro=4))
    reference = (fsdp.update_critic(critic_batch()).meta_info["metrics"], fsdp.compute_values(critic_batch()).batch["values"])
    critic = CriticWorker(critic_settings_for(moe_model_dir, "megatron", world_size=1, micro=2))
    metrics = critic.update_critic(critic_batch()).meta_info["metrics"]
    assert_same_critic_update(reference, metrics, critic.compute_values(critic_batch()).batch["values"])
