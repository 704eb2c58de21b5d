"""Stand-in for ``mindspeed_llm.training.arguments``: feature flags registered on a parser
(``process_args_v2``, what MindSpeed-LLM's parse_args wrapper adds to Megatron's parser) and the
validation order of ``validate_args_v2_decorator``."""

from __future__ import annotations

from functools import wraps

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
from mindspeed_llm.features_manager import FEATURES_LIST  # noqa: F401  (sets the list, as upstream)


def process_args_v2(parser):
    MindSpeedFeaturesManager.register_features_args(parser)
    return parser


def validate_args_v2_decorator(megatron_validate_args):
    """Pre-validate the features, Megatron's validation, post-validate, validate the features."""

    @wraps(megatron_validate_args)
    def wrapper(args, defaults=None):
        MindSpeedFeaturesManager.pre_validate_features_args(args)
        megatron_validate_args(args, defaults or {})
        MindSpeedFeaturesManager.post_validate_features_args(args)
        MindSpeedFeaturesManager.validate_features_args(args)
        return args

    return wrapper
