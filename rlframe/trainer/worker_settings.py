"""The typed settings each role is built with, derived once from the run's config.

Small pure functions: config in, a frozen dataclass of `rlframe/workers/settings.py` out. This is
the only place that knows which config key feeds which worker setting; the workers never see
the config itself, except an engine's own section (`cfg.deepspeed`, `cfg.megatron`: the engine
package's settings class), which reaches it as is. Every training engine's settings come from
`engine_settings(cfg, role, model_path)`.
"""

from __future__ import annotations

import dataclasses
import os

from rlframe.config import OptimConfig, RLConfig, off_policy_correction, policy_loss_options
from rlframe.config.teacher import routed_teachers
from rlframe.memory_plan import rollout_max_model_len
from rlframe.workers.engine.registry import engine_section
from rlframe.workers.settings import (ActorSettings, AgentProgramSettings, CriticSettings, DeviceRequest, EngineSettings, ForwardSettings,
                                     LoraSettings, MultiTurnSettings, OptimSettings, PolicyLossSettings, RefSettings,
                                     RewardModelSettings, RolloutSettings, SamplingSettings, UpdateLoop)


def device_request(cfg: RLConfig) -> DeviceRequest:
    return DeviceRequest(device=cfg.trainer.device, dtype=cfg.model.dtype,
                         attn_implementation=cfg.model.attn_implementation, rollout_engine=cfg.rollout.engine)


def optim_settings(optim: OptimConfig, cfg: RLConfig, head_lr: float | None = None) -> OptimSettings:
    return OptimSettings(lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                         warmup_steps=optim.warmup_steps, grad_clip=optim.grad_clip, head_lr=head_lr,
                         max_consecutive_skips=cfg.trainer.max_consecutive_skipped_updates)


def lora_settings(cfg: RLConfig) -> LoraSettings:
    """model.lora -> the adapters the actor trains (rank 0: none)."""
    lora = cfg.model.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout), target_modules=targets,
                        exclude_modules=tuple(lora.exclude_modules), load_in_4bit=lora.load_in_4bit,
                        kind=lora.kind, seed=cfg.trainer.seed)


def uses_reference_policy(cfg: RLConfig) -> bool:
    return cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward


def reference_is_actor(cfg: RLConfig) -> bool:
    """Under LoRA the reference policy is the actor with its adapters disabled: no ref role."""
    return uses_reference_policy(cfg) and cfg.model.lora.rank > 0


ENGINE_ROLES = ("actor", "ref", "critic", "reward")


def engine_offload(cfg: RLConfig, role: str) -> dict[str, bool]:
    """offload_params / offload_optimizer of the engine of `role` (one of ENGINE_ROLES).

    The trained policy (actor) and stage=rm's reward model (reward, trained with the actor's keys):
    actor.offload_*; under actor.strategy=deepspeed also OpenRLHF's deepspeed.offload / adam_offload,
    which apply to the critic too. The frozen reference: deepspeed.ref_reward_offload."""
    ds, actor = cfg.deepspeed, cfg.actor
    deepspeed = actor.strategy == "deepspeed"
    if role == "ref":
        return {"offload_params": deepspeed and ds.ref_reward_offload, "offload_optimizer": False}
    params, optimizer = deepspeed and ds.offload, deepspeed and ds.adam_offload
    if role in ("actor", "reward"):
        params, optimizer = params or actor.offload_params, optimizer or actor.offload_optimizer
    return {"offload_params": params, "offload_optimizer": optimizer}


def engine_optim(cfg: RLConfig, role: str) -> OptimSettings | None:
    """The optimizer of the engine of `role`; None for the frozen reference policy."""
    if role == "ref":
        return None
    if role == "critic":
        return optim_settings(cfg.critic.optim, cfg, head_lr=cfg.critic.head_lr)
    return optim_settings(cfg.actor.optim, cfg, head_lr=cfg.rm.head_lr if role == "reward" else None)


