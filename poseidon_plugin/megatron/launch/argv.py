"""Rewriting Megatron-LM / MindSpeed-LLM command lines for a plan (pure Python, no torch).

argparse keeps the *last* occurrence of a ``store`` option, so the plan's flags are appended; flags
that would conflict with them (other layer-split mechanisms, ``store_true`` switches that cannot be
undone by a later flag) are stripped first.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from poseidon_plugin.errors import PoseidonError, short_repr

if TYPE_CHECKING:
    from poseidon_plugin.plan import Plan

# Flags the plan owns. Every one takes exactly one value.
PLAN_VALUE_FLAGS: tuple[str, ...] = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--expert-model-parallel-size",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--virtual-pipeline-model-parallel-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--expert-model-parallel-size",   # the plan's EP (Plan.ep); the user's value is kept or searched
    "--context-parallel-size",      # the plan's CP (kept, or searched with --poseidon-search-cp)
    "--context-parallel-algo",      # MindSpeed: the plan's ring attention (megatron_cp_algo)
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


# Parallel dimensions the search does not plan yet: (flag, what it is, what the plan assumes).
UNPLANNED_PARALLELISM: tuple[tuple[str, str, str], ...] = (
    ("--expert-tensor-parallel-size", "expert tensor parallelism",
     "experts are split over the stage's TP degree, Megatron's default (expert TP = TP)"),
)


EP_FLAG = "--expert-model-parallel-size"


def check_refused(argv: Sequence[str]) -> None:
    """PoseidonError for a launch Poseidon cannot plan (checkpoint args, in-process restart, YAML,
    expert-tensor parallelism, which the search does not plan yet; a malformed
    ``--expert-model-parallel-size``; CP algorithms other than the ring)."""
    for flag, why in REFUSED_FLAGS.items():
        if find_flag(argv, flag):
            raise PoseidonError(f"--poseidon-auto cannot be combined with {flag}: {why}")
    comm = flag_value(argv, "--cp-comm-type")
    if comm is not None and comm != "p2p":
        raise PoseidonError(
            f"--poseidon-auto plans context parallelism as Megatron's ring attention "
            f"(--cp-comm-type p2p, the default), not --cp-comm-type {comm}; remove it or launch "
            f"without --poseidon-auto")
    if find_flag(argv, "--hierarchical-context-parallel-sizes"):
        raise PoseidonError(
            "--poseidon-auto does not plan hierarchical context parallelism "
            "(--hierarchical-context-parallel-sizes); remove it or launch without "
            "--poseidon-auto")
    for flag, what, assumed in UNPLANNED_PARALLELISM:
        raw = flag_value(argv, flag)
        if raw is None or (raw == "1" and flag != "--expert-tensor-parallel-size"):
            continue
        raise PoseidonError(
            f"--poseidon-auto does not plan {what} yet ({flag} {raw}): its plans assume {assumed}; "
            f"remove {flag} or launch without --poseidon-auto")
    user_expert_parallel(argv)
    check_layer_freq(argv)


def check_layer_freq(argv: Sequence[str]) -> None:
    """``--moe-layer-freq`` read by the model file's rules (``model._layer_freq``: a list
    expression parsed without ``eval``, at most 4096 layers, Python's integer literals), before
    Megatron's parser ``eval``s it (``'[1]*999999999'`` was a MemoryError there)."""
    raw = flag_value(argv, "--moe-layer-freq")
    if raw is None:
        return
    from poseidon_plugin.errors import SpecError
    from poseidon_plugin.model import _layer_freq

    try:
        _layer_freq(raw, "--moe-layer-freq")
    except SpecError as exc:
        raise PoseidonError(f"--moe-layer-freq: expected {exc.expected}, got "
                            f"{short_repr(raw)}") from None


def user_expert_parallel(argv: Sequence[str]) -> int | None:
    """The user's ``--expert-model-parallel-size`` (None: not given), or a one-line
    PoseidonError for a value that is not an integer >= 1."""
    raw = flag_value(argv, EP_FLAG)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise PoseidonError(f"{EP_FLAG}: expected an integer >= 1, got {raw!r}")
    return value


