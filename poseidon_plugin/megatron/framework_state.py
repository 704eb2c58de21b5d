"""Megatron's process-wide state while Poseidon works before the user's script runs.

The framework's own code reads Megatron's global arguments long before ``pretrain`` would have
set them, once MindSpeed / MindSpeed-LLM patches are applied:

* MindSpeed-LLM (2.1 to 26.x) wraps ``TransformerConfig.__post_init__`` with
  ``megatron.training.get_args()``: no layer can be built without the global args;
* MindSpeed-LLM 2.3 wraps every ``torch.distributed`` collective with a ``get_args()`` call
  (its elastic-training switch): discovery's first collective needs them;
* layer code (MoE routing, MindSpeed's fused paths) reads ``get_args()`` and the number of
  micro-batches in the forward.

So the launch holds the parsed (unvalidated) arguments as Megatron's global args from the parse
on (:func:`hold`), the profiler swaps in each profiled configuration's validated copy and
micro-batch calculator while it builds and times that layer (:func:`profiling`), and everything
is released (:func:`release`) before the script runs, so ``pretrain`` finds Megatron as a fresh
process would ("args is already initialized" otherwise), including the group leftovers
``destroy_model_parallel`` of megatron-core 0.12 forgets.

Only module attributes of megatron are touched, through its own setters where it has them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

log = logging.getLogger("poseidon")

# parallel_state globals megatron-core 0.12.1's destroy_model_parallel leaves set (read from its
# source: declared at module level, not reset there). initialize_model_parallel sets several only
# on the ranks inside a group, so a value left from profiling (PP 1: every rank in its embedding
# group) survives on the others: the last stage of a PP > 1 training then dies in
# finalize_model_grads ("position embedding group is not initialized").
_LEFT_BY_DESTROY = (
    "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "_EMBEDDING_GLOBAL_RANKS",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", "_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_MODEL_PARALLEL_GLOBAL_RANKS", "_MPU_DATA_PARALLEL_RANK", "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "_PIPELINE_GLOBAL_RANKS", "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK",
    "_POSITION_EMBEDDING_GLOBAL_RANKS", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS")


def _global_vars() -> Any:
    from megatron.training import global_vars

    return global_vars


def current_args() -> Any:
    """Megatron's global args, or None when unset."""
    return getattr(_global_vars(), "_GLOBAL_ARGS", None)


def _set_args(args: Any) -> None:
    gv = _global_vars()
    if hasattr(gv, "set_args"):
        gv.set_args(args)
    else:
        gv._GLOBAL_ARGS = args


def hold(args: Any) -> None:
    """Megatron's global args = ``args`` (the launch's parsed namespace) until :func:`release`."""
    _set_args(args)


@contextlib.contextmanager
def profiling(vargs: Any, data_parallel_size: int) -> Iterator[None]:
    """Within the block, the global args are ``vargs`` (a profiled configuration's validated
    copy) and the micro-batch calculator is set for its micro-batch size (one micro-batch per DP
    rank: ``global_batch_size = micro_batch_size x data_parallel_size``), as ``pretrain`` would
    have them; the previous args come back afterwards and the calculator is unset."""
    from megatron.core import num_microbatches_calculator as nmc

    previous = current_args()
    _set_args(vargs)
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(
        int(getattr(vargs, "rank", 0) or 0), None,
        int(vargs.micro_batch_size) * max(1, data_parallel_size), int(vargs.micro_batch_size),
        max(1, data_parallel_size))
    try:
        yield
    finally:
        nmc.unset_num_microbatches_calculator()
        _set_args(previous)


@contextlib.contextmanager
def args_during(args: Any) -> Iterator[None]:
    """Megatron's global args are ``args`` within the block (e.g. a fresh parse being validated:
    MindSpeed-LLM's validation reads ``get_args()``), the previous ones afterwards."""
    previous = current_args()
    _set_args(args)
    try:
        yield
    finally:
        _set_args(previous)


def release() -> None:
    """Megatron as a fresh process has it: no global args, no micro-batch calculator, no
    model-parallel group leftovers. Safe to call when nothing was held."""
    try:
        gv = _global_vars()
    except ImportError:
        return
    if hasattr(gv, "unset_global_variables"):
        gv.unset_global_variables()
    else:  # pragma: no cover - every supported version has it
        gv._GLOBAL_ARGS = None
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.unset_num_microbatches_calculator()
    except ImportError:  # pragma: no cover
        pass
    clear_model_parallel_leftovers()


def clear_model_parallel_leftovers() -> None:
    """``destroy_model_parallel`` and then the globals it does not reset on megatron-core 0.12
    (the embedding groups' ranks): a later ``initialize_model_parallel`` with another pipeline
    size then starts clean."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    for name in _LEFT_BY_DESTROY:
        if getattr(ps, name, None) is not None:
            setattr(ps, name, None)