def engine_settings(cfg: RLConfig, role: str, model_path: str) -> EngineSettings:
    """The training engine of `role`, every key that reaches an engine in one place.

    actor: the trained policy (its LoRA adapters if any, the vision tower frozen if asked); ref: the frozen
    reference policy; critic: PPO's value model (critic.optim); reward: stage=rm's reward model in training
    (a value head, actor.optim with rm.head_lr). Each runs actor.strategy's engine with that engine's own
    config section (cfg.deepspeed, cfg.megatron), its offload flags and trainer.checkpoint_format."""
    if role not in ENGINE_ROLES:
        raise ValueError(f"role={role!r} is not one of {', '.join(ENGINE_ROLES)}")
    actor, policy = cfg.actor, role in ("actor", "ref")
    # (The value heads run the engine's default padding mode and no Ulysses sequence parallelism.)
    layout = {"use_remove_padding": str(actor.use_remove_padding),
              "sequence_parallel_size": actor.ulysses_sequence_parallel_size} if policy else {}
    return EngineSettings(
        model_path=model_path, strategy=actor.strategy, head="causal_lm" if policy else "value",
        device=device_request(cfg), gradient_checkpointing=cfg.model.gradient_checkpointing and role != "ref",
        trust_remote_code=cfg.model.trust_remote_code, **layout, **engine_offload(cfg, role),
        section=engine_section(cfg, actor.strategy), optim=engine_optim(cfg, role),
        lora=lora_settings(cfg) if role == "actor" else LoraSettings(), checkpoint_format=cfg.trainer.checkpoint_format,
        freeze_vision_tower=actor.freeze_vision_tower and role == "actor",
        top_k=student_top_k(cfg) if role == "actor" else 0)


def actor_update_loop(cfg: RLConfig) -> UpdateLoop:
    """Per rank: a mini-batch is ppo_mini_batch_size prompts x rollout.n samples over world_size ranks."""
    actor = cfg.actor
    return UpdateLoop(mini_batch_size=actor.ppo_mini_batch_size * cfg.rollout.n // actor.world_size,
                      micro_batch_size=actor.ppo_micro_batch_size_per_device,
                      max_tokens_per_micro_batch=actor.ppo_max_token_len_per_device, epochs=actor.ppo_epochs,
                      shuffle=actor.shuffle, loss_agg_mode=policy_loss_options(actor)["loss_agg_mode"])


def policy_loss_settings(cfg: RLConfig) -> PolicyLossSettings:
    """The policy loss with "auto" options resolved to the loss's published defaults."""
    actor, algo = cfg.actor, cfg.algorithm
    options = policy_loss_options(actor)
    return PolicyLossSettings(
        policy_loss=actor.policy_loss, clip_ratio_low=options["clip_ratio_low"],
        clip_ratio_high=options["clip_ratio_high"], clip_ratio_c=options["clip_ratio_c"],
        entropy_coeff=actor.entropy_coeff, use_kl_loss=algo.use_kl_loss,
        kl_loss_coef=algo.kl_loss_coef, kl_loss_type=algo.kl_loss_type,
        custom_loss_path=algo.custom_policy_loss.path, custom_loss_name=algo.custom_policy_loss.name,
        tis_cap=algo.tis_cap if off_policy_correction(cfg) == "tis" else None,
        **distillation_loss_settings(cfg))


def uses_teacher(cfg: RLConfig) -> bool:
    """On-policy distillation: teacher.path set (rlframe/config/teacher.py)."""
    return cfg.teacher.path is not None


def student_top_k(cfg: RLConfig) -> int:
    """The actor engine's top-k outputs (distillation metrics and top-k losses): the fsdp engine without
    sequence parallelism computes them; 0 otherwise (and without a teacher)."""
    if not uses_teacher(cfg) or cfg.actor.strategy != "fsdp" or cfg.actor.ulysses_sequence_parallel_size > 1:
        return 0
    return cfg.distillation.top_k


def distillation_loss_settings(cfg: RLConfig) -> dict:
    if not uses_teacher(cfg):
        return {}
    d = cfg.distillation
    return {"distill_mode": d.loss_mode, "distill_coef": d.coef, "distill_use_task_reward": d.use_task_reward,
            "distill_beta": d.beta}


