"""The pre-start count: how many of tests/test_usage_errors.py's bad inputs end with a one-screen `error:` before
any worker starts, each run through exactly what `python -m rlframe.main` runs before Ray (compose_config,
validate_config, prepare_run: the full path for every case, not the test's merge shortcut for most settings).

    python tests/count_usage_errors.py        # prints the count and names every case that is not refused

Not collected by pytest (no test_ prefix): test_usage_errors.py asserts the same per case; this prints the total.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import build_tiny_model_dir  # noqa: E402
from test_usage_errors import (  # noqa: E402
    CONFIG_CASES,
    FILE_CASES,
    USER_CODE,
    assert_one_screen,
    before_start,
    ray_started,
)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="usage_count_"))
    model = build_tiny_model_dir(root / "tiny_llama")
    counter = iter(range(10**6))

    def base(*extra: str) -> list[str]:
        return [f"model.path={model}", f"trainer.run_dir={root / f'run{next(counter)}'}", "trainer.memory_check=off",
                "trainer.total_steps=1", "data.arithmetic.n_train=16", "data.arithmetic.n_val=4", *extra]

    assert before_start(base()) is None, "the base configuration itself is refused"
    cases = [(name, lambda tmp, overrides=overrides: overrides, expected) for name, (overrides, expected) in CONFIG_CASES.items()]
    cases += [(name, setup, expected) for name, (setup, expected) in FILE_CASES.items()]
    refused, missed = 0, []
    for i, (name, setup, expected) in enumerate(cases):
        folder = root / f"case{i}"
        folder.mkdir()
        try:
            assert_one_screen(before_start(base(*setup(folder))), tuple(expected), user_traceback=name in USER_CODE)
            assert not ray_started(), "Ray started"
            refused += 1
        except AssertionError as error:
            missed.append(f"{name}: {str(error).splitlines()[0] if str(error) else 'AssertionError'}")
        except Exception as error:  # noqa: BLE001  (what a user would see as a traceback)
            missed.append(f"{name}: a traceback ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
    print(f"{len(cases)} bad inputs ({len(CONFIG_CASES)} settings, {len(FILE_CASES)} files/rows/reward files); "
          f"{refused} refused before start with a one-screen `error:` naming the key or file; Ray started: {ray_started()}")
    for line in missed:
        print("  not refused before start:", line)
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
