"""Command lines written for verl or EasyR1, translated to rlframe's keys before Hydra sees them.

`translate_overrides(argv)` turns each peer override into ours and returns a one-line notice per
translation ("verl key trainer.save_freq=10 -> trainer.save_every=10"). A peer key that rlframe
has no equivalent for is an error naming the closest of our keys; an unknown key (ours or a
typo) is an error listing the closest keys of the schema ("did you mean actor.optim.lr?") -- never
Hydra's invitation to append it with `+key`.

The table below is the whole translation: `PEER_KEYS[key] = (our key, value function or None)`.
A value function maps the override's value text to a list of (our key, value text) pairs.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Callable

# ------------------------------------------------------------------ value helpers


def _as_list_text(value: str) -> str:
    """A file list as Hydra text: a plain string (`~/data/x.parquet`) becomes a one-item list."""
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        return value
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return "[" + repr(value) + "]" if "'" not in value else '["' + value + '"]'


def _freq(value: str) -> str:
    """verl/EasyR1 frequencies: -1 (or 0) means never; ours: 0."""
    try:
        return str(max(int(value), 0))
    except ValueError:
        return value


def _bool(value: str) -> bool:
    return value.strip().strip("'\"").lower() in ("true", "1", "yes", "on")


def _negate(value: str) -> str:
    return "false" if _bool(value) else "true"


def _loggers(value: str) -> str:
    return _as_list_text(value)


def _truncation(value: str) -> list[tuple[str, str]]:
    mapping = {"error": "error", "left": "truncate_left", "middle": None, "right": None}
    v = value.strip("'\"")
    if mapping.get(v) is None:
        raise CompatError(f"data.truncation={v}: rlframe truncates only on the left (data.overlong=truncate_left) "
                          "or filters/raises. Fix: data.overlong=filter|error|truncate_left")
    return [("data.overlong", mapping[v])]


def _filter_overlong(value: str) -> list[tuple[str, str]]:
    return [("data.overlong", "filter" if _bool(value) else "error")]


def _rollout_name(value: str) -> list[tuple[str, str]]:
    v = value.strip("'\"")
    if v not in ("vllm", "hf"):
        raise CompatError(f"rollout engine '{v}' is not available in rlframe (vllm or hf). Fix: rollout.engine=vllm")
    return [("rollout.engine", v)]


def _only_one(peer: str, ours: str) -> Callable[[str], list[tuple[str, str]]]:
    """A parallel size rlframe does not split by: 1 is accepted (and dropped), more is an error."""

    def translate(value: str) -> list[tuple[str, str]]:
        if value.strip("'\"") in ("1", "null", "None"):
            return []
        raise CompatError(f"{peer}={value}: rlframe's rollout engines are data-parallel only (no tensor "
                          f"parallelism inside one engine). Closest rlframe key: {ours}")
    return translate


def _ignored(value: str) -> list[tuple[str, str]]:
    return []


def _dynamic_bsz(value: str) -> list[tuple[str, str]]:
    # verl's use_dynamic_bsz switches token-budget micro-batches on; ours are on when a budget > 0
    # is set. verl's default budget is 16384 tokens per GPU (set ppo_max_token_len_per_gpu to change it).
    if _bool(value):
        return [("actor.ppo_max_token_len_per_device", "16384"), ("actor.log_prob_max_token_len_per_device", "16384")]
    return [("actor.ppo_max_token_len_per_device", "0"), ("actor.log_prob_max_token_len_per_device", "0")]


def _clip_ratio(value: str) -> list[tuple[str, str]]:
    return [("actor.clip_ratio_low", value), ("actor.clip_ratio_high", value)]


def _val_do_sample(value: str) -> list[tuple[str, str]]:
    return [] if _bool(value) else [("rollout.val_temperature", "0.0")]


# Reward-function keys collect into one reward.functions=[{...}] override (see translate_overrides).
_REWARD = "reward.functions[0]"

# peer key -> (our key, value function). A value function returns [(our key, value), ...].
PEER_KEYS: dict[str, tuple[str | None, Callable | None]] = {
    # ---- verl (verl/trainer/config/ppo_trainer.yaml)
    "data.train_files": ("data.train_files", lambda v: [("data.train_files", _as_list_text(v))]),
    "data.val_files": ("data.val_files", lambda v: [("data.val_files", _as_list_text(v))]),
    "data.truncation": ("data.overlong", _truncation),
    "data.filter_overlong_prompts": ("data.overlong", _filter_overlong),
    "data.filter_overlong_prompts_workers": (None, _ignored),
    "data.val_batch_size": (None, _ignored),
    "data.return_raw_chat": (None, _ignored),
    "actor_rollout_ref.hybrid_engine": (None, _ignored),
    "actor_rollout_ref.model.path": ("model.path", None),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", None),
    "actor_rollout_ref.model.use_remove_padding": ("actor.use_remove_padding", None),
    "actor_rollout_ref.model.trust_remote_code": ("model.trust_remote_code", None),
    "actor_rollout_ref.model.lora_rank": ("model.lora.rank", None),
    "actor_rollout_ref.model.lora_alpha": ("model.lora.alpha", None),
    "actor_rollout_ref.model.target_modules": ("model.lora.target_modules", None),
    "actor_rollout_ref.actor.strategy": ("actor.strategy", None),
    "actor_rollout_ref.actor.optim.lr": ("actor.optim.lr", None),
    "actor_rollout_ref.actor.optim.weight_decay": ("actor.optim.weight_decay", None),
    "actor_rollout_ref.actor.optim.betas": ("actor.optim.betas", None),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("actor.optim.warmup_steps", None),
    "actor_rollout_ref.actor.grad_clip": ("actor.optim.grad_clip", None),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("actor.ppo_mini_batch_size", None),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("actor.ppo_micro_batch_size_per_device", None),
    "actor_rollout_ref.actor.ppo_epochs": ("actor.ppo_epochs", None),
    "actor_rollout_ref.actor.shuffle": ("actor.shuffle", None),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("actor.ppo_max_token_len_per_device", _dynamic_bsz),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("actor.ppo_max_token_len_per_device", None),
    "actor_rollout_ref.actor.use_kl_loss": ("algorithm.use_kl_loss", None),
    "actor_rollout_ref.actor.kl_loss_coef": ("algorithm.kl_loss_coef", None),
    "actor_rollout_ref.actor.kl_loss_type": ("algorithm.kl_loss_type", None),
    "actor_rollout_ref.actor.entropy_coeff": ("actor.entropy_coeff", None),
    "actor_rollout_ref.actor.clip_ratio": ("actor.clip_ratio_low", _clip_ratio),
    "actor_rollout_ref.actor.clip_ratio_low": ("actor.clip_ratio_low", None),
    "actor_rollout_ref.actor.clip_ratio_high": ("actor.clip_ratio_high", None),
    "actor_rollout_ref.actor.clip_ratio_c": ("actor.clip_ratio_c", None),
    "actor_rollout_ref.actor.loss_agg_mode": ("actor.loss_agg_mode", None),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("actor.policy_loss", None),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ("actor.ulysses_sequence_parallel_size", None),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("actor.offload_params", None),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("actor.offload_optimizer", None),
    "actor_rollout_ref.ref.fsdp_config.param_offload": (None, _ignored),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("actor.log_prob_micro_batch_size_per_device", None),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("actor.log_prob_micro_batch_size_per_device", None),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": ("actor.log_prob_max_token_len_per_device", None),
    "actor_rollout_ref.rollout.name": ("rollout.engine", _rollout_name),
    "actor_rollout_ref.rollout.n": ("rollout.n", None),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", None),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", None),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", None),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.gpu_memory_utilization", None),
    "actor_rollout_ref.rollout.enforce_eager": ("rollout.enforce_eager", None),
    "actor_rollout_ref.rollout.enable_chunked_prefill": ("rollout.enable_chunked_prefill", None),
    "actor_rollout_ref.rollout.max_num_batched_tokens": ("rollout.max_num_batched_tokens", None),
    "actor_rollout_ref.rollout.free_cache_engine": ("rollout.enable_sleep_mode", None),
    "actor_rollout_ref.rollout.tensor_model_parallel_size":
        ("rollout.world_size", _only_one("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.world_size")),
    "actor_rollout_ref.rollout.val_kwargs.temperature": ("rollout.val_temperature", None),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": ("rollout.val_temperature", _val_do_sample),
    "critic.optim.lr": ("critic.optim.lr", None),
    "critic.model.path": ("critic.model_path", None),
    "critic.ppo_micro_batch_size_per_gpu": ("critic.ppo_micro_batch_size_per_device", None),
    "critic.forward_micro_batch_size_per_gpu": ("critic.forward_micro_batch_size_per_device", None),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", None),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_ctrl.kl_coef", None),
    "reward_model.model.path": ("reward_model.path", None),
    "reward_model.reward_manager": (None, _ignored),
    "custom_reward_function.path": (f"{_REWARD}.path", None),
    "custom_reward_function.name": (f"{_REWARD}.name", None),
    "trainer.total_training_steps": ("trainer.total_steps", None),
    "trainer.save_freq": ("trainer.save_every", lambda v: [("trainer.save_every", _freq(v))]),
    "trainer.test_freq": ("trainer.val_every", lambda v: [("trainer.val_every", _freq(v))]),
    "trainer.logger": ("trainer.loggers", lambda v: [("trainer.loggers", _loggers(v))]),
    "trainer.default_local_dir": ("trainer.run_dir", None),
    "trainer.max_actor_ckpt_to_keep": ("trainer.max_checkpoints_to_keep", None),
    "trainer.resume_from_path": ("trainer.resume", None),
    "trainer.n_gpus_per_node": ("actor.world_size", None),  # x trainer.nnodes: see translate_overrides
    "trainer.device": ("trainer.device", None),
    "trainer.log_val_generations": (None, _ignored),
    # ---- images (both peers): rlframe/data/multimodal.py
    "data.image_key": ("data.image_key", None),
    "data.min_pixels": ("data.min_pixels", None),
    "data.max_pixels": ("data.max_pixels", None),
    "data.video_key": ("data.video_key", None),
    "data.video_fps": ("data.video_fps", None),  # EasyR1
    "data.video_max_frames": ("data.video_max_frames", None),
    "data.audio_key": ("data.audio_key", None),  # verl (rlframe/data/audio.py)
    "worker.actor.model.freeze_vision_tower": ("actor.freeze_vision_tower", None),
    # ---- EasyR1 (examples/config.yaml)
    "data.rollout_batch_size": ("data.train_batch_size", None),
    "data.format_prompt": ("data.prompt_template", None),
    "data.mini_rollout_batch_size": (None, _ignored),
    "algorithm.disable_kl": ("algorithm.use_kl_loss", lambda v: [("algorithm.use_kl_loss", _negate(v))]),
    "algorithm.kl_coef": ("algorithm.kl_loss_coef", None),
    "worker.actor.global_batch_size": ("actor.ppo_mini_batch_size", None),
    "worker.actor.micro_batch_size_per_device_for_update": ("actor.ppo_micro_batch_size_per_device", None),
    "worker.actor.micro_batch_size_per_device_for_experience": ("actor.log_prob_micro_batch_size_per_device", None),
    "worker.actor.max_grad_norm": ("actor.optim.grad_clip", None),
    "worker.actor.ppo_epochs": ("actor.ppo_epochs", None),
    "worker.actor.padding_free": ("actor.use_remove_padding", None),
    "worker.actor.ulysses_size": ("actor.ulysses_sequence_parallel_size", None),
    "worker.actor.clip_ratio_low": ("actor.clip_ratio_low", None),
    "worker.actor.clip_ratio_high": ("actor.clip_ratio_high", None),
    "worker.actor.clip_ratio_dual": ("actor.clip_ratio_c", None),
    "worker.actor.loss_avg_mode": ("actor.loss_agg_mode", None),
    "worker.actor.model.model_path": ("model.path", None),
    "worker.actor.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", None),
    "worker.actor.model.trust_remote_code": ("model.trust_remote_code", None),
    "worker.actor.optim.lr": ("actor.optim.lr", None),
    "worker.actor.optim.weight_decay": ("actor.optim.weight_decay", None),
    "worker.actor.optim.betas": ("actor.optim.betas", None),
    "worker.actor.offload.offload_params": ("actor.offload_params", None),
    "worker.actor.offload.offload_optimizer": ("actor.offload_optimizer", None),
    "worker.rollout.n": ("rollout.n", None),
    "worker.rollout.temperature": ("rollout.temperature", None),
    "worker.rollout.top_p": ("rollout.top_p", None),
    "worker.rollout.top_k": ("rollout.top_k", None),
    "worker.rollout.gpu_memory_utilization": ("rollout.gpu_memory_utilization", None),
    "worker.rollout.enforce_eager": ("rollout.enforce_eager", None),
    "worker.rollout.enable_chunked_prefill": ("rollout.enable_chunked_prefill", None),
    "worker.rollout.max_num_batched_tokens": ("rollout.max_num_batched_tokens", None),
    "worker.rollout.tensor_parallel_size":
        ("rollout.world_size", _only_one("worker.rollout.tensor_parallel_size", "rollout.world_size")),
    "worker.rollout.val_override_config.temperature": ("rollout.val_temperature", None),
    "worker.reward.reward_function": (f"{_REWARD}.path", None),  # path[:name]
    "worker.reward.reward_type": (f"{_REWARD}.reward_type", None),
    "worker.reward.num_cpus": ("reward.num_workers", None),
    "trainer.max_steps": ("trainer.total_steps", None),
    "trainer.val_freq": ("trainer.val_every", lambda v: [("trainer.val_every", _freq(v))]),
    "trainer.save_checkpoint_path": ("trainer.run_dir", None),
    "trainer.save_limit": ("trainer.max_checkpoints_to_keep", lambda v: [("trainer.max_checkpoints_to_keep", _freq(v))]),
    "trainer.load_checkpoint_path": ("trainer.resume", None),
    "trainer.val_generations_to_log": (None, _ignored),
}

# Prefixes of peer keys whose sub-keys are collected as reward kwargs.
REWARD_KWARGS_PREFIXES = ("custom_reward_function.reward_kwargs.", "worker.reward.reward_function_kwargs.")

# Peer keys with no rlframe equivalent: key -> the closest of ours (named in the error).
NO_EQUIVALENT: dict[str, str] = {
    "actor_rollout_ref.rollout.mode": "rollout.engine (rollouts are synchronous: the agent loop is configured under rollout)",
    "actor_rollout_ref.rollout.multi_turn.enable": "rollout (see the agent loop settings in rlframe/config/)",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_steps (a count of steps)",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.warmup_steps (linear warm-up, then constant)",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.warmup_steps (linear warm-up, then constant)",
    "worker.actor.optim.lr_warmup_ratio": "actor.optim.warmup_steps (a count of steps)",
    "worker.actor.optim.strategy": "actor.optim (AdamW)",
    "trainer.balance_batch": "trainer.balance_batch",
    "config": "recipe (recipe=<name> or recipe=/path/to/recipe.yaml; EasyR1's config=<file> is rlframe's recipe=)",
}
# trainer.balance_batch exists in rlframe under the same name: remove it from NO_EQUIVALENT.
NO_EQUIVALENT.pop("trainer.balance_batch")


class CompatError(ValueError):
    """A peer (verl / EasyR1) override with no rlframe equivalent, or an unknown key."""


# ------------------------------------------------------------------ the schema's keys


def schema_keys(schema: type | None = None, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of the typed config -> whether it holds free-form content below it
    (a dict, a list of sections, or Any), where deeper keys cannot be checked here."""
    if schema is None:
        from rlframe.config import RLConfig

        schema = RLConfig
    keys: dict[str, bool] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        if origin is typing.Union:  # Optional[X]
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if len(args) == 1 else Any
            origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            keys[key] = False
            keys.update(schema_keys(hint, key + "."))
        else:
            keys[key] = hint is Any or origin in (dict, list)
    return keys


