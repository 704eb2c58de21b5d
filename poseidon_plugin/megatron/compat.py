"""Small compatibility fixes applied before the user's script runs."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

log = logging.getLogger("poseidon")

# Flags that make megatron-core's training path run on the CPU (appended under --poseidon-emulate):
# no fused CUDA kernels, no Transformer Engine, gloo collectives.
CPU_EMULATION_FLAGS: tuple[str, ...] = (
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)
# store_true switches that need CUDA-only kernels; stripped under emulation.
CPU_INCOMPATIBLE_BOOL_FLAGS: tuple[str, ...] = ("--use-flash-attn", "--overlap-grad-reduce",
                                               "--sequence-parallel",  # torch LayerNorm: no SP
                                               "--overlap-param-gather")


def patch_dataset_helpers() -> bool:
    """The megatron-core wheel ships ``helpers_cpp`` prebuilt but no Makefile, and
    ``megatron.training`` runs ``make`` on rank 0 (and exits on failure). When the compiled helpers
    import fine, make that compile step a no-op. Returns True when patched."""
    try:
        utils = importlib.import_module("megatron.core.datasets.utils")
    except ImportError:
        return False
    here = os.path.dirname(utils.__file__)
    if os.path.exists(os.path.join(here, "Makefile")):
        return False
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False
    utils.compile_helpers = lambda: None
    log.debug("megatron.core.datasets: prebuilt helpers_cpp found, skipping the make step")
    return True


# Fused CUDA kernels Megatron's defaults ask for, the module each needs, and the flag that turns
# the kernel off. megatron-core's wheel builds none of them: gradient-accumulation fusion and the
# masked-softmax kernels and the persistent layer norm come with Apex (or an NGC container), RoPE
# fusion with Transformer Engine. Without the module Megatron raises at model build (gradient
# accumulation, RoPE, the norm) or at the first attention (softmax); the unfused paths compute the same values.
CUDA_KERNEL_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("gradient-accumulation fusion", "fused_weight_gradient_mlp_cuda",
     "--no-gradient-accumulation-fusion"),
    ("masked-softmax fusion", "scaled_masked_softmax_cuda", "--no-masked-softmax-fusion"),
    ("RoPE fusion", "transformer_engine", "--no-rope-fusion"),
    # the persistent layer norm is Apex's; without Apex the local spec's torch norm asserts it off
    ("persistent layer norm", "apex", "--no-persist-layer-norm"),
)


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_kernel_flags(argv: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """The (kernel, module, flag) of each fused CUDA kernel Megatron would use by default whose
    module is not installed here and whose flag ``argv`` does not already carry."""
    from .argv import find_flag

    return [(kernel, module, flag) for kernel, module, flag in CUDA_KERNEL_FLAGS
            if not module_available(module) and not find_flag(list(argv), flag)]


def missing_kernels_text(missing: list[tuple[str, str, str]]) -> str:
    """``module (kernel), ...`` of :func:`missing_kernel_flags`' result, for the one log line."""
    return ", ".join(f"{module} ({kernel})" for kernel, module, _ in missing)
