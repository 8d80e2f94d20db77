"""Typed configuration: dataclasses that Hydra/OmegaConf fill from a recipe and the command line.

Every field a recipe can set is declared here, with its default and meaning. `validate_config`
checks the whole configuration before any worker starts and reports every problem at once,
each naming the key and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlframe.stages.config import STAGES, DPOConfig, PairGenerationConfig, RewardTrainingConfig, SFTConfig
from rlframe.workers.engine.deepspeed.settings import DeepSpeedSettings
from rlframe.workers.engine.megatron.settings import MegatronSettings
from rlframe.workers.engine.registry import ENGINES, check_engine_model, check_engines


@dataclass
class LoraConfig:
    """LoRA on the actor (workers/engine/lora.py, through peft): the base frozen, low-rank adapters
    trained, the optimizer holding the adapters only. The reference policy is the actor with its
    adapters disabled (no ref model is started). LoRA usually wants a ~10x higher LR than full
    fine-tuning (actor.optim.lr). The critic (PPO) is not affected."""

    rank: int = 0  # 0 = off (full fine-tuning)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # all-linear (every linear layer but the LM head) | [q_proj, v_proj, ...] | a regex
    exclude_modules: list[str] = field(default_factory=list)
    # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, CUDA only), the adapters in full precision.
    load_in_4bit: bool = False
    # How the rollout engine gets the policy after each update: merged (W + alpha/r B A under the base
    # model's names; every engine and placement) | adapter (only A and B; the engine applies them
    # itself: vLLM's LoRA support or the HF engine's own LoRA layers; colocated placement only).
    weight_sync: str = "merged"


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # embedded model name, HF folder, or hub id
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    attn_implementation: str = "auto"  # auto | sdpa | eager | flash_attention_2
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ArithmeticDataConfig:
    n_train: int = 2000
    n_val: int = 64
    seed: int = 0
    max_operand: int = 20


@dataclass
class ShapesDataConfig:
    """data.source=shapes: generated pictures of coloured shapes + counting questions (rlframe/data/shapes.py)."""
    n_train: int = 256
    n_val: int = 32
    seed: int = 0
    size: int = 112  # image side in pixels (112 px = 8 x 8 patches of 14 px = 16 image tokens on Qwen2.5-VL)


@dataclass
class DataConfig:
    source: str = "arithmetic"  # arithmetic (generated) | shapes (generated, with images) | files
    # A file, a list of files, `~` and globs (parquet, jsonl, json, csv, arrow, datasets folders, hub
    # ids name@split); giving train_files implies source=files (rlframe/data/files.py).
    train_files: Any = field(default_factory=list)
    val_files: Any = field(default_factory=list)
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)
    shapes: ShapesDataConfig = field(default_factory=ShapesDataConfig)
    prompt_key: str = "prompt"
    # Images (verl/EasyR1 layout, rlframe/data/multimodal.py): the column holding each row's list of
    # images, one <image> placeholder per image in the prompt. An image outside [min_pixels,
    # max_pixels] (width x height) is scaled into the range (aspect kept) when resize_images, else
    # one above max_pixels is an error naming file, row and field.
    image_key: str = "images"
    min_pixels: int = 3136  # 56 x 56 (Qwen2-VL's processor default)
    max_pixels: int = 1003520  # 1280 x 28 x 28 (Qwen2-VL's processor default)
    resize_images: bool = True
    answer_key: Optional[str] = None
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 8  # prompts per step
    val_max_samples: Optional[int] = None  # null: the whole validation set; N: its first N rows
    # A Jinja template for the user message (EasyR1's format_prompt): `{{ content }}` (also
    # `{{ prompt }}`, `{{ question }}`) is the prompt text; a file path or the template text itself.
    prompt_template: Optional[str] = None
    overlong: str = "filter"  # filter | error | truncate_left
    bad_rows: str = "error"  # error | skip
    shuffle: bool = True
    seed: int = 0


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive (Ziegler et al.: steer the measured KL towards target_kl)
    kl_coef: float = 0.001  # beta (the initial beta for adaptive)
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping: a linear penalty over the last `len` tokens before the limit."""

    enable: bool = False
    len: int = 16  # tokens before data.max_response_length where the penalty starts
    penalty_factor: float = 1.0  # the penalty at the limit


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards all agree; generate more until the batch is full."""

    enable: bool = False
    max_attempts: int = 10  # rollout rounds per step before giving up with an error


@dataclass
class PluginConfig:
    path: Optional[str] = None  # a Python file
    name: Optional[str] = None  # the function in it; also the name it is registered under


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    turn_gamma: float = 1.0  # grpo_turn: discount per model turn of a multi-turn rollout (not per token)
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 / low_var_kl | abs | mse
    whiten_advantages: bool = False  # whiten the advantages over the batch (usual for PPO with gae)
    # KL inside the reward (classic PPO-RLHF): token_level_rewards = scores - beta * kl(old policy, ref),
    # beta from kl_ctrl. The reference model is started only when use_kl_loss or use_kl_in_reward.
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # the per-token KL estimator for the reward penalty (see rlframe/algos/kl.py)
    kl_ctrl: KLControlConfig = field(default_factory=lambda: KLControlConfig())
    overlong_buffer: OverlongBufferConfig = field(default_factory=lambda: OverlongBufferConfig())
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=lambda: DynamicSamplingConfig())
    # Your own estimator / policy loss from a Python file: {path: my_algos.py, name: my_fn}. It is
    # registered under `name` before any worker starts; select it with adv_estimator=<name>
    # (or actor.policy_loss=<name>). See examples/custom_estimator/.
    custom_estimator: PluginConfig = field(default_factory=lambda: PluginConfig())
    custom_policy_loss: PluginConfig = field(default_factory=lambda: PluginConfig())
    # The behaviour policy's correction (rlframe/algos/off_policy.py): tis weights each token's policy-gradient
    # term by min(pi_old / pi_rollout, tis_cap), pi_rollout being the engine's log-probs of its samples |
    # none | auto: tis with trainer.async_rollout (samples from older weights), none otherwise.
    off_policy_correction: str = "auto"
    tis_cap: float = 2.0


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    grad_clip: float = 1.0


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # the training engine (workers/engine/registry.py): fsdp (FSDP2) | deepspeed (ZeRO) | megatron; ref and critic too
    world_size: int = 1  # data-parallel ranks of the actor (and colocated rollout / ref)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimiser step (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int = 4  # sequences per forward/backward
    ppo_epochs: int = 1
    shuffle: bool = True
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo | cispo | your own (algorithm.custom_policy_loss)
    # The policy loss's options. "auto": its published default (rlframe/algos/losses.py
    # POLICY_LOSS_DEFAULTS; vanilla 0.2 / 0.2, dual clip 3.0, token-mean; gspo 3e-4 / 4e-4,
    # seq-mean-token-mean; cispo no lower bound / 0.28, token-mean). null: no bound (clip_ratio_c:
    # dual clip off; cispo's clip_ratio_low). Setting a key the loss ignores is an error.
    clip_ratio_low: Any = "auto"  # ratio range [1 - low, 1 + high]; high > low is DAPO's clip-higher
    clip_ratio_high: Any = "auto"
    clip_ratio_c: Any = "auto"  # dual clip (vanilla): for A < 0 the loss is capped at -A * c
    loss_agg_mode: str = "auto"  # auto | token-mean | seq-mean-token-sum | seq-mean-token-mean | ...-sum-norm
    entropy_coeff: float = 0.0
    log_prob_micro_batch_size_per_device: int = 16
    # With one epoch and one mini-batch per step the update is exactly on-policy: the old log-probs
    # equal the first forward's, so the separate compute_log_prob pass is skipped (and the
    # engine/trainer log-prob agreement is measured inside update_actor instead).
    skip_old_log_prob_when_on_policy: bool = True
    # Padding-free forward (all real tokens of a micro-batch packed in one row): flash-attn varlen on
    # GPU, rlframe's VARLEN_SDPA elsewhere (per-sequence causal SDPA, linear layers on real tokens
    # only; measured on CPU: 8.7 s packed vs 10.4 s padded fwd+bwd, 16 GRPO rollouts of SmolLM2).
    # auto = on, except with attn_implementation=eager (models that do not route attention through
    # transformers' attention interface cannot be packed).
    use_remove_padding: str = "auto"  # auto | true | false
    # Dynamic micro-batches: instead of a fixed count, pack rows up to a token budget per forward
    # (0 = off: use the fixed ppo_micro_batch_size_per_device / log_prob_micro_batch_size_per_device).
    ppo_max_token_len_per_device: int = 0
    log_prob_max_token_len_per_device: int = 0
    # Ulysses sequence parallelism: each group of this many consecutive ranks shares every packed row
    # (1/P of the tokens each; all-to-all around attention). Must divide world_size and the model's
    # attention heads; needs use_remove_padding. Applies to the actor and the reference policy.
    ulysses_sequence_parallel_size: int = 1
    offload_params: bool = False  # GPU only: keep params on CPU between phases (deepspeed: = deepspeed.offload)
    offload_optimizer: bool = False  # GPU only: keep optimizer state on CPU between phases (deepspeed: = adam_offload)
    # Vision-language models: keep the vision tower (and its patch merger) fixed; only the language
    # model trains (weight sync still sends every tensor). An error for a text-only model.
    freeze_vision_tower: bool = False


@dataclass
class CriticConfig:
    """The value model of PPO (used when algorithm.adv_estimator=gae), colocated with the actor."""

    model_path: Optional[str] = None  # default: the actor's model.path (the value head starts at zero)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    # The value head starts at zero; at the backbone's small LR it would need hundreds of steps to
    # reach the reward scale, so it has its own LR (null: optim.lr).
    head_lr: Optional[float] = 1e-3
    ppo_mini_batch_size: Optional[int] = None  # prompts per optimiser step; default actor.ppo_mini_batch_size
    ppo_micro_batch_size_per_device: int = 4  # sequences per forward/backward
    forward_micro_batch_size_per_device: int = 16  # sequences per forward in compute_values
    ppo_epochs: int = 1
    cliprange_value: float = 0.5  # value clipping around the old values; 0 disables
    loss_agg_mode: str = "token-mean"


@dataclass
class ToolConfig:
    path: str = "tools/calculator.py"  # a Python file defining the function and TOOL_SCHEMAS[name]
    name: str = "calculator"


@dataclass
class EnvironmentConfig:
    path: str = ""  # "" = no environment; else a Python file defining the class
    name: str = ""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (workers/rollout/agent_loop.py): model turns alternate with tool
    turns until an answer (a turn without a tool call), `max_turns` model turns, or the response budget
    (data.max_response_length, model + tool tokens). Tool tokens are context, never trained on."""

    enable: bool = False
    tools: list[ToolConfig] = field(default_factory=lambda: [ToolConfig()])
    max_turns: int = 3
    max_tokens_per_turn: int = 0  # a model turn's cap (0: the remaining budget); a cut turn is still parsed
    max_tool_response_tokens: int = 64  # an observation is cut to this many tokens
    tool_timeout_s: float = 5.0  # a call that takes longer becomes a timeout error the model sees
    format: str = "hermes"  # tool-call parser: hermes (<tool_call>{json}</tool_call>) | tag (<name>text</name>)
    #                         | path/to/parser.py:function (text, tools) -> list[ToolCall]
    tool_prompt: bool = True  # a system message describing the tools, in front of each prompt
    tool_prompt_tokens: int = 256  # room for it in the engine's max_model_len
    # An environment (class with reset(row) and step(model_text) -> (observation, reward, done)) judges
    # each model turn without a tool call: its observation becomes the next user message; the sum of its
    # rewards is added to the score (outcome reward on the last model token).
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    # where the environment's per-turn rewards go: final (their sum on the last model token, with the outcome
    # reward) | per_turn (each on the last token of the turn it judged; same total, so grpo/rloo see no change,
    # gae and reinforce_plus_plus with gamma < 1 credit each turn, and grpo_turn with turn_gamma < 1)
    turn_rewards: str = "final"


