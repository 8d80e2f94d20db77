"""Entry point: `python -m rlframe.main recipe=grpo_math [key=value ...]` (`--help`, `--keys [prefix]`, `--cfg job`).

The recipe is a YAML file in `recipes/` (or a path to one); every other argument is a Hydra
override (`actor.optim.lr=1e-6`, `+key=value`, `~key`). The composed config is merged onto the
typed schema in `rlframe.config` (unknown keys and wrong types are errors naming the key) and
validated before Ray or any worker starts: the configuration (`validate_config`), then the model
folder, the memory plan and the run's data (`prepare_run`: every row read, checked and templated).

Bad input of any kind (a recipe, a key, a value, a data file or row, a template, a checkpoint) ends the
run with a one-screen `error: ...` naming the key or file and the fix, exit status 1 (USAGE_ERRORS);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlframe.collector import collector_paused
from rlframe.config import ConfigError, RLConfig, apply_algorithm_defaults, validate_before_workers, validate_config
from rlframe.schema_types import field_type, type_in_words
from rlframe.trainer.startup import STARTUP

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent


def shipped_dir(name: str) -> Path:
    """recipes/ or reward_fns/: next to the package in a checkout, inside it in an installed wheel."""
    in_checkout = REPO_ROOT / name
    return in_checkout if in_checkout.is_dir() else PACKAGE_DIR / name


RECIPES_DIR = shipped_dir("recipes")


class UsageError(SystemExit):
    """Bad input: printed as `error: <message>` (at most one screen), exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"error: {one_screen(message)}")


SCREEN_LINES = 40


def one_screen(message: str, lines: int = SCREEN_LINES) -> str:
    """`message` cut to `lines` lines (the rest counted), each line to 400 characters."""
    rows = [row if len(row) <= 400 else row[:397] + "..." for row in str(message).splitlines()]
    if len(rows) > lines:
        rows = rows[: lines - 1] + [f"  ... and {len(rows) - lines + 1} more lines"]
    return "\n".join(rows)


def usage_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (each message names the key or file and the fix)."""
    from rlframe.data.files import DatasetError
    from rlframe.reward.manager import RewardError
    from rlframe.trainer.checkpoint import CheckpointError

    return (ConfigError, DatasetError, CheckpointError, RewardError)


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="rlframe_schema", name="base", node=RLConfig)
    store.store(name="rlframe_main", node={"defaults": ["_self_", {"rlframe_schema@_global_": "base"}]})


AGENT_PREFIX, MULTI_TURN_PREFIX = "rollout.agent.", "rollout.multi_turn."


LOOP_KEYS = ("tools", "mcp_servers", "environment")  # naming one of these under rollout.agent turns the loop on


def agent_alias_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`rollout.agent.<key>=v` is another name for `rollout.multi_turn.<key>=v` (the agent loop's section);
    naming tools, MCP servers or an environment there also turns the loop on, unless `enable` is given."""
    out, notices, turned_on = [], [], False
    for arg in overrides:
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))]
        body = arg[len(prefix):]
        if not body.startswith(AGENT_PREFIX):
            out.append(arg)
            continue
        key = body.split("=", 1)[0][len(AGENT_PREFIX):]
        out.append(prefix + MULTI_TURN_PREFIX + body[len(AGENT_PREFIX):])
        notices.append(f"{AGENT_PREFIX}{key} -> {MULTI_TURN_PREFIX}{key}")
        turned_on |= key.startswith(LOOP_KEYS)
    explicit = any(a.lstrip("+~").startswith((MULTI_TURN_PREFIX + "enable", AGENT_PREFIX + "enable")) for a in overrides)
    if turned_on and not explicit:
        out.append(MULTI_TURN_PREFIX + "enable=true")
        notices.append("rollout.agent tools/mcp_servers/environment given -> rollout.multi_turn.enable=true")
    return out, notices


