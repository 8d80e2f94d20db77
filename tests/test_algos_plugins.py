"""Loading user advantage estimators and policy losses from files."""

import numpy as np
import pytest
import torch

from rlframe.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageConfig,
    PolicyLossConfig,
    get_advantage_estimator,
    get_policy_loss,
    load_object_from_file,
    register_from_config,
)

USER_FILE = '''
import torch
from rlframe.algos import agg_loss

SCALE = 2.0

def plain_reinforce(old_log_prob, log_prob, advantages, response_mask, *, config, agg=None):
    loss = agg_loss(-advantages * log_prob, response_mask, **(agg or {}))
    return loss, {"scale": SCALE}

def sign_advantage(token_level_rewards, response_mask, group_index=None, *, config, values=None,
                   baseline_rewards=None):
    scores = (token_level_rewards * response_mask).sum(-1)
    advantages = torch.sign(scores)[:, None].expand_as(token_level_rewards).clone()
    return advantages, advantages
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_algo.py"
    path.write_text(USER_FILE)
    return path


def test_register_policy_loss_from_file(user_file):
    try:
        register_from_config("policy_loss", str(user_file), "plain_reinforce", register_as="test_plain_reinforce")
        loss_fn = get_policy_loss("test_plain_reinforce")
        log_prob = torch.tensor([[-1.0, -2.0]])
        loss, metrics = loss_fn(log_prob, log_prob, torch.ones(1, 2), torch.ones(1, 2), config=PolicyLossConfig())
        assert loss.item() == pytest.approx(1.5)
        assert metrics == {"scale": 2.0}
        # registering again (a config reload) replaces the entry
        register_from_config("policy_loss", str(user_file), "plain_reinforce", register_as="test_plain_reinforce")
    finally:
        POLICY_LOSSES.pop("test_plain_reinforce", None)


def test_register_advantage_from_file(user_file):
    try:
        register_from_config("advantage", str(user_file), "sign_advantage")
        estimator = get_advantage_estimator("sign_advantage")
        rewards = torch.tensor([[0.0, 3.0], [-2.0, 5.0]])
        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
        advantages, _ = estimator(rewards, mask, np.array([0, 1]), config=AdvantageConfig())
        # zeroed outside the mask by the registry wrapper
        assert advantages.tolist() == [[1.0, 1.0], [-1.0, 0.0]]
    finally:
        ADVANTAGE_ESTIMATORS.pop("sign_advantage", None)


def test_same_file_name_in_two_folders_does_not_collide(tmp_path):
    for folder, value in (("one", 1), ("two", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "algo.py").write_text(f"VALUE = {value}\n")
    assert load_object_from_file(str(tmp_path / "one" / "algo.py"), "VALUE") == 1
    assert load_object_from_file(str(tmp_path / "two" / "algo.py"), "VALUE") == 2


def test_errors_name_the_problem(tmp_path, user_file):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        load_object_from_file(str(missing), "f")

    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ImportError, match=r"broken\.py.*not_a_real_module_xyz"):
        load_object_from_file(str(broken), "f")

    with pytest.raises(AttributeError, match=r"no 'missing_fn'.*plain_reinforce.*sign_advantage"):
        load_object_from_file(str(user_file), "missing_fn")

    with pytest.raises(TypeError, match="not a function"):
        register_from_config("policy_loss", str(user_file), "SCALE")

    with pytest.raises(ValueError, match="policy_loss"):
        register_from_config("reward", str(user_file), "plain_reinforce")
