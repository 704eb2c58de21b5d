"""The launch's checkpoint hooks (``runner`` calls them; each is one line there).

* :func:`check_save_prerequisites` (every rank, as the launch starts): ``--save`` in
  ``torch_dist`` needs ``psutil`` (megatron-core's filesystem writer asks every worker's memory
  with it; without it every rank dies at its first save with a ``CheckpointException``).
* :func:`rank0_check_resume` (rank 0, after the plan is known, before the report and any model):
  the checkpoint ``--load`` will read, checked against the plan: its files, the format and the
  optimizer state Megatron can reshard to the plan's layout (else one error naming the fix), and
  one line saying what changed since it was saved (devices, plan, predicted time).
* :func:`install_record` (every training rank): after each save, the new rank 0 writes
  :data:`~.reader.RECORD_NAME` into the iteration's folder: the plan, the devices it was made
  for, each file's size and digest.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch.argv import flag_value
from poseidon_plugin.megatron.checkpoint import reader as ck
from poseidon_plugin.megatron.checkpoint.change import DeviceGroup, change_summary

if TYPE_CHECKING:
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.megatron.launch.discovery import Topology

log = logging.getLogger("poseidon")

RESHARDABLE_OPTIM = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def _has(argv: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in argv)


def check_save_prerequisites(argv: Sequence[str]) -> str | None:
    """``--save`` / ``--load`` in megatron-core's ``torch_dist`` format: without ``psutil`` one
    error now, not a ``CheckpointException`` on every rank at the first save; on a
    megatron-core whose distributed checkpointing calls ``np.product`` (0.12.1, MindSpeed-LLM's
    base, and 0.15.3) under NumPy 2, which removed that alias of ``np.prod`` (every rank died
    with an AttributeError at its first save), the alias is put back: the line to log, else
    None."""
    saving = flag_value(argv, "--save") is not None
    if not saving and flag_value(argv, "--load") is None:
        return None
    if flag_value(argv, "--ckpt-format", "torch_dist") != "torch_dist":
        return None
    if saving and importlib.util.find_spec("psutil") is None:
        raise PoseidonError("--save with --ckpt-format torch_dist: megatron-core's checkpoint "
                            "writer needs psutil, which is not installed (pip install psutil); "
                            "every rank would fail at its first save")
    notes = []
    uses = _dist_checkpointing_needs_np_product()
    if uses:
        import numpy
        numpy.product = numpy.prod   # the removed alias, the same function
        notes.append(f"numpy.product restored as numpy.prod: this megatron-core's distributed "
                     f"checkpointing calls it ({uses}) and NumPy {numpy.__version__} removed it")
    if saving:
        note = install_write_item_format()
        if note:
            notes.append(note)
    return "; ".join(notes) or None


FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def install_write_item_format() -> str | None:
    """megatron-core 0.12.1's checkpoint writer (``strategies/filesystem_async.py``) calls
    torch's private ``_write_item(transforms, stream, data, write_item, storage_key)``; the
    torch installed here (2.14) also requires ``serialization_format``, so every rank of a
    MindSpeed-LLM launch on it failed its first save with a ``TypeError``. Where the importable
    megatron-core's writer makes that call without it and the installed torch requires it,
    the writer's own ``_write_item`` name is bound, when that module is imported (MindSpeed's
    adaptor imports megatron first), to :func:`_write_item_torch_default`, which passes torch's
    default (``TORCH_SAVE``).

    The writer runs in a process of its own. megatron-core forks it, and the fork inherits
    the binding; MindSpeed-LLM *spawns* it (its ``temporal_async_caller_schedule_async_call``),
    and a spawned interpreter imports the writer afresh. So the save function the writer hands
    to its caller (``get_save_function_and_args``) is wrapped in
    :class:`_BoundInWriterProcess`, which pickles with it and binds the name again in whatever
    process runs it. The line to log, else None."""
    if not _torch_requires_serialization_format():
        return None
    folder = _megatron_dist_checkpointing()
    path = os.path.join(folder, "strategies", "filesystem_async.py") if folder else ""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    if "_write_item(" not in text or "serialization_format" in text:
        return None
    _after_import(FILESYSTEM_ASYNC, _bind_write_item)
    return (f"megatron-core's checkpoint writer ({path}) calls torch's _write_item without the "
            f"serialization_format torch {getattr(__import__('torch'), '__version__', '?')} "
            "requires: it passes torch's default")


def _torch_requires_serialization_format() -> bool:
    """Whether the installed torch's ``_write_item`` requires ``serialization_format``."""
    import inspect

    try:
        from torch.distributed.checkpoint import filesystem as tfs
    except ImportError:
        return False
    real = getattr(tfs, "_write_item", None)
    return real is not None and getattr(tfs, "SerializationFormat", None) is not None and \
        "serialization_format" in inspect.signature(real).parameters