def closest_keys(key: str, keys: list[str], n: int = 3) -> list[str]:
    """Our keys nearest to `key`: by the full dotted name, and by its last part."""
    found = difflib.get_close_matches(key, keys, n=n, cutoff=0.5)
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = [k for k in keys if k.rsplit(".", 1)[-1] in difflib.get_close_matches(
        leaf, [k.rsplit(".", 1)[-1] for k in keys], n=n, cutoff=0.6)]
    by_leaf.sort(key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())
    for k in by_leaf:
        if k not in found:
            found.append(k)
    return found[:n]


def _check_known(key: str, keys: dict[str, bool]) -> None:
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in keys:
            if i == len(parts) or keys[head]:
                return
            break
    suggestions = closest_keys(key, [k for k in keys])
    hint = f" Did you mean {' or '.join(suggestions)}?" if suggestions else ""
    raise CompatError(f"unknown config key '{key}'.{hint} Fix: use one of the schema's keys "
                      "(all keys and their meaning: rlframe/config/).")


# ------------------------------------------------------------------ translation

_OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.\[\]]*)(?:=(?P<value>.*))?$", re.S)


def translate_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """verl / EasyR1 overrides -> ours; every key checked against the schema.

    Returns (overrides for Hydra, one notice per translated key). Raises CompatError for a peer key
    without an equivalent and for an unknown key, naming the closest of our keys.
    """
    keys = schema_keys()
    out: list[str] = []
    notices: list[str] = []
    reward: dict[str, str] = {}
    reward_kwargs: dict[str, str] = {}
    epochs: str | None = None
    nnodes = next((a.split("=", 1)[1] for a in argv if a.startswith("trainer.nnodes=")), "1")
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if not m:
            out.append(arg)
            continue
        prefix, key, value = m.group("prefix") or "", m.group("key"), m.group("value")
        if key in NO_EQUIVALENT:
            raise CompatError(f"'{key}' (a verl/EasyR1 key) has no equivalent in rlframe. "
                              f"Closest rlframe key: {NO_EQUIVALENT[key]}")
        kwargs_prefix = next((p for p in REWARD_KWARGS_PREFIXES if key.startswith(p)), None)
        if kwargs_prefix is not None and value is not None:
            reward_kwargs[key[len(kwargs_prefix):]] = value
            notices.append(f"{key}={value} -> reward.functions[0].kwargs.{key[len(kwargs_prefix):]}={value}")
            continue
        if key == "trainer.n_gpus_per_node" and value is not None:
            # verl trains on every GPU: actor.world_size = GPUs per node x nodes
            world = int(value) * int(nnodes) if value.isdigit() and nnodes.isdigit() else value
            out.append(f"actor.world_size={world}")
            if nnodes != "1":
                out.append(f"trainer.devices_per_node={value}")
            notices.append(f"{key}={value} -> actor.world_size={world}"
                           + (f", trainer.devices_per_node={value}" if nnodes != "1" else ""))
            continue
        if key == "trainer.total_epochs":
            epochs = value
            out.append(f"trainer.total_epochs={value}")
            continue
        if key in PEER_KEYS and value is not None:
            ours, translate = PEER_KEYS[key]
            if ours is not None and ours.startswith(_REWARD):
                field = ours.rsplit(".", 1)[-1]
                if key == "worker.reward.reward_function" and ":" in value.strip("'\""):
                    path, name = value.strip("'\"").rsplit(":", 1)
                    reward["path"], reward["name"] = path, name
                else:
                    reward[field] = value.strip("'\"")
                notices.append(f"{key}={value} -> reward.functions[0].{field}")
                continue
            pairs = translate(value) if translate else [(ours, value)]
            if [(key, value)] == pairs:
                out.append(arg)
                continue
            out.extend(f"{prefix}{k}={v}" for k, v in pairs)
            if ours == key:  # our own key, its value only put in Hydra's list syntax: nothing to announce
                continue
            shown = ", ".join(f"{k}={v}" for k, v in pairs) or "(not needed in rlframe: dropped)"
            notices.append(f"{key}={value} -> {shown}")
            continue
        if key.startswith(("actor_rollout_ref.", "worker.", "custom_reward_function.")):
            leaf_match = closest_keys(key.split(".", 1)[1] if key.count(".") else key, list(keys))
            hint = f" Closest rlframe keys: {', '.join(leaf_match)}." if leaf_match else ""
            raise CompatError(f"'{key}' (a verl/EasyR1 key) has no translation in rlframe.{hint} "
                              "(The table: rlframe/compat.py; all rlframe keys: rlframe/config/.)")
        if prefix != "~":
            _check_known(key.replace("[", ".").replace("]", ""), keys)
        out.append(arg)
    if reward or reward_kwargs:
        entry = {"path": reward.get("path", "reward_fns/math.py"), "name": reward.get("name", "compute_score")}
        if "reward_type" in reward:
            entry["reward_type"] = reward["reward_type"]
        items = [f"{k}: {_yaml_value(v)}" for k, v in entry.items()]
        if reward_kwargs:
            items.append("kwargs: {" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in reward_kwargs.items()) + "}")
        out.append("reward.functions=[{" + ", ".join(items) + "}]")
    if epochs is not None:
        notices.append(f"trainer.total_epochs={epochs}: the run lasts {epochs} passes over the training data "
                       "(trainer.total_steps is computed from the dataset size)")
    return out, notices


def _yaml_value(value: str) -> str:
    """A value for a Hydra flow mapping: paths and free text quoted, numbers and booleans as they are."""
    v = value.strip()
    if re.fullmatch(r"-?\d+(\.\d*)?([eE][-+]?\d+)?|true|false|True|False|null", v) or v[:1] in "[{'\"":
        return v
    return "'" + v.replace("'", "\\'") + "'"
