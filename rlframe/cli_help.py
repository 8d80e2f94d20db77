"""`--help` / `-h` of the entry points that take a recipe and overrides (rlframe.main, rlframe.plan, rlframe.pairs).

    python -m rlframe.main --help          # what it does, the recipes (read from recipes/), how overrides work
    python -m rlframe.main --keys actor.optim   # the reference of every key under a prefix (type, default, meaning)
    python -m rlframe.main --cfg job recipe=ppo_math critic.ppo_epochs=2   # the composed configuration, as YAML

The recipe list is read from recipes/ each time, and the key reference from the schema (rlframe/docs_gen.py),
so neither can drift from the code.
"""

from __future__ import annotations

HELP_FLAGS = ("-h", "--help")
REFERENCE_URL = "docs/reference/configuration/index.md (the site's Configuration reference)"

COMMANDS = {
    "rlframe.main": ("recipe=<name> [key=value ...]",
                     "Trains: composes the recipe with the overrides, checks the whole configuration, the model\n"
                     "folder, the memory plan and every data row before Ray starts, then runs the recipe's stage\n"
                     "(rl, sft, dpo, rm, pt, rft) and writes <run_dir>/ (metrics.jsonl, checkpoints, report.html)."),
    "rlframe.plan": ("recipe=<name> [key=value ...]",
                     "Prints the per-device memory plan of a configuration (only the model's config.json is read;\n"
                     "no Ray, no worker); exits 1 when it does not fit, with the settings that would."),
    "rlframe.pairs": ("recipe=<name> [key=value ...] [out=pairs.jsonl]",
                      "Samples pairs.n responses for pairs.prompts training prompts with the recipe's rollout\n"
                      "engine, scores them with its reward functions and writes (best, worst) preference pairs\n"
                      "to out= (default pairs.jsonl) for DPO / reward-model training (data.train_files=pairs.jsonl)."),
}


def wants_help(argv: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def recipe_lines() -> list[str]:
    """`  name  (stage)  first sentence of its header comment`, one per recipe in recipes/."""
    from rlframe.docs_gen import recipe_rows

    rows = recipe_rows()
    width = max(len(row.name) for row in rows)
    return [f"  {row.name:<{width}}  {row.stage:<3}  {shorten(row.summary, 96)}" for row in rows]


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def usage(command: str) -> str:
    """The whole --help text of `python -m <command>`."""
    args, what = COMMANDS[command]
    lines = [f"usage: python -m {command} {args}", "", what, "",
             "recipe=NAME picks recipes/NAME.yaml (default grpo_math); recipe=path/to/mine.yaml picks your own.",
             "Recipes (stage, what):", *recipe_lines(), "",
             "Overrides (Hydra syntax), each a key of the typed configuration:",
             "  actor.optim.lr=2e-6 rollout.n=4     set a key",
             "  'reward.functions=[{path: my_reward.py, name: compute_score}]'   a list (quote it for the shell)",
             "  +trainer.runtime_env.env_vars.HF_HOME=/hf    a new key under a free-form mapping",
             "verl / EasyR1 key names are translated (one note each); an unknown key gets the closest of ours.",
             "",
             "Every key, with its type, default, bound and meaning:",
             f"  python -m {command} --keys [prefix]       e.g. --keys actor.optim",
             f"  {REFERENCE_URL}"]
    if command == "rlframe.main":
        lines += ["The composed configuration of a recipe and overrides, without running it:",
                  "  python -m rlframe.main --cfg job recipe=<name> [key=value ...]",
                  "Metrics and what healthy runs show: docs/metrics.md."]
    return "\n".join(lines)


def keys_text(prefix: str = "") -> str:
    """`--keys PREFIX`: each key under the prefix as `key (type, default X[, bound]): meaning`."""
    from rlframe.docs_gen import config_keys

    keys = [k for k in config_keys() if not prefix or k.key == prefix or k.key.startswith(prefix.rstrip(".") + ".")
            or k.key.startswith(prefix.rstrip(".") + "[")]
    if not keys:
        return f"error: no configuration key starts with '{prefix}'. Fix: --keys with a section such as actor, data, trainer"
    return "\n".join(k.one_line() for k in keys)


def handle_info_flags(command: str, argv: list[str]) -> bool:
    """Print --help or --keys [prefix] and return True (the caller exits 0); False when neither is given."""
    if wants_help(argv):
        print(usage(command))
        return True
    if "--keys" in argv:
        rest = argv[argv.index("--keys") + 1:]
        prefix = rest[0] if rest and "=" not in rest[0] and not rest[0].startswith("-") else ""
        text = keys_text(prefix)
        print(text)
        if text.startswith("error:"):
            raise SystemExit(1)
        return True
    return False


def print_composed(compose_config, argv: list[str]) -> None:
    """`--cfg job` (Hydra's flag; `all` is the same here): the typed configuration composed from the recipe and the
    overrides, as YAML, without validating or running it."""
    from omegaconf import OmegaConf

    rest = [a for a in argv if a != "--cfg"]
    if "--cfg" in argv and argv.index("--cfg") + 1 < len(argv) and argv[argv.index("--cfg") + 1] in ("job", "all"):
        rest.remove(argv[argv.index("--cfg") + 1])
    print(OmegaConf.to_yaml(OmegaConf.structured(compose_config(rest))), end="")