def _write_item_torch_default(*args: Any, **kwargs: Any) -> Any:
    """torch's ``_write_item``, given its default ``serialization_format`` where the five
    arguments of megatron-core 0.12.1's call come without it."""
    from torch.distributed.checkpoint import filesystem as tfs

    if len(args) == 5 and "serialization_format" not in kwargs:
        kwargs["serialization_format"] = tfs.SerializationFormat.TORCH_SAVE
    return tfs._write_item(*args, **kwargs)


_write_item_torch_default.poseidon_wraps = True  # type: ignore[attr-defined]


def _bind_write_item(module: Any) -> None:
    """Bind the writer module's ``_write_item`` (and wrap the save function its writer hands
    out, once) in this process."""
    module._write_item = _write_item_torch_default
    writer = getattr(module, "FileSystemWriterAsync", None)
    get = getattr(writer, SAVE_FUNCTION, None)
    if get is None or getattr(get, "poseidon_wraps", False):
        return

    def get_save_function_and_args(self: Any, *args: Any, **kwargs: Any) -> Any:
        got = get(self, *args, **kwargs)
        if isinstance(got, tuple) and got and callable(got[0]):
            got = (_BoundInWriterProcess(got[0]), *got[1:])
        return got

    get_save_function_and_args.poseidon_wraps = True  # type: ignore[attr-defined]
    setattr(writer, SAVE_FUNCTION, get_save_function_and_args)


# the method of megatron-core 0.12.1's FileSystemWriterAsync that hands out (save function,
# preload function, arguments) to the async caller
SAVE_FUNCTION = "get_save_function_and_args"