@dataclass
class PartialRolloutConfig:
    """Partial rollouts (rlframe/trainer/partial.py): each generation call gives a response at most
    max_tokens_per_round new tokens; a response not finished then is held back and continued, from its
    prompt + partial tokens, by a later call -- after a weight sync, with newer weights. Every token records
    the policy version that produced it (token_policy_version) beside its log-prob, so the off-policy
    correction (TIS) weighs each token against the weights that sampled it. A step trains
    data.train_batch_size prompt groups whose n samples have all finished (the oldest first); a step
    generates one round, more only while fewer groups than that have finished."""

    enable: bool = False
    # New tokens per response per generation call; 0: ceil(data.max_response_length / span), where span =
    # max_token_staleness - trainer.max_staleness (0 when synchronous) + 1 is the steps a response may take.
    max_tokens_per_round: int = 0
    # A group is trained only while every token is at most this many policy versions behind the trainer;
    # older held-back groups are restarted from their prompt (partial/restarted_groups). >= max_staleness + 1.
    max_token_staleness: int = 2
    # Prompt batches kept in flight beyond the one a step trains (over-sampling): the held-back pool.
    oversample_batches: int = 1


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (vllm when installed, else hf) | vllm | hf
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    val_temperature: float = 0.0  # greedy validation
    # Seed every training sample's sampling from (trainer.seed, step, prompt uid, sample index), so that a
    # resumed run samples the same tokens with vLLM (whose engine RNG is not checkpointed) as without
    # the interruption. Costs vLLM a per-request generator in its sampler (small on CPU; on GPU at
    # thousands of concurrent requests, turn it off if exact resume does not matter to you).
    seed_each_sample: bool = True
    gpu_memory_utilization: float = 0.4
    cpu_kv_cache_gib: float = 1.0  # vLLM CPU KV cache (fractions allowed; pages released between generations)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # GPU only: CPU generators cannot rewind after a partial prefill
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = True  # GPU only: free engine memory while the trainer trains
    enforce_eager: bool = True
    # Disaggregated placement (trainer.placement=disaggregated): data-parallel engines on their own
    # devices; default actor.world_size. Weights reach them by a bucketed broadcast after each update.
    world_size: Optional[int] = None
    weight_bucket_mb: int = 64  # bucket size of that broadcast
    # Tensor-parallel vLLM: each engine spans this many consecutive ranks (colocated: of the actor's
    # world; disaggregated: of rollout.world_size), for policies too large for one device's engine.
    tensor_parallel_size: int = 1
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # `rollout.agent` is another name for `rollout.multi_turn` (read into it by rlframe.main before validation)
    agent: Optional[dict[str, Any]] = None
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)


