"""Megatron's ``train_step`` wrapped wherever a training loop calls it from.

Megatron's ``train()`` looks ``train_step`` up as a global of ``megatron.training.training``, so
replacing that attribute is enough there. A framework with a loop of its own may have bound the
function under its own module at import (MindSpeed-LLM v26.1.0's
``mindspeed_llm.training.training`` does ``from megatron.training.training import train_step``,
and its adaptor imports it before the launch installs anything): a wrapper set on Megatron's
module alone is never called there, and the live calibration and the straggler monitor would
see no iteration, silently. :func:`wrap_train_step` sets the wrapper on every loaded module
that holds the same function object.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


def _holds(module: Any, fn: Callable) -> bool:
    try:
        return vars(module).get("train_step") is fn
    except TypeError:   # an object in sys.modules without a __dict__
        return False


def wrap_train_step(before: Callable[[], Any], after: Callable[[Any], None]) -> Callable[[], None]:
    """``before()`` ahead of every ``train_step`` call and ``after(its result)`` once the step
    is over (raised or not), on Megatron's module and on every loaded module that bound the same
    function. Returns the undo (it restores only the modules still holding this wrapper)."""
    from megatron.training import training

    orig = training.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        token = before()
        try:
            return orig(*args, **kwargs)
        finally:
            after(token)

    train_step.__wrapped__ = orig  # type: ignore[attr-defined]
    holders = [m for m in list(sys.modules.values()) if m is not None and _holds(m, orig)]
    for module in holders:
        module.train_step = train_step

    def undo() -> None:
        for module in holders:
            if _holds(module, train_step):
                module.train_step = orig

    return undo