def agent_section_as_multi_turn(composed):
    """A recipe's `rollout: {agent: {...}}` section read as `rollout.multi_turn` (see agent_alias_overrides)."""
    rollout = composed.get("rollout") or {}
    if "agent" not in rollout:
        return composed
    data = OmegaConf.to_container(composed)
    agent = data["rollout"].pop("agent") or {}
    if any(key in agent for key in LOOP_KEYS) and "enable" not in agent:
        agent["enable"] = True
    data["rollout"]["multi_turn"] = OmegaConf.to_container(
        OmegaConf.merge(data["rollout"].get("multi_turn") or {}, agent))
    return OmegaConf.create(data)


def compose_config(argv: list[str]) -> RLConfig:
    """Recipe + command-line overrides -> a typed, validated RLConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlframe.compat import CompatError, translate_overrides

    recipe_args = [a for a in argv if a.startswith("recipe=")]
    overrides, agent_notices = agent_alias_overrides([a for a in argv if not a.startswith("recipe=")])
    try:  # verl / EasyR1 keys -> ours (one notice each); unknown keys -> the closest of ours
        overrides, notices = translate_overrides(overrides)
    except CompatError as err:
        raise UsageError(str(err)) from None
    for notice in agent_notices + notices:
        print(f"note: {notice}", flush=True)
    recipe = recipe_args[-1].split("=", 1)[1] if recipe_args else "grpo_math"
    recipe_path = Path(recipe).expanduser().absolute() if recipe.endswith((".yaml", ".yml")) else RECIPES_DIR / f"{recipe}.yaml"
    if not recipe_path.exists():
        raise UsageError(f"unknown recipe '{recipe}' (looked for {recipe_path}).\n"
                         f"Available recipes: {', '.join(available_recipes())}. "
                         "Fix: recipe=<one of those> or recipe=/path/to/your_recipe.yaml")
    check_recipe_file(recipe_path)
    # The typed schema is composed first, the recipe (a config group named after its folder) on
    # top of it, then the command-line overrides, so `key=value` works for every schema key.
    _register_schema()
    group = recipe_path.parent.name
    try:
        with initialize_config_dir(config_dir=str(recipe_path.parent.parent.resolve()), version_base=None):
            composed = compose(config_name="rlframe_main",
                               overrides=[f"+{group}@_global_={recipe_path.stem}", *overrides])
        merged = OmegaConf.merge(OmegaConf.structured(RLConfig), agent_section_as_multi_turn(composed))
    except (HydraException, OmegaConfBaseException) as err:
        raise UsageError(compose_error_message(err, recipe)) from None
    cfg: RLConfig = OmegaConf.to_object(merged)
    from rlframe.data.files import resolve_data_files

    # data.train_files / val_files: a string or a list, `~` and globs; giving files implies source=files.
    cfg.data.train_files = resolve_data_files(cfg.data.train_files)
    cfg.data.val_files = resolve_data_files(cfg.data.val_files)
    if cfg.data.train_files and cfg.data.source in ("arithmetic", "shapes", "tones"):  # (the generated data sets)
        if any(a.startswith("data.source=") for a in overrides):
            raise UsageError(f"data.source={cfg.data.source} together with data.train_files: pick one. "
                             "Fix: drop data.train_files, or data.source=files")
        print("note: data.train_files given -> data.source=files", flush=True)
        cfg.data.source = "files"
    # Reward scripts named relative to the repository (reward_fns/...) work from any directory,
    # and from an installed wheel (which ships reward_fns/ inside the package).
    from rlframe.reward.loader import split_path_name

    for fn in cfg.reward.functions:
        fn.path, fn.name = split_path_name(fn.path, fn.name)  # EasyR1's file.py:function
        fn.path = str(Path(fn.path).expanduser())
        shipped = shipped_dir("reward_fns").parent / fn.path
        if not Path(fn.path).exists() and shipped.exists():
            fn.path = str(shipped)
    # So are user estimator/loss files; made absolute, since workers may run elsewhere.
    for plugin in (cfg.algorithm.custom_estimator, cfg.algorithm.custom_policy_loss):
        if plugin.path and not Path(plugin.path).exists() and (REPO_ROOT / plugin.path).exists():
            plugin.path = str(REPO_ROOT / plugin.path)
        if plugin.path and Path(plugin.path).exists():
            plugin.path = str(Path(plugin.path).resolve())
    return apply_algorithm_defaults(cfg)  # "auto" policy-loss options -> the loss's published defaults


def check_recipe_file(path: Path) -> None:
    """A recipe is a YAML mapping with at least one key (an empty file would run on the schema's defaults)."""
    import yaml

    if path.is_dir():
        raise UsageError(f"recipe {path} is a folder. Fix: recipe=<name> or recipe=/path/to/your_recipe.yaml")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"recipe {path}{where}: YAML syntax error: {problem}. "
                         "Fix: correct the YAML there (keys as `section:` blocks, lists in [ ] or `- ` lines)") from None
    if content is None:
        raise UsageError(f"recipe {path} is empty: nothing to run (it would train on the schema's defaults). "
                         "Fix: write the recipe's keys into it, or recipe=grpo_math for the default")
    if not isinstance(content, dict):
        raise UsageError(f"recipe {path}: expected a mapping of sections (model:, data:, ...), got a "
                         f"{type(content).__name__}. Fix: write it as `section: {{key: value}}` blocks")


