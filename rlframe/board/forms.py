"""The train form -> the `key=value` overrides of `python -m rlframe.main` (pure functions, no gradio).

    form = TrainForm(recipe="grpo_math", total_steps=2, model_source="folder", model_path="/m")
    args = train_args(form, run_dir)          # ["recipe=grpo_math", "trainer.total_steps=2", ...]
    command_line(args)                        # "python -m rlframe.main recipe=grpo_math ..." (what runs)

A field left empty (None or "") adds no override: the recipe's value stands. The editable YAML holds the
rest of the configuration: `yaml_overrides(text, composed, owned)` turns each leaf that differs from the
composed configuration into one override (keys the form owns are the form's: edit them there).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

STAGES = ("rl", "sft", "dpo", "rm", "rft", "pt")  # the issue names the first four; rft and pt have recipes too
MODEL_SOURCES = ("embedded", "folder", "hub")
DATA_SOURCES = ("recipe", "files")
KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
DATA_KEYS = ("prompt_key", "answer_key", "image_key", "video_key", "audio_key")  # form field = data.<same name>
ROUTED_TEACHER_PATH = re.compile(r"^teachers\.[^.]+\.path$")  # teachers.<name>.path (the YAML's routed teachers)

# The keys a user touches most: (form field, config key). Their help text is the schema's (schema_help.py).
MAIN_KEYS: dict[str, str] = {
    "total_steps": "trainer.total_steps",
    "lr": "actor.optim.lr",
    "train_batch_size": "data.train_batch_size",
    "rollout_n": "rollout.n",
    "temperature": "rollout.temperature",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "kl_loss_coef": "algorithm.kl_loss_coef",
    "save_every": "trainer.save_every",
    "val_every": "trainer.val_every",
}


@dataclass
class TrainForm:
    """What the Train tab holds; every field maps to overrides in train_args."""

    stage: str = "rl"
    recipe: str = "grpo_math"
    model_source: str = "embedded"  # embedded (the recipe's model) | folder | hub
    model_path: str = ""
    data_source: str = "recipe"  # recipe (its own, e.g. generated arithmetic) | files
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = ""
    answer_key: str = ""
    image_key: str = ""
    video_key: str = ""  # data.video_key: each row's videos (docs/vision.md); "" = the recipe's
    audio_key: str = ""  # data.audio_key: each row's audios (docs/vision.md); "" = the recipe's
    reward_path: str = ""  # reward_fns/math.py or an uploaded file in the workspace; "" = the recipe's
    reward_name: str = ""
    judge_url: str = ""  # reward.judge.url: an LLM judge's OpenAI-compatible endpoint (docs/judge.md); "" = the recipe's
    judge_model: str = ""  # reward.judge.model: the judge's served name; "" = the recipe's
    # teacher.path: on-policy distillation's frozen teacher (docs/distillation.md), an HF folder with the student's
    # tokenizer; the board confines it to the workspace (actions.Board.checked_form); "" = the recipe's
    teacher_path: str = ""
    distillation_loss_mode: str = ""  # distillation.loss_mode, one of loss_modes(); "" = the recipe's
    total_steps: int | None = None
    lr: float | None = None
    train_batch_size: int | None = None
    rollout_n: int | None = None
    temperature: float | None = None
    max_prompt_length: int | None = None
    max_response_length: int | None = None
    kl_loss_coef: float | None = None
    save_every: int | None = None
    val_every: int | None = None
    extra_yaml: str = ""  # the editable configuration (see yaml_overrides)

    @classmethod
    def from_dict(cls, data: dict) -> TrainForm:
        """From saved settings: unknown keys are ignored, missing ones take the defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


def value_text(value: Any) -> str:
    """A Python value as Hydra's override grammar reads it back (strings quoted when they need it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"{value} cannot be given as a setting")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./~:@+-]+", text) and text.lower() not in ("null", "true", "false", "none"):
        try:
            float(text)
        except ValueError:
            return text
    # `${` escaped: the board's own environment and configuration must not be read into a value
    # (OmegaConf interpolation such as ${oc.env:HOME}); the run receives the text as typed
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${") + "'"


def override(key: str, value: Any) -> str:
    return f"{key}={value_text(value)}"


def reward_override(path: str, name: str) -> str:
    """reward.functions as one function (weight 1): the form picks one; the YAML can list several."""
    entry = {"path": path, "name": name or "compute_score", "weight": 1.0}
    return "reward.functions=[" + value_text(entry) + "]"


def owned_keys(form: TrainForm) -> set[str]:
    """The config keys (and prefixes) this form sets, which yaml_overrides leaves to the form."""
    keys = {MAIN_KEYS[name] for name in MAIN_KEYS if getattr(form, name) not in (None, "")}
    keys |= {"stage", "trainer.run_dir"}
    if form.model_source != "embedded":
        keys.add("model.path")
    if form.data_source == "files":
        keys |= {"data.train_files", "data.val_files", "data.source"}
    keys |= {f"data.{k}" for k in DATA_KEYS if getattr(form, k)}
    if form.reward_path:
        keys.add("reward.functions")
    keys |= {f"reward.judge.{k}" for k in ("url", "model") if getattr(form, f"judge_{k}").strip()}
    if form.teacher_path.strip():
        keys.add("teacher.path")
    if form.distillation_loss_mode.strip():
        keys.add("distillation.loss_mode")
    return keys


def form_overrides(form: TrainForm) -> list[str]:
    """The form's own fields as overrides (the editable YAML and the run folder excluded)."""
    args = [f"recipe={form.recipe}"]
    if form.stage and form.stage != recipe_stage(form.recipe):
        args.append(override("stage", form.stage))
    if form.model_source != "embedded" and form.model_path.strip():
        args.append(override("model.path", form.model_path.strip()))
    if form.data_source == "files" and form.train_files:
        args.append(override("data.train_files", list(form.train_files)))
        args.append(override("data.val_files", list(form.val_files)))
    for key in DATA_KEYS:
        if getattr(form, key):
            args.append(override(f"data.{key}", getattr(form, key)))
    if form.reward_path:
        args.append(reward_override(form.reward_path, form.reward_name))
    for key in ("url", "model"):  # an LLM judge in the loop (a rubric, pattern, ... in the YAML)
        if getattr(form, f"judge_{key}").strip():
            args.append(override(f"reward.judge.{key}", getattr(form, f"judge_{key}").strip()))
    if form.teacher_path.strip():  # on-policy distillation (docs/distillation.md); the rest of teacher: in the YAML
        args.append(override("teacher.path", form.teacher_path.strip()))
    if form.distillation_loss_mode.strip():
        args.append(override("distillation.loss_mode", form.distillation_loss_mode.strip()))
    for name, key in MAIN_KEYS.items():
        value = getattr(form, name)
        if value not in (None, ""):
            args.append(override(key, value))
    return args


