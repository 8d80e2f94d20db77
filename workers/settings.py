"""Typed settings that roles and engines are built with.

The driver derives them once from the run's config (`rlframe/trainer/worker_settings.py`, small
pure functions) and hands them to the roles; workers never pick keys out of a config dict. Each
dataclass holds exactly what one piece of worker code reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlframe.device import DeviceProfile, detect_profile


@dataclass(frozen=True)
class DeviceRequest:
    """What the config asks of the hardware; resolved into a DeviceProfile inside each worker process."""

    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    attn_implementation: str = "auto"
    rollout_engine: str = "auto"

    def profile(self) -> DeviceProfile:
        return detect_profile(self.device, self.dtype, self.attn_implementation, self.rollout_engine)


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    head_lr: float | None = None  # a value head's own LR (critic); None: lr
    max_consecutive_skips: int = 3  # non-finite updates in a row before the run stops


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters over a frozen base model (`workers/engine/lora.py`); rank 0 = full fine-tuning.

    W x becomes W x + (alpha / rank) * B A dropout(x), A: rank x in, B: out x rank (B starts at 0,
    so the adapted model starts equal to the base). `load_in_4bit`: QLoRA, the frozen base in NF4
    (bitsandbytes, CUDA only) with the adapters in full precision.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"  # "all-linear", a regex, or module-name suffixes
    exclude_modules: tuple[str, ...] = ()
    load_in_4bit: bool = False
    kind: str = "lora"  # lora | dora | rslora (workers/engine/lora.py ADAPTER_KINDS)
    seed: int = 0  # initialises A identically on every rank (each rank keeps its shard of the same A)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class EngineSettings:
    """How a training engine builds and shards its model (`workers/engine/`)."""

    model_path: str
    strategy: str = "fsdp"  # the engine implementation (workers/engine/registry.py: ENGINES)
    head: str = "causal_lm"  # causal_lm (log-probs) | value (a scalar per position, PPO's critic)
    device: DeviceRequest = field(default_factory=DeviceRequest)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    use_remove_padding: str = "auto"  # auto | true | false (packed, padding-free forward)
    sequence_parallel_size: int = 1  # Ulysses
    offload_params: bool = False  # fsdp: GPU only; deepspeed: ZeRO-3 parameters on CPU
    offload_optimizer: bool = False  # fsdp: GPU only; deepspeed: ZeRO-Offload (state + step on CPU, CPU Adam)
    optim: OptimSettings | None = None  # None: a frozen model (the reference policy)
    # The engine's own config section, as the config holds it (workers/engine/registry.py: ENGINES[strategy].settings,
    # e.g. DeepSpeedSettings, MegatronSettings); None for an engine without one (fsdp).
    section: Any = None
    lora: LoraSettings = field(default_factory=LoraSettings)  # rank 0: off (full fine-tuning)
    checkpoint_format: str = "full"  # full (gathered, HF safetensors) | sharded (torch.distributed.checkpoint)
    freeze_vision_tower: bool = False  # vision-language models: the vision tower gets no gradient
    top_k: int = 0  # > 0: forwards also give the model's top-k and its log-probs at another's top-k (distillation)


@dataclass(frozen=True)
class UpdateLoop:
    """The epochs x mini-batches x micro-batches of one update, on this rank."""

    mini_batch_size: int = 8  # sequences per optimiser step, on this rank
    micro_batch_size: int = 4  # sequences per forward/backward
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by token budget instead of a fixed count
    epochs: int = 1
    shuffle: bool = True
    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's objective: policy loss (+ KL loss, - entropy bonus)."""

    policy_loss: str = "vanilla"
    clip_ratio_low: float | None = 0.2  # None: no lower bound (CISPO)
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # dual clip; None: off
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    custom_loss_path: str | None = None  # algorithm.custom_policy_loss: a file registered as `policy_loss`
    custom_loss_name: str | None = None
    # Off-policy correction (rlframe/algos/off_policy.py): the cap C of the truncated importance weights
    # min(pi_old / pi_rollout, C) on each token's policy-gradient term; None: no correction.
    tis_cap: float | None = None
    # On-policy distillation (rlframe/algos/distillation.py): the loss mode (None: no teacher), its weight, whether
    # the task reward's policy gradient is kept, and the JSD's beta.
    distill_mode: str | None = None
    distill_coef: float = 1.0
    distill_use_task_reward: bool = False
    distill_beta: float = 0.5


