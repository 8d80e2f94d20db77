"""`python -m rlframe.plan recipe=... [overrides]`: the pre-flight memory plan, without starting anything.

    python -m rlframe.plan recipe=grpo_math model.path=/path/to/hf_folder \
        trainer.device=cuda trainer.nnodes=1 trainer.devices_per_node=8 actor.world_size=8

prints the per-device table of rlframe/memory_plan.py (only the model's config.json is read; no Ray,
no worker) and exits 1 when the plan does not fit, with the settings that would.
"""

from __future__ import annotations

import sys

from rlframe.cli_help import handle_info_flags
from rlframe.config import ConfigError
from rlframe.main import UsageError, compose_config
from rlframe.memory_plan import check_memory
from rlframe.models.provision import resolve_model_path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if handle_info_flags("rlframe.plan", argv):  # --help / -h, --keys [prefix]
        return 0
    cfg = compose_config(argv)
    cfg.trainer.memory_check = "warn"  # print the table whatever the recipe says; the exit code tells the verdict
    try:
        plan = check_memory(cfg, resolve_model_path(cfg.model.path))
    except ConfigError as err:
        raise UsageError(str(err)) from None
    return 0 if plan.fits() else 1


if __name__ == "__main__":
    sys.exit(main())