def compose_error_message(err: Exception, recipe: str) -> str:
    """Hydra / OmegaConf's error as one line naming the key: a wrong type names the key and the type it takes."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, (ValidationError, ConfigKeyError)):
        cause = cause.__cause__ or cause.__context__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, ValidationError) and key:
        wanted = type_in_words(field_type(key))
        return (f"{key}: {getattr(cause, 'value', None)!r} is not {wanted} (in recipe '{recipe}' or its overrides). "
                f"Fix: {key}=<{wanted}> (its meaning and default: rlframe/config/)")
    text = str(cause if cause is not None else err).splitlines()[0]
    return (f"in recipe '{recipe}' or its overrides: {text}\n"
            "Fix: check the key names against rlframe/config/ (e.g. actor.optim.lr=1e-6).")


def prepare_data(cfg: RLConfig, run_dir: Path) -> tuple[list[str], list[str]]:
    if cfg.data.source == "files":
        return list(cfg.data.train_files), list(cfg.data.val_files)
    if cfg.data.source == "shapes":  # generated pictures of shapes with counting questions (vision-language)
        from rlframe.data.shapes import generate_shapes_dataset

        s = cfg.data.shapes
        if s.kind == "video":  # generated clips of a moving shape, "which way does it move"
            from rlframe.data.video_shapes import generate_video_shapes_dataset

            train, val = generate_video_shapes_dataset(run_dir / "data", n_train=s.n_train, n_val=s.n_val,
                                                       seed=s.seed, size=s.size, frames=s.frames, fps=s.fps)
            return [str(train)], [str(val)]
        train, val = generate_shapes_dataset(run_dir / "data", n_train=s.n_train, n_val=s.n_val, seed=s.seed, size=s.size)
        return [str(train)], [str(val)]
    if cfg.data.source == "tones":  # generated sine-tone clips, "how many beeps" / "which is higher" (audio)
        from rlframe.data.audio_tones import generate_audio_tones_dataset

        t = cfg.data.tones
        train, val = generate_audio_tones_dataset(run_dir / "data", n_train=t.n_train, n_val=t.n_val, seed=t.seed,
                                                  rate=t.rate, beep_seconds=t.beep_seconds, gap_seconds=t.gap_seconds)
        return [str(train)], [str(val)]
    from rlframe.data.arithmetic import generate_arithmetic_dataset

    a = cfg.data.arithmetic
    train, val = generate_arithmetic_dataset(run_dir / "data", n_train=a.n_train, n_val=a.n_val, seed=a.seed,
                                             max_operand=a.max_operand)
    return [str(train)], [str(val)]


# What every worker's environment gets (the KV cache size reaches vLLM as an engine argument).
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def init_ray(cfg: RLConfig, run_dir: Path | None = None) -> None:
    """Join or start the Ray cluster. With `run_dir` (and not trainer.verbose), every worker's stdout and stderr
    (vLLM, transformers, torch, tqdm) go to <run_dir>/logs/worker-<pid>.log, our own warnings still to the console."""
    import ray

    if ray.is_initialized():
        return
    env_vars = dict(WORKER_ENV)
    # Join RAY_ADDRESS / trainer.ray_address (e.g. auto) or start a local cluster; trainer.runtime_env
    # (env vars, working dir) reaches every worker on every node.
    from rlframe.controller.cluster import connect, runtime_env

    env_vars.update(cfg.trainer.runtime_env.env_vars)
    env = runtime_env(env_vars, cfg.trainer.runtime_env.working_dir)
    if run_dir is not None and not cfg.trainer.verbose:  # a quiet console (workers/log_capture.py)
        from rlframe.workers.log_capture import worker_log_env

        env["env_vars"].update(worker_log_env(run_dir, cfg.trainer.verbose))
        env["worker_process_setup_hook"] = "rlframe.workers.log_capture.capture_worker_output"
    connect(cfg.trainer.ray_address, cfg.trainer.num_cpus, env, dashboard=cfg.trainer.ray_dashboard)


@dataclass
class PreparedRun:
    """What `prepare_run` checked and built before Ray: the run's folder, model folder, tokenizer, data files and
    the datasets the checks built that the stage's driver takes instead of building them again."""

    run_dir: Path
    model_path: str
    tokenizer: Any
    train_files: list[str]
    val_files: list[str]
    datasets: dict = field(default_factory=dict)


