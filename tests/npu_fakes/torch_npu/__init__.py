"""Stand-in for Huawei's ``torch_npu`` (tests only; never installed anywhere else).

The real package needs Ascend's CANN and breaks ``import torch`` without it. This one keeps what
MindSpeed and MindSpeed-LLM touch on a CPU host under Poseidon's emulation:

* ``torch.npu`` (and ``torch_npu.npu``): a device module whose queries answer for the CPU, so code
  that asks "which NPU, how much memory, synchronise" runs; streams and events are the CPU's.
* ``torch_npu.contrib.transfer_to_npu``: importable; the real one rewrites ``torch.cuda`` calls to
  ``torch.npu``: under emulation ``torch.cuda`` is already the CPU, so it does nothing.
* NPU kernels (``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``, ...): the few MindSpeed's
  default paths call are computed in plain torch with the kernel's documented semantics; any other
  ``torch_npu.npu_*`` raises ``NotImplementedError`` naming the kernel, so a feature that needs
  one fails loudly rather than silently.
"""

from __future__ import annotations

import sys
import types

import torch

__version__ = "2.7.1.post0+fake"   # the torch_npu line MindSpeed 2.3 / 26.1 pair with

from . import _C, contrib, npu, utils  # noqa: E402,F401  (npu: the device module)
from ._kernels import *  # noqa: E402,F401,F403
from . import _kernels  # noqa: E402

torch.npu = npu                       # what the real import does: torch.npu is the device module
sys.modules.setdefault("torch.npu", npu)
if not hasattr(torch, "float8_e8m0fnu"):
    torch.float8_e8m0fnu = torch.float32  # type: ignore[attr-defined]
hifloat8 = torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.float16


from _npu_fake_common import install_finder as _install_finder  # noqa: E402
from _npu_fake_common import module_getattr as _module_getattr  # noqa: E402

__getattr__ = _module_getattr("torch_npu")   # other kernels / APIs: import, fail when called
_install_finder()
