"""Stand-in for MindSpeed-LLM 2.3.0's features list: no layout feature."""

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
from mindspeed_llm.features_manager.basic import DualpipeVFeature, MegatronBasicFeature, NoopLayersFeature
from mindspeed_llm.features_manager.pipeline_parallel.num_layer_list import NumLayerListFeature


def create_features_list():
    return [MegatronBasicFeature(), NumLayerListFeature(), NoopLayersFeature(), DualpipeVFeature()]


FEATURES_LIST = create_features_list()
MindSpeedFeaturesManager.set_features_list(FEATURES_LIST)
