"""Load a user's advantage estimator or policy loss from a Python file, by path.

    # my_loss.py (anywhere on disk)
    def my_loss(old_log_prob, log_prob, advantages, response_mask, *, config, agg=None):
        ...
        return loss, {}

    register_from_config("policy_loss", "my_loss.py", "my_loss", register_as="my_loss")
    get_policy_loss("my_loss")

An estimator says what it needs (rlframe.algos.advantages.EstimatorNeeds) with a `needs` attribute,
a dict of those fields or an EstimatorNeeds; without one it needs nothing beyond the rewards:

    def median_baseline(token_level_rewards, response_mask, group_index=None, *, config, **_): ...
    median_baseline.needs = {"groups": True}    # rollout.n >= 2 is then checked before any worker starts
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from functools import lru_cache
from typing import Any

from rlframe.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    NEED_NAMES,
    NO_NEEDS,
    EstimatorNeeds,
    estimator_needs,
    register_advantage_estimator,
)
from rlframe.algos.losses import POLICY_LOSSES, register_policy_loss

PLUGIN_KINDS = ("advantage", "policy_loss")


def load_object_from_file(path: str, name: str) -> Any:
    """Import the file at `path` as a fresh module and return its attribute `name`.

    The module gets a unique name derived from the absolute path, so two files that are both called
    `reward.py` do not collide. Errors name the file and say what went wrong.
    """
    absolute_path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(absolute_path):
        raise FileNotFoundError(f"plugin file not found: {path!r} (resolved to {absolute_path})")
    digest = hashlib.sha1(absolute_path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(absolute_path))[0]
    module_name = f"rlframe_plugin_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, absolute_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {absolute_path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ImportError(
            f"importing plugin file {absolute_path} failed: {type(error).__name__}: {error}\n"
            f"{traceback.format_exc()}"
        ) from error
    if not hasattr(module, name):
        defined = sorted(n for n in vars(module) if not n.startswith("_"))
        raise AttributeError(
            f"plugin file {absolute_path} defines no {name!r}; it defines: {', '.join(defined) or '(nothing)'}"
        )
    return getattr(module, name)


def register_from_config(kind: str, path: str, name: str, register_as: str | None = None) -> Any:
    """Load `name` from the file at `path` and register it as an advantage estimator or policy loss.

    kind: "advantage" or "policy_loss"; register_as: the registry name (defaults to `name`).
    Re-registering the same name replaces the previous entry, so reloading a config is harmless.
    Returns the loaded function.
    """
    if kind not in PLUGIN_KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; choose one of {', '.join(PLUGIN_KINDS)}")
    fn = load_object_from_file(path, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {path} is a {type(fn).__name__}, not a function")
    registry_name = register_as or name
    if kind == "advantage":
        needs = declared_needs(fn, f"{name!r} in {path}")
        ADVANTAGE_ESTIMATORS.pop(registry_name, None)
        register_advantage_estimator(registry_name, needs=needs)(fn)
    else:
        POLICY_LOSSES.pop(registry_name, None)
        register_policy_loss(registry_name)(fn)
    return fn


def register_configured_plugins(algorithm: dict) -> None:
    """Register `algorithm.custom_estimator` / `algorithm.custom_policy_loss` ({path, name}) if set.

    Called by the driver before workers start (estimators run there) and by each actor worker
    (policy losses run there); `algorithm` is the config section as a plain dict.
    """
    for key, kind in (("custom_estimator", "advantage"), ("custom_policy_loss", "policy_loss")):
        plugin = algorithm.get(key) or {}
        if plugin.get("path"):
            register_from_config(kind, plugin["path"], plugin["name"])


def declared_needs(fn: Any, where: str) -> EstimatorNeeds:
    """A user estimator's `needs` attribute as EstimatorNeeds: absent -> nothing; a dict of its field
    names -> those set; an EstimatorNeeds as it is. Anything else is a TypeError / ValueError naming `where`."""
    needs = getattr(fn, "needs", None)
    if needs is None:
        return NO_NEEDS
    if isinstance(needs, EstimatorNeeds):
        return needs
    if not isinstance(needs, dict):
        raise TypeError(f"{where}: `needs` is a {type(needs).__name__}; give a dict such as {{'groups': True}} "
                        f"(keys: {', '.join(NEED_NAMES)}) or an rlframe.algos.EstimatorNeeds")
    unknown = sorted(set(needs) - set(NEED_NAMES))
    if unknown:
        raise ValueError(f"{where}: `needs` has unknown keys {unknown}; the keys are {', '.join(NEED_NAMES)}")
    not_bool = sorted(key for key, value in needs.items() if not isinstance(value, bool))
    if not_bool:
        raise TypeError(f"{where}: `needs` values must be true or false ({', '.join(not_bool)} are not)")
    return EstimatorNeeds(**needs)


def configured_estimator_needs(algorithm: Any) -> EstimatorNeeds:
    """What the run's estimator needs: `algorithm` is the config section (adv_estimator, custom_estimator).

    The user's file of algorithm.custom_estimator, when it provides algorithm.adv_estimator, is read for
    its `needs` (before it is registered too, as the checks run before the driver registers it); else the
    registry's entry. A name that is neither needs nothing (validate_config reports it). Raises the
    loading errors of load_object_from_file / declared_needs.
    """
    name, plugin = algorithm.adv_estimator, algorithm.custom_estimator
    if plugin.path and plugin.name == name:
        path = os.path.abspath(os.path.expanduser(plugin.path))
        return _needs_in_file(path, name, _version(path))
    return estimator_needs(name) if name in ADVANTAGE_ESTIMATORS else NO_NEEDS


def _version(path: str) -> tuple[int, int]:
    """The file's (modification time, size): a new version of it is read again."""
    try:
        stat = os.stat(path)
    except OSError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _needs_in_file(path: str, name: str, version: tuple[int, int]) -> EstimatorNeeds:
    """declared_needs of `name` in the file at `path`, imported once per `version` of the file."""
    return declared_needs(load_object_from_file(path, name), f"{name!r} in {path}")
