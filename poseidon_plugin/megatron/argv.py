"""Rewriting Megatron-LM / MindSpeed-LLM command lines for a plan (pure Python, no torch).

argparse keeps the *last* occurrence of a ``store`` option, so the plan's flags are appended; flags
that would conflict with them (other layer-split mechanisms, ``store_true`` switches that cannot be
undone by a later flag) are stripped first.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..errors import PoseidonError

if TYPE_CHECKING:
    from ..plan import Plan

# Flags the plan owns. Every one takes exactly one value.
PLAN_VALUE_FLAGS: tuple[str, ...] = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--virtual-pipeline-model-parallel-size",
    "--micro-batch-size",
    "--global-batch-size",
    # MindSpeed-LLM / MindSpeed layer-split mechanisms
    "--num-layer-list",
    "--pipeline-num-transformer-layers",
)
# store_true switches that conflict with an explicit layout or with Poseidon's rank order.
PLAN_BOOL_FLAGS: tuple[str, ...] = (
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--use-tp-pp-dp-mapping",  # Poseidon's renumbering assumes Megatron's default order tp-cp-ep-dp-pp
)

# Flags Poseidon refuses, with the reason shown to the user.
REFUSED_FLAGS: dict[str, str] = {
    "--use-checkpoint-args": "it overwrites the parallel layout with the checkpoint's after parsing; "
    "drop it (Poseidon sets TP/PP itself) or launch without --poseidon-auto",
    "--inprocess-restart": "in-process restart re-creates the process group and re-parses argv "
    "outside Poseidon's control",
    "--yaml-cfg": "YAML configs replace the command line Poseidon rewrites; pass the settings as flags",
}


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def find_flag(argv: Sequence[str], flag: str) -> bool:
    return any(_flag_name(t) == flag for t in argv)


def flag_value(argv: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of the last occurrence of ``flag`` (``--flag v`` or ``--flag=v``)."""
    value = default
    for i, tok in enumerate(argv):
        name, eq, inline = tok.partition("=")
        if name != flag:
            continue
        if eq:
            value = inline
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


def strip_flags(argv: Sequence[str], value_flags: Iterable[str] = (),
                bool_flags: Iterable[str] = ()) -> list[str]:
    """``argv`` without the given flags (and, for value flags, their value)."""
    value_flags = set(value_flags)
    bool_flags = set(bool_flags)
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, _ = tok.partition("=")
        if name in value_flags:
            i += 1 if eq else 2
            continue
        if name in bool_flags:
            i += 1
            continue
        out.append(tok)
        i += 1
    return out


def check_refused(argv: Sequence[str]) -> None:
    """PoseidonError for a launch Poseidon cannot plan (checkpoint args, in-process restart, YAML, CP/EP)."""
    for flag, why in REFUSED_FLAGS.items():
        if find_flag(argv, flag):
            raise PoseidonError(f"--poseidon-auto cannot be combined with {flag}: {why}")
    for flag, what in (("--context-parallel-size", "context parallelism"),
                       ("--expert-model-parallel-size", "expert parallelism")):
        raw = flag_value(argv, flag)
        if raw is not None and raw != "1":
            raise PoseidonError(f"--poseidon-auto plans dense TP/PP/DP only; {what} ({flag} {raw}) "
                                "is not supported yet; remove it or launch without --poseidon-auto")


# ----------------------------------------------------------------------------------------------
# plan -> flags
# ----------------------------------------------------------------------------------------------


def backend_flags(plan: Plan, backend: str) -> list[str]:
    """The flags that set ``plan`` on ``backend``: the plan's own ``mindspeed_llm_args()`` for
    'mindspeed-llm', ``megatron_args()`` otherwise."""
    return plan.mindspeed_llm_args() if backend == "mindspeed-llm" else plan.megatron_args()


