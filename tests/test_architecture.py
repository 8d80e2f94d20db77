"""The layering of the code base, checked on its import statements (function-level imports included).

- `rlframe/controller/` is a generic runtime: it imports nothing of the RL config, the models,
  the workers or the trainer.
- No import cycle anywhere in `rlframe` and `workers` (imported as `rlframe.workers`).
- The wheel carries every package, the recipes, the ready reward functions and tools.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO_ROOT

FORBIDDEN_IN_CONTROLLER = ("rlframe.config", "rlframe.workers", "rlframe.models", "rlframe.trainer")


def module_files() -> dict[str, Path]:
    """Module name -> file, for rlframe/ and workers/ (as rlframe.workers)."""
    out = {}
    for root, package in ((REPO_ROOT / "rlframe", "rlframe"), (REPO_ROOT / "workers", "rlframe.workers")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that `name` imports anywhere in its file."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a.b.func -> a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def test_controller_imports_nothing_of_config_models_workers_or_trainer():
    bad = {name: sorted(t for t in targets if t.startswith(FORBIDDEN_IN_CONTROLLER))
           for name, targets in import_graph().items() if name.startswith("rlframe.controller")}
    assert not {k: v for k, v in bad.items() if v}, bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that starts and ends at the same module), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its own submodules is not a cycle of design: importing
    `rlframe.controller.dispatch` runs `rlframe/controller/__init__.py` first either way. Edges from a
    module to the __init__ of its own parent package are dropped."""
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    return {name: {t for t in targets if not (t in packages and name.startswith(t + "."))}
            for name, targets in graph.items()}


def test_no_import_cycles():
    cycle = find_cycle(without_package_inits(import_graph()))
    assert cycle is None, " -> ".join(cycle)


def test_wheel_carries_packages_recipes_and_reward_functions(tmp_path):
    """A non-editable wheel: every package folder, the recipes and reward_fns; a recipe composes from it."""
    source = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                                     "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True, timeout=600)
    wheel = next(tmp_path.glob("rlframe-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("rlframe/workers/engine/fsdp/engine.py", "rlframe/workers/roles/actor_rollout.py",
                    "rlframe/workers/rollout/factory.py", "rlframe/controller/placement.py",
                    "rlframe/recipes/grpo_math.yaml", "rlframe/reward_fns/math.py", "rlframe/tools/calculator.py"):
        assert package in names, package
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from rlframe.main import compose_config, RECIPES_DIR; cfg = compose_config(['recipe=grpo_math']); "
            "print(RECIPES_DIR); print(cfg.reward.functions[0].path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    recipes_dir, reward_path = out.stdout.split()
    assert recipes_dir == str(site / "rlframe" / "recipes")
    assert reward_path == str(site / "rlframe" / "reward_fns" / "math.py")
