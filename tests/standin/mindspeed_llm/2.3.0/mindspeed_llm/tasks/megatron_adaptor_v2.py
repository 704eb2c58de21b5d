"""Stand-in for MindSpeed-LLM 2.3.0's ``mindspeed_llm/tasks/megatron_adaptor_v2.py``: no
``repatch``; ``execute()`` does not remove earlier patches. (Upstream also imports
``torch_npu.contrib.transfer_to_npu`` here.)"""

import argparse

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

PARSED = []  # stand-in only: every namespace FeatureAdaptor parsed


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
        args = FeatureAdaptor.get_mindspeed_llm_args()
        MindSpeedFeaturesManager.apply_features_pre_patches(args)
        MindSpeedFeaturesManager.apply_features_patches(args)


FeatureAdaptor.execute()
