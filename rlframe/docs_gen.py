"""The reference pages written from the code itself: every configuration key, every logged metric, the recipe table.

    config_keys()        # every leaf key of RLConfig: dotted name, type, default, bound / choices, meaning
    recipe_rows()        # every recipes/*.yaml: name, stage, the first sentence of its header comment
    config_pages()       # {"reference/configuration/<section>.md": markdown} (one page per top-level section)
    metrics_page()       # the metrics glossary (rlframe/trainer/metric_glossary.py) as markdown
    recipe_table()       # the recipe table, included wherever the docs show it

A key's meaning is the schema's own comment beside its field (above it and after it on the line, read by
rlframe/board/schema_help.py) plus the note of its bound (rlframe/bounds.py). The docs hook
(docs/hooks/generated_pages.py) renders these at every `mkdocs build`; tests/test_docs_reference.py fails when a
key or a logged metric has no meaning, so nothing here is written twice or by hand.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_PAGE_DIR = "reference/configuration"
# The top-level sections, one page each; the stage sections share one page (`stage` itself is there).
STAGE_SECTIONS = ("stage", "sft", "dpo", "rm", "pairs", "pt", "rft")
PAGE_TITLES = {
    "model": "model: the policy's weights, dtype, LoRA", "data": "data: prompts, lengths, the batch",
    "algorithm": "algorithm: estimator, KL, DAPO, plugins", "actor": "actor: the policy's training",
    "critic": "critic: PPO's value model", "rollout": "rollout: engines, sampling, multi-turn, partial rollouts",
    "reward": "reward: reward functions, the judge", "reward_model": "reward_model: a trained reward model in RL",
    "trainer": "trainer: steps, checkpoints, cluster, loggers, gates",
    "teacher": "teacher: the frozen teacher of on-policy distillation",
    "distillation": "distillation: the on-policy distillation loss", "deepspeed": "deepspeed: the ZeRO engine",
    "megatron": "megatron: the Megatron-core engine", "stages": "stages: pt, sft, dpo, rm, rft and pair generation",
}


@dataclass
class KeyDoc:
    key: str  # full dotted name: model.lora.alpha; a list of sections: reward.functions[].weight
    type: str
    default: Any
    bound: str  # "> 0", "one of: a, b" or ""
    meaning: str
    source: str  # module.Class that declares it

    @property
    def section(self) -> str:
        top = re.split(r"[.\[]", self.key, maxsplit=1)[0]
        return "stages" if top in STAGE_SECTIONS else top

    def default_text(self) -> str:
        return yaml_value(self.default)

    def one_line(self) -> str:
        bound = f", {self.bound}" if self.bound else ""
        return f"{self.key} ({self.type}, default {self.default_text()}{bound}): {self.meaning or '(no meaning written)'}"


def yaml_value(value: Any) -> str:
    """A default as a recipe writes it: null, true, 1e-06, [0.9, 0.999], {} ."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        value = [dataclasses.asdict(item) for item in value]
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value != value.strip() else value
    return json.dumps(value)


def type_name(hint: Any) -> str:
    """Optional[float] -> "float | null", list[str] -> "list[str]", dict[str, str] -> "dict[str, str]"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]" if args else origin.__name__
    if hint is Any:
        return "any"
    if dataclasses.is_dataclass(hint):
        return hint.__name__
    return getattr(hint, "__name__", str(hint))


def bound_text(f: dataclasses.Field) -> str:
    meta = f.metadata or {}
    if "choices" in meta:
        return "one of: " + ", ".join(str(c) for c in meta["choices"])
    if meta.get("bound"):
        length = f", {meta['length']} items" if meta.get("length") else ""
        return meta["bound"] + length
    return ""


def meaning_of(cls: type, f: dataclasses.Field) -> str:
    from rlframe.board.schema_help import comments_of

    comment = comments_of(cls).get(f.name, "")
    note = (f.metadata or {}).get("note", "")
    if note and note not in comment:
        comment = f"{comment} ({note})" if comment else note[0].upper() + note[1:]
    return comment


def walk(cls: type, instance: Any, prefix: str) -> list[KeyDoc]:
    out: list[KeyDoc] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], getattr(instance, f.name)
        key = prefix + f.name
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out += walk(hint, value, key + ".")
            continue
        out.append(KeyDoc(key, type_name(hint), value, bound_text(f), meaning_of(cls, f), f"{cls.__module__}.{cls.__name__}"))
        if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            out += walk(args[0], args[0](), key + "[].")  # each item's fields, at the item's defaults
    return out


def config_keys() -> list[KeyDoc]:
    """Every leaf key of the schema, in declaration order; a list of sections also lists its items' keys."""
    from rlframe.config import RLConfig

    return walk(RLConfig, RLConfig(), "")


def keys_without_meaning() -> list[str]:
    return [f"{k.key} ({k.source})" for k in config_keys() if not k.meaning.strip()]


