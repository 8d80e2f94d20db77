"""Package discovery (the metadata lives in pyproject.toml).

The design card puts `workers/` at the top of the repo while it imports as `rlframe.workers`, and
ships the recipes and ready reward functions with the package; pyproject alone cannot express a
discovered sub-tree under a renamed folder, so the package list is found here: a new folder under
`rlframe/` or `workers/` is packaged without anyone listing it.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["rlframe", "rlframe.*"])
packages += ["rlframe.workers"] + [f"rlframe.workers.{name}" for name in find_packages("workers")]
packages += ["rlframe.recipes", "rlframe.reward_fns", "rlframe.tools"]

setup(
    packages=packages,
    package_dir={"rlframe.workers": "workers", "rlframe.recipes": "recipes", "rlframe.reward_fns": "reward_fns",
                 "rlframe.tools": "tools"},
    package_data={"rlframe.recipes": ["*.yaml"], "rlframe.reward_fns": ["*.py"], "rlframe.tools": ["*.py"]},
)