def runs_folder() -> Path:
    """Where a run without trainer.run_dir goes: $RLFRAME_RUNS_DIR; else, run as a Ray job (`ray job submit`, whose
    working directory is a temporary copy), ~/rlframe/runs on the node the driver runs on; else ./runs."""
    import os

    from rlframe.controller.cluster import JOB_CONFIG_ENV

    if os.environ.get("RLFRAME_RUNS_DIR"):
        return Path(os.environ["RLFRAME_RUNS_DIR"]).expanduser()
    return Path("~/rlframe/runs").expanduser() if os.environ.get(JOB_CONFIG_ENV) else Path("runs")


def prepare_run(cfg: RLConfig) -> PreparedRun:
    """Everything that can be known before Ray starts, after validate_config: the run directory's lock and where
    the run starts (checkpoints, resume), then check_before_ray. Starts no Ray and no worker; bad input raises one
    of usage_errors() (or UsageError)."""
    from rlframe.trainer.run_dir import RunDirError, claim_run_dir

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.run_dir or runs_folder() / f"{cfg.trainer.experiment_name}-{stamp}").resolve()
    try:  # the run directory's lock (a second run there is refused) and where this run starts, before anything is written
        claim_run_dir(cfg, run_dir)
    except RunDirError as err:
        raise UsageError(str(err)) from None
    from rlframe.workers.log_capture import route_driver_logs

    route_driver_logs(run_dir, cfg.trainer.verbose)  # library chatter to <run_dir>/logs/driver.log (after the claim)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    print(f"run directory: {run_dir}", flush=True)
    return check_before_ray(cfg, run_dir)


def check_before_ray(cfg: RLConfig, run_dir: Path) -> PreparedRun:
    """prepare_run's checks once the run directory is claimed (the board's preview calls it on a scratch folder):
    the model folder's checks and the memory plan (printed), the tokenizer, and the data (every row read, checked,
    templated and counted, as the stage's driver will: rlframe/preflight.py; generated data sets written under
    `run_dir`). Bad input raises one of usage_errors() (or UsageError)."""
    from transformers import AutoTokenizer

    from rlframe.models.provision import hub_model_problem, looks_like_hub_id, resolve_model_path
    from rlframe.preflight import check_run_data

    model_path = resolve_model_path(cfg.model.path)
    if looks_like_hub_id(model_path):  # (transformers' own error is a traceback, from inside the tokenizer's load)
        problem = hub_model_problem(model_path)
        if problem is not None:
            raise UsageError(f"model.path: {problem}")
    validate_before_workers(cfg, model_path)  # the checks that read the model folder, then the memory plan
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    train_files, val_files = prepare_data(cfg, run_dir)
    datasets = check_run_data(cfg, tokenizer, train_files, val_files)
    return PreparedRun(run_dir, model_path, tokenizer, train_files, val_files, datasets)