def expert_parallel_choice(argv: Sequence[str], search_ep: bool) -> tuple[int, ...] | None:
    """The EP degrees the search may use (``SearchOptions.expert_parallel``): the user's
    ``--expert-model-parallel-size N`` (1 when absent, Megatron's default) kept as ``(N,)``;
    with ``--poseidon-search-ep`` (``search_ep``) None, every valid degree (N is then only
    where the user started)."""
    user = user_expert_parallel(argv)
    return None if search_ep else (user or 1,)


DISPATCHER_FLAG = "--moe-token-dispatcher-type"
PRICED_DISPATCHER = "alltoall"   # what a plan prices when the user chose none


def pin_dispatcher(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--moe-token-dispatcher-type alltoall`` appended when it builds MoE layers
    (``--num-experts`` above 0) and chooses no dispatcher: megatron-core's default is
    ``allgather``, the plan prices the all-to-all one; the profiling and the training then run
    it too. A user's own choice is kept (the model records it, the plan prices and pins it)."""
    experts = flag_value(argv, "--num-experts")
    if experts in (None, "0", "None") or find_flag(argv, DISPATCHER_FLAG):
        return list(argv)
    return [*argv, DISPATCHER_FLAG, PRICED_DISPATCHER]


# ----------------------------------------------------------------------------------------------
# plan -> flags
# ----------------------------------------------------------------------------------------------


def backend_flags(plan: Plan, backend: str, mindspeed_layout: bool = False) -> list[str]:
    """The flags that set ``plan`` on ``backend``: the plan's own ``mindspeed_llm_args()`` for
    'mindspeed-llm' (the split as the layout flag where that MindSpeed-LLM registers it),
    ``megatron_args()`` otherwise; its EP degree (``Plan.ep``) where it is above 1 and the
    plan's own flags do not say it already."""
    flags = list(plan.mindspeed_llm_args(mindspeed_layout) if backend == "mindspeed-llm"
                 else plan.megatron_args())
    ep = plan_ep(plan)
    if ep is not None and ep > 1 and EP_FLAG not in flags:
        flags += [EP_FLAG, str(ep)]
    return flags


def plan_ep(plan: Plan) -> int | None:
    """The plan's EP degree (``Plan.ep``), None for a plan that does not carry one."""
    ep = getattr(plan, "ep", None)
    return None if ep is None else int(ep)


def rewrite_argv(argv: Sequence[str], plan: Plan, backend: str,
                 mindspeed_layout: bool = False) -> list[str]:
    """``argv`` (script arguments, no program name) with the plan applied; deterministic.

    ``mindspeed_layout``: the installed MindSpeed-LLM registers ``--pipeline-model-parallel-layout``
    (:func:`mindspeed_llm_registers_layout`); only then can a MindSpeed-LLM plan be interleaved.
    """
    if backend not in ("megatron", "mindspeed-llm"):
        raise PoseidonError(f"unknown backend {backend!r}; expected megatron or mindspeed-llm")
    if backend == "mindspeed-llm":
        _check_mindspeed_split(argv, plan, mindspeed_layout)
    bool_flags = list(PLAN_BOOL_FLAGS)
    if plan.tp == 1:
        bool_flags.append("--sequence-parallel")  # Megatron rejects SP without TP
    value_flags = [f for f in PLAN_VALUE_FLAGS if f != EP_FLAG or plan_ep(plan) is not None]
    out = strip_flags(argv, value_flags, bool_flags)   # a plan without EP leaves the user's EP
    return out + backend_flags(plan, backend, mindspeed_layout)


def _check_mindspeed_split(argv: Sequence[str], plan: Plan, layout_registered: bool) -> None:
    """PoseidonError for a split MindSpeed-LLM would refuse: an interleaved plan without the layout
    flag (it refuses ``--num-layer-list`` with a virtual pipeline), ``--noop-layers``, dualpipev."""
    if plan.virtual_stages > 1 and not layout_registered:
        raise PoseidonError("this MindSpeed-LLM has no --pipeline-model-parallel-layout (v26.1.0 "
                            "and later register it) and refuses --num-layer-list with a virtual "
                            "pipeline; search with --poseidon-max-virtual-stages 1")
    if plan.pp <= 1:
        return
    flag = ("--pipeline-model-parallel-layout" if plan.virtual_stages > 1 or layout_registered
            else "--num-layer-list")
    if find_flag(argv, "--noop-layers"):
        raise PoseidonError(f"MindSpeed-LLM cannot combine --noop-layers with {flag}; remove "
                            "--noop-layers to let Poseidon split the layers")
    if flag_value(argv, "--schedules-method") == "dualpipev":
        raise PoseidonError(f"MindSpeed-LLM's dualpipev schedule cannot take {flag}; remove "
                            "--schedules-method dualpipev")
    for switch in ("--recompute-in-bubble", "--recompute-in-advance"):
        if plan.virtual_stages > 1 and find_flag(argv, switch):
            raise PoseidonError(f"MindSpeed refuses {switch} with --pipeline-model-parallel-layout; "
                                f"remove {switch} or search with --poseidon-max-virtual-stages 1")


def overridden_flags(argv: Sequence[str], new_argv: Sequence[str]) -> list[str]:
    """What the rewrite changed of the user's own plan-owned flags, one item each:
    ``--tensor-model-parallel-size 2 -> 1``, ``--num-layer-list dropped``,
    ``--sequence-parallel dropped: tp=1``."""
    out: list[str] = []
    for flag in PLAN_VALUE_FLAGS:
        old = flag_value(argv, flag)
        if old is None:
            continue
        new = flag_value(new_argv, flag)
        if new is None and flag in _DEFAULTS:
            new = str(_DEFAULTS[flag])
        if new is None:
            out.append(f"{flag} dropped")
        elif new != old:
            out.append(f"{flag} {old} -> {new}")
    for flag in (*PLAN_BOOL_FLAGS, "--sequence-parallel"):
        if find_flag(argv, flag) and not find_flag(new_argv, flag):
            why = {"--sequence-parallel": f": tp={flag_value(new_argv, '--tensor-model-parallel-size')}",
                   "--use-tp-pp-dp-mapping": ": Poseidon places ranks in the default order"}
            out.append(f"{flag} dropped{why.get(flag, '')}")
    return out


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
              "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
              EP_FLAG, "--context-parallel-size"}
