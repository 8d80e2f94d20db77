"""The references written from the code (rlframe/docs_gen.py): every configuration key and every logged metric has a
meaning, the recipe table lists every recipe, and README's copy of it is current.

A new schema field without a comment, a metric logged without a glossary entry, or a recipe added without
regenerating README's table fails here (CI), not on a reader. tests/data/logged_metrics.json holds the metric
names tiny 2-step runs of the stage recipes logged (tests/test_recipes.py's sizes), so the glossary is checked
without a run here (tests/collect_logged_metrics.py rewrites it); tests/test_recipes.py checks the same on every recipe's live run.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from conftest import REPO_ROOT

from rlframe.board.schema_help import comments_of
from rlframe.docs_gen import (
    config_keys,
    config_pages,
    keys_without_meaning,
    metrics_page,
    readme_with_table,
    recipe_rows,
    recipe_table,
    walk,
)
from rlframe.trainer.metric_glossary import METRICS, meaning_of, unknown_metrics

LOGGED = json.loads((Path(__file__).parent / "data" / "logged_metrics.json").read_text())


def declaring_class(key_doc):
    module, name = key_doc.source.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_every_config_key_has_a_meaning_from_its_source_comment():
    keys = config_keys()
    assert len(keys) > 300
    assert keys_without_meaning() == []
    # the meaning is the field's own comment (a bound's note such as "0: off" alone does not say what a key is)
    uncommented = [k.key for k in keys if not comments_of(declaring_class(k)).get(k.key.rsplit(".", 1)[-1].split("[")[0])]
    assert uncommented == [], f"write a `#` comment beside these fields: {uncommented}"


@dataclasses.dataclass
class _Section:
    documented: int = 1  # a field with its meaning
    undocumented: float = 0.5


def test_a_field_without_a_comment_is_reported():
    docs = {k.key: k for k in walk(_Section, _Section(), "demo.")}
    assert docs["demo.documented"].meaning == "a field with its meaning"
    assert docs["demo.undocumented"].meaning == ""


def test_reference_names_each_key_with_type_default_bound_and_meaning():
    by_key = {k.key: k for k in config_keys()}
    lr = by_key["actor.optim.lr"]
    assert (lr.type, lr.default, lr.bound) == ("float", 1e-6, "> 0") and "learning rate" in lr.meaning
    assert by_key["critic.optim.lr"].default == 1e-5  # the section's own default, not the class's
    assert by_key["model.lora.alpha"].type == "float"
    assert by_key["model.dtype"].bound.startswith("one of: auto")
    assert "reward.functions[].weight" in by_key
    pages = config_pages()
    for k in config_keys():
        assert f"### `{k.key}`" in pages[f"reference/configuration/{k.section}.md"], k.key
    for key in ("rollout.val_temperature", "actor.entropy_coeff", "trainer.val_before_train", "trainer.export_hf",
                "algorithm.norm_adv_by_std", "critic.model_path", "reward_model.path", "optim.weight_decay"):
        assert any(k.key.endswith(key) and k.meaning for k in config_keys()), key


def test_every_metric_the_tiny_runs_logged_has_a_meaning():
    assert set(LOGGED) >= {"grpo_math", "ppo_math", "sft_math", "dpo_math", "rm_math", "pt_text"}
    for recipe, keys in LOGGED.items():
        assert unknown_metrics(keys) == [], f"{recipe} logs metrics the glossary does not explain"
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_loss",
                 "response_length/mean", "perf/mfu", "timing/rollout"):
        assert meaning_of(name) is not None and meaning_of(name).meaning, name


def test_a_metric_without_an_entry_is_reported():
    assert unknown_metrics(["actor/pg_loss", "actor/a_new_metric", "step"]) == ["actor/a_new_metric"]
    assert meaning_of("timing/rollout").name == "timing/*"  # a family covers its open-ended parts
    assert meaning_of("actor/pg_loss").name == "actor/pg_loss"  # an exact entry wins over any family


def test_glossary_entries_are_unique_and_rendered():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(m.meaning for m in METRICS)
    page = metrics_page()
    assert all(f"`{name}`" in page for name in names)


def test_recipe_table_lists_every_recipe_with_its_stage():
    on_disk = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml"))
    rows = recipe_rows()
    assert [r.name for r in rows] == on_disk
    stages = {r.name: r.stage for r in rows}
    assert (stages["pt_text"], stages["rft_math"], stages["sft_math"], stages["grpo_gateway_math"]) == ("pt", "rft", "sft", "rl")
    assert all(r.summary.endswith(".") for r in rows)
    table = recipe_table("../")
    assert all(f"| `{name}` |" in table for name in on_disk)
    assert "(../engines/lora.md)" in table


def test_readme_recipe_table_is_current():
    text = (REPO_ROOT / "README.md").read_text()
    assert readme_with_table(text) == text, "README's recipe table is stale: run `python -m rlframe.docs_gen`"


@pytest.mark.parametrize("page", ["recipes.md"])
def test_docs_include_the_generated_table_instead_of_a_copy(page):
    text = (REPO_ROOT / "docs" / page).read_text()
    assert "<!-- recipes-table -->" in text
    assert "| `grpo_math` |" not in text


def test_every_gpu_install_line_keeps_the_default_extras():
    """The GPU line is the CPU default's extras with gpu for cpu (it once dropped board, eval and agents)."""
    import re

    default = re.search(r"echo (cpu,[a-z,]+)\)", (REPO_ROOT / "Makefile").read_text()).group(1).split(",")
    wanted = {"gpu"} | set(default) - {"cpu"}
    pages = [REPO_ROOT / "Makefile", REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    lines = [(page.name, m.group(1)) for page in pages for m in re.finditer(r"EXTRAS=(gpu[a-z,]*)", page.read_text())]
    assert len(lines) >= 5
    for page, extras in lines:
        assert set(extras.split(",")) >= wanted, f"{page}: EXTRAS={extras} lacks {sorted(wanted - set(extras.split(',')))}"


def test_every_generated_page_is_in_the_nav():
    """A new config section gets a generated page; mkdocs --strict refuses a page outside mkdocs.yml's nav, so the
    nav must name it (caught here in a second rather than by the docs build)."""
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    missing = [path for path in config_pages() if path.endswith(".md") and f": {path}" not in nav]
    assert not missing, f"add to mkdocs.yml's nav: {missing}"