def shutdown_ray() -> None:
    """Stop the local Ray cluster this process started (its workers, raylet and GCS) now, while the driver still
    runs, rather than in the interpreter's exit; a joined cluster is only left (rlframe/controller/cluster.py)."""
    from rlframe.controller.cluster import shutdown

    shutdown()


def start_trainer(cfg: RLConfig):
    """Prepare the run, start Ray, check the cluster and build the stage's trainer (its workers with it)."""
    from rlframe.trainer.signals import STOP

    with STARTUP.phase("prepare"):
        prepared = prepare_run(cfg)
    run_dir = prepared.run_dir
    with STARTUP.phase("ray_init"):
        init_ray(cfg, run_dir)
    STOP.install()  # again: ray.init replaces the SIGTERM handler with one that aborts the driver
    with STARTUP.phase("cluster_check"):
        from rlframe.controller.cluster import ClusterTooSmall, check_cluster, list_nodes, print_nodes
        from rlframe.trainer.launch import cluster_request

        nodes = list_nodes()
        print_nodes(nodes)
        try:  # too few devices is an error here, before any worker starts
            check_cluster(cluster_request(cfg, nodes), nodes)
        except ClusterTooSmall as err:
            raise UsageError(str(err)) from None
    start, workers_before = time.perf_counter(), STARTUP.parts.get("workers", 0.0)
    from rlframe.stages.run import make_trainer

    trainer = make_trainer(cfg, prepared.model_path, prepared.tokenizer, prepared.train_files, prepared.val_files,
                           run_dir, prepared.datasets)  # by cfg.stage
    STARTUP.add("driver_setup", time.perf_counter() - start - (STARTUP.parts.get("workers", 0.0) - workers_before))
    return trainer, run_dir


def run(cfg: RLConfig) -> dict:
    from rlframe.trainer.run_dir import release_run_dir

    with collector_paused():  # the start-up's imports and builds (rlframe/collector.py); training collects as usual
        trainer, run_dir = start_trainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        with STARTUP.exit_phase(run_dir):  # the shutdown, timed: <run_dir>/startup.json
            trainer.close()
            release_run_dir(run_dir)
            shutdown_ray()
    before, after = summary["val_before"], summary["val_after"]
    if before.get("val/reward_mean") is not None and after.get("val/reward_mean") is not None:
        print(f"validation reward: {before['val/reward_mean']:.3f} -> {after['val/reward_mean']:.3f}; "
              f"accuracy: {before['val/accuracy']:.3f} -> {after['val/accuracy']:.3f}")
    if "hf_model" in summary:
        trained = "reward model" if cfg.stage == "rm" else "actor"
        print(f"trained {trained} (HF format): {summary['hf_model']}")
    print(f"run directory: {run_dir}")
    return summary


def main(argv: list[str] | None = None) -> None:
    """Compose, validate, run; bad input (usage_errors(): config, data, template, checkpoint, a reward that fails
    on nearly every sample) ends as one `error:` screen, exit status 1; anything else keeps its traceback."""
    from rlframe.trainer.signals import Stopped, stop_signals

    STARTUP.begin()  # the start-up profile (rlframe/trainer/startup.py): `imports` ends here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    from rlframe.cli_help import handle_info_flags, print_composed

    if handle_info_flags("rlframe.main", argv):  # --help / -h, --keys [prefix]
        return
    try:
        if "--cfg" in argv:  # --cfg job: the composed configuration, nothing run
            return print_composed(compose_config, argv)
        with STARTUP.phase("config"), collector_paused():
            cfg = compose_config(argv)
            validate_config(cfg)
        with stop_signals():  # SIGINT / SIGTERM: stop at the next safe point (between steps); a second one: at once
            try:
                run(cfg)
            except Stopped as stop:
                print(stop.summary(), flush=True)
                raise SystemExit(stop.exit_code) from None
    except usage_errors() as err:
        raise UsageError(str(err)) from None


def exit_now(code: int = 0) -> None:
    """After a finished run (its files closed, its workers and Ray stopped): run the exit hooks (wandb's service,
    multiprocessing's children), flush, and leave without the rest of the interpreter's teardown (the finalisers
    of thousands of modules, torch's thread pools), which only costs time here. In-process callers of main()
    never get here."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_now(0)