def teacher_settings(cfg: RLConfig, teacher_path: str):
    """The teacher's frozen engine (teacher.backend: fsdp or vllm; top-k per position) at temperature 1, on the
    actor's devices."""
    from rlframe.workers.roles.teacher import TeacherSettings

    engine = EngineSettings(model_path=teacher_path, strategy="fsdp", head="causal_lm", device=device_request(cfg),
                            trust_remote_code=cfg.model.trust_remote_code,
                            use_remove_padding=str(cfg.actor.use_remove_padding), top_k=cfg.distillation.top_k)
    forward = ForwardSettings(micro_batch_size=cfg.teacher.micro_batch_size,
                              max_tokens_per_micro_batch=cfg.actor.log_prob_max_token_len_per_device, temperature=1.0)
    settings = TeacherSettings(engine=engine, forward=forward, offload=cfg.teacher.offload, backend=cfg.teacher.backend,
                           max_model_len=rollout_settings(cfg, teacher_path).max_model_len + 1,  # (+ the 1 token vLLM samples)
                           gpu_memory_utilization=cfg.teacher.gpu_memory_utilization,
                           cpu_kv_cache_gib=cfg.teacher.cpu_kv_cache_gib, url=cfg.teacher.url or "",
                           served_model=cfg.teacher.model, timeout_s=cfg.teacher.timeout_s,
                           max_concurrency=cfg.teacher.max_concurrency,
                           api_key=os.environ.get(cfg.teacher.api_key_env, "") if cfg.teacher.backend == "url" else "")
    return dataclasses.replace(settings, routes=tuple(
        (tuple(route.data_sources), routed_teacher_settings(cfg, settings, route))
        for route in routed_teachers(cfg).values()))


def routed_teacher_settings(cfg: RLConfig, default, route):
    """One `teachers:` entry: the default teacher's settings with the route's folder, backend and server."""
    from rlframe.models.provision import resolve_model_path

    return dataclasses.replace(
        default, engine=dataclasses.replace(default.engine, model_path=resolve_model_path(route.path)),
        backend=route.backend, url=route.url or "", served_model=route.model,
        api_key=os.environ.get(cfg.teacher.api_key_env, "") if route.backend == "url" else "")


def log_prob_settings(cfg: RLConfig) -> ForwardSettings:
    """Old and reference log-probs: at the sampling temperature, as the rollout drew the tokens."""
    return ForwardSettings(micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_device,
                           max_tokens_per_micro_batch=cfg.actor.log_prob_max_token_len_per_device,
                           temperature=cfg.rollout.temperature)


def sampling_settings(cfg: RLConfig) -> tuple[SamplingSettings, SamplingSettings]:
    """(training, validation) sampling; validation uses neither top-p nor top-k."""
    rollout, max_new = cfg.rollout, cfg.data.max_response_length
    train = SamplingSettings(max_new_tokens=max_new, temperature=rollout.temperature, top_p=rollout.top_p,
                             top_k=rollout.top_k)
    return train, SamplingSettings(max_new_tokens=max_new, temperature=rollout.val_temperature)


def rollout_settings(cfg: RLConfig, model_path: str) -> RolloutSettings:
    rollout = cfg.rollout
    train, validation = sampling_settings(cfg)
    return RolloutSettings(
        model_path=model_path, device=device_request(cfg), trust_remote_code=cfg.model.trust_remote_code,
        max_model_len=rollout_max_model_len(cfg), train=train, validation=validation,
        seed=cfg.trainer.seed, gpu_memory_utilization=rollout.gpu_memory_utilization,
        cpu_kv_cache_gib=rollout.cpu_kv_cache_gib, enable_prefix_caching=rollout.enable_prefix_caching,
        enable_chunked_prefill=rollout.enable_chunked_prefill, max_num_batched_tokens=rollout.max_num_batched_tokens,
        enable_sleep_mode=rollout.enable_sleep_mode, enforce_eager=rollout.enforce_eager,
        limit_mm_per_prompt={"image": rollout.limit_images_per_prompt, "video": rollout.limit_videos_per_prompt},
        tensor_parallel_size=rollout.tensor_parallel_size,
        lora=lora_settings(cfg) if cfg.model.lora.rank > 0 and cfg.model.lora.weight_sync == "adapter" else None,
        multi_turn=multi_turn_settings(cfg), agent_program=agent_program_settings(cfg))


