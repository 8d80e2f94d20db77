"""Doctor checks of the configuration: the named config checks, the model folder, the memory plan."""

from __future__ import annotations

from rlframe.config import ConfigError, RLConfig, validate_config, validate_model_folder
from rlframe.doctor.result import CheckResult, failed, passed, skipped, warned

GROUP = "config"


def check_config(cfg: RLConfig) -> CheckResult:
    """Every named check of rlframe/config/ (validate_config)."""
    from rlframe.config import CHECKS

    try:
        validate_config(cfg)
    except ConfigError as error:
        return failed(GROUP, "valid", str(error).replace("\n", " "), "change the keys named (each line names its fix)")
    return passed(GROUP, "valid", f"{len(CHECKS)} section checks passed (recipe, overrides, estimator needs)")


def check_model_folder(cfg: RLConfig) -> tuple[CheckResult, str | None]:
    """model.path provisioned (an embedded model is converted once), then the checks that read its folder."""
    from rlframe.models.provision import resolve_model_path

    try:
        model_path = resolve_model_path(cfg.model.path)
    except Exception as error:  # a hub id without network, a broken GGUF, ...
        return failed(GROUP, "model", f"{cfg.model.path}: {type(error).__name__}: {error}",
                      "model.path=<a local HF folder> (or an embedded model name)"), None
    try:
        validate_model_folder(cfg, model_path)
    except ConfigError as error:
        return failed(GROUP, "model", str(error).replace("\n", " "), "change the keys named"), model_path
    return passed(GROUP, "model", f"{model_path}"), model_path


def check_memory_plan(cfg: RLConfig, model_path: str) -> CheckResult:
    """The pre-flight memory plan (rlframe/memory_plan.py), printed; refused as the run would refuse it."""
    if cfg.trainer.memory_check == "off":
        return skipped(GROUP, "memory_plan", "trainer.memory_check=off")
    from rlframe.memory_plan import check_memory

    try:
        plan = check_memory(cfg, model_path)
    except ConfigError as error:
        return failed(GROUP, "memory_plan", str(error).replace("\n", " "), "one of the settings the plan names as fitting")
    if not plan.fits():
        return warned(GROUP, "memory_plan", "the plan does not fit (trainer.memory_check=warn lets it run)",
                      "see the table above for settings that fit")
    peak = max(plan.devices, key=lambda d: d.peak[1])
    return passed(GROUP, "memory_plan", f"fits: peak {peak.peak[1]:.1f} GiB ({peak.peak[0]}) of {peak.capacity_gib:.1f} GiB "
                                        "per device (table above)")
