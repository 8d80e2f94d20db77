"""Typed configuration: dataclasses that Hydra/OmegaConf fill from a recipe and the command line.

Every field a recipe can set is declared in this package, with its default and meaning, one module per
topic; each module's named checks sit beside the fields they guard:

    model.py      model:        the policy's weights, dtype, LoRA
    data.py       data:         prompts, lengths, the batch
    algorithm.py  algorithm:    estimator (and what it needs), KL, DAPO, plugins, off-policy correction
    actor.py      actor:, critic:   the policy's and the value model's training, policy-loss options
    rollout.py    rollout:      engines, multi-turn tool use, partial rollouts
    reward.py     reward:, reward_model:
    trainer.py    trainer:      steps, checkpoints, placement over nodes, asynchronous rollout, loggers
    teacher.py    teacher:, distillation:   on-policy distillation from a frozen teacher
    stages.py     stage and sft: / dpo: / rm: / pairs: (their dataclasses: rlframe/stages/config.py)
    checks.py     how a check is written and run; ConfigError

The engines' sections (deepspeed:, megatron:) are their packages' settings classes, with their checks
(workers/engine/<name>/settings.py, found through workers/engine/registry.py).

`validate_config` checks the whole configuration before any worker starts and reports every problem
at once, each naming the key and the fix; `validate_before_workers` repeats the checks that read the
model folder once it is provisioned and runs the memory plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlframe.config import actor, algorithm, data, model, reward, rollout, stages, teacher, trainer
from rlframe.config.actor import (
    POLICY_LOSS_KEYS,
    ActorConfig,
    CriticConfig,
    OptimConfig,
    apply_algorithm_defaults,
    policy_loss_options,
    skips_old_log_prob_pass,
)
from rlframe.config.algorithm import (
    AlgorithmConfig,
    DynamicSamplingConfig,
    KLControlConfig,
    OverlongBufferConfig,
    PluginConfig,
    off_policy_correction,
    run_estimator_needs,
)
from rlframe.config.checks import (
    RUN_USER_CODE,
    ConfigError,
    declared_bounds_hold,
    local_model_dir,
    problems_of,
    raise_problems,
)
from rlframe.config.data import ArithmeticDataConfig, DataConfig, ShapesDataConfig
from rlframe.config.model import LoraConfig, ModelConfig
from rlframe.config.reward import RewardConfig, RewardFunctionConfig, RewardModelConfig
from rlframe.config.rollout import (
    EnvironmentConfig,
    MultiTurnConfig,
    PartialRolloutConfig,
    RolloutConfig,
    ToolConfig,
    partial_span_steps,
    partial_tokens_per_round,
)
from rlframe.config.teacher import DistillationConfig, TeacherConfig
from rlframe.config.trainer import (
    PLACEMENTS,
    RuntimeEnvConfig,
    TimeoutConfig,
    TrainerConfig,
    devices_needed,
    rollout_world_size,
)
from rlframe.stages.config import DPOConfig, PairGenerationConfig, PretrainConfig, RewardTrainingConfig, RFTConfig, SFTConfig
from rlframe.workers.engine.deepspeed.settings import DeepSpeedSettings
from rlframe.workers.engine.megatron.settings import MegatronSettings
from rlframe.workers.engine.registry import check_engine_model, check_engines


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # On-policy distillation (rlframe/config/teacher.py): a frozen teacher scoring the student's samples.
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # the loss, with teacher.path
    # several teachers routed by the rows' data_source: {name: {path, backend, url, model, data_sources: [...]}};
    # the rows no route lists go to teacher: (docs/distillation.md)
    # (each entry is read as a RoutedTeacherConfig by rlframe.config.teacher.routed_teachers: Hydra cannot assign a
    # command-line dict to a typed dict entry)
    teachers: dict[str, Any] = field(default_factory=dict)
    # The engines' own sections: each engine package's settings class, handed to its engine as is.
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)  # actor.strategy=deepspeed
    megatron: MegatronSettings = field(default_factory=MegatronSettings)  # actor.strategy=megatron
    # The stage a recipe runs (rlframe/stages/): rl (this loop) | sft | dpo | rm; their sections below.
    stage: str = "rl"
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    pairs: PairGenerationConfig = field(default_factory=PairGenerationConfig)
    pt: PretrainConfig = field(default_factory=PretrainConfig)  # stage=pt
    rft: RFTConfig = field(default_factory=RFTConfig)  # stage=rft


# Every rule on the configuration alone: first each field's declared bound or choices (rlframe/bounds.py),
# then section by section: rule(cfg, need). The engines' own checks run through their registry
# (check_engines: each entry's CHECKS, whatever the strategy).
CHECKS = ((declared_bounds_hold,) + model.CHECKS + data.CHECKS + algorithm.CHECKS + actor.CHECKS + actor.CRITIC_CHECKS
          + rollout.CHECKS + reward.CHECKS + trainer.CHECKS + teacher.CHECKS + (check_engines,) + stages.CHECKS)
# The rules that read the model's folder: rule(cfg, need, model_dir), model_dir None when it is not on
# this machine yet (a hub id, an embedded model not converted yet); run again once it is provisioned.
FOLDER_CHECKS = model.FOLDER_CHECKS + (check_engine_model,) + rollout.FOLDER_CHECKS + teacher.FOLDER_CHECKS


def validate_config(cfg: RLConfig, *, run_user_code: bool = True) -> None:
    """Check the configuration before any worker starts; raise ConfigError listing all problems.

    Resolves the policy loss's "auto" options first (apply_algorithm_defaults) and splits a reward
    function's `file.py:function` path (in place). `run_user_code=False` (the board's Preview): no MCP server is
    started and no tool or environment file imported; they are checked as written (checks.RUN_USER_CODE).
    """
    apply_algorithm_defaults(cfg)
    token = RUN_USER_CODE.set(run_user_code)
    try:
        raise_problems(problems_of(cfg, CHECKS) + problems_of(cfg, FOLDER_CHECKS, local_model_dir(cfg.model.path)))
    finally:
        RUN_USER_CODE.reset(token)


def validate_model_folder(cfg: RLConfig, model_dir: str) -> None:
    """The checks that read the model folder (LoRA target modules, the engine's model checks, the context
    length, partial rollouts of a vision-language policy) on the provisioned `model_dir`; ConfigError."""
    raise_problems(problems_of(cfg, FOLDER_CHECKS, local_model_dir(model_dir)))


def validate_before_workers(cfg: RLConfig, model_path: str) -> None:
    """After model.path is provisioned (`model_path`, a folder), before any worker starts: the model-folder
    checks, then the memory plan (rlframe/memory_plan.py: printed, and refused per trainer.memory_check)."""
    validate_model_folder(cfg, model_path)
    if cfg.trainer.memory_check != "off":
        from rlframe.memory_plan import check_memory

        check_memory(cfg, model_path)


def to_container(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


__all__ = [
    "PLACEMENTS", "POLICY_LOSS_KEYS", "ActorConfig", "AlgorithmConfig", "ArithmeticDataConfig", "ConfigError",
    "CriticConfig", "DPOConfig", "DistillationConfig", "DataConfig", "DeepSpeedSettings", "DynamicSamplingConfig", "EnvironmentConfig",
    "KLControlConfig", "LoraConfig", "MegatronSettings", "ModelConfig", "MultiTurnConfig", "OptimConfig",
    "OverlongBufferConfig", "PairGenerationConfig", "PartialRolloutConfig", "PluginConfig", "RLConfig",
    "RewardConfig", "RewardFunctionConfig", "RewardModelConfig", "RewardTrainingConfig", "RolloutConfig",
    "RuntimeEnvConfig", "SFTConfig", "ShapesDataConfig", "TeacherConfig", "TimeoutConfig", "ToolConfig", "TrainerConfig",
    "apply_algorithm_defaults", "devices_needed", "off_policy_correction", "partial_span_steps",
    "partial_tokens_per_round", "policy_loss_options", "rollout_world_size", "run_estimator_needs",
    "skips_old_log_prob_pass", "to_container", "validate_before_workers", "validate_config", "validate_model_folder",
]