def rewrite_argv(argv: Sequence[str], plan: Plan, backend: str) -> list[str]:
    """``argv`` (script arguments, no program name) with the plan applied; deterministic."""
    if backend not in ("megatron", "mindspeed-llm"):
        raise PoseidonError(f"unknown backend {backend!r}; expected megatron or mindspeed-llm")
    if backend == "mindspeed-llm" and plan.virtual_stages > 1:
        raise PoseidonError("MindSpeed-LLM's --num-layer-list cannot express an interleaved "
                            "(virtual-stage) plan; search with --poseidon-max-virtual-stages 1")
    bool_flags = list(PLAN_BOOL_FLAGS)
    if plan.tp == 1:
        bool_flags.append("--sequence-parallel")  # Megatron rejects SP without TP
    if backend == "mindspeed-llm" and plan.pp > 1:
        if find_flag(argv, "--noop-layers"):
            raise PoseidonError("MindSpeed-LLM disables --num-layer-list when --noop-layers is set; "
                                "remove --noop-layers to let Poseidon split the layers")
        if flag_value(argv, "--schedules-method") == "dualpipev":
            raise PoseidonError("MindSpeed-LLM's dualpipev schedule cannot take a --num-layer-list; "
                                "remove --schedules-method dualpipev")
    out = strip_flags(argv, PLAN_VALUE_FLAGS, bool_flags)
    return out + backend_flags(plan, backend)


# ----------------------------------------------------------------------------------------------
# backend detection and MindSpeed-LLM hand-off
# ----------------------------------------------------------------------------------------------


def detect_backend(requested: str, script: str | None) -> str:
    """'megatron' or 'mindspeed-llm': the requested one, else guessed from imports and the script."""
    if requested in ("megatron", "mindspeed-llm"):
        return requested
    if any(m == "mindspeed_llm" or m.startswith("mindspeed_llm.") for m in sys.modules):
        return "mindspeed-llm"
    if script and os.path.isfile(script):
        try:
            with open(script, encoding="utf-8", errors="replace") as f:
                if "mindspeed_llm" in f.read():
                    return "mindspeed-llm"
        except OSError:
            pass
    return "megatron"


_INT_FLAGS = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
              "--global-batch-size", "--decoder-first-pipeline-num-layers",
              "--decoder-last-pipeline-num-layers", "--num-layers-per-virtual-pipeline-stage",
              "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size"}


def mindspeed_repatch_args(new_argv: Sequence[str]) -> dict[str, Any]:
    """The dict MindSpeed-LLM's ``repatch`` overlays on its args for the rewritten argv.

    MindSpeed-LLM caches the args it parsed at import (``FeatureAdaptor._args``) and ``repatch``
    only overlays this dict, so it carries every flag the plan owns: the plan's values, ``None``
    for split flags the rewrite removed, ``False`` for stripped switches.
    """
    out: dict[str, Any] = {}
    for flag in PLAN_VALUE_FLAGS:
        raw = flag_value(new_argv, flag)
        key = flag[2:].replace("-", "_")
        out[key] = None if raw is None else (int(raw) if flag in _INT_FLAGS else raw)
    for flag in PLAN_BOOL_FLAGS:
        if not find_flag(new_argv, flag):
            out[flag[2:].replace("-", "_")] = False
    if not find_flag(new_argv, "--sequence-parallel"):
        out["sequence_parallel"] = False
    return out


def import_mindspeed_llm(script: str, argv: Sequence[str]) -> None:
    """Import MindSpeed-LLM's adaptor (its NPU / feature patches) so profiling runs the same code as
    training. It parses ``sys.argv`` at import, hence ``[script] + argv`` (options stripped) first;
    after the plan, :func:`apply_mindspeed_llm` re-applies its patches for the rewritten flags."""
    import importlib

    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        importlib.import_module("mindspeed_llm.megatron_adaptor")
    except ImportError as e:
        raise PoseidonError(f"the MindSpeed-LLM backend needs mindspeed_llm importable ({e}); install "
                            "MindSpeed-LLM or pass --poseidon-backend megatron") from None
    finally:
        sys.argv = saved


def apply_mindspeed_llm(new_argv: Sequence[str]) -> bool:
    """Re-apply MindSpeed-LLM's argv-gated patches if its adaptor was imported before the rewrite.

    MindSpeed-LLM parses ``sys.argv`` when ``mindspeed_llm`` is imported and installs feature patches
    (e.g. ``NumLayerListFeature``) only for flags present then. When the adaptor is already loaded
    (the user imported it before Poseidon), ``megatron_adaptor_v2.repatch`` re-parses the rewritten
    argv. Returns True when repatch was called.
    """
    mod = sys.modules.get("mindspeed_llm.tasks.megatron_adaptor_v2")
    if mod is None or not hasattr(mod, "repatch"):
        return False
    mod.repatch(mindspeed_repatch_args(new_argv))
    return True
