"""What tests/fork_runner.py's fork server imports once: the libraries every `python -m rlframe.main` driver imports
before its first step. Imports only: no thread, pool, cluster or computation is started (a forked child inherits
none of them)."""

import rlframe  # first: its import-time hook (transformers without scikit-learn)
import rlframe.main  # noqa: F401  (omegaconf, hydra, the schema, torch through the loss registry)
import rlframe.preflight  # noqa: F401  (the data checks)
import rlframe.stages.run  # noqa: F401  (the stages' drivers)
import rlframe.trainer.rl_trainer  # noqa: F401  (tensordict, torch._dynamo, Ray)
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
import ray.dashboard.optional_deps  # noqa: F401,E402  (ray.init imports it to choose its daemons: ~1.5 s of aiohttp)
import worker_zygote  # noqa: F401,E402  (its runtime-env hook, for the runs whose workers are forked)
