"""Stand-in for MindSpeed-LLM's ``NumLayerListFeature`` (2.2 and later)."""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

from mindspeed.features_manager.feature import MindSpeedFeature


class NumLayerListFeature(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__(feature_name="num-layer-list", optimization_level=2)

    def register_args(self, parser: ArgumentParser) -> None:
        group = parser.add_argument_group(title=self.feature_name)
        group.add_argument("--num-layer-list", type=str,
                           help="a list of number of layers, seperated by comma; e.g., 4,4,4,4")

    def pre_validate_args(self, args: Namespace) -> None:
        # Megatron checks num_layers % pp: it sees one layer per stage meanwhile
        self.origin_num_layers = None
        if args.num_layer_list:
            self.origin_num_layers = args.num_layers
            args.num_layers = len(args.num_layer_list.split(","))

    def validate_args(self, args: Namespace) -> None:
        if not args.num_layer_list:
            return
        if getattr(args, "save_model_type", None) != "hf":
            if len(args.num_layer_list.split(",")) != args.pipeline_model_parallel_size:
                raise ValueError("len(args.num_layer_list) != args.pipeline_model_parallel_size")
        if not args.pipeline_model_parallel_size > 1:
            raise ValueError("Dynamic pipeline model should work with pipeline parallel.")
        if args.num_layers_per_virtual_pipeline_stage:
            raise ValueError("Dynamic pipeline model and virtual pipeline cannot be enabled at the same time.")
        if args.schedules_method == "dualpipev":
            raise ValueError("Dynamic pipeline model and dualpipev cannot be enabled at the same time.")
        if args.noop_layers:
            args.num_layer_list = None

    def post_validate_args(self, args: Namespace) -> None:
        if self.origin_num_layers:
            args.num_layers = self.origin_num_layers

    def register_patches(self, patch_manager, args: Namespace) -> None:
        if not args.num_layer_list:
            return

        def get_num_layers_to_build(config, vp_stage=None):
            raise NotImplementedError("stand-in")

        def get_layer_offset_wrapper(fn):
            return fn

        def core_transformer_config_from_args_wrapper(fn):
            return fn

        patch_manager.register_patch("megatron.core.transformer.transformer_block.get_num_layers_to_build",
                                     get_num_layers_to_build)
        patch_manager.register_patch(
            "megatron.core.transformer.transformer_layer.TransformerLayer._get_layer_offset",
            get_layer_offset_wrapper)
        patch_manager.register_patch("megatron.training.arguments.core_transformer_config_from_args",
                                     core_transformer_config_from_args_wrapper)