def loss_modes() -> tuple[str, ...]:
    """distillation.loss_mode's choices, read from the schema (rlframe/config/teacher.py LOSS_MODES, what its one_of
    check accepts: k1, the advantage term, and the loss terms of rlframe/algos/distillation.py's registry)."""
    from rlframe.config.teacher import LOSS_MODES

    return tuple(LOSS_MODES)


def teacher_paths(form: TrainForm) -> list[tuple[str, str]]:
    """Every teacher folder the form names, as (key, value): its teacher box, and the editable YAML's teacher.path
    (when the box is empty) and teachers.<name>.path. The board confines each one (actions.Board.checked_form)."""
    boxed = bool(form.teacher_path.strip())
    out = [("teacher.path", form.teacher_path.strip())] if boxed else []
    try:
        edited = yaml.safe_load(form.extra_yaml) if form.extra_yaml.strip() else None
    except yaml.YAMLError:  # (yaml_overrides names the error and its line)
        edited = None
    if isinstance(edited, dict):
        for key, value in flatten(edited).items():
            wanted = ROUTED_TEACHER_PATH.match(key) or (key == "teacher.path" and not boxed)
            if wanted and value not in (None, ""):
                out.append((key, str(value)))
    return out


def train_args(form: TrainForm, run_dir: str | Path, composed: dict | None = None) -> list[str]:
    """Everything `python -m rlframe.main` is given: the form, the YAML's changes, the run folder."""
    args = form_overrides(form)
    if composed is not None and form.extra_yaml.strip():
        args += yaml_overrides(form.extra_yaml, composed, owned_keys(form))
    args.append(override("trainer.run_dir", str(run_dir)))
    return args


def command_line(args: list[str], entry: str = "rlframe.main") -> str:
    """The command as a user would type it, quoted as the run itself records it (owner.json's command)."""
    return " ".join(["python", "-m", entry, *(shlex.quote(a) for a in args)])


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are leaves."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


class YamlError(ValueError):
    """The editable YAML cannot be read; the message names the line and the fix."""


def yaml_overrides(text: str, composed: dict, owned: set[str]) -> list[str]:
    """Each leaf of the edited YAML that differs from `composed` -> `key=value` (a new key: `+key=value`).

    Keys in `owned` (or under them) are skipped: the form sets them."""
    try:
        edited = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise YamlError(f"the configuration YAML,{where}: {getattr(err, 'problem', None) or err}. "
                        "Fix: correct the YAML there (`section:` blocks, two-space indents)") from None
    if edited is None:
        return []
    if not isinstance(edited, dict):
        raise YamlError("the configuration YAML must be a mapping of sections (model:, data:, ...). "
                        "Fix: write it as `section: {key: value}` blocks, or clear it")
    base = flatten(composed)
    out = []
    for key, value in flatten(edited).items():
        if not KEY.match(key):
            raise YamlError(f"the configuration YAML: '{key}' is not a key name. Fix: letters, digits and _ only")
        if any(key == k or key.startswith(k + ".") for k in owned):
            continue
        if key in base and base[key] == value:
            continue
        out.append(("" if key in base or any(b.startswith(key + ".") for b in base) else "+") + override(key, value))
    return out


def recipe_stage(recipe: str) -> str:
    """The stage a recipe file sets (`stage:`), rl when it sets none."""
    from rlframe.main import RECIPES_DIR

    path = Path(recipe) if recipe.endswith((".yaml", ".yml")) else RECIPES_DIR / f"{recipe}.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "rl"
    return str(data.get("stage", "rl")) if isinstance(data, dict) else "rl"


def recipes_by_stage() -> dict[str, list[str]]:
    """Every shipped recipe under its stage (pt and rft recipes are listed under their own names too)."""
    from rlframe.main import available_recipes

    out: dict[str, list[str]] = {}
    for name in available_recipes():
        out.setdefault(recipe_stage(name), []).append(name)
    return out
