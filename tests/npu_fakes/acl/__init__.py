"""Stand-in for Ascend's ``acl`` (pyACL runtime bindings): every name imports; calling any of them
raises ``NotImplementedError`` naming it."""

from _npu_fake_common import module_getattr

__getattr__ = module_getattr("acl")

from _npu_fake_common import install_finder

install_finder()