# a plan-owned flag the rewrite left out: Megatron's default (MindSpeed's for the CP algorithm)
_DEFAULTS = {EP_FLAG: 1, "--context-parallel-size": 1,
             "--context-parallel-algo": "megatron_cp_algo"}


def mindspeed_repatch_args(new_argv: Sequence[str]) -> dict[str, Any]:
    """The dict handed to MindSpeed-LLM's ``repatch`` for the rewritten argv.

    ``repatch`` re-parses ``sys.argv`` (``FeatureAdaptor._args`` is never assigned, so
    ``get_mindspeed_llm_args`` parses afresh) and then sets each key of this dict on the result.
    The caller sets ``sys.argv`` to the rewritten command line first, so the dict only restates
    it: every flag the plan owns with the plan's value, ``None`` for split flags the rewrite
    removed, ``False`` for stripped switches.
    """
    out: dict[str, Any] = {}
    for flag in PLAN_VALUE_FLAGS:
        raw = flag_value(new_argv, flag)
        key = flag[2:].replace("-", "_")
        out[key] = _DEFAULTS.get(flag) if raw is None else (int(raw) if flag in _INT_FLAGS else raw)
    for flag in PLAN_BOOL_FLAGS:
        if not find_flag(new_argv, flag):
            out[flag[2:].replace("-", "_")] = False
    if not find_flag(new_argv, "--sequence-parallel"):
        out["sequence_parallel"] = False
    return out


def mindspeed_llm_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("mindspeed_llm") is not None
    except (ImportError, ValueError):
        return False