@dataclass(frozen=True)
class ForwardSettings:
    """Forward passes without gradients (old / reference log-probs, values)."""

    micro_batch_size: int = 16
    max_tokens_per_micro_batch: int = 0
    temperature: float = 1.0


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class McpServerSettings:
    """One MCP server whose tools the agent loop calls (workers/rollout/mcp_tools.py): a command started over
    stdio, or the url of a streamable-HTTP server. Paths in `command`/`args` are resolved by the driver."""

    name: str = ""  # what errors and the tools' `path` call it ("" = derived from the command or url)
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables for the server process
    url: str = ""
    tools: tuple[str, ...] = ()  # the server's tools the model gets (() = all it lists)
    prefix: str = ""  # the model sees each tool as prefix + name
    startup_timeout_s: float = 30.0
    inherit_env: bool = False  # the server gets this process's whole environment (else the MCP SDK's default)


@dataclass(frozen=True)
class MultiTurnSettings:
    """Multi-turn rollouts with tools (workers/rollout/agent_loop.py); `tools`: (path, function name) pairs."""

    tools: tuple[tuple[str, str], ...] = ()
    max_turns: int = 3
    max_tokens_per_turn: int = 0  # 0: a turn may use the whole remaining budget
    max_tool_response_tokens: int = 64
    tool_timeout_s: float = 5.0
    format: str = "hermes"
    tool_prompt: bool = True
    environment: tuple[str, str] | None = None  # (path, class name): feedback after each model turn
    mcp_servers: tuple[McpServerSettings, ...] = ()  # MCP servers whose tools join `tools`


@dataclass(frozen=True)
class AgentProgramSettings:
    """A user's agent run once per sample against the gateway (workers/rollout/agent_program.py): a function
    (`path`, `name`) or a shell `command`. `record_dir`: where each rollout's call record goes (None: nowhere)."""

    path: str = ""
    name: str = ""
    command: str = ""
    rows: str = "merged"
    max_concurrent_episodes: int = 8
    episode_timeout_s: float = 120.0
    max_tokens_per_call: int = 0  # 0: the episode's remaining budget
    tool_format: str = "hermes"
    host: str = "127.0.0.1"
    allow_remote: bool = False
    sampling_from_request: bool = False
    record_dir: str | None = None
    max_body_bytes: int = 4 << 20  # the gateway's limits (workers/rollout/gateway.py, GatewayLimits)
    read_timeout_s: float = 10.0
    max_connections: int = 64
    max_calls_per_episode: int = 128
    max_episode_tokens: int = 0
    inherit_env: bool = False  # the agent gets this process's whole environment (else an allow-list + OPENAI_*)


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout engine (`workers/rollout/`) and how it samples for training, validation, baselines."""

    model_path: str
    device: DeviceRequest = field(default_factory=DeviceRequest)
    trust_remote_code: bool = False
    max_model_len: int = 512
    train: SamplingSettings = field(default_factory=lambda: SamplingSettings(max_new_tokens=64))
    validation: SamplingSettings = field(default_factory=lambda: SamplingSettings(max_new_tokens=64, temperature=0.0))
    seed: int = 0
    gpu_memory_utilization: float = 0.4
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = True
    enforce_eager: bool = True
    limit_mm_per_prompt: dict = field(default_factory=lambda: {"image": 4, "video": 1})  # vLLM, vision-language models
    tensor_parallel_size: int = 1  # ranks per vLLM engine (workers/rollout/tensor_parallel.py)
    # Adapter-only weight sync (model.lora.weight_sync=adapter): the engine applies these adapters
    # itself and receives only their tensors after each update. None: it receives full weights.
    lora: LoraSettings | None = None
    multi_turn: MultiTurnSettings | None = None  # None: one completion per prompt
    agent_program: AgentProgramSettings | None = None  # a user's agent through the gateway (None: off)

    def greedy(self) -> SamplingSettings:
        """One greedy sample (ReMax's baseline)."""
        return SamplingSettings(max_new_tokens=self.train.max_new_tokens, temperature=0.0)


@dataclass(frozen=True)
class ActorSettings:
    """Everything the actor role (with or without its rollout engine) is built with."""

    engine: EngineSettings
    loop: UpdateLoop
    loss: PolicyLossSettings
    log_prob: ForwardSettings
    rollout: RolloutSettings | None  # None: disaggregated, the engines live in their own group
    seed: int = 0
    weight_sync_timeout_s: float = 600.0


@dataclass(frozen=True)
class RefSettings:
    engine: EngineSettings
    log_prob: ForwardSettings


@dataclass(frozen=True)
class CriticSettings:
    engine: EngineSettings
    loop: UpdateLoop
    forward: ForwardSettings
    cliprange_value: float = 0.5
    seed: int = 0


@dataclass(frozen=True)
class RewardModelSettings:
    model_path: str
    device: DeviceRequest = field(default_factory=DeviceRequest)
    max_length: int = 2048
    micro_batch_size: int = 8
    dtype: str = "auto"
    trust_remote_code: bool = False
