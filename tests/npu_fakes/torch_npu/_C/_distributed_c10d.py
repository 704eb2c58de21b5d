"""Stand-in for HCCL's process-group bindings. The launch's collectives run on gloo; MindSpeed
only builds ``ProcessGroupHCCL.Options`` to tag groups with HCCL settings. Its options carry
``hccl_config`` per instance and not as a class attribute, like torch_npu releases before the
group-name tagging: MindSpeed checks ``hasattr(Options, 'hccl_config')`` and then leaves the
options alone, so gloo groups get none."""

from __future__ import annotations


class ProcessGroupHCCL:
    class Options:
        def __init__(self) -> None:
            self.hccl_config: dict = {}
            self.is_high_priority_stream = False
