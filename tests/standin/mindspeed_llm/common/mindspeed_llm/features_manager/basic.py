"""Stand-in for the features whose flags the pipeline features read: MindSpeed's
``--optimization-level`` (MegatronBasicFeature), ``--noop-layers`` (NoopLayersFeature),
``--schedules-method`` (DualpipeVFeature)."""

from __future__ import annotations

from argparse import ArgumentParser

from mindspeed.features_manager.feature import MindSpeedFeature


class MegatronBasicFeature(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("megatron-basic", optimization_level=0)

    def register_args(self, parser: ArgumentParser) -> None:
        parser.add_argument("--optimization-level", type=int, default=2)


class NoopLayersFeature(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("noop-layers", optimization_level=2)

    def register_args(self, parser: ArgumentParser) -> None:
        parser.add_argument("--noop-layers", type=str, default=None)


class DualpipeVFeature(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("schedules-method", optimization_level=2)

    def register_args(self, parser: ArgumentParser) -> None:
        parser.add_argument("--schedules-method", type=str, default=None, choices=["dualpipev"])