def import_mindspeed_llm(script: str, argv: Sequence[str]) -> Any:
    """Import MindSpeed-LLM's adaptor the way its scripts do (``from mindspeed_llm import
    megatron_adaptor``: a name ``mindspeed_llm/__init__.py`` binds to ``tasks.megatron_adaptor``
    (2.0-2.1) or ``tasks.megatron_adaptor_v2`` (2.2 and later), not a submodule), so profiling
    runs the same patched code as training. It parses ``sys.argv`` at import, hence
    ``[script] + argv`` (options stripped) first; after the plan, :func:`apply_mindspeed_llm`
    re-applies its patches for the rewritten flags. Returns the adaptor module."""
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        from mindspeed_llm import megatron_adaptor  # type: ignore[import-not-found]
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "mindspeed_llm").split(".")[0] \
                not in ("mindspeed_llm",):   # MindSpeed-LLM is there; what it imports is not
            from poseidon_plugin.megatron.imports import explain

            raise explain(e, "mindspeed_llm.megatron_adaptor",
                          "the MindSpeed-LLM backend") from None
        backend = os.environ.get("TRAINING_BACKEND")
        hint = (f" (TRAINING_BACKEND={backend}: MindSpeed-LLM defines megatron_adaptor only "
                "for mcore)" if backend and backend.lower() != "mcore" else "")
        raise PoseidonError(f"the MindSpeed-LLM backend needs `from mindspeed_llm import "
                            f"megatron_adaptor` to work ({e}){hint}; install MindSpeed-LLM or "
                            "pass --poseidon-backend megatron") from None
    finally:
        sys.argv = saved
    return megatron_adaptor


def mindspeed_llm_registers_layout() -> bool:
    """Whether the installed MindSpeed-LLM accepts ``--pipeline-model-parallel-layout``: its own
    argument registration (``process_args_v2``, the feature flags its parse_args wrapper adds)
    has the flag. True from v26.1.0 (MindSpeed's ``PipelineModelParallelLayoutFeature``); False
    for v26.0.0 and 2.x, and when MindSpeed-LLM is not importable."""
    import argparse

    try:
        from mindspeed_llm.training.arguments import process_args_v2  # type: ignore[import-not-found]

        parser = process_args_v2(argparse.ArgumentParser(allow_abbrev=False))
    except Exception:  # noqa: BLE001 - not installed, 2.0-2.1 (no v2 arguments), or broken
        return False
    return "--pipeline-model-parallel-layout" in getattr(parser, "_option_string_actions", {})


def _loaded_adaptor() -> Any:
    pkg = sys.modules.get("mindspeed_llm")
    return getattr(pkg, "megatron_adaptor", None) if pkg is not None else None


def apply_mindspeed_llm(new_argv: Sequence[str]) -> bool:
    """Re-apply MindSpeed-LLM's argv-gated patches after the rewrite, when its adaptor is loaded.

    The adaptor parses ``sys.argv`` at import and installs feature patches only for flags present
    then (``NumLayerListFeature`` patches ``get_num_layers_to_build`` only if ``--num-layer-list``
    was there). The caller has set ``sys.argv`` to the rewritten command line. v26.0.0 and later:
    ``megatron_adaptor_v2.repatch`` (removes every patch, re-parses, re-applies). 2.2-2.3 have no
    ``repatch``: the same three steps by hand (``MindSpeedFeaturesManager.remove_patches`` then
    ``FeatureAdaptor.execute``). 2.0-2.1 install the layer-list patches unconditionally: nothing
    to do. Returns True when patches were re-applied.
    """
    adaptor = _loaded_adaptor()
    if adaptor is None:
        return False
    if hasattr(adaptor, "repatch"):
        adaptor.repatch(mindspeed_repatch_args(new_argv))
        return True
    feature_adaptor = getattr(adaptor, "FeatureAdaptor", None)
    if feature_adaptor is None:
        return False
    from mindspeed.features_manager.features_manager import (  # type: ignore[import-not-found]
        MindSpeedFeaturesManager,
    )

    MindSpeedFeaturesManager.remove_patches()
    feature_adaptor.execute()
    return True
