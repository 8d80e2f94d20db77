"""The configuration checks as a structure (rlframe/config/): each section's named checks, composed by
validate_config; and what an advantage estimator needs, read from its registry entry (never its name),
for the built-in estimators and for a user's estimator file."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from rlframe import config
from rlframe.algos import ADVANTAGE_ESTIMATORS, EstimatorNeeds, estimator_needs, register_advantage_estimator
from rlframe.algos.plugins import configured_estimator_needs, declared_needs, register_from_config
from rlframe.config import ConfigError, RLConfig, skips_old_log_prob_pass, validate_config, validate_model_folder
from rlframe.config.checks import problems_of, raise_problems

SECTION_MODULES = ("model", "data", "algorithm", "actor", "rollout", "reward", "trainer", "teacher", "stages")
CONFIG_DIR = Path(config.__file__).parent

# What each built-in estimator needs, by hand from its docstring's formula (rlframe/algos/advantages.py).
BUILT_IN_NEEDS = {
    "gae": EstimatorNeeds(critic=True),  # V_t from the critic
    "grpo": EstimatorNeeds(groups=True),  # mean_g, std_g
    "grpo_turn": EstimatorNeeds(groups=True, multi_turn=True),  # the same turn of the group
    "drgrpo": EstimatorNeeds(groups=True),
    "rloo": EstimatorNeeds(groups=True),  # mean_{j != i}
    "opo": EstimatorNeeds(groups=True),  # length-weighted group baseline
    "reinforce_plus_plus_baseline": EstimatorNeeds(groups=True),
    "reinforce_plus_plus": EstimatorNeeds(),  # the batch whitens, no group
    "remax": EstimatorNeeds(greedy_baseline=True),  # b_i: the greedy response's reward
}


def problems(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    return str(error.value)


def estimator_file(folder: Path, needs_line: str, name: str = "my_estimator") -> Path:
    """A user's estimator file `folder/name.py` (the folder is made) defining `name`, then `needs_line`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(f'''
        def {name}(token_level_rewards, response_mask, group_index=None, *, config, values=None,
                   baseline_rewards=None):
            scores = (token_level_rewards * response_mask).sum(-1)
            return scores[:, None] * response_mask, scores[:, None] * response_mask
    ''') + needs_line + "\n")
    return path


def custom(path: Path, name: str = "my_estimator", **sections) -> RLConfig:
    cfg = RLConfig()
    cfg.algorithm.adv_estimator = name
    cfg.algorithm.custom_estimator.path, cfg.algorithm.custom_estimator.name = str(path), name
    for dotted, value in sections.items():
        *head, last = dotted.split("__")
        target = cfg
        for part in head:
            target = getattr(target, part)
        setattr(target, last, value)
    return cfg


# ------------------------------------------------------------------------------ estimator needs
def test_every_built_in_estimator_declares_its_needs():
    assert {name: estimator_needs(name) for name in BUILT_IN_NEEDS} == BUILT_IN_NEEDS
    assert set(BUILT_IN_NEEDS) <= set(ADVANTAGE_ESTIMATORS)


def test_unknown_estimator_names_the_registered_ones():
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'.*grpo"):
        estimator_needs("nope")


def test_registering_without_needs_needs_nothing():
    try:
        register_advantage_estimator("test_needs_default")(lambda *a, **k: None)
        register_advantage_estimator("test_needs_groups", needs=EstimatorNeeds(groups=True))(lambda *a, **k: None)
        assert estimator_needs("test_needs_default") == EstimatorNeeds()
        assert estimator_needs("test_needs_groups") == EstimatorNeeds(groups=True)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_needs_default", None)
        ADVANTAGE_ESTIMATORS.pop("test_needs_groups", None)


@pytest.mark.parametrize("needs_line, expected", [
    ("", EstimatorNeeds()),
    ("my_estimator.needs = {'groups': True}", EstimatorNeeds(groups=True)),
    ("my_estimator.needs = {'critic': True, 'groups': False}", EstimatorNeeds(critic=True)),
    ("from rlframe.algos import EstimatorNeeds\nmy_estimator.needs = EstimatorNeeds(greedy_baseline=True)",
     EstimatorNeeds(greedy_baseline=True)),
])
def test_a_user_file_declares_needs(tmp_path, needs_line, expected):
    path = estimator_file(tmp_path, needs_line)
    cfg = custom(path)
    assert configured_estimator_needs(cfg.algorithm) == expected  # read before it is registered
    try:
        register_from_config("advantage", str(path), "my_estimator")
        assert estimator_needs("my_estimator") == expected
    finally:
        ADVANTAGE_ESTIMATORS.pop("my_estimator", None)


def test_a_run_that_does_not_select_the_user_estimator_asks_the_registry(tmp_path):
    cfg = custom(estimator_file(tmp_path, "my_estimator.needs = {'critic': True}"))
    cfg.algorithm.adv_estimator = "rloo"
    assert configured_estimator_needs(cfg.algorithm) == EstimatorNeeds(groups=True)
    cfg.algorithm.adv_estimator = "not_registered"
    assert configured_estimator_needs(cfg.algorithm) == EstimatorNeeds()  # validate_config names it


@pytest.mark.parametrize("needs, error, match", [
    ({"group": True}, ValueError, r"unknown keys \['group'\]; the keys are critic, groups"),
    ({"groups": 1}, TypeError, "groups are not"),
    (["groups"], TypeError, "a list"),
])
def test_malformed_needs_are_named(needs, error, match):
    def fn():
        pass

    fn.needs = needs
    with pytest.raises(error, match=match):
        declared_needs(fn, "'fn' in my.py")


def test_user_estimator_needs_are_checked_before_any_worker(tmp_path):
    groups = estimator_file(tmp_path / "groups", "my_estimator.needs = {'groups': True}")
    assert "rollout.n: my_estimator compares samples of one prompt" in problems(custom(groups, rollout__n=1))
    validate_config(custom(groups, rollout__n=2))
    plain = estimator_file(tmp_path / "plain", "", name="plain")
    validate_config(custom(plain, "plain", rollout__n=1))  # needs nothing: one sample is fine
    critic = estimator_file(tmp_path / "critic", "my_estimator.needs = {'critic': True}")
    message = problems(custom(critic, critic__loss_agg_mode="bogus"))  # a critic-only check runs: needs.critic
    assert "critic.loss_agg_mode: 'bogus' is not one of" in message
    validate_config(custom(plain, "plain", critic__loss_agg_mode="bogus"))  # no critic, nothing to check
    validate_config(custom(critic, trainer__critic_warmup=2))  # a critic to warm up
    turns = estimator_file(tmp_path / "turns", "my_estimator.needs = {'multi_turn': True}")
    assert "algorithm.adv_estimator: grpo_turn credits the model turns" in problems(custom(turns))


def test_a_greedy_baseline_is_refused_where_the_weights_move_on(tmp_path):
    greedy = estimator_file(tmp_path, "my_estimator.needs = {'greedy_baseline': True}")
    assert "rollout.partial.enable: ReMax's greedy baseline" in problems(custom(greedy, rollout__partial__enable=True))
    asynchronous = custom(greedy, trainer__async_rollout=True, trainer__placement="disaggregated")
    assert "algorithm.adv_estimator: ReMax's greedy baseline" in problems(asynchronous)


def test_a_broken_user_file_is_a_config_error(tmp_path):
    broken = estimator_file(tmp_path, "my_estimator.needs = {'value': True}")
    assert "algorithm.custom_estimator: 'my_estimator' in" in problems(custom(broken))
    missing = tmp_path / "raises.py"
    missing.write_text("import not_a_real_module_xyz\n")
    assert "algorithm.custom_estimator: importing plugin file" in problems(custom(missing))


def test_the_critic_is_started_and_planned_from_the_needs(tmp_path, tiny_model_dir):
    from rlframe.memory_plan import ModelShape, plan_memory
    from rlframe.trainer.launch import trainer_roles

    shape = ModelShape(params=2**20, layers=2, hidden=128, intermediate=256, vocab=400, heads=2, kv_heads=2, head_dim=64)
    for cfg, has_critic in ((custom(estimator_file(tmp_path / "critic", "my_estimator.needs = {'critic': True}")), True),
                            (custom(estimator_file(tmp_path / "plain", "", name="plain"), "plain"), False),
                            (RLConfig(), False)):
        cfg.model.path = str(tiny_model_dir)
        assert ("critic" in trainer_roles(cfg, str(tiny_model_dir), with_rollout=True)) is has_critic
        roles = {item.role for device in plan_memory(cfg, shape, gpu=True, capacity_gib=80.0).devices
                 for item in device.items}
        assert ("critic" in roles) is has_critic


# ------------------------------------------------------------------------- the checks' structure
def test_each_section_lists_named_checks_that_validate_config_runs_once_in_order():
    listed = {"CHECKS": [], "FOLDER_CHECKS": []}
    for name in SECTION_MODULES:
        module = getattr(config, name)
        for attr in ("CHECKS", "CRITIC_CHECKS", "FOLDER_CHECKS"):
            for check in getattr(module, attr, ()):
                # (a section may list a sub-section module's checks: trainer.py lists gates.py's)
                assert check.__module__.startswith("rlframe.config.") and not check.__name__.startswith("_"), check
                arguments = list(inspect.signature(check).parameters)
                assert arguments == ["cfg", "need", "model_dir"][: 3 if attr == "FOLDER_CHECKS" else 2], check
                listed["FOLDER_CHECKS" if attr == "FOLDER_CHECKS" else "CHECKS"].append(check)
    for attr, checks in listed.items():
        composed = list(getattr(config, attr))
        assert len(composed) == len(set(composed))
        # every section's checks, in the order of SECTION_MODULES; + the engines' (one entry, their registry);
        # the declared bounds first (rlframe/bounds.py)
        assert [c for c in composed if c in checks] == checks
        assert len(composed) == len(checks) + (2 if attr == "CHECKS" else 1), attr
    assert config.CHECKS[0] is config.declared_bounds_hold


def test_no_config_file_over_600_lines_and_no_estimator_name_compared():
    for path in CONFIG_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path
    names = set(BUILT_IN_NEEDS)
    root = CONFIG_DIR.parent
    for path in [*CONFIG_DIR.glob("*.py"), root / "trainer" / "launch.py", root / "memory_plan.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = {c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)}
                assert not constants & names, (path, ast.unparse(node))


def test_problems_are_gathered_in_order_and_reported_at_once():
    def first(cfg, need):
        need(False, "a.b", "first. Fix: a.b=1")
        need(True, "a.c", "never")

    def second(cfg, need, folder):
        need(folder is None, "a.d", f"second {folder}")

    found = problems_of(None, (first,)) + problems_of(None, (second,), "/x")
    assert found == ["a.b: first. Fix: a.b=1", "a.d: second /x"]
    with pytest.raises(ConfigError) as error:
        raise_problems(found)
    assert str(error.value) == "invalid configuration:\n  - a.b: first. Fix: a.b=1\n  - a.d: second /x"
    raise_problems([])  # nothing to report


def test_the_old_log_prob_pass_is_skipped_only_when_exactly_on_policy():
    cfg = RLConfig()
    cfg.actor.ppo_mini_batch_size = cfg.data.train_batch_size = 8
    assert skips_old_log_prob_pass(cfg)
    for dotted, value in (("actor.ppo_epochs", 2), ("actor.ppo_mini_batch_size", 4),
                          ("algorithm.use_kl_in_reward", True), ("actor.skip_old_log_prob_when_on_policy", False)):
        changed = RLConfig()
        changed.actor.ppo_mini_batch_size = changed.data.train_batch_size = 8
        section, key = dotted.split(".")
        setattr(getattr(changed, section), key, value)
        assert not skips_old_log_prob_pass(changed), dotted


def test_partial_rollouts_refuse_a_vision_language_policy_from_its_folder(tmp_path):
    from rlframe.models.tiny_vlm import build_tokenizer, tiny_vlm_config

    tiny_vlm_config(build_tokenizer()).save_pretrained(tmp_path)  # config.json only
    cfg = RLConfig()
    cfg.model.path, cfg.rollout.partial.enable = str(tmp_path), True
    expected = f"rollout.partial.enable: {tmp_path} is a vision-language model"
    assert expected in problems(cfg)
    with pytest.raises(ConfigError, match="is a vision-language model"):
        validate_model_folder(cfg, str(tmp_path))  # again once provisioned (main.run: validate_before_workers)
    cfg.rollout.partial.enable = False
    validate_model_folder(cfg, str(tmp_path))


# ------------------------------------------------------------------------- bounds declared beside the fields
# Sections whose numbers are checked by their own named checks or settings class (owned elsewhere; not yet bounded)
OWN_NUMBER_CHECKS = ("deepspeed.", "megatron.", "pt.", "rft.", "trainer.gates.", "reward.judge.")


def _numeric(hint) -> bool:
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, list) and len(args) == 1:
        hint = args[0]
    return hint in (int, float)


def test_every_number_of_the_schema_declares_its_bound_and_the_defaults_keep_them():
    import typing

    from rlframe.bounds import bound_problems, walk_fields

    cfg = RLConfig()
    assert bound_problems(cfg) == []  # every default within its own bound
    unbounded = []
    for key, _, _, f in walk_fields(cfg):
        parent = cfg
        for part in key.replace("]", "").replace("[", ".").split(".")[:-1]:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        if (_numeric(typing.get_type_hints(type(parent))[f.name]) and "bound" not in f.metadata
                and not key.startswith(OWN_NUMBER_CHECKS)):
            unbounded.append(key)
    assert unbounded == [], f"numeric keys without a declared bound (rlframe.bounds.bounded): {unbounded}"


def test_bound_grammar():
    from rlframe.bounds import bounded, describe, within

    assert within(1, ">= 1") and not within(0, ">= 1") and not within(True, ">= 0")
    assert within(1.0, "(0, 1]") and not within(0.0, "(0, 1]") and within(-1, ">= -1")
    assert within(-1, "== -1 or >= 1") and not within(0, "== -1 or >= 1")
    assert not within(float("nan"), "finite") and not within(float("inf"), "> 0") and within(-3.5, "finite")
    assert describe("(0, 1]") == "in (0, 1]" and describe("> 0", float("nan")) == "a finite number, > 0"
    with pytest.raises(ValueError, match="not a bound: 'positive'"):
        bounded(1, "positive")