# ------------------------------------------------------------------------------------ markdown
def md_text(text: str) -> str:
    """Schema prose into markdown: `<run_dir>` is not an HTML tag, `|` does not end a table cell."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def config_pages() -> dict[str, str]:
    """{path under docs/: markdown}: an index and one page per top-level section, each key a heading."""
    by_section: dict[str, list[KeyDoc]] = {}
    for k in config_keys():
        by_section.setdefault(k.section, []).append(k)
    pages = {}
    for section, keys in by_section.items():
        lines = [f"# {PAGE_TITLES.get(section, section)}", "",
                 "Generated from the schema (`rlframe/config/`, `rlframe/stages/config.py`, the engines' settings) at "
                 "every docs build: the meaning is the comment beside the field. On the command line: "
                 f"`python -m rlframe.main --keys {section if section != 'stages' else 'sft'}`.", ""]
        for k in keys:
            facts = [f"`{k.type}`", f"default `{k.default_text()}`"] + ([f"`{k.bound}`"] if k.bound else [])
            lines += [f"### `{k.key}`", "", " · ".join(facts), "", md_text(k.meaning), ""]
        pages[f"{CONFIG_PAGE_DIR}/{section}.md"] = "\n".join(lines)
    index = ["# Configuration reference", "",
             "Every key of the typed configuration, by its full dotted name (search for `model.lora.alpha`), with its "
             "type, default, bound or choices and meaning; generated from the schema at every docs build, so it "
             "cannot drift from the code. Any key is an override: `python -m rlframe.main recipe=grpo_math "
             "actor.optim.lr=2e-6`. On the command line: `python -m rlframe.main --keys [prefix]`; the composed "
             "configuration of a recipe: `python -m rlframe.main --cfg job recipe=NAME`.", "",
             "| section | keys |", "|---|---|"]
    index += [f"| [{PAGE_TITLES.get(s, s)}]({s}.md) | {len(keys)} |" for s, keys in by_section.items()]
    pages[f"{CONFIG_PAGE_DIR}/index.md"] = "\n".join(index) + "\n"
    return pages


# ------------------------------------------------------------------------------------ recipes
@dataclass
class RecipeRow:
    name: str
    stage: str
    summary: str  # the first sentence of the header comment
    read: str  # the docs page that explains it (derived from what the recipe sets)


def recipes_dir() -> Path:
    """recipes/ next to the package in a checkout, inside it in an installed wheel (as rlframe.main finds it)."""
    package = Path(__file__).resolve().parent
    return package.parent / "recipes" if (package.parent / "recipes").is_dir() else package / "recipes"


def header_sentence(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    joined = " ".join(lines)
    match = re.match(r"(.+?[.])(\s|$)", joined)
    return match.group(1) if match else joined


def docs_page_of(recipe: dict) -> str:
    """Where a recipe is explained, from what it sets: its stage, engine, LoRA, agent loop, gateway, judge, teacher, images."""
    actor, rollout, model = recipe.get("actor") or {}, recipe.get("rollout") or {}, recipe.get("model") or {}
    if recipe.get("stage", "rl") != "rl":
        return "stages.md"
    if actor.get("strategy") in ("deepspeed", "megatron"):
        return f"engines/{actor['strategy']}.md"
    if (model.get("lora") or {}).get("rank"):
        return "engines/lora.md"
    if "agent_program" in rollout:
        return "gateway.md"
    if ((recipe.get("reward") or {}).get("judge") or {}).get("url") or ((recipe.get("reward") or {}).get("judge") or {}).get("model"):
        return "judge.md"
    if "multi_turn" in rollout or "agent" in rollout:
        return "agents.md"
    if "teacher" in recipe:
        return "distillation.md"
    if (recipe.get("data") or {}).get("source") in ("shapes", "tones"):
        return "vision.md"
    if (recipe.get("data") or {}).get("train_files"):
        return "data.md"
    return "algorithms.md"


def recipe_rows() -> list[RecipeRow]:
    import yaml

    rows = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        text = path.read_text()
        recipe = yaml.safe_load(text) or {}
        rows.append(RecipeRow(path.stem, str(recipe.get("stage", "rl")), header_sentence(text), docs_page_of(recipe)))
    return rows


def recipe_table(link_prefix: str = "") -> str:
    """The recipe table as markdown; `link_prefix` leads from the including page to docs/ ("../", "docs/")."""
    up = link_prefix
    lines = ["| recipe | stage | what | read |", "|---|---|---|---|"]
    for row in recipe_rows():
        lines.append(f"| `{row.name}` | {row.stage} | {md_text(row.summary).replace('|', '&#124;')} | "
                     f"[{row.read.removesuffix('.md')}]({up}{row.read}) |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ metrics
def metrics_page() -> str:
    from rlframe.trainer.metric_glossary import HEALTHY_RUN, METRICS, SECTIONS

    lines = ["# Metrics glossary", "",
             "Every metric a run logs (to `<run_dir>/metrics.jsonl`, the console's progress line, wandb and "
             "tensorboard, and the curves of `report.html`), with its meaning and what a healthy run shows. Generated "
             "from the registry `rlframe/trainer/metric_glossary.py` at every docs build; a test fails when a run "
             "logs a name that is not in it. `*` stands for one or more path parts (`timing/*`: `timing/rollout`, ...).", "",
             "## A healthy run at a glance", "", *[f"- {md_text(line)}" for line in HEALTHY_RUN], ""]
    for section, intro in SECTIONS.items():
        entries = [m for m in METRICS if m.section == section]
        if not entries:
            continue
        lines += [f"## {section}", "", md_text(intro), "", "| metric | meaning | healthy |", "|---|---|---|"]
        lines += [f"| `{m.name}` | {md_text(m.meaning).replace('|', '&#124;')} | "
                  f"{md_text(m.healthy).replace('|', '&#124;') or '-'} |" for m in entries]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ README
README_START, README_END = "<!-- recipes-table:start (generated: python -m rlframe.docs_gen) -->", "<!-- recipes-table:end -->"


def readme_with_table(text: str) -> str:
    """README.md's text with the generated recipe table between its markers (GitHub renders it without mkdocs)."""
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_START}\n{recipe_table('docs/')}\n{README_END}{tail}"


def main() -> None:
    """`python -m rlframe.docs_gen`: rewrite README.md's recipe table (the docs site renders its own at build)."""
    readme = Path(__file__).resolve().parent.parent / "README.md"
    readme.write_text(readme_with_table(readme.read_text()))
    print(f"wrote the recipe table of {readme}")


if __name__ == "__main__":
    main()