class _BoundInWriterProcess:
    """The writer's save function, which binds :func:`_write_item_torch_default` in the
    process that calls it (pickled to a spawned writer process with the function; unpickling
    the function imports the writer module there)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = sys.modules.get(FILESYSTEM_ASYNC)
        if module is not None:
            _bind_write_item(module)
        return self.fn(*args, **kwargs)


def _after_import(name: str, patch: Any) -> None:
    """``patch(module)`` once module ``name`` is imported (now, if it is already)."""
    import importlib.machinery

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder:
        busy = False

        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname != name or self.busy:
                return None
            self.busy = True
            try:
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            finally:
                self.busy = False
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                patch(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    finder = Finder()
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]


def _megatron_dist_checkpointing() -> str | None:
    """The folder of the importable megatron-core's ``dist_checkpointing``, found on
    ``sys.path`` as an import would find it, without importing megatron (MindSpeed's adaptor
    patches it, and must come first); None if there is none."""
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "megatron", "core", "dist_checkpointing")
        if os.path.isfile(os.path.join(folder, "exchange_utils.py")):
            return folder
    return None


def _dist_checkpointing_needs_np_product() -> str | None:
    """The file of the importable megatron-core's ``dist_checkpointing`` that calls
    ``np.product`` while the installed NumPy (2.x) has none (megatron-core 0.12.1 and 0.15.3,
    MindSpeed-LLM's base among them); None otherwise, or when it cannot be told."""
    import numpy
    if hasattr(numpy, "product"):
        return None
    folder = _megatron_dist_checkpointing()
    if folder is None:
        return None
    for name in ("exchange_utils.py", "mapping.py", "validation.py"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if "np.product(" in f.read():
                    return os.path.join(folder, name)
        except OSError:
            continue
    return None


def topology_devices(topo: "Topology") -> tuple[DeviceGroup, ...]:
    """The launch's devices, one group per node (a host's devices of one type)."""
    return tuple(DeviceGroup(f"host {topo.node_hosts[n]}", topo.node_types[n], len(ranks))
                 for n, ranks in enumerate(topo.nodes))


def _fused_adam_available() -> bool:
    """megatron-core's DistributedOptimizer loads a state only with TE's or Apex's Adam."""
    return any(importlib.util.find_spec(m) is not None
               for m in ("transformer_engine", "apex"))


def _legacy_layout(path: str) -> tuple[int, int]:
    """(TP, PP) of a legacy ``torch`` checkpoint, from its ``mp_rank_TT[_PPP][_EEE]`` folders."""
    tp = pp = 1
    for name in os.listdir(path):
        m = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?", name)
        if m:
            tp = max(tp, int(m.group(1)) + 1)
            if m.group(2) is not None:
                pp = max(pp, int(m.group(2)) + 1)
    return tp, pp


def resharding_refusal(info: ck.CheckpointInfo, plan: "Plan", argv: Sequence[str],
                       fused_adam: bool) -> str | None:
    """Why Megatron cannot load ``info`` under ``plan`` with ``argv`` (the fix named), or None."""
    where = f"--load {info.load_dir}: iteration {info.iteration}"
    run = (plan.tp, plan.pp)
    load_optim = not _has(argv, "--no-load-optim") and not _has(argv, "--finetune")
    if info.fmt == "torch":
        saved = _legacy_layout(info.path)
        if saved != run:
            return (f"{where} is in Megatron's legacy 'torch' format, saved at tp={saved[0]} "
                    f"pp={saved[1]}; that format loads only at the same TP and PP and this plan "
                    f"is tp={run[0]} pp={run[1]}: convert it first (a launch at tp={saved[0]} "
                    f"pp={saved[1]} with --ckpt-format torch --load it --ckpt-convert-format "
                    "torch_dist --ckpt-convert-save DIR), then --load DIR")
        return None
    if info.fmt != "torch_dist":
        return (f"{where} ({info.path}) is in a format Poseidon cannot check ({info.fmt}): a "
                "resume under a new plan needs --ckpt-format torch_dist")
    saved = (int(info.saved("tensor_model_parallel_size", 1)),
             int(info.saved("pipeline_model_parallel_size", 1)))
    if load_optim and info.saved("use_distributed_optimizer", False) and saved != run:
        sharding = info.content.get("distrib_optim_sharding_type") or (
            "fully_sharded_model_space" if info.saved("ckpt_fully_parallel_save", False)
            else "dp_zero_gather_scatter")
        if sharding not in RESHARDABLE_OPTIM:
            return (f"{where}: its distributed-optimizer state is sharded {sharding!r}, which "
                    f"Megatron reshards only at the same TP and PP (saved tp={saved[0]} "
                    f"pp={saved[1]}, this plan tp={run[0]} pp={run[1]}): save with "
                    "--dist-ckpt-optim-fully-reshardable, or add --no-load-optim to start the "
                    "optimizer afresh")
    refusal = _expert_optimizer_refusal(info, plan, where) if load_optim else None
    if refusal:
        return refusal
    dist_opt = _has(argv, "--use-distributed-optimizer")
    if load_optim and bool(info.saved("use_distributed_optimizer", False)) != dist_opt:
        saved_kind, run_kind = (("the distributed optimizer", "Megatron's other optimizer")
                                if not dist_opt else
                                ("Megatron's non-distributed optimizer", "the distributed one"))
        return (f"{where}: its optimizer state was saved by {saved_kind} and this launch runs "
                f"{run_kind}; Megatron loads optimizer state only into the kind that saved it: "
                f"{'add' if not dist_opt else 'drop'} --use-distributed-optimizer, or add "
                "--no-load-optim to start the optimizer afresh")
    if load_optim and dist_opt and not fused_adam:
        return (f"{where}: --use-distributed-optimizer cannot load optimizer state here: "
                "without Transformer Engine or Apex megatron-core's DistributedOptimizer uses "
                "torch's Adam, which has no state before its first step "
                "(DistributedOptimizer.state_dict asserts); add --no-load-optim, or train and "
                "save without --use-distributed-optimizer")
    return None


def _expert_optimizer_refusal(info: ck.CheckpointInfo, plan: "Plan", where: str) -> str | None:
    """A MoE's optimizer state across EP 1 <-> EP > 1: Megatron keeps the expert parameters in an
    optimizer of their own at EP > 1 (a ChainedOptimizer of two), and loading that state into
    EP 1's single optimizer fails (megatron-core 0.19: 'Could not find parameter group ... in
    loaded checkpoint', seen on the core_v0.19.0 tree, EP 2 -> EP 1; megatron-core 0.12.1 under
    MindSpeed-LLM v26.1.0: a KeyError, 'optimizer.state.exp_avg.decoder.layers... from model not
    in state dict', the saved keys being chained_0 / chained_1's, seen with this check bypassed)."""
    if not info.saved("num_experts"):
        return None
    saved_ep = int(info.saved("expert_model_parallel_size", 1) or 1)
    run_ep = int(getattr(plan, "ep", 1))
    if (saved_ep > 1) == (run_ep > 1):
        return None
    return (f"{where}: its optimizer state was saved at EP {saved_ep} and this plan runs EP "
            f"{run_ep}; Megatron keeps expert parameters in an optimizer of their own only at "
            "EP > 1 and cannot load the one into the other: relaunch with "
            f"--expert-model-parallel-size {saved_ep} where the devices allow it, or add "
            "--no-load-optim (the weights load; the optimizer starts afresh)")


def resume_notes(info: ck.CheckpointInfo, plan: "Plan", argv: Sequence[str]) -> list[str]:
    """What Megatron will not carry over (said before training, not found in the losses)."""
    notes = []
    saved = _saved_tp_pp(info)
    if saved != (plan.tp, plan.pp) and not _has(argv, "--no-load-rng"):
        notes.append(f"RNG state not resumed: Megatron reshards it only at the same TP and PP "
                     f"(saved tp={saved[0]} pp={saved[1]}, now tp={plan.tp} pp={plan.pp}); "
                     "every rank re-seeds from --seed, so dropout masks differ from an "
                     "uninterrupted run (the launch adds --no-load-rng)")
    return notes


def rng_flag(argv: Sequence[str], plan: "Plan") -> str | None:
    """``--no-load-rng`` where the ``--load`` checkpoint was saved at another TP or PP than
    ``plan``'s (and neither ``--no-load-rng`` nor ``--finetune`` is given), else None; every
    rank adds it. Megatron says "RNG state will be ignored" at such a load, but megatron-core
    0.12.1 (MindSpeed-LLM's base) then still reads the saved RNG state, finds none and ends
    the process with ``sys.exit()``, exit status 0, before any training: a relaunch that
    changed TP or PP would stop without training and without an error."""
    load_dir = flag_value(argv, "--load")
    if not load_dir or not os.path.isdir(load_dir) or any(
            _has(argv, f) for f in ("--no-load-rng", "--finetune", "--ckpt-convert-format")):
        return None
    try:
        info = ck.read_checkpoint(load_dir, _ckpt_step(argv))
    except (PoseidonError, OSError):
        return None   # rank 0's check has said why
    if info.iteration < 0:
        return None
    return "--no-load-rng" if _saved_tp_pp(info) != (plan.tp, plan.pp) else None


def _saved_tp_pp(info: ck.CheckpointInfo) -> tuple[int, int]:
    return (int(info.saved("tensor_model_parallel_size", 1)),
            int(info.saved("pipeline_model_parallel_size", 1)))


def _ckpt_step(argv: Sequence[str]) -> int | None:
    """``--ckpt-step`` as an integer (None when not given); a PoseidonError when it is not."""
    step_text = flag_value(argv, "--ckpt-step")
    try:
        return int(step_text) if step_text is not None else None
    except ValueError:
        raise PoseidonError(f"--ckpt-step: expected an integer, got {step_text!r}") from None


def rank0_check_resume(argv: Sequence[str], plan: "Plan",
                       devices: Sequence[DeviceGroup]) -> None:
    """The ``--load`` checkpoint against ``plan`` (module docstring); raises PoseidonError."""
    load_dir = flag_value(argv, "--load")
    if not load_dir or _has(argv, "--ckpt-convert-format"):
        return
    step = _ckpt_step(argv)
    if not os.path.isdir(load_dir):
        log.info("resume: --load %s does not exist: training starts at iteration 0", load_dir)
        return
    info = ck.read_checkpoint(load_dir, step)
    if info.iteration < 0:
        log.info("resume: no checkpoint in --load %s: training starts at iteration 0", load_dir)
        return
    refusal = resharding_refusal(info, plan, argv, _fused_adam_available())
    if refusal:
        raise PoseidonError(refusal)
    log.warning("resume from iteration %d: %s", info.iteration, _what_changed(info, plan, devices))
    for note in resume_notes(info, plan, argv):
        log.warning("resume: %s", note)


def _what_changed(info: ck.CheckpointInfo, plan: "Plan", devices: Sequence[DeviceGroup]) -> str:
    """The change summary from Poseidon's record (what it cannot tell, said instead)."""
    if info.record is None:
        return f"{info.path} was saved without Poseidon's record: what changed is not known"
    from poseidon_plugin.plan import Plan

    try:
        old_plan = Plan.from_json(json.dumps(info.record["plan"]))
        old_devices = [DeviceGroup.from_dict(d) for d in info.record.get("devices", ())]
    except (PoseidonError, KeyError, TypeError, ValueError) as e:
        return (f"its record {ck.RECORD_NAME} is unreadable ({str(e)[:200]}): what changed is "
                "not known")
    return change_summary(old_devices, devices, old_plan, plan)


def write_record(save_dir: str, iteration: int, plan_json: str,
                 devices: Sequence[DeviceGroup]) -> str | None:
    """Poseidon's record of a saved iteration (its path), or None when the folder is absent."""
    from poseidon_plugin.safeio import write_atomic

    path = ck.iteration_dir(save_dir, iteration)
    if not os.path.isdir(path):
        return None
    record: dict[str, Any] = {"format_version": 1, "iteration": iteration,
                              "plan": json.loads(plan_json),
                              "devices": [d.to_dict() for d in devices],
                              "files": ck.shard_files(path)}
    out = os.path.join(path, ck.RECORD_NAME)
    write_atomic(out, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def install_record(plan_json: str, devices: Sequence[DeviceGroup]) -> None:
    """Wrap Megatron's ``save_checkpoint`` (where ``pretrain`` calls it) so that rank 0 writes
    the record after each synchronous ``torch_dist`` save; a failure is a warning."""
    from megatron.training import checkpointing, training

    orig = checkpointing.save_checkpoint

    def save_checkpoint(iteration, *args, **kwargs):
        result = orig(iteration, *args, **kwargs)
        try:
            _after_save(iteration, plan_json, devices)
        except Exception as e:   # noqa: BLE001 - the record never stops the training
            log.warning("checkpoint record not written: %s", e)
        return result

    save_checkpoint.__wrapped__ = orig   # type: ignore[attr-defined]
    for module in (checkpointing, training):
        if getattr(module, "save_checkpoint", None) is orig:
            module.save_checkpoint = save_checkpoint


def _after_save(iteration: int, plan_json: str, devices: Sequence[DeviceGroup]) -> None:
    import torch.distributed as dist
    from megatron.training import get_args

    args = get_args()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if getattr(args, "async_save", False) or getattr(args, "ckpt_format", "") != "torch_dist":
        return
    out = write_record(args.save, int(iteration), plan_json, devices)
    if out:
        log.info("checkpoint record: %s", out)
