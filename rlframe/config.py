"""Typed configuration: dataclasses that Hydra/OmegaConf fill from a recipe and the command line.

Every field a recipe can set is declared here, with its default and meaning. `validate_config`
checks the whole configuration before any worker starts and reports every problem at once,
each naming the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # embedded model name, HF folder, or hub id
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    attn_implementation: str = "auto"  # auto | sdpa | eager | flash_attention_2
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class ArithmeticDataConfig:
    n_train: int = 2000
    n_val: int = 64
    seed: int = 0
    max_operand: int = 20


@dataclass
class DataConfig:
    source: str = "arithmetic"  # arithmetic (generated) | files
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)
    prompt_key: str = "prompt"
    answer_key: Optional[str] = None
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 8  # prompts per step
    val_max_samples: int = 64
    overlong: str = "filter"  # filter | error | truncate_left
    bad_rows: str = "error"  # error | skip
    shuffle: bool = True
    seed: int = 0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 / low_var_kl | abs | mse


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    grad_clip: float = 1.0


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    world_size: int = 1  # data-parallel ranks of the actor (and colocated rollout / ref)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimiser step (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int = 4  # sequences per forward/backward
    ppo_epochs: int = 1
    shuffle: bool = True
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    log_prob_micro_batch_size_per_device: int = 16
    # With one epoch and one mini-batch per step the update is exactly on-policy: the old log-probs
    # equal the first forward's, so the separate compute_log_prob pass is skipped (and the
    # engine/trainer log-prob agreement is measured inside update_actor instead).
    skip_old_log_prob_when_on_policy: bool = True
    offload_params: bool = False  # GPU only: keep params on CPU between phases
    offload_optimizer: bool = False  # GPU only: keep optimizer state on CPU between phases


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (vllm when installed, else hf) | vllm | hf
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    val_temperature: float = 0.0  # greedy validation
    gpu_memory_utilization: float = 0.4
    cpu_kv_cache_gib: int = 1
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = True  # GPU only: free engine memory while the trainer trains
    enforce_eager: bool = True
    check_logprob_drift: bool = True


@dataclass
class RewardFunctionConfig:
    path: str = "reward_fns/math.py"
    name: str = "compute_score"
    weight: float = 1.0
    data_sources: Optional[list[str]] = None


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    num_workers: int = 2
    timeout_s: float = 10.0
    batch_timeout_s: float = 300.0
    fallback_score: float = 0.0
    fail_fast: bool = False


@dataclass
class TimeoutConfig:
    rollout: float = 1800.0
    log_prob: float = 1800.0
    update: float = 3600.0
    weight_sync: float = 600.0
    init: float = 900.0


@dataclass
class TrainerConfig:
    total_steps: int = 20
    run_dir: Optional[str] = None  # default: runs/<experiment_name>-<timestamp>
    project_name: str = "rlframe"
    experiment_name: str = "grpo_math"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + wandb, tensorboard
    val_before_train: bool = True
    val_every: int = 0  # 0: only before and after training
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    num_cpus: Optional[int] = None  # CPUs given to a local Ray cluster (default: all cores)
    cpus_per_worker: Optional[float] = None  # default: num_cpus / actor.world_size
    ray_address: Optional[str] = None
    export_hf: bool = True
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """An inconsistent configuration; the message lists every problem with its key and fix."""


def validate_config(cfg: RLConfig) -> None:
    """Check the configuration before any worker starts; raise ConfigError listing all problems."""
    from rlframe.models.provision import is_resolvable

    problems: list[str] = []

    def need(condition: bool, key: str, message: str) -> None:
        if not condition:
            problems.append(f"{key}: {message}")

    actor, data, rollout = cfg.actor, cfg.data, cfg.rollout
    need(is_resolvable(cfg.model.path), "model.path",
         f"'{cfg.model.path}' is neither a folder on disk, an embedded model, nor an HF hub id. "
         "Fix: model.path=/path/to/hf_model_dir (or smollm2-135m-instruct).")
    need(cfg.model.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype",
         f"'{cfg.model.dtype}' is not one of auto, float32, bfloat16, float16")
    need(rollout.engine in ("auto", "vllm", "hf"), "rollout.engine",
         f"'{rollout.engine}' is not one of auto, vllm, hf")
    need(rollout.n >= 1, "rollout.n", "must be >= 1")
    need(cfg.algorithm.adv_estimator not in ("grpo", "drgrpo", "rloo") or rollout.n >= 2, "rollout.n",
         f"{cfg.algorithm.adv_estimator} compares samples of one prompt: set rollout.n >= 2")
    need(actor.world_size >= 1, "actor.world_size", "must be >= 1")
    need(data.train_batch_size >= 1, "data.train_batch_size", "must be >= 1")
    need(actor.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", "must be >= 1")
    if data.train_batch_size >= 1 and actor.ppo_mini_batch_size >= 1:
        need(data.train_batch_size % actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
             f"data.train_batch_size={data.train_batch_size} is not a multiple of "
             f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}. Fix: make the mini-batch divide the batch.")
        mini_seqs = actor.ppo_mini_batch_size * rollout.n
        if actor.world_size >= 1:
            need(mini_seqs % actor.world_size == 0, "actor.world_size",
                 f"a mini-batch of {mini_seqs} sequences (ppo_mini_batch_size x rollout.n) does not split "
                 f"over actor.world_size={actor.world_size} ranks. Fix: change one of them.")
            per_rank = mini_seqs // actor.world_size
            need(actor.ppo_micro_batch_size_per_device >= 1 and per_rank % max(actor.ppo_micro_batch_size_per_device, 1) == 0,
                 "actor.ppo_micro_batch_size_per_device",
                 f"each rank gets {per_rank} sequences per mini-batch, not a multiple of "
                 f"ppo_micro_batch_size_per_device={actor.ppo_micro_batch_size_per_device}. Fix: pick a divisor of {per_rank}.")
    need(data.max_prompt_length > 0 and data.max_response_length > 0, "data.max_response_length",
         "prompt and response lengths must be positive")
    need(data.source in ("arithmetic", "files"), "data.source", f"'{data.source}' is not arithmetic or files")
    if data.source == "files":
        need(bool(data.train_files), "data.train_files", "data.source=files needs at least one train file")
        for f in list(data.train_files) + list(data.val_files):
            need(Path(f).exists(), "data.train_files/val_files", f"'{f}' does not exist")
    need(actor.loss_agg_mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
         "actor.loss_agg_mode", f"'{actor.loss_agg_mode}' is not a known aggregation mode")
    need(0 < actor.clip_ratio_low < 1 and actor.clip_ratio_high > 0, "actor.clip_ratio_low/high",
         "clip ratios must be in (0, 1) for low and > 0 for high")
    need(cfg.trainer.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    need(cfg.trainer.device in ("auto", "cpu", "cuda"), "trainer.device", "must be auto, cpu or cuda")
    for i, fn in enumerate(cfg.reward.functions):
        need(Path(fn.path).exists(), f"reward.functions[{i}].path",
             f"'{fn.path}' does not exist. Fix: point it at your reward script (e.g. reward_fns/math.py).")
    unknown_loggers = set(cfg.trainer.loggers) - {"console", "jsonl", "wandb", "tensorboard"}
    need(not unknown_loggers, "trainer.loggers", f"unknown loggers {sorted(unknown_loggers)}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def to_container(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