@dataclass
class RewardFunctionConfig:
    path: str = "reward_fns/math.py"
    name: str = "compute_score"
    weight: float = 1.0
    data_sources: Optional[list[str]] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function (verl reward_kwargs)
    # sample | sequential (per sample) | batch (EasyR1); null: from the file's REWARD_TYPE, else by signature
    reward_type: Optional[str] = None


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    num_workers: int = 2
    timeout_s: float = 10.0
    batch_timeout_s: float = 300.0
    fallback_score: float = 0.0
    fail_fast: bool = False
    # Score step k's samples in a background thread while the old-log-prob / reference / critic passes run;
    # the driver joins the scores before the advantage (timing/reward_wait_s: how long it blocked there).
    # Same scores, same failure messages and counts; false: score, then run those passes (the old order).
    # Steps that need the rewards before the log-probs (DAPO's dynamic sampling) always score first.
    overlap: bool = True


@dataclass
class RewardModelConfig:
    """A model-based reward (HF sequence-classification RM, num_labels=1) added to the rule rewards:
    score = sum of weighted reward functions + weight * rm_score. Runs colocated with the actor."""

    enable: bool = False
    path: str = ""
    weight: float = 1.0
    max_length: int = 2048
    micro_batch_size: int = 8
    dtype: str = "auto"
    trust_remote_code: bool = False


@dataclass
class TimeoutConfig:
    rollout: float = 1800.0
    log_prob: float = 1800.0
    update: float = 3600.0
    weight_sync: float = 600.0
    init: float = 900.0


@dataclass
class RuntimeEnvConfig:
    """What every worker on every node gets (Ray runtime_env): env vars and an uploaded working dir."""

    env_vars: dict[str, str] = field(default_factory=dict)
    working_dir: Optional[str] = None  # uploaded to every node; its files are importable there


@dataclass
class TrainerConfig:
    total_steps: int = 20
    # Passes over the training data (verl/EasyR1 total_epochs); set, it replaces total_steps with
    # total_epochs x (training rows // data.train_batch_size).
    total_epochs: Optional[int] = None
    run_dir: Optional[str] = None  # default: runs/<experiment_name>-<timestamp>
    project_name: str = "rlframe"
    experiment_name: str = "grpo_math"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + wandb, tensorboard
    val_before_train: bool = True
    val_at_end: bool = True
    # Reorder each batch so every data-parallel rank gets a near-equal number of tokens (a greedy
    # equal-count partition; the spread is at most one sequence's length) before it is split.
    balance_batch: bool = True
    val_every: int = 0  # 0: only before and after training
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    num_cpus: Optional[int] = None  # CPUs given to a local Ray cluster (default: all cores)
    cpus_per_worker: Optional[float] = None  # default: num_cpus / actor.world_size
    ray_address: Optional[str] = None
    # Multi-node placement (rlframe/trainer/launch.py, examples/multinode.md). colocated: actor,
    # rollout and ref share every device; disaggregated: rollout engines on their own devices (nodes).
    placement: str = "colocated"  # colocated | disaggregated
    nnodes: int = 1
    devices_per_node: Optional[int] = None  # GPUs (or CPU slots of cpus_per_worker) per node; None: legacy one-node pool
    # Optional node pinning: one custom Ray resource per node (ray start --resources='{"node_a": 1}');
    # node i's bundles go to the node that has node_resources[i]. Empty: Ray node ids picked by the driver.
    node_resources: list[str] = field(default_factory=list)
    runtime_env: RuntimeEnvConfig = field(default_factory=lambda: RuntimeEnvConfig())
    export_hf: bool = True
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    critic_warmup: int = 0  # PPO: the first N steps train only the critic (the actor is not updated)
    # Checkpoints (<run_dir>/checkpoints/step_N, see rlframe/trainer/checkpoint.py): every
    # `save_every` steps and at the last step; 0 = none at all.
    save_every: int = 0
    max_checkpoints_to_keep: int = 2  # older complete checkpoints are deleted; 0 = keep all
    # full: every rank's shard gathered into one HF safetensors file + a full optimizer file (loads in
    # transformers as it is; needs the whole model in one rank's CPU memory) | sharded: each rank writes
    # its own shards with torch.distributed.checkpoint (no gather: for models that do not fit one
    # host); resumes at any world size, `python -m rlframe.export` turns it into an HF folder.
    checkpoint_format: str = "full"
    # auto: continue from the newest complete checkpoint in run_dir (a fresh start when there is
    # none) | disable: always start fresh | a path to one checkpoint folder (step_N).
    resume: str = "auto"
    # A dead or stuck worker: tear the worker groups down, start new ones and resume from the
    # latest checkpoint, at most this many times per run (0 = stop with the error).
    max_restarts: int = 0
    # Non-finite loss or gradient norm: the optimiser step is skipped; after this many in a row
    # the run stops naming the step and micro-batch.
    max_consecutive_skipped_updates: int = 3
    # The pre-flight memory plan (rlframe/plan.py, `python -m rlframe.plan`), printed before workers
    # start: error = refuse a plan that does not fit (naming the role, device and settings that fit) |
    # warn = print the problem and run | off = no plan.
    memory_check: str = "error"
    device_memory_gib: Optional[float] = None  # one device's memory for the plan (default: measured here)
    # One device's peak TFLOP/s for perf/mfu (default: the datasheet bf16 figure of known GPUs, the
    # fp32 matmul rate measured at start on CPU).
    device_peak_tflops: Optional[float] = None
    # One-step off-policy training (disaggregated placement): the engines generate step k+1's batch while
    # the trainer updates on step k's; the weights reach the engines between steps. Each sample records
    # the version of the weights that generated it (policy_version = updates applied); the staleness
    # (trainer version - sample version, async/staleness_max) never exceeds max_staleness (0: generate
    # after each sync, as the synchronous loop; 1: one step ahead; k >= 2: k steps ahead, the weights staged in
    # Ray's object store and loaded by the engines between generations, so the trainer never waits for them to
    # finish generating). Corrected by algorithm.off_policy_correction.
    async_rollout: bool = False
    max_staleness: int = 1


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
    # The engines' own sections: each engine package's settings class, handed to its engine as is.
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)  # actor.strategy=deepspeed
    megatron: MegatronSettings = field(default_factory=MegatronSettings)  # actor.strategy=megatron
    # The stage a recipe runs (rlframe/stages/): rl (this loop) | sft | dpo | rm; their sections below.
    stage: str = "rl"
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    pairs: PairGenerationConfig = field(default_factory=PairGenerationConfig)


