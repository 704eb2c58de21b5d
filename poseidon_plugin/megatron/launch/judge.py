"""The framework judges the plan: rank 0 (and ``poseidon plan --megatron-args``) runs the
installed framework's own argument parsing, validation and model-config build on the rewritten
command line before the plan is broadcast (printed).

:func:`framework_refusal` parses ``[script] + new_argv`` afresh with ``megatron.training.
arguments.parse_args``, validates the result with ``validate_args``, builds the model's
``TransformerConfig`` from it with ``core_transformer_config_from_args`` and runs the pipeline
layout's own checks (``validate_layer_layout``: the decoder and MTP layer counts, where MTP may
sit) -- the module's current functions, so MindSpeed-LLM's patched ones when its adaptor is
loaded (its config wrapper) -- on that fresh namespace (never the launch's live one), set to the
plan's world size and rank 0, output silenced. megatron-core 0.15+ runs the layout checks in the
config's ``__post_init__``; MindSpeed (v26.1.0's backport on 0.12.1) patches them in only for a
layout the launch had when its patches were applied, so the judge runs the layout class's checks
itself (megatron-core's, else MindSpeed's). A refusal (``AssertionError``, ``ValueError``,
``TypeError``, ``RuntimeError``, an argparse exit) is returned as one line naming the step; any
other failure means the check itself could not run: it is logged and the plan goes on unjudged
(the script's own validation still runs).

:func:`plan_refusal` is ``poseidon plan --megatron-args``' judge: the model's own flags
(:func:`model_argv`), the training setup's, the user's, then the plan's, judged as above with
no device (:func:`answered_device_queries`).

:func:`search_accepted` is the loop around the search: a refused configuration is added to the
search's ``FrameworkRules`` (``FrameworkRules.refuse``) and the search runs again, at most
``MAX_RESEARCHES`` times; a clear error when the framework accepted none of them.

Under CPU emulation the CUDA queries of ``validate_args`` (``get_device_arch_version`` at TP > 1)
are answered by the emulation's shims; on a GPU / NPU by the device; where neither is there
(``poseidon plan``) by :func:`answered_device_queries`, for the block only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch import argv as argvmod
from poseidon_plugin.megatron import framework_state

if TYPE_CHECKING:
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.search import SearchOptions

log = logging.getLogger("poseidon")

MAX_RESEARCHES = 3   # searches again after a refusal, at most (4 plans judged in all)

# what validate_args raises when it refuses a configuration (asserts, ValueError, ...)
REFUSALS = (AssertionError, ValueError, TypeError, RuntimeError, SystemExit)


class JudgeError(PoseidonError):
    """The framework refused every plan the bounded search offered."""


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _unknown_plan_flags(args: Any, new_argv: Sequence[str]) -> list[str]:
    """The plan's flags in ``new_argv`` this parser does not know (its namespace has no field):
    ``parse_args(ignore_unknown_args=True)`` would drop them silently."""
    return [flag for flag in argvmod.PLAN_VALUE_FLAGS
            if argvmod.find_flag(new_argv, flag)
            and not hasattr(args, flag[2:].replace("-", "_"))]


def framework_refusal(script: str, new_argv: Sequence[str], world_size: int,
                      backend: str = "megatron", device: bool = True) -> str | None:
    """Why the installed framework refuses the rewritten command line (one line), or None when
    its ``parse_args`` + ``validate_args`` + ``core_transformer_config_from_args`` accept it (or
    the check cannot run here: logged). ``device`` False: no accelerator is there to ask (the
    planning command): :func:`answered_device_queries` answers for it."""
    try:
        import megatron.training.arguments as margs
    except ImportError as exc:
        log.warning("the plan is not checked by Megatron's validate_args: %s", _first_line(exc))
        return None
    name = "MindSpeed-LLM" if backend == "mindspeed-llm" else "Megatron"
    saved_argv = sys.argv
    sys.argv = [script, *new_argv]
    out = io.StringIO()
    queries = contextlib.nullcontext() if device else answered_device_queries()
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings(), queries, \
                _quiet("megatron"):
            warnings.simplefilter("ignore")
            try:
                args = margs.parse_args(ignore_unknown_args=True)
            except SystemExit as exc:
                return f"{name}'s parse_args refuses the command line (exit {exc.code})"
            unknown = _unknown_plan_flags(args, new_argv)
            if unknown:
                if backend == "mindspeed-llm":   # a stand-in or no adaptor: nothing to judge by
                    log.warning("the plan is not checked by MindSpeed-LLM's validate_args: "
                                "Megatron's parser here has no %s (MindSpeed-LLM's adaptor "
                                "not loaded)", " ".join(unknown))
                    return None
                return f"this Megatron's parse_args does not know {' '.join(unknown)}"
            args.world_size, args.rank = int(world_size), 0
            return _validated_and_built(margs, args, name)
    finally:
        sys.argv = saved_argv


# The layout's own class: megatron-core's (0.15+), else MindSpeed's backport (v26.1.0 on 0.12.1),
# whose config check MindSpeed registers only for a layout given when its patches were applied.
_LAYOUT_MODULES = ("megatron.core.transformer.pipeline_parallel_layer_layout",
                   "mindspeed.core.pipeline_parallel.pipeline_model_parallel_layout.layout")


def _layout_class() -> Any:
    import importlib

    for name in _LAYOUT_MODULES:
        try:
            return importlib.import_module(name).PipelineParallelLayerLayout
        except (ImportError, AttributeError):
            continue
    return None


def _check_layout(layout_class: Any, args: Any) -> None:
    """The layout's own checks (``validate_layer_layout``: one embedding and loss, the decoder
    and MTP layer counts, where MTP may sit) on ``--pipeline-model-parallel-layout``, whether or
    not the config build ran them."""
    layout = args.pipeline_model_parallel_layout   # a string, or parsed by the steps before
    if not hasattr(layout, "validate_layer_layout"):
        layout = layout_class(layout, args.pipeline_model_parallel_size)
    layout.validate_layer_layout(num_layers=args.num_layers,
                                 mtp_num_layers=getattr(args, "mtp_num_layers", None))


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """``logger_name``'s INFO lines (the layout's pretty print) kept out of the judge's output."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _validated_and_built(margs: Any, args: Any, name: str) -> str | None:
    """``validate_args`` then ``core_transformer_config_from_args`` on ``args`` (Megatron's
    global args meanwhile): the first refusal as one line naming the step, else None."""
    build = getattr(margs, "core_transformer_config_from_args", None)
    steps = [("validate_args", lambda: margs.validate_args(args, {}))]
    if build is None:
        log.warning("the plan's model config is not built: this Megatron's arguments module has "
                    "no core_transformer_config_from_args")
    else:
        steps.append(("core_transformer_config_from_args", lambda: build(args)))
    layout = _layout_class()
    if layout is not None and isinstance(getattr(args, "pipeline_model_parallel_layout", None),
                                         str):
        steps.append(("pipeline layout check", lambda: _check_layout(layout, args)))
    with framework_state.args_during(args):
        for step, run in steps:
            try:
                run()
            except REFUSALS as exc:
                return f"{name}'s {step}: {_first_line(exc)}"
            except Exception as exc:  # noqa: BLE001 - the check could not run: say so, go on
                log.warning("the plan is not checked by %s's %s (it failed with %s: %s)", name,
                            step, type(exc).__name__, _first_line(exc))
                return None
    return None


