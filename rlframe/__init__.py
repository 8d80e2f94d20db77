"""rlframe. Importing the package sets one import-time fact for every rlframe process (driver, Ray workers, CLIs):

transformers imports scikit-learn (and with it scipy.stats) whenever it is installed, from
transformers.generation.candidate_generator, for one thing rlframe never uses (the confidence threshold of
assisted decoding). That is ~2 s of CPU in every process that loads a tokenizer or a model (measured: `from
transformers import AutoTokenizer, AutoModelForCausalLM` 7.6 -> 5.7 s of CPU on 2 cores), paid by the driver and
each worker of every run. scikit-learn stays importable (lm-eval uses it); transformers is only told it is absent,
just before that module loads.
"""

from __future__ import annotations

import sys


class _TransformersWithoutSklearn:
    """A meta-path hook that, when transformers.generation.candidate_generator is about to load, makes
    transformers.utils.is_sklearn_available say False, then removes itself. It finds no module itself."""

    MODULE = "transformers.generation.candidate_generator"

    def find_spec(self, name, path=None, target=None):
        if name == self.MODULE:
            sys.meta_path.remove(self)
            utils = sys.modules.get("transformers.utils")
            if utils is not None:
                utils.is_sklearn_available = lambda: False
        return None


if _TransformersWithoutSklearn.MODULE not in sys.modules:
    sys.meta_path.insert(0, _TransformersWithoutSklearn())