class ConfigError(ValueError):
    """An inconsistent configuration; the message lists every problem with its key and fix."""


POLICY_LOSS_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode")  # actor.*, "auto"-able
GROUP_ESTIMATORS = ("grpo", "grpo_turn", "drgrpo", "rloo", "opo", "reinforce_plus_plus_baseline")  # baseline from the group


def policy_loss_options(actor: ActorConfig) -> dict[str, Any]:
    """The actor's POLICY_LOSS_KEYS with "auto" resolved to the policy loss's published default (pure).

    A key the loss does not read resolves to None; one set explicitly is kept as it is
    (validate_config rejects it if the loss ignores it).
    """
    from rlframe.algos.losses import policy_loss_defaults

    defaults = policy_loss_defaults(actor.policy_loss)
    values = {key: getattr(actor, key) for key in POLICY_LOSS_KEYS}
    return {key: defaults.get(key) if isinstance(value, str) and value == "auto" else value
            for key, value in values.items()}


def apply_algorithm_defaults(cfg: RLConfig) -> RLConfig:
    """Write policy_loss_options into cfg.actor (in place; idempotent: nothing is "auto" afterwards)."""
    for key, value in policy_loss_options(cfg.actor).items():
        setattr(cfg.actor, key, value)
    return cfg


def validate_config(cfg: RLConfig) -> None:
    """Check the configuration before any worker starts; raise ConfigError listing all problems."""
    from rlframe.models.provision import is_resolvable

    apply_algorithm_defaults(cfg)
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
    tp = rollout.tensor_parallel_size
    engine_ranks = actor.world_size if cfg.trainer.placement == "colocated" else (rollout.world_size or actor.world_size)
    need(tp >= 1 and engine_ranks % max(tp, 1) == 0, "rollout.tensor_parallel_size",
         f"{tp} must be >= 1 and divide the {engine_ranks} ranks that run rollout engines "
         f"({'actor.world_size' if cfg.trainer.placement == 'colocated' else 'rollout.world_size'}). Fix: a divisor of it")
    need(tp == 1 or rollout.engine != "hf", "rollout.tensor_parallel_size",
         "the HF generate engine has no tensor parallelism. Fix: rollout.engine=vllm (or auto)")
    need(tp == 1 or not rollout.multi_turn.enable, "rollout.tensor_parallel_size",
         "multi-turn rollouts schedule turns as tools return, which differs between ranks; the ranks of a "
         "tensor-parallel engine must submit identical requests. Fix: rollout.tensor_parallel_size=1")
    need(tp == 1 or cfg.model.lora.weight_sync != "adapter" or cfg.model.lora.rank == 0, "rollout.tensor_parallel_size",
         "adapter-only weight sync is not wired for tensor-parallel engines. Fix: model.lora.weight_sync=merged")
    need(cfg.trainer.checkpoint_format in ("full", "sharded"), "trainer.checkpoint_format",
         f"'{cfg.trainer.checkpoint_format}' is not one of full, sharded")
    need(cfg.trainer.checkpoint_format == "full" or (actor.strategy == "fsdp" and cfg.model.lora.rank == 0),
         "trainer.checkpoint_format",
         "sharded checkpoints are written by the FSDP engine for full fine-tuning (a LoRA checkpoint holds "
         "only the small adapters; DeepSpeed gathers a bucket at a time). Fix: trainer.checkpoint_format=full")
    need(cfg.trainer.memory_check in ("error", "warn", "off"), "trainer.memory_check",
         f"'{cfg.trainer.memory_check}' is not one of error, warn, off")
    need(cfg.trainer.device_memory_gib is None or cfg.trainer.device_memory_gib > 0, "trainer.device_memory_gib",
         "must be > 0 GiB (or null: measured on this machine)")
    need(cfg.algorithm.adv_estimator not in GROUP_ESTIMATORS or rollout.n >= 2, "rollout.n",
         f"{cfg.algorithm.adv_estimator} compares samples of one prompt (with one, every advantage is 0): "
         "set rollout.n >= 2")
    need(actor.strategy in ENGINES, "actor.strategy",
         f"'{actor.strategy}' is not a training engine here ({', '.join(ENGINES)}). Fix: actor.strategy=fsdp")
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
    sp = actor.ulysses_sequence_parallel_size
    need(sp >= 1 and actor.world_size % max(sp, 1) == 0, "actor.ulysses_sequence_parallel_size",
         f"{sp} must be >= 1 and divide actor.world_size={actor.world_size}. Fix: pick a divisor of the world size.")
    need(sp == 1 or str(actor.use_remove_padding).lower() != "false", "actor.ulysses_sequence_parallel_size",
         "sequence parallelism splits packed rows: it needs actor.use_remove_padding=auto or true")
    need(data.max_prompt_length > 0 and data.max_response_length > 0, "data.max_response_length",
         "prompt and response lengths must be positive")
    need(data.source in ("arithmetic", "shapes", "files"), "data.source",
         f"'{data.source}' is not arithmetic, shapes or files")
    need(0 < data.min_pixels <= data.max_pixels, "data.min_pixels/max_pixels",
         f"need 0 < min_pixels <= max_pixels, got {data.min_pixels} and {data.max_pixels}. "
         "Fix: e.g. data.min_pixels=3136 data.max_pixels=1003520")
    if data.source == "shapes":
        need(data.shapes.n_train >= data.train_batch_size and data.shapes.size >= 28, "data.shapes",
             f"n_train={data.shapes.n_train} must fill one batch of data.train_batch_size={data.train_batch_size} "
             f"and size={data.shapes.size} must be >= 28 px")
    if data.source == "files":
        need(bool(data.train_files), "data.train_files", "data.source=files needs at least one train file")
        from rlframe.data.files import is_hub_id, resolve_data_files

        for f in resolve_data_files(data.train_files) + resolve_data_files(data.val_files):
            need(Path(f).exists() or is_hub_id(f), "data.train_files/val_files",
                 f"'{f}' does not exist. Fix: create it (e.g. python examples/data_preprocess/gsm8k.py "
                 "--local_dir ~/data/gsm8k) or point the key at your file")
    need(data.val_max_samples is None or data.val_max_samples >= 1, "data.val_max_samples",
         "must be >= 1, or null for the whole validation set")
    need(cfg.trainer.total_epochs is None or cfg.trainer.total_epochs >= 1, "trainer.total_epochs",
         "must be >= 1, or null to run trainer.total_steps steps")
    need(cfg.trainer.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    need(cfg.trainer.device in ("auto", "cpu", "cuda"), "trainer.device", "must be auto, cpu or cuda")
    if cfg.reward_model.enable:
        need(bool(cfg.reward_model.path) and is_resolvable(cfg.reward_model.path), "reward_model.path",
             f"'{cfg.reward_model.path}' is not a model folder or hub id. Fix: reward_model.path=/path/to/rm")
    _validate_reward_functions(cfg, need)
    _validate_multi_turn(cfg, need)
    trainer = cfg.trainer
    need(trainer.save_every >= 0, "trainer.save_every", "must be >= 0 (0 = no checkpoints)")
    need(trainer.max_checkpoints_to_keep >= 0, "trainer.max_checkpoints_to_keep", "must be >= 0 (0 = keep all)")
    need(trainer.resume in ("auto", "disable") or Path(trainer.resume).is_dir(), "trainer.resume",
         f"'{trainer.resume}' is neither auto, disable nor an existing checkpoint folder. "
         "Fix: trainer.resume=auto or trainer.resume=<run_dir>/checkpoints/step_N")
    need(trainer.max_restarts >= 0, "trainer.max_restarts", "must be >= 0")
    need(trainer.max_restarts == 0 or trainer.save_every > 0, "trainer.max_restarts",
         "restarts resume from a checkpoint. Fix: set trainer.save_every >= 1 too")
    need(trainer.max_consecutive_skipped_updates >= 1, "trainer.max_consecutive_skipped_updates", "must be >= 1")
    _validate_algorithm(cfg, need)
    _validate_placement(cfg, need)
    _validate_async(cfg, need)
    _validate_partial(cfg, need)
    check_engines(cfg, need, _local_model_dir(cfg.model.path))  # each engine's CHECKS (workers/engine/registry.py)
    _validate_context_length(cfg, need)
    _validate_lora(cfg, need)
    _validate_stage(cfg, need)
    unknown_loggers = set(cfg.trainer.loggers) - {"console", "jsonl", "wandb", "tensorboard"}
    need(not unknown_loggers, "trainer.loggers", f"unknown loggers {sorted(unknown_loggers)}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _validate_stage(cfg: RLConfig, need) -> None:
    """stage and the sft / dpo / rm / pairs sections (rlframe/stages/)."""
    from rlframe.algos.preference import PREFERENCE_LOSSES

    need(cfg.stage in STAGES, "stage", f"'{cfg.stage}' is not one of {', '.join(STAGES)}")
    world = max(cfg.actor.world_size, 1)
    sft, dpo, rm, pairs = cfg.sft, cfg.dpo, cfg.rm, cfg.pairs
    if cfg.stage == "sft":
        need(sft.loss_on in ("response", "all"), "sft.loss_on", f"'{sft.loss_on}' is not response or all")
        need(sft.epochs >= 1, "sft.epochs", "must be >= 1")
        need(sft.max_length >= 2, "sft.max_length", "must be >= 2")
        need(sft.batch_size >= world and sft.batch_size % world == 0, "sft.batch_size",
             f"{sft.batch_size} sequences do not split over actor.world_size={world} ranks. Fix: a multiple of it")
        need(sft.micro_batch_size >= 1, "sft.micro_batch_size", "must be >= 1")
    if cfg.stage in ("dpo", "rm"):
        batch = dpo.batch_size if cfg.stage == "dpo" else rm.batch_size
        need(batch >= world and batch % world == 0, f"{cfg.stage}.batch_size",
             f"{batch} pairs do not split over actor.world_size={world} ranks. Fix: a multiple of it")
        need((dpo.epochs if cfg.stage == "dpo" else rm.epochs) >= 1, f"{cfg.stage}.epochs", "must be >= 1")
        need(pairs.n >= 2, "pairs.n", "a pair needs at least 2 samples per prompt")
        need(pairs.prompts >= 0 and pairs.batch_size >= 1, "pairs.prompts", "pairs.prompts >= 0, pairs.batch_size >= 1")
    if cfg.stage == "dpo":
        need(dpo.loss in PREFERENCE_LOSSES, "dpo.loss", f"'{dpo.loss}' is not one of {', '.join(PREFERENCE_LOSSES)}")
        need(dpo.beta > 0, "dpo.beta", "must be > 0")
        need(0.0 <= dpo.label_smoothing < 0.5, "dpo.label_smoothing", "must be in [0, 0.5)")
        need(dpo.label_smoothing == 0.0 or dpo.loss == "sigmoid", "dpo.label_smoothing",
             f"only the sigmoid loss reads it (dpo.loss={dpo.loss}). Fix: dpo.label_smoothing=0")
    if cfg.stage != "rl":
        need(cfg.model.lora.rank == 0, "model.lora.rank", f"stage={cfg.stage} trains full weights here. Fix: model.lora.rank=0")
        need(cfg.trainer.placement == "colocated", "trainer.placement",
             f"stage={cfg.stage} runs colocated. Fix: trainer.placement=colocated")


def _validate_algorithm(cfg: RLConfig, need) -> None:
    """Policy loss, PPO/critic, KL-in-reward, DAPO and plugin keys (see rlframe/algos)."""
    from rlframe.algos import ADVANTAGE_ESTIMATORS, AGG_MODES, POLICY_LOSSES, policy_loss_defaults
    from rlframe.algos.kl import KL_KINDS

    algo, critic, rollout = cfg.algorithm, cfg.critic, cfg.rollout
    for key, plugin in (("algorithm.custom_estimator", algo.custom_estimator),
                        ("algorithm.custom_policy_loss", algo.custom_policy_loss)):
        need((plugin.path is None) == (plugin.name is None), key, "set both path and name (or neither)")
        need(plugin.path is None or Path(plugin.path).is_file(), f"{key}.path", f"'{plugin.path}' is not a file")
    estimators = set(ADVANTAGE_ESTIMATORS) | {algo.custom_estimator.name}
    need(algo.adv_estimator in estimators, "algorithm.adv_estimator",
         f"'{algo.adv_estimator}' is not a registered estimator ({', '.join(sorted(ADVANTAGE_ESTIMATORS))}). "
         "Fix: pick one, or load your own with algorithm.custom_estimator={path: ..., name: ...}")
    need(cfg.actor.policy_loss in set(POLICY_LOSSES) | {algo.custom_policy_loss.name}, "actor.policy_loss",
         f"'{cfg.actor.policy_loss}' is not a registered policy loss ({', '.join(sorted(POLICY_LOSSES))}). "
         "Fix: pick one, or load your own with algorithm.custom_policy_loss={path: ..., name: ...}")
    actor, reads = cfg.actor, policy_loss_defaults(cfg.actor.policy_loss)  # the keys the loss reads -> defaults
    for key in POLICY_LOSS_KEYS:
        need(key in reads or getattr(actor, key) is None, f"actor.{key}",
             f"the {actor.policy_loss} policy loss ignores it (it reads {', '.join(reads)}). "
             f"Fix: remove actor.{key} (or set it to auto), or pick a policy loss that uses it.")
    need(actor.loss_agg_mode in AGG_MODES, "actor.loss_agg_mode",
         f"'{actor.loss_agg_mode}' is not one of auto, {', '.join(AGG_MODES)}")
    low, high, c = actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c
    if "clip_ratio_low" in reads:
        need((low is None and reads["clip_ratio_low"] is None) or (_is_number(low) and 0 < low < 1),
             "actor.clip_ratio_low", f"{low!r}: must be a number in (0, 1) (the ratio's lower bound is 1 - low)"
             + (", or null for none" if reads["clip_ratio_low"] is None else ""))
    if "clip_ratio_high" in reads:
        need(_is_number(high) and high > 0, "actor.clip_ratio_high",
             f"{high!r}: must be a number > 0 (the ratio's upper bound is 1 + high)")
    if "clip_ratio_c" in reads:
        need(c is None or (_is_number(c) and c > 1), "actor.clip_ratio_c",
             f"{c!r}: must be a number > 1, or null to turn the dual clip off")
    need(algo.kl_penalty in KL_KINDS, "algorithm.kl_penalty", f"'{algo.kl_penalty}' is not one of {', '.join(KL_KINDS)}")
    need(algo.kl_ctrl.type in ("fixed", "adaptive"), "algorithm.kl_ctrl.type", "must be fixed or adaptive")
    need(algo.kl_ctrl.type != "adaptive" or (algo.kl_ctrl.target_kl > 0 and algo.kl_ctrl.horizon > 0),
         "algorithm.kl_ctrl", "the adaptive controller needs target_kl > 0 and horizon > 0")
    if algo.overlong_buffer.enable:
        need(0 < algo.overlong_buffer.len <= cfg.data.max_response_length, "algorithm.overlong_buffer.len",
             f"must be in 1..data.max_response_length ({cfg.data.max_response_length})")
    if algo.dynamic_sampling.enable:
        need(algo.dynamic_sampling.max_attempts >= 1, "algorithm.dynamic_sampling.max_attempts", "must be >= 1")
        need(rollout.n >= 2, "rollout.n", "dynamic sampling drops groups whose rewards agree: set rollout.n >= 2")
    if algo.adv_estimator == "gae":
        need(critic.loss_agg_mode in AGG_MODES, "critic.loss_agg_mode", f"'{critic.loss_agg_mode}' is not one of {AGG_MODES}")
        need(critic.model_path is None or _resolvable(critic.model_path), "critic.model_path",
             f"'{critic.model_path}' is neither a folder, an embedded model nor a hub id")
        mini = critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
        need(mini >= 1 and cfg.data.train_batch_size % mini == 0, "critic.ppo_mini_batch_size",
             f"{mini} does not divide data.train_batch_size={cfg.data.train_batch_size}")
        per_rank = mini * rollout.n // max(cfg.actor.world_size, 1)
        need(critic.ppo_micro_batch_size_per_device >= 1 and per_rank % max(critic.ppo_micro_batch_size_per_device, 1) == 0,
             "critic.ppo_micro_batch_size_per_device",
             f"each rank gets {per_rank} sequences per critic mini-batch. Fix: pick a divisor of {per_rank}.")
        need(critic.cliprange_value >= 0, "critic.cliprange_value", "must be >= 0 (0 disables clipping)")
    need(0.0 <= algo.turn_gamma <= 1.0, "algorithm.turn_gamma", f"{algo.turn_gamma}: must be in [0, 1]")
    need(algo.adv_estimator != "grpo_turn" or rollout.multi_turn.enable, "algorithm.adv_estimator",
         "grpo_turn credits the model turns of multi-turn rollouts; on single-turn ones it is grpo. "
         "Fix: algorithm.adv_estimator=grpo, or rollout.multi_turn.enable=true")
    need(cfg.trainer.critic_warmup >= 0, "trainer.critic_warmup", "must be >= 0")
    need(cfg.trainer.critic_warmup == 0 or algo.adv_estimator == "gae", "trainer.critic_warmup",
         "only PPO with a critic (algorithm.adv_estimator=gae) has a critic to warm up. Fix: trainer.critic_warmup=0")


LORA_ENGINES = ("fsdp",)  # trainer engines that implement LoRA (workers/engine/lora.py)
LORA_WEIGHT_SYNC = ("merged", "adapter")


def _validate_lora(cfg: RLConfig, need, model_dir: str | None = None) -> None:
    """model.lora: values, the engine, QLoRA's GPU, and target modules against the model's own module
    names (when its config is on disk here: `model_dir`, else a folder or an already-provisioned
    embedded model; `validate_model_lora` repeats this once the model is provisioned)."""
    lora = cfg.model.lora
    if lora.rank == 0:
        need(not lora.load_in_4bit, "model.lora.load_in_4bit",
             "QLoRA trains LoRA adapters over a 4-bit base: it needs model.lora.rank > 0. Fix: model.lora.rank=16")
        return
    need(lora.rank > 0, "model.lora.rank", f"{lora.rank}: must be >= 0 (0 = off)")
    need(_is_number(lora.alpha) and lora.alpha > 0, "model.lora.alpha", f"{lora.alpha!r}: must be > 0")
    need(_is_number(lora.dropout) and 0 <= lora.dropout < 1, "model.lora.dropout", f"{lora.dropout!r}: must be in [0, 1)")
    need(cfg.actor.strategy in LORA_ENGINES, "actor.strategy",
         f"the {cfg.actor.strategy} engine does not implement LoRA (model.lora.rank={lora.rank}); engines with "
         f"LoRA: {', '.join(LORA_ENGINES)}. Fix: actor.strategy=fsdp, or model.lora.rank=0 for full fine-tuning")
    need(lora.weight_sync in LORA_WEIGHT_SYNC, "model.lora.weight_sync",
         f"'{lora.weight_sync}' is not one of {', '.join(LORA_WEIGHT_SYNC)}")
    need(lora.weight_sync != "adapter" or cfg.trainer.placement == "colocated", "model.lora.weight_sync",
         "adapter-only sync is for colocated engines; the disaggregated broadcast sends merged weights. "
         "Fix: model.lora.weight_sync=merged")
    targets = lora.target_modules
    need(isinstance(targets, str) or (isinstance(targets, (list, tuple)) and targets
                                      and all(isinstance(t, str) for t in targets)),
         "model.lora.target_modules", f"{targets!r}: must be all-linear, a regex, or a non-empty list of module names")
    if lora.load_in_4bit:
        import torch

        from rlframe.workers.engine.lora import qlora_unavailable_reason

        gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        reason = qlora_unavailable_reason(gpu)
        need(reason is None, "model.lora.load_in_4bit", str(reason))
    model_dir = _local_model_dir(model_dir or cfg.model.path)
    if model_dir is not None and (isinstance(targets, str) or (isinstance(targets, (list, tuple)) and targets)):
        from rlframe.workers.engine.lora import model_linear_names, target_module_problems

        linear, names, output = model_linear_names(model_dir, cfg.model.trust_remote_code)
        for key, problem in target_module_problems(targets, list(lora.exclude_modules), linear, names, output):
            need(False, key, problem)


def validate_model_lora(cfg: RLConfig, model_dir: str) -> None:
    """The model-dependent LoRA checks on the provisioned model folder (before any worker starts)."""
    problems: list[str] = []

    def need(condition: bool, key: str, message: str) -> None:
        if not condition:
            problems.append(f"{key}: {message}")

    _validate_lora(cfg, need, model_dir)
    check_engine_model(cfg, need, _local_model_dir(model_dir))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _validate_context_length(cfg: RLConfig, need) -> None:
    """Prompt + response (+ the tool prompt of multi-turn rollouts) within the model's positions, when the
    model folder is here and declares no RoPE scaling (which would stretch them): otherwise vLLM refuses
    it only when the workers start, and the trainer would read positions it never learned."""
    folder = _local_model_dir(cfg.model.path)
    if folder is None:
        return
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config") or config
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or config.get("rope_scaling"):
        return
    mt = cfg.rollout.multi_turn
    tool_prompt = mt.tool_prompt_tokens if mt.enable else 0
    length = cfg.data.max_prompt_length + cfg.data.max_response_length + tool_prompt
    need(length <= positions, "data.max_prompt_length",
         f"{cfg.data.max_prompt_length} + data.max_response_length {cfg.data.max_response_length}"
         + (f" + rollout.multi_turn.tool_prompt_tokens {tool_prompt}" if tool_prompt else "")
         + f" = {length} tokens exceeds the model's max_position_embeddings ({positions}, {folder}/config.json). "
         f"Fix: shorten them to at most {positions} in total")


def _local_model_dir(path: str) -> str | None:
    """A model folder with a config.json on this machine (a folder, or an embedded model already
    converted into the cache); None for hub ids and models not provisioned yet."""
    from rlframe.models.provision import EMBEDDED_MODELS, cache_root

    if path in EMBEDDED_MODELS:
        folder = cache_root() / "models" / EMBEDDED_MODELS[path].folder_name
    else:
        folder = Path(path).expanduser()
    return str(folder) if (folder / "config.json").is_file() else None


def _validate_multi_turn(cfg: RLConfig, need) -> None:
    """Limits, parser and every tool file / function / schema (imported here, before any worker)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    from rlframe.workers.rollout.tools import ToolLoadError, get_parser, load_environment, load_tool

    need(mt.max_turns >= 1, "rollout.multi_turn.max_turns", "must be >= 1")
    need(mt.max_tokens_per_turn >= 0, "rollout.multi_turn.max_tokens_per_turn", "must be >= 0 (0 = no cap)")
    need(mt.max_tool_response_tokens >= 1, "rollout.multi_turn.max_tool_response_tokens", "must be >= 1")
    need(mt.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s", "must be > 0")
    need(mt.tool_prompt_tokens >= 0, "rollout.multi_turn.tool_prompt_tokens", "must be >= 0")
    need(mt.turn_rewards in ("final", "per_turn"), "rollout.multi_turn.turn_rewards",
         f"'{mt.turn_rewards}' is not final or per_turn. Fix: rollout.multi_turn.turn_rewards=per_turn")
    # tensor-parallel engine ranks must submit identical requests in the same order; the agent loop's
    # turns depend on when tools return, which differs between ranks
    need(cfg.rollout.tensor_parallel_size == 1, "rollout.multi_turn.enable",
         f"multi-turn rollouts need rollout.tensor_parallel_size=1 (got {cfg.rollout.tensor_parallel_size}). "
         "Fix: rollout.tensor_parallel_size=1 (data-parallel engines instead)")
    try:
        get_parser(mt.format)
    except ToolLoadError as error:
        need(False, "rollout.multi_turn.format", str(error))
    need(bool(mt.tools) or bool(mt.environment.path), "rollout.multi_turn.tools",
         "no tool and no environment. Fix: rollout.multi_turn.tools=[{path: tools/calculator.py, name: calculator}]")
    if mt.environment.path:
        try:
            load_environment(mt.environment.path, mt.environment.name)
        except ToolLoadError as error:
            need(False, "rollout.multi_turn.environment", str(error))
    for i, tool in enumerate(mt.tools):
        try:
            load_tool(tool.path, tool.name)
        except ToolLoadError as error:
            need(False, f"rollout.multi_turn.tools[{i}]", str(error))


def _validate_reward_functions(cfg: RLConfig, need) -> None:
    """Each reward file exists and defines its function (loaded here, in the driver, before any worker)."""
    from rlframe.reward.loader import RewardLoadError
    from rlframe.reward.manager import RewardSpec, validate_reward_specs

    need(bool(cfg.reward.functions), "reward.functions", "no reward function. Fix: reward.functions=[{path: reward_fns/math.py}]")
    from rlframe.reward.loader import split_path_name

    for i, fn in enumerate(cfg.reward.functions):
        fn.path, fn.name = split_path_name(fn.path, fn.name)  # EasyR1's file.py:function
        if not Path(fn.path).exists():
            need(False, f"reward.functions[{i}].path",
                 f"'{fn.path}' does not exist. Fix: point it at your reward script (e.g. reward_fns/math.py).")
            continue
        try:
            validate_reward_specs([RewardSpec(path=fn.path, name=fn.name, weight=fn.weight, data_sources=fn.data_sources,
                                              kwargs=dict(fn.kwargs), reward_type=fn.reward_type)])
        except (RewardLoadError, ValueError) as error:
            need(False, f"reward.functions[{i}]", str(error))


PLACEMENTS = ("colocated", "disaggregated")


def rollout_world_size(cfg: RLConfig) -> int:
    return cfg.rollout.world_size or cfg.actor.world_size


def devices_needed(cfg: RLConfig) -> int:
    if cfg.trainer.placement == "disaggregated":
        return cfg.actor.world_size + rollout_world_size(cfg)
    return cfg.actor.world_size


def _validate_placement(cfg: RLConfig, need) -> None:
    """Placement keys (the cluster itself is checked when the workers start, before any of them does)."""
    t = cfg.trainer
    need(t.placement in PLACEMENTS, "trainer.placement", f"'{t.placement}' is not one of {', '.join(PLACEMENTS)}")
    need(t.nnodes >= 1, "trainer.nnodes", "must be >= 1")
    need(t.devices_per_node is None or t.devices_per_node >= 1, "trainer.devices_per_node", "must be >= 1")
    need(t.nnodes == 1 or t.devices_per_node is not None, "trainer.devices_per_node",
         f"trainer.nnodes={t.nnodes} needs the devices of each node. Fix: trainer.devices_per_node=<GPUs per node>")
    need(not t.node_resources or len(t.node_resources) == t.nnodes, "trainer.node_resources",
         f"gives {len(t.node_resources)} resource names for trainer.nnodes={t.nnodes}. Fix: one per node")
    rw = cfg.rollout.world_size
    need(rw is None or rw >= 1, "rollout.world_size", "must be >= 1")
    need(rw is None or t.placement == "disaggregated" or rw == cfg.actor.world_size, "rollout.world_size",
         "in colocated placement the engines share the actor's devices (rollout.world_size = actor.world_size). "
         "Fix: drop rollout.world_size, or trainer.placement=disaggregated")
    need(cfg.rollout.weight_bucket_mb >= 1, "rollout.weight_bucket_mb", "must be >= 1")
    need(t.cpus_per_worker is None or t.cpus_per_worker > 0, "trainer.cpus_per_worker", "must be > 0")
    if t.devices_per_node is not None and t.nnodes >= 1 and t.placement in PLACEMENTS:
        have = t.nnodes * t.devices_per_node
        need(devices_needed(cfg) <= have, "trainer.devices_per_node",
             f"{t.placement} placement needs {devices_needed(cfg)} devices "
             + (f"(actor.world_size={cfg.actor.world_size} + rollout.world_size={rollout_world_size(cfg)})"
                if t.placement == "disaggregated" else f"(actor.world_size={cfg.actor.world_size})")
             + f" but trainer.nnodes x trainer.devices_per_node = {have}. Fix: raise one of them or lower the world sizes")


def off_policy_correction(cfg: RLConfig) -> str:
    """algorithm.off_policy_correction with auto resolved: tis for asynchronous or partial rollouts, none otherwise."""
    chosen = cfg.algorithm.off_policy_correction
    off_policy = cfg.trainer.async_rollout or cfg.rollout.partial.enable  # samples of older weights
    return ("tis" if off_policy else "none") if chosen == "auto" else chosen


def _validate_async(cfg: RLConfig, need) -> None:
    """trainer.async_rollout / max_staleness and the off-policy correction (rlframe/algos/off_policy.py)."""
    from rlframe.algos.off_policy import OFF_POLICY_CORRECTIONS

    t, algo = cfg.trainer, cfg.algorithm
    need(algo.off_policy_correction in OFF_POLICY_CORRECTIONS, "algorithm.off_policy_correction",
         f"'{algo.off_policy_correction}' is not one of {', '.join(OFF_POLICY_CORRECTIONS)}")
    need(_is_number(algo.tis_cap) and algo.tis_cap >= 1.0, "algorithm.tis_cap",
         f"{algo.tis_cap} must be a number >= 1 (a cap below 1 down-weights even on-policy tokens). Fix: 2.0")
    need(isinstance(t.max_staleness, int) and t.max_staleness >= 0, "trainer.max_staleness",
         f"{t.max_staleness}: the steps the asynchronous loop generates ahead must be a whole number >= 0 (0: after "
         "each sync, as the synchronous loop; 1: one step ahead; k: k steps ahead). Fix: trainer.max_staleness=1")
    if not t.async_rollout:
        return
    # Without a correction the update treats samples of older weights as on-policy (what several peers' async
    # modes do silently): allowed only when asked for by name, algorithm.off_policy_correction=none.
    need(t.placement == "disaggregated", "trainer.async_rollout",
         f"generation overlaps the update only when the engines have devices of their own (trainer.placement="
         f"{t.placement}: they share the trainer's). Fix: trainer.placement=disaggregated, or trainer.async_rollout=false")
    need(not algo.dynamic_sampling.enable, "algorithm.dynamic_sampling.enable",
         "dynamic sampling regenerates until the batch is full, which needs the rewards before the next generation "
         "starts; it is not pipelined. Fix: algorithm.dynamic_sampling.enable=false, or trainer.async_rollout=false")
    need(algo.adv_estimator != "remax", "algorithm.adv_estimator",
         "ReMax's greedy baseline must come from the weights that sampled the batch; the asynchronous loop does not "
         "generate it ahead. Fix: another estimator (grpo, rloo), or trainer.async_rollout=false")


def partial_tokens_per_round(cfg: RLConfig) -> int:
    """rollout.partial.max_tokens_per_round with 0 resolved: the smallest budget with which a full-length response
    finishes within the steps the token staleness bound allows (ceil(max_response_length / span))."""
    chosen = cfg.rollout.partial.max_tokens_per_round
    return chosen if chosen > 0 else -(-cfg.data.max_response_length // partial_span_steps(cfg))


def partial_span_steps(cfg: RLConfig) -> int:
    """The steps a held-back response may span before its first tokens are too stale to train (>= 1)."""
    depth = cfg.trainer.max_staleness if cfg.trainer.async_rollout else 0
    return max(1, cfg.rollout.partial.max_token_staleness - depth + 1)


def _validate_partial(cfg: RLConfig, need) -> None:
    """rollout.partial (rlframe/trainer/partial.py): budget, staleness bound, and what it cannot continue."""
    partial, t, algo = cfg.rollout.partial, cfg.trainer, cfg.algorithm
    if not partial.enable:
        return
    key = "rollout.partial.enable"
    # Continuing a response means sending prompt + partial tokens back to the engine as a prompt. vLLM and HF
    # generate take token ids; the multi-turn agent loop's turns (tool calls, observations) cannot be resumed
    # mid-turn, and dynamic sampling / ReMax need every sample of the step from the step's own weights.
    need(not cfg.rollout.multi_turn.enable, key,
         "the multi-turn agent loop cannot resume a response cut mid-turn (its tool calls and observations are not "
         "token-in, token-out). Fix: rollout.partial.enable=false, or rollout.multi_turn.enable=false")
    need(not algo.dynamic_sampling.enable, key,
         "dynamic sampling regenerates until the groups' rewards differ, from the step's own weights; held-back "
         "groups would mix in. Fix: rollout.partial.enable=false, or algorithm.dynamic_sampling.enable=false")
    need(algo.adv_estimator != "remax", key,
         "ReMax's greedy baseline must come from the weights that sampled the whole response. Fix: another "
         "estimator (grpo, rloo), or rollout.partial.enable=false")
    need(cfg.data.source != "shapes", key,
         "responses to image prompts are not continued (the engine would need the pixels and 3-D positions again). "
         "Fix: rollout.partial.enable=false")
    need(partial.max_tokens_per_round >= 0, "rollout.partial.max_tokens_per_round",
         f"{partial.max_tokens_per_round} must be >= 0 (0: the smallest budget the staleness bound allows)")
    need(partial.oversample_batches >= 1, "rollout.partial.oversample_batches",
         f"{partial.oversample_batches}: a step trains one batch of finished groups; at least one more batch must be in "
         "flight to hold responses back. Fix: rollout.partial.oversample_batches=1")
    depth = t.max_staleness if t.async_rollout else 0
    need(depth <= 1, key,
         f"partial rollouts continue held-back responses in the next generation, so at most one generation may be in "
         f"flight (trainer.max_staleness={depth} sends {depth}). Fix: trainer.max_staleness=1, or "
         "rollout.partial.enable=false")
    need(partial.max_token_staleness >= depth + 1, "rollout.partial.max_token_staleness",
         f"{partial.max_token_staleness}: fresh tokens are already {depth} version(s) behind when trained "
         f"(trainer.max_staleness={depth if t.async_rollout else '0, synchronous'}); a held-back token is at least one "
         f"more. Fix: rollout.partial.max_token_staleness={depth + 1} or more")
    budget, length, steps = partial_tokens_per_round(cfg), cfg.data.max_response_length, partial_span_steps(cfg)
    need(budget * steps >= length, "rollout.partial.max_tokens_per_round",
         f"{budget} tokens per round x {steps} step(s) (the span rollout.partial.max_token_staleness="
         f"{partial.max_token_staleness} allows) < data.max_response_length={length}: a full-length response would be "
         f"restarted forever. Fix: rollout.partial.max_tokens_per_round={-(-length // steps)} or more (0 picks it), or "
         "raise rollout.partial.max_token_staleness")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _resolvable(path: str) -> bool:
    from rlframe.models.provision import is_resolvable

    return is_resolvable(path)


def to_container(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
