"""mkdocs hook: the pages written from the code at every build, so none of them can drift from it.

- reference/configuration/*.md: every configuration key (type, default, bound, meaning), one page per section;
- metrics.md: the metrics glossary (rlframe/trainer/metric_glossary.py);
- the recipe table, wherever a page holds the line `<!-- recipes-table -->` (README.md's copy is checked
  by tests/test_docs_reference.py instead, since GitHub renders it without mkdocs).

All three come from rlframe/docs_gen.py; nothing is written to disk.
"""

from __future__ import annotations

import posixpath

from mkdocs.structure.files import File

RECIPES_MARKER = "<!-- recipes-table -->"


def generated_pages() -> dict[str, str]:
    from rlframe.docs_gen import config_pages, metrics_page

    return {**config_pages(), "metrics.md": metrics_page()}


def on_files(files, config):
    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if RECIPES_MARKER not in markdown:
        return markdown
    from rlframe.docs_gen import recipe_table

    depth = len([part for part in posixpath.dirname(page.file.src_uri).split("/") if part])
    return markdown.replace(RECIPES_MARKER, recipe_table("../" * depth))
