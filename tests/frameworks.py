"""Where the tests find the real framework trees and the side environment that runs them.

The unchanged upstream trees (Megatron-LM, MindSpeed, MindSpeed-LLM; see their PROVENANCE.md) live
beside the repository in ``../shared/frameworks`` (``POSEIDON_FRAMEWORKS`` overrides). They are
test material: used from there, never copied. A user's clone has no such folder: the tests that
need it skip, saying so.

MindSpeed-LLM's pure-Python dependencies (transformers, datasets, peft, scipy, einops, ...) live in
a side environment that reaches torch and this package through the main venv (``make test``
builds it: ``.msllm/venv``; ``POSEIDON_MSLLM_PYTHON`` names its interpreter). The NPU libraries are
the stand-ins of ``tests/npu_fakes``.
"""

from __future__ import annotations

import os
import subprocess

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
NPU_FAKES = os.path.join(TESTS, "npu_fakes")
FRAMEWORKS = os.path.abspath(os.environ.get("POSEIDON_FRAMEWORKS")
                             or os.path.join(ROOT, "..", "shared", "frameworks"))

# MindSpeed-LLM release -> (its tree, the MindSpeed it pairs with, the Megatron-LM it runs on)
MINDSPEED_LLM_RELEASES: dict[str, tuple[str, str, str]] = {
    "26.1.0": ("mindspeed-llm-v26.1.0", "mindspeed-26.1.0_core_r0.12.1", "megatron-lm-core_v0.12.1"),
    "2.3.0": ("mindspeed-llm-v2.3.0", "mindspeed-2.3.0_core_r0.12.1", "megatron-lm-core_v0.12.1"),
}
LAYOUT_RELEASES = frozenset({"26.1.0"})   # register --pipeline-model-parallel-layout


def tree(name: str) -> str:
    return os.path.join(FRAMEWORKS, name)


def msllm_python() -> str | None:
    return os.environ.get("POSEIDON_MSLLM_PYTHON") or None


def mindspeed_llm_skip_reason(release: str) -> str | None:
    """Why the real MindSpeed-LLM ``release`` cannot run here, or None."""
    if not os.path.isdir(FRAMEWORKS):
        return (f"the framework trees are not here ({FRAMEWORKS}): a user's clone; the workplace "
                "CI has them")
    missing = [t for t in MINDSPEED_LLM_RELEASES[release] if not os.path.isdir(tree(t))]
    if missing:
        return f"{', '.join(missing)} not in {FRAMEWORKS}"
    py = msllm_python()
    if not py or not os.path.exists(py):
        return ("MindSpeed-LLM's side environment is not built (POSEIDON_MSLLM_PYTHON unset): run "
                "the tests with `make test`")
    return None


def mindspeed_llm_pythonpath(release: str) -> str:
    """NPU stand-ins first, then MindSpeed-LLM, MindSpeed, the Megatron-LM checkout, the repo."""
    llm, ms, meg = MINDSPEED_LLM_RELEASES[release]
    return os.pathsep.join([NPU_FAKES, tree(llm), tree(ms), tree(meg), ROOT])


def mindspeed_llm_env(release: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": mindspeed_llm_pythonpath(release), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "TRAINING_BACKEND": "mcore"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.update(extra or {})
    return env


def script(release: str) -> str:
    return os.path.join(tree(MINDSPEED_LLM_RELEASES[release][0]), "pretrain_gpt.py")


def run_python(release: str, args: list[str], timeout: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``args`` run by the side environment's Python with ``release`` on the path."""
    return subprocess.run([msllm_python() or "python3", *args], capture_output=True, text=True,
                          timeout=timeout, env=mindspeed_llm_env(release, env), cwd=ROOT)
