"""mkdocs hook: a source tree where `workers/` sits under `rlframe/`, as it imports, for griffe to read.

setup.py maps the package `rlframe.workers` to the top-level folder `workers/`; griffe finds modules by
folder, so the API pages read from `.cache/griffe/rlframe/`, a tree of links to `rlframe/*` plus
`workers`. Built at every build; nothing is copied.
"""

from pathlib import Path


def build_tree(root: Path) -> None:
    tree = root / ".cache" / "griffe" / "rlframe"
    tree.mkdir(parents=True, exist_ok=True)
    wanted = {entry.name: entry for entry in (root / "rlframe").iterdir()}
    wanted["workers"] = root / "workers"
    for link in tree.iterdir():
        if link.name not in wanted or link.resolve() != wanted[link.name].resolve():
            link.unlink()
    for name, target in wanted.items():
        if not (tree / name).exists():
            (tree / name).symlink_to(target.resolve())


# At import: mkdocs loads hooks while it reads mkdocs.yml, before any plugin's on_config (mkdocstrings
# reads its paths there).
build_tree(Path(__file__).resolve().parents[2])  # docs/hooks/griffe_tree.py -> the repository root