# What a Hopper answers: the Megatron lines' validation asks the device's architecture at TP or
# CP > 1 (below 10 it requires CUDA_DEVICE_MAX_CONNECTIONS=1, which a launch script sets).
_PLANNING_DEVICE = types.SimpleNamespace(name="none (planning)", major=9, minor=0,
                                         total_memory=0, multi_processor_count=1)


@contextlib.contextmanager
def answered_device_queries() -> Iterator[None]:
    """Within the block, the CUDA queries of Megatron's validation are answered without a device
    when torch sees none and no emulation answers them (``poseidon plan`` on a CPU host):
    ``get_device_properties`` / ``get_device_capability`` as a Hopper (9.0), and
    ``CUDA_DEVICE_MAX_CONNECTIONS`` 1 where unset (what the launch sets). Restored afterwards;
    no CUDA call is made."""
    import torch

    from poseidon_plugin.megatron.emulate import emulation

    patched: dict[str, Any] = {}
    if not emulation.shims_installed() and not torch.cuda.is_available():
        patched = {"get_device_properties": lambda *a, **k: _PLANNING_DEVICE,
                   "get_device_capability": lambda *a, **k: (9, 0)}
    saved = {name: getattr(torch.cuda, name) for name in patched}
    env_set = "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    for name, value in patched.items():
        setattr(torch.cuda, name, value)
    if env_set:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        if env_set:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def model_argv(model: Any, seq_length: int, setup: Any = None) -> list[str]:
    """Megatron flags that build ``model`` (a ModelSpec) whole: its layers' shape
    (``offline.model_flags``), every decoder layer, the dense / MoE pattern
    (``--moe-layer-freq`` as a 0/1 list: Megatron has no first-k-dense flag), the MTP layers
    and ``setup``'s (a TrainingSetup) precision / recompute / optimizer."""
    from poseidon_plugin.training import megatron_flags
    from poseidon_plugin.megatron.profile.offline import model_flags

    flags = model_flags(model, seq_length, 1)
    flags[flags.index("--num-layers") + 1] = str(model.num_layers)
    if model.is_mixed:
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, model.moe_pattern)) + "]"]
    if model.mtp_num_layers:
        flags += ["--mtp-num-layers", str(model.mtp_num_layers)]
    return flags + (megatron_flags(setup) if setup is not None else [])


