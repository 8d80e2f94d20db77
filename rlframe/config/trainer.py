"""The `trainer:` section (steps, checkpoints, placement over nodes, asynchronous rollout, logging) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlframe.bounds import bounded
from rlframe.config.gates import CHECKS as GATE_CHECKS
from rlframe.config.gates import GatesConfig
from rlframe.workers.engine.registry import ENGINES


@dataclass
class TimeoutConfig:
    rollout: float = bounded(1800.0, "> 0")  # seconds
    # seconds for one compute_log_prob / reference / value pass before the call is reported as stuck
    log_prob: float = bounded(1800.0, "> 0")
    update: float = bounded(3600.0, "> 0")  # seconds for one actor or critic update
    weight_sync: float = bounded(600.0, "> 0")  # seconds for one weight sync into the rollout engines
    init: float = bounded(900.0, "> 0")  # seconds for the workers to start and build their models


@dataclass
class RuntimeEnvConfig:
    """What every worker on every node gets (Ray runtime_env): env vars and an uploaded working dir."""

    # environment variables for every worker (a new one: +trainer.runtime_env.env_vars.NAME=value)
    env_vars: dict[str, str] = field(default_factory=dict)
    working_dir: Optional[str] = None  # uploaded to every node; its files are importable there


@dataclass
class TrainerConfig:
    # Training steps. RL: one batch of data.train_batch_size prompts each (>= 1). Stage recipes (pt, sft, dpo, rm,
    # rft): a cap on the steps their epochs (rft: rounds) give, with a note; 0: no cap (their recipes' value).
    total_steps: int = bounded(20, ">= 0", "0: a stage's own epochs or rounds; an RL run needs >= 1")
    # Passes over the training data (verl/EasyR1 total_epochs); set, it replaces total_steps with
    # total_epochs x (training rows // data.train_batch_size).
    total_epochs: Optional[int] = bounded(None, ">= 1", "null: run trainer.total_steps steps")
    # default: <runs>/<experiment_name>-<timestamp>, <runs> being $RLFRAME_RUNS_DIR, else ~/rlframe/runs under
    # `ray job submit` (its working directory is a temporary copy), else ./runs
    run_dir: Optional[str] = None
    # false: the console shows our progress line and our warnings; vLLM / Ray / transformers / torch output goes
    # to <run_dir>/logs/ (driver.log, worker-<pid>.log). true: everything on the console as well.
    verbose: bool = False
    project_name: str = "rlframe"  # the wandb project (and tensorboard's grouping)
    # the run's name: wandb's run name and the default run directory runs/<experiment_name>-<time>
    experiment_name: str = "grpo_math"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + wandb, tensorboard
    val_before_train: bool = True  # validate once before the first step (step 0 of metrics.jsonl)
    val_at_end: bool = True  # validate after the last step (summary.json's val_after)
    # stage=rl: write every trained sample (step, uid, response, score, scorable, advantage) to
    # <run_dir>/rollouts.jsonl after the advantage (verl's rollout_data_dir); false: nothing written
    dump_rollouts: bool = False
    # Reorder each batch so every data-parallel rank gets a near-equal number of tokens (a greedy
    # equal-count partition; the spread is at most one sequence's length) before it is split.
    balance_batch: bool = True
    val_every: int = bounded(0, ">= 0", "0: only before and after training")  # validate every N steps
    seed: int = bounded(0, ">= 0")  # the run's seed: rollout sampling (rollout.seed_each_sample), evaluation repeats (seed + r), new heads
    device: str = "auto"  # auto | cpu | cuda
    num_cpus: Optional[int] = bounded(None, ">= 1", "null: all cores")  # CPUs given to a local Ray cluster
    cpus_per_worker: Optional[float] = bounded(None, "> 0")  # default: num_cpus / actor.world_size
    # a running Ray cluster to join (auto, ray://host:10001, host:6379); null: RAY_ADDRESS, else start a local one
    ray_address: Optional[str] = None
    # A local cluster (no ray_address): also start Ray's dashboard (its web UI, job and state APIs, on port 8265);
    # false: a run uses neither, and starts without it
    ray_dashboard: bool = False
    # Multi-node placement (rlframe/trainer/launch.py, examples/multinode.md). colocated: actor,
    # rollout and ref share every device; disaggregated: rollout engines on their own devices (nodes).
    placement: str = "colocated"  # colocated | disaggregated
    nnodes: int = bounded(1, ">= 1")  # nodes the run's placement spans (with devices_per_node; docs/multinode.md)
    devices_per_node: Optional[int] = bounded(None, ">= 1")  # GPUs (or CPU slots of cpus_per_worker) per node; None: legacy one-node pool
    # Optional node pinning: one custom Ray resource per node (ray start --resources='{"node_a": 1}');
    # node i's bundles go to the node that has node_resources[i]. Empty: Ray node ids picked by the driver.
    node_resources: list[str] = field(default_factory=list)
    runtime_env: RuntimeEnvConfig = field(default_factory=lambda: RuntimeEnvConfig())
    export_hf: bool = True  # write the trained model as an HF folder at the end (<run_dir>/hf_model)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    critic_warmup: int = bounded(0, ">= 0")  # PPO: the first N steps train only the critic (the actor is not updated)
    # Checkpoints (<run_dir>/checkpoints/step_N, see rlframe/trainer/checkpoint.py): every
    # `save_every` steps and at the last step; 0 = none at all.
    save_every: int = bounded(0, ">= 0", "0: no checkpoints")
    max_checkpoints_to_keep: int = bounded(2, ">= 0", "0: keep all")  # older complete checkpoints are deleted
    # full: every rank's shard gathered into one HF safetensors file + a full optimizer file (loads in
    # transformers as it is; needs the whole model in one rank's CPU memory) | sharded: each rank writes
    # its own shards with torch.distributed.checkpoint (no gather: for models that do not fit one
    # host); resumes at any world size, `python -m rlframe.export` turns it into an HF folder.
    checkpoint_format: str = "full"
    # auto: continue from the newest complete checkpoint in run_dir (a fresh start when there is
    # none) | disable: always start fresh | a path to one checkpoint folder (step_N).
    resume: str = "auto"
    # A run that starts fresh (resume=disable, a checkpoint from elsewhere, or auto where no checkpoint is
    # usable) in a run_dir where an earlier run left steps (checkpoints, metrics.jsonl):
    # refuse (an error naming what is there) | move_aside (move that run's output into
    # <run_dir>/previous/<UTC time>/ first). rlframe/trainer/run_dir.py
    fresh_start: str = "refuse"
    # Data-stream keys (batch size, rollout.n, data files, seeds; run_dir.DATA_STREAM) allowed to differ from
    # the resumed checkpoint's config.yaml, e.g. [data.train_batch_size]; other changes are only listed.
    resume_allow_changes: list[str] = field(default_factory=list)
    # A dead or stuck worker: tear the worker groups down, start new ones and resume from the
    # latest checkpoint, at most this many times per run (0 = stop with the error).
    max_restarts: int = bounded(0, ">= 0")
    # Non-finite loss or gradient norm: the optimiser step is skipped; after this many in a row
    # the run stops naming the step and micro-batch.
    max_consecutive_skipped_updates: int = bounded(3, ">= 1")
    # The pre-flight memory plan (rlframe/plan.py, `python -m rlframe.plan`), printed before workers
    # start: error = refuse a plan that does not fit (naming the role, device and settings that fit) |
    # warn = print the problem and run | off = no plan.
    memory_check: str = "error"
    device_memory_gib: Optional[float] = bounded(None, "> 0", "null: measured on this machine")  # one device's memory for the plan (default: measured here)
    # One device's peak TFLOP/s for perf/mfu (default: the datasheet bf16 figure of known GPUs, the
    # fp32 matmul rate measured at start on CPU).
    device_peak_tflops: Optional[float] = bounded(None, "> 0")
    # One-step off-policy training (disaggregated placement): the engines generate step k+1's batch while
    # the trainer updates on step k's; the weights reach the engines between steps. Each sample records
    # the version of the weights that generated it (policy_version = updates applied); the staleness
    # (trainer version - sample version, async/staleness_max) never exceeds max_staleness (0: generate
    # after each sync, as the synchronous loop; 1: one step ahead; k >= 2: k steps ahead, the weights staged in
    # Ray's object store and loaded by the engines between generations, so the trainer never waits for them to
    # finish generating). Corrected by algorithm.off_policy_correction.
    async_rollout: bool = False
    # asynchronous rollout: how many steps generation may run ahead of training
    max_staleness: int = bounded(1, ">= 0", "0: after each sync, as the synchronous loop; k: k steps ahead")
    # Checks on every RL step that warn about or stop a run that silently broke (rlframe/config/gates.py).
    gates: GatesConfig = field(default_factory=GatesConfig)


PLACEMENTS = ("colocated", "disaggregated")
CHECKPOINT_FORMATS = ("full", "sharded")
MEMORY_CHECKS = ("error", "warn", "off")
DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")


def rollout_world_size(cfg) -> int:
    return cfg.rollout.world_size or cfg.actor.world_size


def devices_needed(cfg) -> int:
    if cfg.trainer.placement == "disaggregated":
        return cfg.actor.world_size + rollout_world_size(cfg)
    return cfg.actor.world_size


# ------------------------------------------------------------------------------------ checks
def checkpoint_format_supported(cfg, need) -> None:
    """full anywhere; sharded from an engine that writes it (FSDP), for full fine-tuning."""
    fmt, strategy = cfg.trainer.checkpoint_format, cfg.actor.strategy
    need(fmt in CHECKPOINT_FORMATS, "trainer.checkpoint_format", f"'{fmt}' is not one of {', '.join(CHECKPOINT_FORMATS)}")
    writes_sharded = strategy in ENGINES and ENGINES[strategy].sharded_checkpoints
    need(fmt == "full" or (writes_sharded and cfg.model.lora.rank == 0), "trainer.checkpoint_format",
         "sharded checkpoints are written by the FSDP engine for full fine-tuning (a LoRA checkpoint holds "
         "only the small adapters; DeepSpeed gathers a bucket at a time). Fix: trainer.checkpoint_format=full")


def memory_check_known(cfg, need) -> None:
    t = cfg.trainer
    need(t.memory_check in MEMORY_CHECKS, "trainer.memory_check", f"'{t.memory_check}' is not one of {', '.join(MEMORY_CHECKS)}")


def device_known(cfg, need) -> None:
    need(cfg.trainer.device in DEVICES, "trainer.device", "must be auto, cpu or cuda")


def run_dir_is_a_folder(cfg, need) -> None:
    """trainer.run_dir: a folder (made when missing), not a file."""
    run_dir = cfg.trainer.run_dir
    path = Path(run_dir).expanduser() if run_dir else None
    need(path is None or not path.exists() or path.is_dir(), "trainer.run_dir",
         f"'{run_dir}' is a file, not a folder. Fix: trainer.run_dir=<a new or existing folder>")


def checkpoint_schedule_valid(cfg, need) -> None:
    """Where a run resumes from; restarts need checkpoints (the counts are bounded beside their fields)."""
    t = cfg.trainer
    need(t.resume in ("auto", "disable") or Path(t.resume).is_dir(), "trainer.resume",
         f"'{t.resume}' is neither auto, disable nor an existing checkpoint folder. "
         "Fix: trainer.resume=auto or trainer.resume=<run_dir>/checkpoints/step_N")
    need(t.fresh_start in ("refuse", "move_aside"), "trainer.fresh_start",
         f"'{t.fresh_start}' is not one of refuse, move_aside")
    need(t.max_restarts == 0 or t.save_every > 0, "trainer.max_restarts",
         "restarts resume from a checkpoint. Fix: set trainer.save_every >= 1 too")


def critic_warmup_has_a_critic(cfg, need) -> None:
    from rlframe.config.algorithm import run_estimator_needs

    warmup = cfg.trainer.critic_warmup
    need(warmup <= 0 or run_estimator_needs(cfg).critic, "trainer.critic_warmup",
         "only PPO with a critic (algorithm.adv_estimator=gae) has a critic to warm up. Fix: trainer.critic_warmup=0")


def placement_fits_nodes(cfg, need) -> None:
    """Placement keys (the cluster itself is checked when the workers start, before any of them does)."""
    t = cfg.trainer
    need(t.placement in PLACEMENTS, "trainer.placement", f"'{t.placement}' is not one of {', '.join(PLACEMENTS)}")
    need(t.nnodes == 1 or t.devices_per_node is not None, "trainer.devices_per_node",
         f"trainer.nnodes={t.nnodes} needs the devices of each node. Fix: trainer.devices_per_node=<GPUs per node>")
    need(not t.node_resources or len(t.node_resources) == t.nnodes, "trainer.node_resources",
         f"gives {len(t.node_resources)} resource names for trainer.nnodes={t.nnodes}. Fix: one per node")
    if t.devices_per_node is not None and t.nnodes >= 1 and t.placement in PLACEMENTS:
        have = t.nnodes * t.devices_per_node
        need(devices_needed(cfg) <= have, "trainer.devices_per_node",
             f"{t.placement} placement needs {devices_needed(cfg)} devices "
             + (f"(actor.world_size={cfg.actor.world_size} + rollout.world_size={rollout_world_size(cfg)})"
                if t.placement == "disaggregated" else f"(actor.world_size={cfg.actor.world_size})")
             + f" but trainer.nnodes x trainer.devices_per_node = {have}. Fix: raise one of them or lower the world sizes")


def async_rollout_can_run_ahead(cfg, need) -> None:
    """trainer.async_rollout: engines on devices of their own, and nothing that needs the step's rewards or
    weights before the next generation starts. (Without a correction the update treats samples of older
    weights as on-policy, what several peers' async modes do silently: allowed only when asked for by name,
    algorithm.off_policy_correction=none.)"""
    t, algo = cfg.trainer, cfg.algorithm
    if not t.async_rollout:
        return
    from rlframe.config.algorithm import run_estimator_needs

    need(t.placement == "disaggregated", "trainer.async_rollout",
         f"generation overlaps the update only when the engines have devices of their own (trainer.placement="
         f"{t.placement}: they share the trainer's). Fix: trainer.placement=disaggregated, or trainer.async_rollout=false")
    need(not algo.dynamic_sampling.enable, "algorithm.dynamic_sampling.enable",
         "dynamic sampling regenerates until the batch is full, which needs the rewards before the next generation "
         "starts; it is not pipelined. Fix: algorithm.dynamic_sampling.enable=false, or trainer.async_rollout=false")
    need(not run_estimator_needs(cfg).greedy_baseline, "algorithm.adv_estimator",
         "ReMax's greedy baseline must come from the weights that sampled the batch; the asynchronous loop does not "
         "generate it ahead. Fix: another estimator (grpo, rloo), or trainer.async_rollout=false")


def rl_run_has_steps(cfg, need) -> None:
    t = cfg.trainer
    need(cfg.stage != "rl" or t.total_steps >= 1 or bool(t.total_epochs), "trainer.total_steps",
         "0 means 'as many as the epochs give' for the stage recipes (pt, sft, dpo, rm, rft); an RL run needs a count. "
         "Fix: trainer.total_steps=20, or trainer.total_epochs=1")


def loggers_known(cfg, need) -> None:
    unknown_loggers = set(cfg.trainer.loggers) - set(LOGGERS)
    need(not unknown_loggers, "trainer.loggers", f"unknown loggers {sorted(unknown_loggers)}")


CHECKS = (checkpoint_format_supported, memory_check_known, device_known, run_dir_is_a_folder, checkpoint_schedule_valid,
          critic_warmup_has_a_critic, placement_fits_nodes, async_rollout_can_run_ahead,
          rl_run_has_steps, loggers_known) + GATE_CHECKS
