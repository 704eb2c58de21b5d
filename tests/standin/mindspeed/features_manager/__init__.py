"""Stand-in for ``mindspeed.features_manager`` (the features MindSpeed-LLM imports from it)."""

from mindspeed.features_manager.feature import MindSpeedFeature
from mindspeed.features_manager.pipeline_parallel.pipeline_model_parallel_layout_feature import (
    PipelineModelParallelLayoutFeature,
)

__all__ = ["MindSpeedFeature", "PipelineModelParallelLayoutFeature"]