def agent_program_settings(cfg: RLConfig) -> AgentProgramSettings | None:
    """rollout.agent_program -> the episode runner's settings; its call record goes to <trainer.run_dir>/gateway."""
    ap = cfg.rollout.agent_program
    if not ap.enabled:
        return None
    import os

    from rlframe.workers.rollout.tools import resolve_tool_path

    run_dir = cfg.trainer.run_dir
    return AgentProgramSettings(path=str(resolve_tool_path(ap.path)) if ap.path else "", name=ap.name, command=ap.command,
                                rows=ap.rows, max_concurrent_episodes=ap.max_concurrent_episodes,
                                episode_timeout_s=ap.episode_timeout_s, max_tokens_per_call=ap.max_tokens_per_call,
                                tool_format=ap.tool_format, host=ap.host, sampling_from_request=ap.sampling_from_request,
                                record_dir=os.path.join(os.path.abspath(run_dir), "gateway") if run_dir else None,
                                allow_remote=ap.allow_remote, max_body_bytes=ap.max_body_bytes,
                                read_timeout_s=ap.read_timeout_s, max_connections=ap.max_connections,
                                max_calls_per_episode=ap.max_calls_per_episode, max_episode_tokens=ap.max_episode_tokens,
                                inherit_env=ap.inherit_env)


def multi_turn_settings(cfg: RLConfig) -> MultiTurnSettings | None:
    from rlframe.workers.rollout.mcp_tools import mcp_server_settings

    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    return MultiTurnSettings(tools=tuple((t.path, t.name) for t in mt.tools), max_turns=mt.max_turns,
                             max_tokens_per_turn=mt.max_tokens_per_turn,
                             max_tool_response_tokens=mt.max_tool_response_tokens, tool_timeout_s=mt.tool_timeout_s,
                             format=mt.format, tool_prompt=mt.tool_prompt,
                             environment=(mt.environment.path, mt.environment.name) if mt.environment.path else None,
                             mcp_servers=tuple(mcp_server_settings(server) for server in mt.mcp_servers))


def actor_settings(cfg: RLConfig, model_path: str, *, with_rollout: bool = True) -> ActorSettings:
    """with_rollout=False: disaggregated placement, the engines live in the rollout pool."""
    return ActorSettings(engine=engine_settings(cfg, "actor", model_path), loop=actor_update_loop(cfg),
                         loss=policy_loss_settings(cfg), log_prob=log_prob_settings(cfg),
                         rollout=rollout_settings(cfg, model_path) if with_rollout else None, seed=cfg.trainer.seed,
                         weight_sync_timeout_s=cfg.trainer.timeouts.weight_sync)


def ref_settings(cfg: RLConfig, model_path: str) -> RefSettings:
    return RefSettings(engine=engine_settings(cfg, "ref", model_path), log_prob=log_prob_settings(cfg))


def critic_settings(cfg: RLConfig, model_path: str) -> CriticSettings:
    """model_path: critic.model_path when set, else the actor's model (resolved by the driver)."""
    critic, world = cfg.critic, cfg.actor.world_size
    engine = engine_settings(cfg, "critic", model_path)
    mini = critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    loop = UpdateLoop(mini_batch_size=mini * cfg.rollout.n // world, micro_batch_size=critic.ppo_micro_batch_size_per_device,
                      epochs=critic.ppo_epochs, shuffle=cfg.actor.shuffle, loss_agg_mode=critic.loss_agg_mode)
    return CriticSettings(engine=engine, loop=loop, cliprange_value=critic.cliprange_value, seed=cfg.trainer.seed,
                          forward=ForwardSettings(micro_batch_size=critic.forward_micro_batch_size_per_device))


def reward_model_settings(cfg: RLConfig, model_path: str) -> RewardModelSettings:
    rm = cfg.reward_model
    return RewardModelSettings(model_path=model_path, device=device_request(cfg), max_length=rm.max_length,
                               micro_batch_size=rm.micro_batch_size, dtype=rm.dtype, trust_remote_code=rm.trust_remote_code)


def judge_engine_settings(cfg: RLConfig) -> tuple[RolloutSettings, object]:
    """The local LLM judge's engine (reward.judge.model; rlframe/reward/judge.py): greedy, reward.judge.max_new_tokens,
    reward.judge.max_model_len; and its tokenizer."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from rlframe.models.provision import resolve_model_path
    from rlframe.reward.judge import judge_engine

    judge = cfg.reward.judge
    path = resolve_model_path(judge.model)
    settings = rollout_settings(cfg, path)
    settings = replace(settings, device=replace(settings.device, rollout_engine=judge_engine(judge.engine)), lora=None,
                       multi_turn=None, agent_program=None, max_model_len=judge.max_model_len,
                       validation=SamplingSettings(max_new_tokens=judge.max_new_tokens, temperature=0.0))
    return settings, AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