def plan_refusal(plan: Plan, model: Any, seq_length: int, setup: Any,
                 user_argv: Sequence[str]) -> str | None:
    """``poseidon plan --megatron-args``: why the installed Megatron refuses ``plan`` for
    ``model`` with the user's flags (:func:`framework_refusal` without a device), or None.

    The planning host is not the training one: what Megatron refuses there with the model's and
    the user's flags alone, on one rank (no Transformer Engine for its default RoPE fusion, a
    flag of the user's it refuses whatever the plan), says nothing of the plan: a warning says
    the plan is not judged, and it is kept."""
    from poseidon_plugin.errors import PoseidonError

    argv = [*model_argv(model, seq_length, setup), *user_argv]
    try:
        new_argv = argvmod.rewrite_argv(argv, plan, "megatron")
    except PoseidonError as exc:
        return str(exc)
    why = framework_refusal("pretrain_gpt.py", new_argv, plan.world_size, device=False)
    if why is None:
        return None
    alone = framework_refusal("pretrain_gpt.py", argv, 1, device=False)
    if alone == why:
        log.warning("the plan's flags are not judged here: the installed Megatron refuses the "
                    "model's and --megatron-args' flags without them too (%s)", why)
        return None
    return why


def search_accepted(search: Callable[[SearchOptions], Plan], options: SearchOptions,
                    judge: Callable[[Plan], str | None],
                    max_researches: int = MAX_RESEARCHES) -> Plan:
    """The fastest plan ``search(options)`` finds that ``judge`` (the framework's validation:
    None = accepted, else why not) accepts: each refused configuration is excluded
    (``FrameworkRules.refuse``), one line logged, and the search runs again, at most
    ``max_researches`` times; :class:`JudgeError` naming every refusal when none is accepted.
    A search that finds nothing left (InfeasibleError) propagates, naming the exclusions."""
    from poseidon_plugin.search.rules import Shape

    refusals: list[str] = []
    for attempt in range(max_researches + 1):
        plan = search(options)
        why = judge(plan)
        if why is None:
            for line in plan.search.get("excluded", ()):
                if line not in refusals:   # those were logged as they came
                    log.info("%s", line)
            return plan
        shape = Shape.of_plan(plan)
        line = f"{shape.describe()} excluded: {why}"
        refusals.append(line)
        if attempt == max_researches:
            break
        log.warning("%s; searching again without it (%d of %d)", line, attempt + 1,
                    max_researches)
        options = options.replace(rules=options.rules.refuse(shape, why))
    raise JudgeError(f"the training framework refused the {len(refusals)} best plans: "
                     + "; ".join(refusals) + ". Its own message names the flag; change it, "
                     "or narrow the search (--poseidon-schedules, --poseidon-max-virtual-stages, "
                     "--poseidon-tp)")


__all__ = ["framework_refusal", "plan_refusal", "model_argv", "answered_device_queries",
           "search_accepted", "JudgeError", "MAX_RESEARCHES"]


def installed_trains_moe_free_stages() -> bool:
    """Whether the installed megatron-core trains a pipeline stage that holds no MoE layer
    (0.19 on; 0.12.1, MindSpeed-LLM's, hangs at the first optimizer step:
    ``search/rules.py``, ``MOE_FREE_STAGE_FIXED_IN``); not installed or unknown: no. The launch
    and ``poseidon plan --megatron-args`` (judged by the installed Megatron) search with it."""
    from poseidon_plugin.megatron import provenance
    from poseidon_plugin.search import rules

    version = rules.version_tuple(provenance.megatron_core().version)
    return version is not None and version[:2] >= rules.MOE_FREE_STAGE_FIXED_IN
