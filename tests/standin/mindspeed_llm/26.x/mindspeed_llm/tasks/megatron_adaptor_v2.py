"""Stand-in for MindSpeed-LLM 26.x's ``mindspeed_llm/tasks/megatron_adaptor_v2.py``: ``execute()``
removes earlier patches; ``repatch(config)`` re-parses ``sys.argv`` and sets ``config`` on it.
(Upstream also imports ``torch_npu.contrib.transfer_to_npu`` here.)"""

import argparse

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

PARSED = []  # stand-in only: every namespace FeatureAdaptor parsed (after repatch's overlay)


class FeatureAdaptor:
    _args = None  # never assigned: every call parses sys.argv again

    @classmethod
    def get_mindspeed_llm_args(cls):
        if cls._args is not None:
            return cls._args
        from mindspeed_llm.training.arguments import process_args_v2

        parser = argparse.ArgumentParser(description="MindSpeed-LLM Arguments", allow_abbrev=False)
        args, _unknown = process_args_v2(parser).parse_known_args()
        PARSED.append(args)
        return args

    @classmethod
    def execute(cls):
        MindSpeedFeaturesManager.remove_patches()
        args = FeatureAdaptor.get_mindspeed_llm_args()
        MindSpeedFeaturesManager.apply_features_pre_patches(args)
        MindSpeedFeaturesManager.apply_features_patches(args)


def repatch(config):
    MindSpeedFeaturesManager.remove_patches()
    args = FeatureAdaptor.get_mindspeed_llm_args()
    for k, v in config.items():
        setattr(args, k, v)
    MindSpeedFeaturesManager.apply_features_pre_patches(args)
    MindSpeedFeaturesManager.apply_features_patches(args)


FeatureAdaptor.execute()
