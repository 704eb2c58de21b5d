"""Stand-in for ``mindspeed.features_manager.features_manager.MindSpeedFeaturesManager``."""

from __future__ import annotations

from mindspeed.patch_utils import MindSpeedPatchesManager


class MindSpeedFeaturesManager:
    FEATURES_LIST: list = []

    @classmethod
    def set_features_list(cls, features_list) -> None:
        cls.FEATURES_LIST[:] = features_list

    @classmethod
    def apply_features_pre_patches(cls, mindspeed_args) -> None:
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(mindspeed_args):
                feature.pre_register_patches(MindSpeedPatchesManager, mindspeed_args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def apply_features_patches(cls, mindspeed_args) -> None:
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(mindspeed_args):
                feature.register_patches(MindSpeedPatchesManager, mindspeed_args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def register_features_args(cls, parser) -> None:
        for feature in cls.FEATURES_LIST:
            feature.register_args(parser)

    @classmethod
    def pre_validate_features_args(cls, args) -> None:
        for feature in cls.FEATURES_LIST:
            feature.pre_validate_args(args)

    @classmethod
    def post_validate_features_args(cls, args) -> None:
        for feature in cls.FEATURES_LIST:
            feature.post_validate_args(args)

    @classmethod
    def validate_features_args(cls, args) -> None:
        for feature in cls.FEATURES_LIST:
            feature.validate_args(args)

    @classmethod
    def remove_patches(cls) -> None:
        MindSpeedPatchesManager.remove_patches()
