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

Only module attributes of megatron are touched, through its own setters where it has them,
and the data the profiled layer's forward and backward leave on the framework's modules and
classes (:class:`DataState`), put back as they were when the profiling of a configuration ends:
megatron-core's MoE router stores a 0-dim aux-loss scale on ``MoEAuxLossAutoScaler`` at its
first backward (the training's own ``set_loss_scale(torch.ones(1))`` then fails to copy into
it: "output with shape [] doesn't match the broadcast shape [1]") and fills the layer-wise
aux-loss tracker; MindSpeed keeps its own such state.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
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


@contextlib.contextmanager
def untouched(what: str = "profiling") -> Iterator[None]:
    """The framework's module and class data (:class:`DataState`) as before the block, after it
    (an error included); the attributes put back are logged at debug level."""
    data = DataState.capture()
    try:
        yield
    finally:
        restored = data.restore()
        if restored:
            log.debug("%s left framework state; put back: %s", what, ", ".join(restored))


# the frameworks whose modules' data the profiling of a layer may change
FRAMEWORK_PACKAGES = ("megatron", "mindspeed", "mindspeed_llm")
_CONTAINERS = (dict, list, set)


def _is_data(value: Any) -> bool:
    """Whether a module or class attribute is state (tensors, numbers, containers, None), not
    code: functions, classes, modules and descriptors are what MindSpeed's patches replace, and
    they stay as they are."""
    return not (callable(value) or isinstance(value, (types.ModuleType, staticmethod,
                                                      classmethod, property)))


def _framework_modules() -> list[tuple[str, types.ModuleType]]:
    return [(name, mod) for name, mod in list(sys.modules.items())
            if isinstance(mod, types.ModuleType)
            and name.split(".", 1)[0] in FRAMEWORK_PACKAGES]


class DataState:
    """The data attributes of every imported framework module (``FRAMEWORK_PACKAGES``) and of
    the classes defined there, as they are at :meth:`capture` (containers copied one level
    deep); :meth:`restore` puts back each one that changed (rebinds it, refills a container
    changed in place, removes a data attribute that appeared) and names them."""

    def __init__(self, owners: list[tuple[str, Any, dict[str, Any]]]) -> None:
        self._owners = owners

    @classmethod
    def capture(cls) -> "DataState":
        owners: list[tuple[str, Any, dict[str, Any]]] = []
        for name, mod in _framework_modules():
            owners.append((name, mod, _data_of(vars(mod))))
            for attr, value in list(vars(mod).items()):
                if isinstance(value, type) and value.__module__ == name:
                    owners.append((f"{name}.{attr}", value, _data_of(vars(value))))
        return cls(owners)

    def restore(self) -> list[str]:
        restored: list[str] = []
        for where, owner, before in self._owners:
            now = vars(owner)
            for attr in [a for a, v in list(now.items()) if a not in before and _is_data(v)
                         and not a.startswith("__")]:
                delattr(owner, attr)
                restored.append(f"{where}.{attr}")
            for attr, (value, items) in before.items():
                current = now.get(attr, _MISSING)
                if current is not value:
                    setattr(owner, attr, value)
                    restored.append(f"{where}.{attr}")
                elif items is not None and not _same(_items(value), items):
                    value.clear()
                    if isinstance(value, dict):
                        value.update(items)
                    elif isinstance(value, list):
                        value.extend(items)
                    else:
                        value.update(items)
                    restored.append(f"{where}.{attr}")
        return restored


_MISSING = object()


def _items(value: Any) -> Any:
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items()]
    if isinstance(value, (list, set)):
        return list(value)
    return None


def _same(now: list, before: list) -> bool:
    """The same items (a dict's as (key, value) pairs), compared by identity: a tensor's ``==``
    is elementwise."""
    if len(now) != len(before):
        return False
    pairs = zip(now, before)
    return all(a[0] is b[0] and a[1] is b[1] if isinstance(a, tuple) and isinstance(b, tuple)
               else a is b for a, b in pairs) or sorted(map(id, now)) == sorted(map(id, before))


def _data_of(namespace: Any) -> dict[str, tuple[Any, Any]]:
    """attribute -> (value, its items when a container) of the data attributes."""
    out: dict[str, tuple[Any, Any]] = {}
    for attr, value in list(namespace.items()):
        if attr.startswith("__") or not _is_data(value):
            continue
        out[attr] = (value, _items(value) if type(value) in _CONTAINERS else None)
    return out
