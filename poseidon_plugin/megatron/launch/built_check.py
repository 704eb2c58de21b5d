"""The model the framework built, checked against the one the plan was made for.

MindSpeed-LLM and Megatron decide each decoder layer's MLP (dense or MoE) in their own block
builds (``--moe-layer-freq``, MindSpeed-LLM's ``--first-k-dense-replace``, its layer numbering
under ``--num-layer-list``); a plan costs the layers as the planner read the flags. After the
plan is applied, every decoder block the script builds is checked as it is built: each layer's
global number (``layer_number``, offset included) is one of the model's, and its MLP is MoE
exactly where the plan's model has a MoE layer. A difference stops the rank with one line
(``poseidon: error``-style, exit 2) before the first step: the training would otherwise run a
model other than the one planned (and priced), silently.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

from poseidon_plugin.errors import PoseidonError

log = logging.getLogger("poseidon")


def is_moe_module(mlp: Any) -> bool:
    """Whether a built layer's MLP is a MoE layer (a class named ``*MoE*`` in its MRO)."""
    return mlp is not None and any("MoE" in c.__name__ for c in type(mlp).__mro__)


def built_kinds(block: Any) -> list[tuple[int, bool]]:
    """(global layer number, MoE?) of each layer a decoder block built (no-op layers skipped)."""
    out = []
    for layer in getattr(block, "layers", ()):
        number = getattr(layer, "layer_number", None)
        if number is None or not hasattr(layer, "mlp"):
            continue
        out.append((int(number), is_moe_module(layer.mlp)))
    return out


def is_mla_module(attention: Any) -> bool:
    """Whether a built layer's self-attention is multi-latent (a class named ``*MLA*`` in its
    MRO: megatron-core's ``MLASelfAttention``, MindSpeed-LLM's ``CustomMLASelfAttention``)."""
    return attention is not None and any("MLA" in c.__name__ for c in type(attention).__mro__)


def attention_mismatch(block: Any, planned_mla: bool, framework: str) -> str | None:
    """One line where a built layer's attention is not the kind the plan priced, or None.
    MindSpeed-LLM's ``pretrain_gpt.py`` builds megatron-core's plain GPT layer spec unless
    ``--spec`` names another, so ``--multi-latent-attention`` alone trains ordinary attention."""
    for layer in getattr(block, "layers", ()):
        attention = getattr(layer, "self_attention", None)
        if attention is None or type(attention).__name__ in ("IdentityOp", "IdentityFuncOp"):
            continue
        mla = is_mla_module(attention)
        if mla == planned_mla:
            continue
        fix = (" (its DeepSeek recipes name --spec mindspeed_llm.tasks.models.spec."
               "deepseek_spec layer_spec)" if planned_mla and framework == "MindSpeed-LLM"
               else "")
        return (f"{framework} built layer {getattr(layer, 'layer_number', '?')}'s attention as "
                f"{type(attention).__name__}, but the plan's model "
                f"{'has' if planned_mla else 'has no'} multi-latent attention "
                f"(--multi-latent-attention){fix}: not launching a model other than the one "
                "planned")
    return None


def mismatch(built: Sequence[tuple[int, bool]], planned_moe: Sequence[bool],
             framework: str) -> str | None:
    """The first difference between the built layers and the plan's model, as one line, or None."""
    n = len(planned_moe)
    for number, moe in built:
        if not 1 <= number <= n and not any(planned_moe):
            # a dense model's layers are alike: MindSpeed-LLM 2.3.0 numbers --num-layer-list's
            # stages as if the split were even (stage 1 of 2,6 gets layers 5..10 of 8) and
            # trains the planned model all the same; a MoE model's numbering indexes its
            # aux-loss tracker and decides its layer kinds (an IndexError, the wrong kinds)
            continue
        if not 1 <= number <= n:
            return (f"{framework} built decoder layer number {number}, but the model has "
                    f"{n} layers (its layer numbering of this pipeline split differs from the "
                    "plan's): not launching a model other than the one planned")
        if moe != planned_moe[number - 1]:
            what = lambda m: "a MoE" if m else "a dense"   # noqa: E731
            return (f"{framework} built layer {number} as {what(moe)} layer; the plan's model "
                    f"has {what(planned_moe[number - 1])} layer there (its layers are costed as "
                    "the planner read --num-experts / --moe-layer-freq / --first-k-dense-replace):"
                    " not launching a model other than the one planned")
    return None


def install(planned_moe: Sequence[bool], framework: str,
            fail: Callable[[PoseidonError], int],
            planned_mla: bool | None = None) -> Callable[[], None]:
    """Check every TransformerBlock built from now on (:func:`mismatch`, and with
    ``planned_mla`` :func:`attention_mismatch`); on a difference, ``fail(error)`` (prints the
    line) and exit with its code. Returns the undo."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    planned = tuple(bool(m) for m in planned_moe)
    original = TransformerBlock.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        line = mismatch(built_kinds(self), planned, framework)
        if line is None and planned_mla is not None:
            line = attention_mismatch(self, planned_mla, framework)
        if line is not None:
            raise SystemExit(fail(PoseidonError(line)))

    TransformerBlock.__init__ = init
    return lambda: setattr(TransformerBlock, "__init__", original)
