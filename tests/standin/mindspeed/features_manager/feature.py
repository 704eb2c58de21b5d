"""Stand-in for ``mindspeed.features_manager.feature.MindSpeedFeature``."""

from __future__ import annotations

from argparse import ArgumentParser, Namespace


class MindSpeedFeature:
    def __init__(self, feature_name: str, optimization_level: int = 2) -> None:
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = optimization_level == 0

    def is_need_apply(self, args: Namespace) -> bool:
        return bool((self.optimization_level <= getattr(args, "optimization_level", 2)
                     and getattr(args, self.feature_name, None)) or self.default_patches)

    def register_args(self, parser: ArgumentParser) -> None:
        pass

    def pre_validate_args(self, args: Namespace) -> None:
        pass

    def validate_args(self, args: Namespace) -> None:
        pass

    def post_validate_args(self, args: Namespace) -> None:
        pass

    def pre_register_patches(self, patch_manager, args: Namespace) -> None:
        pass

    def register_patches(self, patch_manager, args: Namespace) -> None:
        pass
