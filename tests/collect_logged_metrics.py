"""Write tests/data/logged_metrics.json: the metric names tiny 2-step runs of some recipes log.

    .venv/bin/python tests/collect_logged_metrics.py grpo_math ppo_math sft_math ...   # (~1-3 min a recipe)

Each recipe runs as tests/test_recipes.py runs it (its TINY_SIZES and SIZES, the tiny random Llama), and its
sorted metric names replace that recipe's entry in the file; tests/test_docs_reference.py then checks that the
glossary (rlframe/trainer/metric_glossary.py) explains each of them.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # tests/collect_logged_metrics.py -> the repository
sys.path.insert(0, str(REPO / "tests"))
OUT = REPO / "tests" / "data" / "logged_metrics.json"


def main(recipes: list[str]) -> None:
    import conftest
    from conftest import build_tiny_model_dir, read_metrics, run_main
    import test_recipes

    class NoFixtures:  # grpo_gsm8k needs pytest's GSM8K fixture: not collected here
        def getfixturevalue(self, name):
            raise SystemExit(f"{name}: run this recipe's keys from its test instead")

    found = json.loads(OUT.read_text()) if OUT.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="logged_metrics_"))
    try:
        model = build_tiny_model_dir(work / "tiny")
        conftest.TEST_ENV["RLFRAME_CACHE"] = str(work / "cache")  # (the runs' environment: conftest.run_env)
        for recipe in recipes:
            folder = work / recipe
            folder.mkdir()
            result = run_main([*test_recipes.recipe_args(recipe, model, NoFixtures()), f"trainer.run_dir={folder / 'run'}"],
                              cwd=folder)
            if result.returncode:
                print(f"{recipe}: failed\n{result.stderr[-3000:]}")
                continue
            found[recipe] = sorted({key for line in read_metrics(folder / "run") for key in line})
            print(f"{recipe}: {len(found[recipe])} names", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    OUT.write_text(json.dumps(dict(sorted(found.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
