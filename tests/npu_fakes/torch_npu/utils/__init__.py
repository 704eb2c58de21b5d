"""Stand-in for ``torch_npu.utils``: the few helpers MindSpeed calls at import or in training."""

from _npu_fake_common import module_getattr

__getattr__ = module_getattr("torch_npu.utils")


def register_asd_hook(*_a, **_k) -> None:
    """Ascend's silent-data-corruption detector hook: no detector on the CPU."""
    return None


def reset_thread_affinity(*_a, **_k) -> None:
    """Ascend's CPU-core binding of the host threads: left to the OS here."""
    return None
