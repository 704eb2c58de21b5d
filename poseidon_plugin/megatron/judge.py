"""The framework judges the plan: rank 0 runs the installed framework's own argument parsing and
validation on the rewritten command line before the plan is broadcast.

:func:`framework_refusal` parses ``[script] + new_argv`` afresh with ``megatron.training.
arguments.parse_args`` and validates the result with ``validate_args`` -- the module's current
functions, so MindSpeed-LLM's patched ones when its adaptor is loaded -- on that fresh namespace
(never the launch's live one), set to the plan's world size and rank 0, output silenced. A
refusal (``AssertionError``, ``ValueError``, ``TypeError``, ``RuntimeError``, an argparse
exit) is returned as one line; any other failure means the check itself could not run: it is
logged and the plan goes on unjudged (the script's own validation still runs).

:func:`search_accepted` is the loop around the search: a refused configuration is added to the
search's ``FrameworkRules`` (``FrameworkRules.refuse``) and the search runs again, at most
``MAX_RESEARCHES`` times; a clear error when the framework accepted none of them.

Under CPU emulation the CUDA queries of ``validate_args`` (``get_device_arch_version`` at TP > 1)
are answered by the emulation's shims; on a GPU / NPU by the device.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import PoseidonError
from . import argv as argvmod
from . import framework_state

if TYPE_CHECKING:
    from ..plan import Plan
    from ..search import SearchOptions

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
                      backend: str = "megatron") -> str | None:
    """Why the installed framework refuses the rewritten command line (one line), or None when
    its ``parse_args`` + ``validate_args`` accept it (or the check cannot run here: logged)."""
    try:
        import megatron.training.arguments as margs
    except ImportError as exc:
        log.warning("the plan is not checked by Megatron's validate_args: %s", _first_line(exc))
        return None
    name = "MindSpeed-LLM" if backend == "mindspeed-llm" else "Megatron"
    saved_argv = sys.argv
    sys.argv = [script, *new_argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
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
            try:
                with framework_state.args_during(args):
                    margs.validate_args(args, {})
            except REFUSALS as exc:
                return f"{name}'s validate_args: {_first_line(exc)}"
            except Exception as exc:  # noqa: BLE001 - the check could not run: say so, go on
                log.warning("the plan is not checked by %s's validate_args (it failed with "
                            "%s: %s)", name, type(exc).__name__, _first_line(exc))
                return None
    finally:
        sys.argv = saved_argv
    return None


def search_accepted(search: Callable[[SearchOptions], Plan], options: SearchOptions,
                    judge: Callable[[Plan], str | None],
                    max_researches: int = MAX_RESEARCHES) -> Plan:
    """The fastest plan ``search(options)`` finds that ``judge`` (the framework's validation:
    None = accepted, else why not) accepts: each refused configuration is excluded
    (``FrameworkRules.refuse``), one line logged, and the search runs again, at most
    ``max_researches`` times; :class:`JudgeError` naming every refusal when none is accepted.
    A search that finds nothing left (InfeasibleError) propagates, naming the exclusions."""
    from ..search.rules import Shape

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


__all__ = ["framework_refusal", "search_accepted", "JudgeError", "MAX_RESEARCHES"]
