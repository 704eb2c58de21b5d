"""Stand-in for ``torch.npu`` / ``torch_npu.npu``: the device module, answered by ``torch.cuda``.

Under Poseidon's CPU emulation ``torch.cuda`` already answers for the emulated device (the CPU
shims of ``poseidon_plugin.megatron.emulate.emulation``: device count, names, memory statistics, events,
streams, RNG state), so every query is forwarded to it, as ``transfer_to_npu`` forwards the other
way on a real Ascend host. A name ``torch.cuda`` does not have raises ``AttributeError``."""

from __future__ import annotations

import torch


def is_available() -> bool:
    return torch.cuda.is_available()


def set_compile_mode(*_a, **_k) -> None:      # graph compilation switch: nothing to compile here
    return None


def set_option(*_a, **_k) -> None:            # ACL options: none on the CPU
    return None


def init() -> None:
    return None


def __getattr__(name: str):
    if name == "default_generators":   # one per device; the emulated devices share the CPU's
        return (torch.default_generator,) * max(1, torch.cuda.device_count())
    try:
        return getattr(torch.cuda, name)
    except AttributeError:
        raise AttributeError(f"torch.npu (stand-in) has no attribute {name!r}") from None
