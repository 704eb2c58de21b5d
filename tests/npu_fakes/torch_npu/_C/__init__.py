"""Stand-in for ``torch_npu._C`` (the C extension): what MindSpeed reads of it."""

from _npu_fake_common import module_getattr

from . import _distributed_c10d  # noqa: F401

__getattr__ = module_getattr("torch_npu._C")
