"""Small compatibility fixes applied before the user's script runs."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

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
    """Megatron's C++ dataset helpers (``helpers_cpp``) without writing into megatron's tree.

    ``megatron.training`` runs ``make`` in ``megatron/core/datasets`` on rank 0 (and exits on
    failure). The megatron-core wheel ships the helpers prebuilt and no Makefile: the step is made
    a no-op. A Megatron-LM checkout ships ``helpers.cpp`` and a Makefile: its ``make`` writes into
    the checkout (which may be read-only or shared, e.g. a container image) and builds with
    whatever ``python3`` is first on PATH. Here the helpers are built once per source and Python
    into a cache outside the tree (:func:`build_helpers_cached`) and imported as
    ``megatron.core.datasets.helpers_cpp``; a tree whose helpers already import is left alone.
    Returns True when the make step was replaced."""
    try:
        utils = importlib.import_module("megatron.core.datasets.utils")
    except ImportError:
        return False
    here = os.path.dirname(utils.__file__)
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        if os.path.exists(os.path.join(here, "Makefile")):
            return False    # built in the tree already: Megatron's make finds nothing to do
        utils.compile_helpers = lambda: None
        log.debug("megatron.core.datasets: prebuilt helpers_cpp found, skipping the make step")
        return True
    source = os.path.join(here, "helpers.cpp")
    if not os.path.exists(source):
        return False
    so_path = build_helpers_cached(source)
    _import_as("megatron.core.datasets.helpers_cpp", so_path)
    utils.compile_helpers = lambda: None
    log.info("megatron.core.datasets: helpers_cpp built from %s into %s", source, so_path)
    return True


def helpers_cache_dir() -> str:
    return os.environ.get("POSEIDON_HELPERS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "poseidon", "megatron-helpers")


def build_helpers_cached(source: str) -> str:
    """Compile Megatron's ``helpers.cpp`` as its Makefile does (g++ -O3 -shared -std=c++11 -fPIC,
    pybind11's includes) for this Python, into :func:`helpers_cache_dir` keyed by the source's
    hash and the extension suffix; ranks of a host build it once (a file lock). Raises
    :class:`PoseidonError` with the fix when pybind11 or the compiler is missing."""
    import fcntl
    import hashlib
    import subprocess
    import sysconfig

    from poseidon_plugin.errors import PoseidonError

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + suffix.encode()).hexdigest()[:16]
    out_dir = os.path.join(helpers_cache_dir(), key)
    so_path = os.path.join(out_dir, "helpers_cpp" + suffix)
    if os.path.exists(so_path):
        return so_path
    try:
        import pybind11
    except ImportError:
        raise PoseidonError(f"Megatron's dataset helpers ({source}) must be compiled and pybind11 is "
                            "not installed: pip install pybind11") from None
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, ".lock"), "w")
    except OSError as exc:   # a file in the way, no permission, a read-only HOME
        raise PoseidonError(f"cannot build Megatron's dataset helpers into {out_dir} "
                            f"({exc.strerror or exc}): set POSEIDON_HELPERS_CACHE to a writable "
                            "directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(so_path):
            return so_path
        tmp = f"{so_path}.{os.getpid()}.tmp"
        cmd = [os.environ.get("CXX", "g++"), "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC",
               f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", source,
               "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise PoseidonError(f"Megatron's dataset helpers ({source}) must be compiled and no C++ "
                                f"compiler was found ({cmd[0]}): install g++ or set CXX") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise PoseidonError(f"compiling Megatron's dataset helpers ({source}) failed: {last}")
        os.replace(tmp, so_path)
    return so_path


def _import_as(name: str, path: str) -> None:
    """Load the extension at ``path`` as module ``name`` (and bind it on its package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(importlib.import_module(parent), child, module)


# MindSpeed / MindSpeed-LLM switches (store_true) whose paths call Ascend-only kernels (CANN
# fused ops, MC2 / CoC communication-compute fusion): under CPU emulation they are turned off,
# with one line naming them, as the CUDA path turns off the fused kernels it lacks. The layer
# profiled and trained is then the unfused one on every rank.
MINDSPEED_NPU_KERNEL_FLAGS: tuple[str, ...] = (
    "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb",
    "--use-fused-ring-attention-update", "--use-fused-moe-token-permute-and-unpermute",
    "--use-fused-mlp", "--use-fused-mhc", "--use-fused-lightning-indexer",
    "--use-fused-lightning-indexer-loss", "--use-fused-lightning-indexer-kl-loss",
    "--use-fused-sparse-flash-attention", "--use-ascend-mc2", "--use-mc2", "--use-ascend-coc",
)


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
    from poseidon_plugin.megatron.launch.argv import find_flag

    return [(kernel, module, flag) for kernel, module, flag in CUDA_KERNEL_FLAGS
            if not module_available(module) and not find_flag(list(argv), flag)]


def missing_kernels_text(missing: list[tuple[str, str, str]]) -> str:
    """``module (kernel), ...`` of :func:`missing_kernel_flags`' result, for the one log line."""
    return ", ".join(f"{module} ({kernel})" for kernel, module, _ in missing)
