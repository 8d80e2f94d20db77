"""Pure tensor functions of the RL algorithms: advantages, policy losses, KL, distillation; and their registries."""

from rlframe.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    EstimatorNeeds,
    estimator_needs,
    get_advantage_estimator,
    register_advantage_estimator,
)
from rlframe.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
)
from rlframe.algos.losses import (
    AGG_MODES,
    POLICY_LOSS_DEFAULTS,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    log_probs_from_logits,
    policy_loss_config,
    policy_loss_defaults,
    register_policy_loss,
)
from rlframe.algos.dapo import informative_groups, overlong_penalty
from rlframe.algos.distillation import DISTILLATION_LOSSES, get_distillation_loss, register_distillation_loss, reverse_kl_advantage
from rlframe.algos.plugins import configured_estimator_needs, load_object_from_file, register_from_config
from rlframe.algos.utils import masked_mean, masked_sum, masked_var, masked_whiten
from rlframe.algos.value import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DISTILLATION_LOSSES",
    "AGG_MODES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "EstimatorNeeds",
    "FixedKLController",
    "POLICY_LOSSES",
    "POLICY_LOSS_DEFAULTS",
    "PolicyLossConfig",
    "agg_loss",
    "build_kl_controller",
    "compute_value_loss",
    "configured_estimator_needs",
    "entropy_from_logits",
    "estimator_needs",
    "get_advantage_estimator",
    "get_distillation_loss",
    "get_policy_loss",
    "informative_groups",
    "kl_penalty",
    "load_object_from_file",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss_config",
    "policy_loss_defaults",
    "register_advantage_estimator",
    "register_distillation_loss",
    "register_from_config",
    "register_policy_loss",
    "reverse_kl_advantage",
]
