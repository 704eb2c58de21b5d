"""Stand-in for MindSpeed's ``PipelineModelParallelLayoutFeature`` (26.1.0_core_r0.12.1): the
``--pipeline-model-parallel-layout`` flag backported onto core_r0.12.1, always on (level 0)."""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

from mindspeed.features_manager.feature import MindSpeedFeature


def num_stages(layout: str) -> int:
    """Stages of a flat layout string (``Et*3|t*5|tL``); ``(...)*n`` groups are not modelled."""
    if "(" in layout:
        raise NotImplementedError("the stand-in counts flat layouts only")
    return layout.count("|") + 1


class PipelineModelParallelLayoutFeature(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("pipeline-model-parallel-layout", optimization_level=0)

    def register_args(self, parser: ArgumentParser) -> None:
        group = parser.add_argument_group(title="pipeline-model-parallel-layout")
        group.add_argument("--pipeline-model-parallel-layout", type=str, default=None)

    def validate_args(self, args: Namespace) -> None:
        layout = getattr(args, "pipeline_model_parallel_layout", None)
        if layout is None:
            return
        if getattr(args, "schedules_method", None) == "dualpipev":
            raise AssertionError("--pipeline-model-parallel-layout is incompatible with "
                                 "--schedules-method dualpipev.")
        if getattr(args, "noop_layers", None) is not None:
            raise AssertionError("--pipeline-model-parallel-layout is incompatible with --noop-layers.")
        set_vpp = [getattr(args, "num_layers_per_virtual_pipeline_stage", None),
                   getattr(args, "num_virtual_stages_per_pipeline_rank", None)]
        if any(v is not None for v in set_vpp):
            raise AssertionError("No more than one of the following arguments can be set at the "
                                 "same time: --num-layers-per-virtual-pipeline-stage, "
                                 "--num-virtual-stages-per-pipeline-rank,"
                                 "--pipeline-model-parallel-layout.")
        stages = num_stages(layout)
        pp = args.pipeline_model_parallel_size
        if stages % pp:
            raise AssertionError("The length of pipeline_model_parallel_layout must be divisible "
                                 f"by pipeline_model_parallel_size ({stages=}, {pp=})")
        vpp = stages // pp
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None

    def register_patches(self, patch_manager, args: Namespace) -> None:
        if not getattr(args, "pipeline_model_parallel_layout", None):
            return

        def get_num_layers_to_build_wrapper(fn):
            return fn

        patch_manager.register_patch("megatron.core.transformer.transformer_block.get_num_layers_to_build",
                                     get_num_layers_to_build_wrapper)
