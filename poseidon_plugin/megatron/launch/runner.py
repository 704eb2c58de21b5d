"""The ``--poseidon-auto`` flow, run on every rank before the user's script builds anything.

    options -> refuse -> [emulation] -> bootstrap -> discovery + link probe -> profiling (or cache)
      -> gather -> megatron's op overheads + p2p call costs (or cache) -> search on rank 0,
      judged by the framework's own validate_args (:mod:`.judge`)
      -> broadcast plan + checksum -> [dry-run: print, exit 0]
      -> renumber ranks + real process group -> rewrite argv -> the user's script

Process groups: the bootstrap's gloo probe group is the default group throughout, except while
the layer is timed on a GPU / NPU (the default group is then NCCL / HCCL over the launch's ranks,
so megatron-core's TP groups, which inherit its backend, are the training's; destroyed, and a
fresh probe group made, before the gather). Before the script runs the probe group goes too and
the default group is made once more, with the renumbered ranks and the training's backend; no
model-parallel state is left (the profiler destroys its own), so Megatron's
``initialize_megatron`` finds torch.distributed initialised and makes its own groups from it.

:func:`plan_and_apply` is that line, one phase function per step over a :class:`LaunchContext`.
``_all_ranks_*`` phases run on every rank (most of them meet in a collective); ``_rank0_*`` phases
run on rank 0 only (calibration, search, the report).

Entry points: :func:`launch_main` (``python -m poseidon_plugin.launch script.py ...``) and
:func:`auto_main` (``import poseidon_plugin.auto`` at the top of the script).
"""

from __future__ import annotations

import hashlib
import logging
import os
import runpy
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from poseidon_plugin.errors import DistributedError, PoseidonError, is_refusal
from poseidon_plugin.safeio import open_input, write_atomic
from poseidon_plugin.megatron.launch import argv as argvmod
from poseidon_plugin.megatron import framework_state
from poseidon_plugin.megatron.launch import bootstrap, discovery, renumber
from poseidon_plugin.megatron.profile import callcost_profile, group_profile, profile_gather, profiler
from poseidon_plugin.megatron.emulate import emulation
from poseidon_plugin.megatron.launch import judge
from poseidon_plugin.megatron.checkpoint import resume as checkpoint_hooks
from poseidon_plugin.megatron.launch.compat import (CPU_EMULATION_FLAGS, CPU_INCOMPATIBLE_BOOL_FLAGS,
                     MINDSPEED_NPU_KERNEL_FLAGS, missing_kernel_flags,
                     missing_kernels_text, patch_dataset_helpers)
from poseidon_plugin.megatron.imports import explain as explain_import_error
from poseidon_plugin.megatron.imports import require_megatron
from poseidon_plugin.megatron.launch.options import PoseidonOptions, default_profile_dir, extract_options

if TYPE_CHECKING:
    from poseidon_plugin.cluster import Cluster
    from poseidon_plugin.model import ModelSpec
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.training import TrainingSetup
    from poseidon_plugin.profiles import ProfileDB
    from poseidon_plugin.search import SearchOptions

log = logging.getLogger("poseidon")

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# logging and small helpers
# ----------------------------------------------------------------------------------------------


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# every name logging.getLevelName knows (logging.getLevelNamesMapping is Python 3.11+; the
# plugin runs on 3.10, MindSpeed-LLM's Python)
_LEVEL_NAMES = frozenset(LOG_LEVELS) | {"WARN", "FATAL", "NOTSET"}


def log_level() -> str:
    """POSEIDON_LOG_LEVEL (default INFO), or a one-line PoseidonError naming the levels."""
    text = os.environ.get("POSEIDON_LOG_LEVEL", "INFO")
    if text.strip().upper() not in _LEVEL_NAMES:
        raise PoseidonError(f"POSEIDON_LOG_LEVEL={text!r}: expected one of "
                            f"{', '.join(LOG_LEVELS)}")
    return text.strip().upper()


def _setup_logging(rank: int | None) -> None:
    if getattr(_setup_logging, "handler", None) is not None:
        return
    level = log_level()
    handler = logging.StreamHandler(sys.stderr)
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    _setup_logging.handler = handler  # type: ignore[attr-defined]
    _set_log_rank(rank)


def rank_label(rank: int | str | None, launch_rank: int | str | None = None) -> str:
    """``rank 0 (launch rank 2)`` once ranks are renumbered (Megatron's rank first), else
    ``rank 2``."""
    if rank is None:
        return ""
    if launch_rank is None or str(launch_rank) == str(rank):
        return f"rank {rank}"
    return f"rank {rank} (launch rank {launch_rank})"


def _set_log_rank(rank: int | None, launch_rank: int | None = None) -> None:
    handler = getattr(_setup_logging, "handler", None)
    if handler is not None:
        label = rank_label(rank, launch_rank)
        prefix = f"[poseidon {label}]" if label else "[poseidon]"
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))


def _out(text: str) -> None:
    """What the user reads (rank 0): stdout, flushed."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def _enable_stack_dumps() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack of a rank that seems stuck."""
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, RuntimeError):  # not the main thread / no SIGUSR1
        pass


def plan_checksum(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------
# the launch context
# ----------------------------------------------------------------------------------------------


@dataclass
class AutoResult:
    """What :func:`plan_and_apply` leaves behind on a rank that goes on to train."""

    argv: list[str]
    new_rank: int
    world_size: int
    plan: Plan


@dataclass(eq=False, repr=False)
class LaunchContext:
    """What one rank knows about the launch. Each phase fills in the fields under its name; a
    field is read only by later phases (reading it earlier is an AttributeError)."""

    script: str
    argv: list[str]                  # the script's arguments (CPU flags appended under emulation)
    opts: PoseidonOptions
    env: bootstrap.LaunchEnv
    t_start: float
    # _all_ranks_setup_device
    emu: emulation.EmulationSpec | None = field(init=False, default=None)
    device: bootstrap.LocalDevice = field(init=False)
    host: str = field(init=False)
    backend: str = field(init=False)  # "megatron" | "mindspeed-llm"
    mindspeed_layout: bool = field(init=False, default=False)  # MindSpeed-LLM has the layout flag
    private_sends: bool = field(init=False, default=False)  # emulation: sends from a private copy
    # _all_ranks_read_model
    args: Any = field(init=False)     # Megatron's argparse namespace (parsed, not validated)
    model: ModelSpec = field(init=False)
    training: TrainingSetup = field(init=False)   # recompute, optimizer, dtypes, attention
    global_batch_size: int = field(init=False)
    micro_batch_sizes: tuple[int, ...] = field(init=False)
    expert_parallel: tuple[int, ...] | None = field(init=False, default=(1,))  # EP kept / None
    # _all_ranks_bootstrap: the rendezvous store, barriers and the probe gloo group
    overrides: dict[str, Any] = field(init=False)
    boot: bootstrap.Bootstrap = field(init=False)
    # _all_ranks_discover (the cluster's compute speed: calibrated by _rank0_calibrate_cluster)
    topo: discovery.Topology = field(init=False)
    cluster: Cluster = field(init=False)
    # _all_ranks_profile
    tps: tuple[int, ...] = field(init=False)
    eps: tuple[int, ...] = field(init=False, default=(1,))   # EP degrees MoE layers are profiled at
    cache_path: str = field(init=False)
    profiles: ProfileDB | None = field(init=False, default=None)   # rank 0 only
    stragglers: list[str] = field(init=False, default_factory=list)  # rank 0 only
    type_shares: dict[str, float] = field(init=False, default_factory=dict)  # rank 0, emulation
    # _all_ranks_share_plan
    plan: Plan = field(init=False)
    plan_text: str = field(init=False)
    renum: renumber.Renumbering = field(init=False)
    new_argv: list[str] = field(init=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def seq_length(self) -> int:
        return int(self.args.seq_length)

    @property
    def profile_seq_length(self) -> int:
        """The sequence the layers are profiled (and their records keyed) at: a CP rank's
        seq / CP under the script's ``--context-parallel-size`` (``profiler.profiling_args``
        builds the layer so), the whole sequence without CP."""
        return profile_seq_length(self.seq_length, getattr(self.args, "context_parallel_size", 1))

    def guarded(self, phase: str, fn: Callable[[], T]) -> T:
        """``fn`` run as ``phase``: an error is posted to the other ranks, which name this one
        (``POSEIDON_FAULT_INJECT`` can make this rank misbehave here)."""
        return bootstrap.run_guarded(self.boot, phase, fn)


# ----------------------------------------------------------------------------------------------
# the flow
# ----------------------------------------------------------------------------------------------


def plan_and_apply(script: str, argv: list[str], opts: PoseidonOptions) -> AutoResult:
    """Everything before the user's script (the module docstring's line). Returns on ranks that
    train; raises SystemExit(0) on ranks the plan leaves unused and after a dry run."""
    ctx = _all_ranks_start(script, argv, opts)          # refuse, logging
    _all_ranks_setup_device(ctx)                        # [emulation] or the real device; backend
    _all_ranks_read_model(ctx)                          # Megatron's parser -> model, batch sizes
    _all_ranks_bootstrap(ctx)
    try:
        _all_ranks_discover(ctx)                        # discovery + link probe -> Cluster
        _all_ranks_profile(ctx)                         # profiling (or cache) -> gather
        if ctx.rank == 0:
            _rank0_calibrate_cluster(ctx)
        _all_ranks_share_plan(ctx)                      # search on rank 0 -> broadcast + checksum
        if ctx.rank == 0:
            _rank0_report(ctx)
        if ctx.opts.dry_run:
            _all_ranks_leave_dry_run(ctx)               # exit 0 before any model is built
        ctx.guarded("apply", lambda: ctx.boot.barrier("apply"))
    except BaseException:
        if ctx.boot.probe_up:
            ctx.boot.finish_probe()
        raise
    return _all_ranks_apply(ctx)                        # renumber + real process group + argv


def _all_ranks_start(script: str, argv: list[str], opts: PoseidonOptions) -> LaunchContext:
    argvmod.check_refused(argv)
    checkpoint_note = checkpoint_hooks.check_save_prerequisites(argv)
    env = bootstrap.LaunchEnv.from_environ()
    if opts.save_plan and env.rank == 0:   # rank 0 writes it after the search
        from poseidon_plugin.errors import check_writable
        check_writable("--poseidon-save-plan", opts.save_plan)
        _check_save_plan_is_no_input(script, argv, opts)
    _setup_logging(env.rank)
    if checkpoint_note and env.rank == 0:
        log.info(checkpoint_note)
    _enable_stack_dumps()
    if opts.replan_on_straggler and not argvmod.flag_value(argv, "--save") and env.rank == 0:
        log.warning("--poseidon-replan-on-straggler needs --save (a checkpoint to resume "
                    "from): a straggler will be named, the job not stopped")
    return LaunchContext(script, list(argv), opts, env, time.perf_counter())


# the launch's input files named by Megatron's flags (besides the script and --poseidon-*)
_INPUT_FILE_FLAGS = ("--tokenizer-model", "--vocab-file", "--merge-file")


def _check_save_plan_is_no_input(script: str, argv: list[str], opts: PoseidonOptions) -> None:
    """--poseidon-save-plan naming the script, an input file or a file of the profile cache
    is refused: the plan JSON would be written over it (exit 0, the input lost)."""
    from poseidon_plugin.safeio import check_distinct

    inputs = [("(the training script)", script), ("--poseidon-emulate", opts.emulate_file),
              ("--poseidon-cluster", opts.cluster_file)]
    inputs += [(flag, argvmod.flag_value(argv, flag)) for flag in _INPUT_FILE_FLAGS]
    check_distinct([("--poseidon-save-plan", opts.save_plan)], inputs)
    if profile_gather.names_a_cache_file(opts.profile_dir, opts.save_plan):
        raise PoseidonError(f"--poseidon-save-plan {opts.save_plan}: a file of the profile "
                            f"cache ({opts.profile_dir or default_profile_dir()}); writing the "
                            "plan there would overwrite the cache: save it elsewhere")


def _all_ranks_setup_device(ctx: LaunchContext) -> None:
    """This rank's device (emulated under ``--poseidon-emulate``) and the backend."""
    if ctx.opts.emulate_file:
        _setup_emulated_device(ctx)
    else:
        # TP > 1 may be chosen: Megatron asserts this before any CUDA context exists (pre-Blackwell)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        ctx.device = bootstrap.setup_device(ctx.env.local_rank)
        if ctx.device.kind == "cpu":
            raise PoseidonError("no GPU or NPU found on this rank; to rehearse the launch on CPU "
                                "add --poseidon-emulate FILE (see examples/emulate-2types.yaml)")
        if ctx.device.kind == "cuda":
            _turn_off_missing_kernels(ctx)
        ctx.host = bootstrap.hostname()
    ctx.backend = argvmod.detect_backend(ctx.opts.backend, ctx.script)
    if ctx.backend == "mindspeed-llm":
        _setup_mindspeed_llm(ctx)
    if ctx.emu is not None:
        _emulated_framework_shims(ctx)


def _emulated_framework_shims(ctx: LaunchContext) -> None:
    """Under the emulation: the all-to-all dispatcher's split sizes handed to gloo as from a
    device (:func:`.emulation.host_split_sizes`); on megatron-core < 0.19 every pipeline send
    from a private copy (:func:`.emulation.private_pipeline_sends`), one line saying so; where
    that cannot be done, interleaving is left out of the search (:func:`launch_rules`), naming
    megatron-core's version."""
    from poseidon_plugin.megatron import provenance

    emulation.host_split_sizes()   # the all-to-all dispatcher's splits, as on a device
    ctx.private_sends = emulation.private_pipeline_sends()
    if ctx.private_sends and ctx.rank == 0:
        log.info("emulation: megatron-core %s's interleaved schedule frees a pipeline output "
                 "before its isend has finished (gloo reuses the memory at once: NaN losses; "
                 "0.19 waits); every pipeline send goes from a private copy",
                 provenance.megatron_core().version)


def _turn_off_missing_kernels(ctx: LaunchContext) -> None:
    """Megatron's default fused CUDA kernels whose modules (Apex, Transformer Engine) are not
    installed are turned off, with one line saying which: Megatron would otherwise stop at model
    build, after the search. The profiled layer is built from the same flags."""
    missing = missing_kernel_flags(ctx.argv)
    if not missing:
        return
    if ctx.rank == 0:
        log.warning("not installed here: %s; appending %s", missing_kernels_text(missing),
                    " ".join(flag for _, _, flag in missing))
    ctx.argv = ctx.argv + [flag for _, _, flag in missing]


def _setup_mindspeed_llm(ctx: LaunchContext) -> None:
    """MindSpeed-LLM's adaptor imported as its scripts do (required on real devices; under
    emulation when installed), and its interleaving rule: the layout flag where the installed
    MindSpeed-LLM registers it (v26.1.0 and later), otherwise no virtual stages (V = 1), since it
    refuses ``--num-layer-list`` with a virtual pipeline."""
    if ctx.emu is not None:
        _turn_off_npu_kernels(ctx)
    adaptor = None
    if ctx.emu is None or argvmod.mindspeed_llm_installed():
        adaptor = argvmod.import_mindspeed_llm(ctx.script, ctx.argv)
    ctx.mindspeed_layout = argvmod.mindspeed_llm_registers_layout()
    if ctx.rank == 0:
        log.info("MindSpeed-LLM: %s; --pipeline-model-parallel-layout %s",
                 f"adaptor {adaptor.__name__} ({getattr(adaptor, '__file__', '?')})"
                 if adaptor is not None else "not installed (emulation: its flags only)",
                 "registered" if ctx.mindspeed_layout else "not registered")
    if ctx.opts.max_virtual_stages > 1 and not ctx.mindspeed_layout:
        ctx.opts = replace(ctx.opts, max_virtual_stages=1)
        if ctx.rank == 0:
            log.info("MindSpeed-LLM registers no --pipeline-model-parallel-layout (v26.1.0 and "
                     "later do): interleaved plans are not searched (V = 1)")


def _turn_off_npu_kernels(ctx: LaunchContext) -> None:
    """Under CPU emulation, MindSpeed's switches for Ascend-only kernels are dropped before its
    adaptor parses the command line, with one line naming them."""
    on = [f for f in MINDSPEED_NPU_KERNEL_FLAGS if argvmod.find_flag(ctx.argv, f)]
    if not on:
        return
    if ctx.rank == 0:
        log.warning("emulation: MindSpeed's Ascend-only kernels are off (no NPU here): dropping %s",
                    " ".join(on))
    ctx.argv = argvmod.strip_flags(ctx.argv, bool_flags=on)


def _setup_emulated_device(ctx: LaunchContext) -> None:
    """CPU shims and slowdown for this rank's emulated type; CUDA-only flags swapped for CPU ones."""
    import torch

    env = ctx.env
    ctx.emu = emu = emulation.load_emulation(ctx.opts.emulate_file)
    etype = emu.type_of(env.rank)
    memory_bytes = int(etype.memory_gib * (1 << 30))
    emulation.install_cpu_shims(local_rank=env.local_rank, device_count=env.local_world_size,
                                device_name=etype.name, memory_bytes=memory_bytes)
    emulation.install_slowdown(etype.slowdown)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))
    dropped = [f for f in CPU_INCOMPATIBLE_BOOL_FLAGS if argvmod.find_flag(ctx.argv, f)]
    if dropped and env.rank == 0:
        log.info("emulation: dropping CUDA-only %s; appending %s", " ".join(dropped),
                 " ".join(CPU_EMULATION_FLAGS))
    ctx.argv = (argvmod.strip_flags(ctx.argv, bool_flags=CPU_INCOMPATIBLE_BOOL_FLAGS)
                + list(CPU_EMULATION_FLAGS))
    ctx.device = bootstrap.setup_device(env.local_rank, emulated_name=etype.name,
                                        emulated_memory_bytes=memory_bytes)
    ctx.host = emu.host_of(env.rank) or bootstrap.hostname()


def _all_ranks_read_model(ctx: LaunchContext) -> None:
    """The model's hyper-parameters from Megatron's own parser (nothing validated); the batch."""
    from poseidon_plugin.model import model_from_megatron_args
    from poseidon_plugin.training import setup_from_megatron_args

    require_megatron("--poseidon-auto")   # one line naming what is missing, and the fix
    pinned = argvmod.pin_dispatcher(ctx.argv)
    if len(pinned) > len(ctx.argv) and ctx.rank == 0:
        log.info("MoE without --moe-token-dispatcher-type: %s %s appended (the dispatcher the "
                 "plan prices; megatron-core's default is allgather)", argvmod.DISPATCHER_FLAG,
                 argvmod.PRICED_DISPATCHER)
    ctx.argv = pinned
    args = profiler.parse_megatron_args(ctx.script, ctx.argv)
    ctx.args = args
    framework_state.hold(args)   # the framework's patched code reads them from here on
    ctx.model = model_from_megatron_args(args, name=os.path.basename(ctx.script))
    if ctx.backend == "mindspeed-llm" and profiler.mindspeed_llm_builds_blocks():
        _check_mindspeed_llm_layers(args, ctx.model)
    note = ctx.model.planning_note()   # mixed layer kinds, MTP: what is not yet costed
    if note and ctx.rank == 0:
        log.warning(note)
    ctx.training = setup_from_megatron_args(args)
    if ctx.opts.tp_candidates:   # before the rendezvous, not in parallel_state on every rank
        from poseidon_plugin.megatron.profile.profile_tps import check_tps_divide_model
        check_tps_divide_model(ctx.opts.tp_candidates, ctx.model, flag="--poseidon-tp")
    gbs = args.global_batch_size
    if gbs is None:
        raise PoseidonError("--poseidon-auto needs --global-batch-size (the plan chooses DP and the "
                            "micro-batch size around it)")
    mbs_list = ctx.opts.micro_batch_sizes or (int(args.micro_batch_size or 1),)
    if not any(int(gbs) % b == 0 for b in mbs_list):
        raise PoseidonError(f"--global-batch-size {gbs} is not divisible by any micro-batch size "
                            f"candidate ({', '.join(map(str, mbs_list))}): no plan can split it; "
                            "change the global batch or --poseidon-micro-batch-sizes")
    ctx.global_batch_size = int(gbs)
    ctx.micro_batch_sizes = tuple(mbs_list)
    ctx.expert_parallel = _expert_parallel(ctx)
    _search_options(ctx)   # the batch, the sequence (their bounds) and the search flags refused
                           # here, before the discovery and the profiling


def _check_mindspeed_llm_layers(args: Any, model: ModelSpec) -> None:
    """One line where MindSpeed-LLM would build other layer kinds than the planner reads from
    the flags (:func:`.profiler.mindspeed_llm_moe_pattern`): its ``pretrain_gpt.py`` builds every
    layer as MoE unless ``--first-k-dense-replace`` is set, ``--moe-layer-freq`` alone is not
    read there."""
    from poseidon_plugin.layers import pattern_expression

    freq = getattr(args, "moe_layer_freq", None)
    built = profiler.mindspeed_llm_moe_pattern(model.num_layers, getattr(args, "num_experts", None),
                                               getattr(args, "first_k_dense_replace", None), freq)
    if built is None:
        raise PoseidonError("MindSpeed-LLM's block build takes an integer --moe-layer-freq with "
                            f"--first-k-dense-replace, not {freq!r}: it would fail building the "
                            "model")
    if tuple(built) != tuple(model.moe_pattern):
        raise PoseidonError(
            f"MindSpeed-LLM builds the layers as {pattern_expression(tuple(built))} (1: MoE), "
            f"not {pattern_expression(tuple(model.moe_pattern))} as the flags read: its "
            "pretrain_gpt.py makes every layer MoE and reads --moe-layer-freq only with "
            "--first-k-dense-replace K (the first K layers dense); use that to plan dense layers")
    fmt = getattr(args, "ckpt_format", None) or "torch_dist"
    if 0 in built and 1 in built and getattr(args, "save", None) and fmt != "torch":
        # MindSpeed-LLM swaps the dense layers' MLP spec in its own block build and leaves
        # megatron-core's moe_layer_freq at 1, so TransformerBlock.sharded_state_dict stacks
        # every layer's MLP under one key with a layer axis the dense layers cover only in
        # part: the first save dies on every rank (v26.1.0 on core_v0.12.1, seen)
        raise PoseidonError(
            f"MindSpeed-LLM cannot save this model with --ckpt-format {fmt}: its "
            "--first-k-dense-replace "
            "builds dense and MoE layers that megatron-core's distributed checkpoint keys as one "
            "stacked layer list, and the first save fails on every rank (CheckpointingException: "
            "Invalid access pattern for decoder.layers.mlp.linear_fc1.weight); save with "
            "--ckpt-format torch (it loads only at the same TP and PP), or drop --save")


def launch_rules(ctx: LaunchContext) -> Any:
    """What the framework refuses with the script's flags (``search/rules.py``), for the model
    (MoE layers at TP > 1 need ``--sequence-parallel``)."""
    from poseidon_plugin.search.rules import FrameworkRules, Rule

    rules = FrameworkRules.from_argv(ctx.argv, num_layers=ctx.model.num_layers,
                                     moe=any(k.is_moe for k in ctx.model.layer_kinds))
    if getattr(ctx, "emu", None) is not None and not getattr(ctx, "private_sends", True):
        release = emulation.megatron_core_release()
        if release is not None and release < emulation.PRIVATE_SENDS_BEFORE:
            rules = FrameworkRules(rules.rules + (Rule("no_interleaving", 1,
                                                       emulated_vpp_line()),))
    return rules


def emulated_vpp_line() -> str:
    """Why an emulated launch on megatron-core < 0.19 plans without interleaving, when its
    pipeline sends could not be given private copies (megatron-core's p2p module not found)."""
    from poseidon_plugin.megatron import provenance

    return (f"megatron-core {provenance.megatron_core().version}'s interleaved schedule frees a "
            "pipeline output before its isend has finished (NaN losses over gloo; 0.19 waits) "
            "and its pipeline sends could not be given private copies; an emulated launch "
            "plans without it")


def _expert_parallel(ctx: LaunchContext) -> tuple[int, ...] | None:
    """The EP degrees the search may use: the script's ``--expert-model-parallel-size`` kept
    (1 when absent), every valid one with ``--poseidon-search-ep``; a kept EP > 1 on a model
    without MoE layers, or one not dividing its experts, is a one-line error."""
    choice = argvmod.expert_parallel_choice(ctx.argv, ctx.opts.search_ep)
    experts = int(ctx.model.num_experts or 0)
    if choice is not None and choice[0] > 1:
        ep = choice[0]
        if not experts:
            raise PoseidonError(f"--expert-model-parallel-size {ep} on a model without MoE "
                                "layers (no --num-experts): remove it")
        if experts % ep:
            raise PoseidonError(f"--expert-model-parallel-size {ep} does not divide the "
                                f"model's {experts} experts (--num-experts)")
        if ep > ctx.world_size:
            raise PoseidonError(f"--expert-model-parallel-size {ep} is more than the launch's "
                                f"{ctx.world_size} ranks")
    return choice


def profiled_eps(expert_parallel: tuple[int, ...] | None, num_experts: int,
                 world_size: int) -> tuple[int, ...]:
    """The EP degrees a launch profiles its MoE layers at: the kept one, or (searched) every
    degree dividing the experts and at most the ranks; (1,) for a dense model."""
    if not num_experts:
        return (1,)
    if expert_parallel is not None:
        return tuple(sorted(set(expert_parallel)))
    return tuple(e for e in range(1, min(num_experts, world_size) + 1) if num_experts % e == 0)


def _all_ranks_bootstrap(ctx: LaunchContext) -> None:
    """The rendezvous store, the deadline barriers and the probe gloo group."""
    ctx.overrides = discovery.load_overrides(ctx.opts.cluster_file)
    ctx.boot = bootstrap.Bootstrap(ctx.env, ctx.opts.timeout_s)
    t0 = time.perf_counter()
    ctx.boot.start()
    log.debug("bootstrap: %.2f s", time.perf_counter() - t0)


def _all_ranks_discover(ctx: LaunchContext) -> None:
    """Who runs where (all-gather), grouped into nodes; the link probe; the discovered Cluster."""
    env, device, boot = ctx.env, ctx.device, ctx.boot
    me = discovery.DeviceInfo(
        rank=env.rank, local_rank=env.local_rank, host=ctx.host,
        device_type=discovery.rename_type(device.name, ctx.overrides),
        memory_bytes=device.memory_bytes, kind=device.kind,
        speed_hint=(ctx.emu.type_of(env.rank).speed if ctx.emu is not None else 1.0),
        device_name=device.name)
    infos = ctx.guarded("discovery", lambda: boot.all_gather_object(me, "discovery"))
    ctx.topo = topo = discovery.group_nodes(infos)
    assert boot.sync is not None
    boot.sync.names = {i.rank: topo.describe(i.rank) for i in topo.infos}
    t0 = time.perf_counter()
    skip = discovery.links_given(ctx.overrides, topo.node_types)
    links = ctx.guarded("link-probe", lambda: discovery.measure_links(boot, topo, device, skip))
    ctx.cluster = cluster = discovery.discover_cluster(
        topo, links, ctx.overrides, source=ctx.opts.cluster_file or "<discovered>")
    if ctx.rank == 0:
        log.info("discovered %s: %s; link probe %.2f s", topo.summary(),
                 ", ".join(f"{t} x{cluster.devices_of_type(t)}" for t in cluster.type_names),
                 time.perf_counter() - t0)


def _all_ranks_profile(ctx: LaunchContext) -> None:
    """Every (type, TP, micro-batch) the search may use: from the cache if rank 0 has them all,
    else the user's layer timed on every rank at once and gathered to rank 0."""
    args = ctx.args
    ctx.tps = ctx.opts.tp_candidates or _profiled_tps(ctx.cluster, ctx.model, ctx.world_size)
    rules = launch_rules(ctx)
    refused = [t for t in ctx.tps if not rules.tp_allowed(t)]
    if refused:   # e.g. MoE layers without --sequence-parallel (CPU emulation runs without it)
        if ctx.rank == 0:
            log.warning("not profiled nor planned: %s", "; ".join(rules.tp_lines(refused)))
        ctx.tps = tuple(t for t in ctx.tps if t not in refused) or (1,)
    ctx.eps = profiled_eps(ctx.expert_parallel, int(ctx.model.num_experts or 0), ctx.world_size)
    if ctx.eps != (1,) and not profile_gather.keys_carry_ep():
        ctx.eps = (1,)   # records cannot say their EP here: the search prices EP 1 only
    emu_tag = ([f"emu:{n}={t.speed}" for n, t in sorted(ctx.emu.types.items())]
               if ctx.emu is not None else [])
    key = profile_gather.cache_key([f"impl:{getattr(args, 'transformer_impl', '')}",
                                    f"bf16:{bool(args.bf16)}", f"fp16:{bool(args.fp16)}",
                                    *emu_tag], backend=ctx.backend)
    ctx.cache_path = profile_gather.cache_path(ctx.opts.profile_dir, key.tag)
    needed = profile_gather.needed_keys(ctx.cluster, ctx.model, ctx.tps, ctx.micro_batch_sizes,
                                        ctx.profile_seq_length, ctx.training, eps=ctx.eps)
    pairs, messages = _engine_cost_needs(ctx)
    cached = (False, False)
    if ctx.rank == 0:
        ctx.profiles = profile_gather.load_cache(ctx.cache_path, ctx.opts.reprofile)
        cached = (profile_gather.all_measured(ctx.profiles, needed),
                  callcost_profile.engine_costs_cached(ctx.profiles, ctx.cluster.type_names,
                                                       pairs, messages))
        profile_gather.note_provenance(ctx.opts.profile_dir, key, cached[0])  # a version changed?
    cached = ctx.guarded("profile-cache", lambda: ctx.boot.broadcast_object(cached, "profile-cache"))
    if cached[0]:
        if ctx.rank == 0:
            log.info("profiles: all %d from the cache %s (no profiling)", len(needed),
                     ctx.cache_path)
    else:
        t0 = time.perf_counter()
        gathered = _all_ranks_measure(ctx)
        if ctx.emu is not None:
            gathered = _all_ranks_remeasure_off_speeds(ctx, gathered)
        if ctx.rank == 0:
            _rank0_store_profiles(ctx, gathered, time.perf_counter() - t0)
    if not cached[1]:
        _all_ranks_measure_engine_costs(ctx, pairs, messages)


def _engine_cost_needs(ctx: LaunchContext) -> tuple[list[tuple[str, str, int, int]],
                                                    dict[int, int]]:
    """The rank pairs (one per link kind of the launch: ``callcost_profile.link_pairs``) and
    the activation messages (each micro-batch size, the whole sequence and seq / CP) whose
    per-call p2p costs the search charges."""
    pairs = callcost_profile.link_pairs(ctx.topo)
    messages = callcost_profile.activation_messages(
        ctx.model.hidden_size, sorted({ctx.seq_length, ctx.profile_seq_length}),
        ctx.micro_batch_sizes)
    return pairs, messages


def _all_ranks_measure_engine_costs(ctx: LaunchContext, pairs, messages) -> None:
    """Megatron-core's per-op overheads on every rank and the per-call p2p costs of ``pairs``
    (:func:`.callcost_profile.measure_engine_costs`); rank 0 stores them (``op_overheads``:
    each type's median over its ranks; ``p2p_calls``) in the profile DB and its cache file,
    where the search reads them."""
    t0 = time.perf_counter()
    gathered = callcost_profile.measure_engine_costs(
        ctx.boot, pairs, messages, device=_torch_device(ctx.device),
        backend=bootstrap.device_backend(ctx.device.kind))
    if ctx.rank != 0:
        return
    assert ctx.profiles is not None
    ops, calls = callcost_profile.engine_cost_records(
        gathered, {i.rank: i.device_type for i in ctx.topo.infos})
    for o in ops:
        ctx.profiles.put_op_overhead(o)
    for c in calls:
        ctx.profiles.put_p2p_call(c)
    try:
        ctx.profiles.save(ctx.cache_path)
    except PoseidonError as e:
        log.warning("could not write the profile cache: %s", e)
    log.info("megatron's per-op overheads and p2p call costs: %d op overhead and %d p2p call "
             "record(s) in %.2f s", len(ops), len(calls), time.perf_counter() - t0)
    for o in ops:
        log.info("  op overhead %-12s forward %.3f ms  backward %.3f ms", o.device_type,
                 o.forward_ms, o.backward_ms)
    for c in calls:
        log.info("  p2p call %-12s %-10s %9d B  send %.3f ms  receive-ready %.3f ms  "
                 "latency %.3f ms", c.device_type, c.link, c.message_bytes, c.send_call_ms,
                 c.recv_ready_ms, c.latency_ms)


def _all_ranks_remeasure_off_speeds(ctx: LaunchContext,
                                    gathered: list[list[profiler.LayerTiming]]
                                    ) -> list[list[profiler.LayerTiming]]:
    """Under CPU emulation: while an emulated type's measured slowdown misses its expected one
    by more than SPEED_TOLERANCE (a burst of load on the host during its turns), every rank
    profiles again, up to SPEED_ATTEMPTS in all; rank 0 keeps the attempt that missed least
    (and its host shares). Rank 0 decides, every rank follows its broadcast."""
    from poseidon_plugin.megatron.emulate.contention import SPEED_ATTEMPTS, SPEED_TOLERANCE, emulated_speed_checks, speed_error

    assert ctx.emu is not None
    speeds = {n: t.speed for n, t in ctx.emu.types.items()}
    types = {i.rank: i.device_type for i in ctx.topo.infos}
    best: tuple[float, list, dict] | None = None
    for attempt in range(1, SPEED_ATTEMPTS + 1):
        again = False
        if ctx.rank == 0:
            aggs, _ = profiler.aggregate(dict(enumerate(gathered)), types)
            checks = emulated_speed_checks(aggs, speeds, ctx.type_shares)
            err = speed_error(checks)
            if best is None or err < best[0]:
                best = (err, gathered, dict(ctx.type_shares))
            again = err > SPEED_TOLERANCE and attempt < SPEED_ATTEMPTS
            if again:
                log.warning("emulated speed: %s: off by %.0f%% (more than %d%%): profiling "
                            "again (attempt %d of %d)",
                            "; ".join(c.describe() for c in checks if not c.ok), 100 * err,
                            100 * SPEED_TOLERANCE, attempt + 1, SPEED_ATTEMPTS)
            elif attempt > 1:
                log.info("emulated speed: kept the attempt that missed least (%.0f%%) of %d",
                         100 * best[0], attempt)
        again = ctx.guarded("speed-retry",
                            lambda: ctx.boot.broadcast_object(again, "speed-retry"))
        if not again:
            break
        gathered = _all_ranks_measure(ctx)
    if ctx.rank == 0:
        assert best is not None
        ctx.type_shares = best[2]
        return best[1]
    return gathered


def _all_ranks_measure(ctx: LaunchContext) -> list[list[profiler.LayerTiming]]:
    """The layer timed on every rank for ``ctx.tps`` x ``ctx.micro_batch_sizes``, gathered (on
    every rank, by launch rank). The TP groups run on the device's backend (NCCL on GPU, HCCL on
    NPU, gloo under emulation): megatron-core's TP groups inherit the default group's backend
    and the probe group is gloo, so the default group is switched for the timing
    (:func:`.group_profile.profile_and_gather`) and is the probe group again afterwards."""
    return group_profile.profile_and_gather(
        ctx.boot, ctx.args, ctx.tps, ctx.micro_batch_sizes, device=_torch_device(ctx.device),
        iters=ctx.opts.profile_iters, backend=bootstrap.device_backend(ctx.device.kind),
        turns=(profiler.Turns(ctx.env.local_rank, ctx.env.local_world_size)
               if ctx.emu is not None else None),
        contention=_contention_probe(ctx) if ctx.emu is not None else None,
        kinds=(profiler.ProfiledKind.of_model(ctx.model, ctx.eps) if getattr(ctx, "model", None)
               is not None else None))


def _contention_probe(ctx: LaunchContext
                      ) -> Callable[[Callable[[], tuple[float, float]], float], float]:
    """Under CPU emulation: every rank runs its TP-1 layer at once (:mod:`.contention`), its mean
    step time over its time alone (``alone_s``); returns the share of this rank's physical host
    and device type (the median of those ranks' ratios)."""
    from poseidon_plugin.megatron.emulate import contention

    factor = emulation.slowdown_factor() or 1.0
    real_host = bootstrap.hostname()   # emulated hosts of one machine share its cores
    my_type = ctx.topo.infos[ctx.rank].device_type

    def probe(step: Callable[[], tuple[float, float]], alone_s: float) -> float:
        ctx.boot.barrier("contention-start")
        sample = contention.measure_contention(step, factor, alone_s)
        got = ctx.boot.all_gather_object((sample.ratio, real_host, my_type),
                                         "contention-gather")
        shares = contention.host_shares({r: g[0] for r, g in enumerate(got)},
                                        {r: g[1] for r, g in enumerate(got)},
                                        {r: g[2] for r, g in enumerate(got)})
        if ctx.rank == 0:
            per_type = {g[2]: shares[r] for r, g in enumerate(got)}
            ctx.type_shares = per_type
            log.info("host contention: %d rank(s) running at once slow each other's compute "
                     "%s (median step time together over alone, %.1f s; per rank %s; the fixed rule "
                     "ranks x threads / cores would say x%.2f for every type)", len(got),
                     ", ".join(f"{t} x{v:.2f}" for t, v in sorted(per_type.items())),
                     contention.CONTENTION_SECONDS, " ".join(f"{g[0]:.2f}" for g in got),
                     profiler.host_share())
        return shares[ctx.rank]

    return probe


def _rank0_store_profiles(ctx: LaunchContext, gathered: list[list[profiler.LayerTiming]],
                          took_s: float) -> None:
    """Per-type medians of the gathered timings into the profile DB and its cache file; log them
    and the stragglers."""
    assert ctx.profiles is not None
    aggs, ctx.stragglers = profiler.aggregate(dict(enumerate(gathered)),
                                              {i.rank: i.device_type for i in ctx.topo.infos})
    env = profile_gather.measurement_env(ctx.device.name, ctx.device.kind, ctx.backend)
    for record in profile_gather.measured_records(aggs, ctx.profile_seq_length,
                                                  profile_gather.kind_signatures(ctx.model),
                                                  ctx.training, env,
                                                  profile_gather.devices_by_type(ctx.topo.infos)):
        ctx.profiles.put(record)
    try:
        ctx.profiles.save(ctx.cache_path)
    except PoseidonError as e:
        log.warning("could not write the profile cache: %s", e)
    kinds = len(profile_gather.kind_signatures(ctx.model))
    log.info("profiling: %d config(s)%s x %d rank(s) in %.2f s; cache %s",
             len(ctx.tps) * len(ctx.micro_batch_sizes),
             f" x {kinds} layer kinds" if kinds > 1 else "", ctx.world_size, took_s,
             ctx.cache_path)
    for a in aggs:
        log.info("  %-12s %s%stp=%d mbs=%d  fwd %8.2f ms  bwd %8.2f ms  optimizer %7.2f ms  "
                 "act %6.1f MiB  (median of %d%s)", a.device_type,
                 f"{a.kind:<6s}" if a.kind else "", f"ep={a.ep} " if a.ep > 1 else "",
                 a.tp, a.micro_batch_size,
                 a.forward_ms, a.backward_ms, a.optimizer_ms, a.activation_bytes / 2**20, a.ranks,
                 f"; {a.unconverged} not within 2%" if a.unconverged else "")
    for s in ctx.stragglers:
        log.warning("straggler: %s", s)
    if ctx.emu is not None:
        _log_emulated_speeds(ctx, aggs)


def _log_emulated_speeds(ctx: LaunchContext, aggs: Sequence[profiler.Aggregate]) -> None:
    """Under CPU emulation: did each type measure at its configured speed? One line per type;
    a warning when a ratio is more than 10 % off (the plan then rests on wrong speeds)."""
    from poseidon_plugin.megatron.emulate.contention import SPEED_ATTEMPTS, SPEED_TOLERANCE, emulated_speed_checks

    assert ctx.emu is not None
    speeds = {n: t.speed for n, t in ctx.emu.types.items()}
    for c in emulated_speed_checks(aggs, speeds, ctx.type_shares):
        if c.ok:
            log.info("emulated speed: %s: within %d%%", c.describe(), 100 * SPEED_TOLERANCE)
        else:
            log.warning("emulated speed: %s: more than %d%% off; the profile (and the plan) "
                        "do not see this type at its configured speed (a loaded host? the "
                        "closest of up to %d profiling attempts is kept; --poseidon-reprofile "
                        "measures again)", c.describe(), 100 * SPEED_TOLERANCE, SPEED_ATTEMPTS)


def _rank0_calibrate_cluster(ctx: LaunchContext) -> None:
    """The cluster's compute speed set from the measured layers (rank 0 is the one that searches)."""
    assert ctx.profiles is not None
    ctx.cluster = profile_gather.calibrate(
        ctx.cluster, ctx.profiles, ctx.model, ctx.tps, ctx.micro_batch_sizes,
        ctx.profile_seq_length, fixed=discovery.speed_given(ctx.overrides),
        estimated_peak=[i.device_type for i in ctx.topo.infos if i.kind not in ("cuda", "npu")],
        setup=ctx.training, eps=ctx.eps)


def _all_ranks_share_plan(ctx: LaunchContext) -> None:
    """Rank 0 searches; every rank receives the plan (checksummed), renumbers, rewrites argv."""
    payload: tuple[str, str] | None = None
    from poseidon_plugin.megatron.launch.search_transport import launch_searchers
    group = launch_searchers(ctx.boot, ctx.topo, ctx.rank)   # one searcher per host (> 1 host)
    if ctx.rank == 0:
        payload = ctx.guarded("search", lambda: _rank0_search_plan(ctx, group))
    else:
        ctx.boot.phase("search")
        if group is not None:
            with group:
                ctx.guarded("search-share", group.serve)
    text, digest = ctx.guarded("plan-broadcast",
                               lambda: ctx.boot.broadcast_object(payload, "plan-broadcast"))
    if plan_checksum(text) != digest:
        raise DistributedError(f"rank {ctx.rank}: the plan received from rank 0 fails its "
                               "checksum (corrupted broadcast)")
    from poseidon_plugin.plan import Plan

    ctx.plan_text = text
    ctx.plan = Plan.from_json(text)
    ctx.renum = renumber.renumber(ctx.plan.rank_order(), ctx.topo, ctx.world_size)
    ctx.new_argv = argvmod.rewrite_argv(ctx.argv, ctx.plan, ctx.backend,
                                        mindspeed_layout=ctx.mindspeed_layout)
    overridden = argvmod.overridden_flags(ctx.argv, ctx.new_argv)
    if ctx.rank == 0 and overridden:
        log.warning("the plan overrides your %s", ", ".join(overridden))
    if ctx.rank == 0:   # the --load checkpoint against the plan: convert, refuse, or say what changed
        ctx.guarded("resume-check", lambda: checkpoint_hooks.rank0_check_resume(
            ctx.argv, ctx.plan, checkpoint_hooks.topology_devices(ctx.topo)))
    ctx.guarded("plan-verified", lambda: ctx.boot.barrier("plan-verified"))


def _rank0_search_plan(ctx: LaunchContext, group=None) -> tuple[str, str]:
    """The plan's JSON and its checksum (what rank 0 broadcasts); ``group``: the hosts'
    searchers (search/distributed.py) the search is shared with."""
    from poseidon_plugin.search import search_plan

    if group is not None:
        log.info("search: shared by %d searchers (one per host)", group.size)
        with group:
            return _rank0_search_plan_with(ctx, group.search)
    return _rank0_search_plan_with(ctx, search_plan)


def _rank0_search_plan_with(ctx: LaunchContext, search_plan) -> tuple[str, str]:
    t0 = time.perf_counter()
    options = _search_options(ctx)
    path = previous_plan_path(ctx.cache_path, ctx.cluster, ctx.model, options)
    previous = None if ctx.opts.replan or not options.keep_tolerance else _load_previous(path)
    plan = judge.search_accepted(
        lambda o: search_plan(ctx.cluster, ctx.model, o, ctx.profiles, previous=previous),
        options, lambda p: _rank0_framework_refusal(ctx, p))
    log.info("search: %.2f s", time.perf_counter() - t0)
    s = plan.search
    if s["previous_plan"] in ("kept", "replaced"):
        log.info("the previous launch's plan (%s) is %.2f ms under these costs, %+.2f%% over the "
                 "fastest %.2f ms: %s (window %g%%; --poseidon-replan chooses afresh)", path,
                 s["previous_ms"], 100 * (s["previous_ms"] / s["fastest_ms"] - 1),
                 s["fastest_ms"], s["previous_plan"], 100 * options.keep_tolerance)
    elif s["previous_plan"] != "none":
        log.warning("the previous launch's plan (%s) is %s; planning afresh", path,
                    s["previous_plan"])
    text = plan.to_json()
    _save_previous(path, text)
    return text, plan_checksum(text)


def _rank0_framework_refusal(ctx: LaunchContext, plan: Plan) -> str | None:
    """Why the installed framework (Megatron's or MindSpeed-LLM's parse_args + validate_args)
    refuses ``plan`` on the command line the script would run with; None: accepted."""
    hang = _moe_free_stage_refusal(ctx, plan)
    if hang:
        return hang
    try:
        new_argv = argvmod.rewrite_argv(ctx.argv, plan, ctx.backend,
                                        mindspeed_layout=ctx.mindspeed_layout)
    except PoseidonError as e:
        return str(e)
    return judge.framework_refusal(ctx.script, new_argv, plan.world_size, ctx.backend)


def _moe_free_stage_refusal(ctx: LaunchContext, plan: Plan) -> str | None:
    """A plan whose pipeline stage holds no MoE layer, on a megatron-core before 0.19 (the
    one the script imports; MindSpeed-LLM's 0.12.1): it would hang at the first optimizer
    step (``search/rules.py``, ``MOE_FREE_STAGE_FIXED_IN``)."""
    from poseidon_plugin.megatron import provenance
    from poseidon_plugin.search import rules

    core = provenance.megatron_core()
    name = "MindSpeed-LLM" if ctx.backend == "mindspeed-llm" else "Megatron"
    return rules.moe_free_stage_refusal(plan, ctx.model, f"{name} on megatron-core "
                                        f"{core.version}", rules.version_tuple(core.version))


def previous_plan_path(cache_path: str, cluster: Cluster, model: ModelSpec,
                       options: SearchOptions) -> str:
    """Where a launch keeps its plan for the next identical launch: beside the profile cache,
    named by a hash of what the plan depends on (the cache's name: versions and emulation;
    model, sequence, batch, training setup, the cluster's device types and nodes, the search
    space), not of the measured costs. The devices as a set: the same devices in another rank
    order (a relaunch whose ranks came up in another order) keep their plan, which names
    device types, not ranks."""
    o = options
    key = repr((os.path.basename(cache_path), model.signature(), model.num_layers,
                o.global_batch_size, o.seq_length, o.training, o.schedules, o.pruning,
                o.tp_mode, o.tp_degrees, o.micro_batch_sizes, o.max_virtual_stages, o.type_order,
                sorted((t, cluster.devices_of_type(t)) for t in cluster.type_names),
                sorted((n.device_type, n.num_devices) for n in cluster.nodes)))
    ep = getattr(o, "expert_parallel", (1,))
    if ep != (1,):   # EP kept at 1 (the default): the key dense launches always had
        key += f"|ep={ep}"
    if o.context_parallel not in (None, (1,)):   # likewise CP
        key += f"|cp={o.context_parallel}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(cache_path), f"plan-{digest}.json")


def _load_previous(path: str) -> Plan | None:
    """The plan a previous identical launch ran, or None (none yet; unreadable: a warning). A
    damaged file is moved aside, as a damaged profile cache is (``profile_gather.load_cache``),
    so that it cannot fail the next launch either."""
    from poseidon_plugin.plan import Plan

    try:
        with open_input(path) as f:   # a FIFO planted there: a warning, not a hang
            return Plan.from_json(f.read(64 << 20).decode("utf-8"))
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("previous plan %s is unreadable (%s); planning afresh", path, e)
        return None
    except (PoseidonError, ValueError) as e:   # not UTF-8; a directory or FIFO there too
        aside = f"{path}.corrupt-{int(time.time())}"
        try:
            os.replace(path, aside)
        except OSError:
            aside = "(could not move it)"
        log.warning("previous plan %s is unreadable, planning afresh: %s; old file kept as %s",
                    path, str(e)[:300], aside)
        return None


def _save_previous(path: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomic(path, text)
    except (OSError, PoseidonError) as e:
        log.warning("could not keep the plan for the next launch in %s: %s", path, e)


def profile_seq_length(seq_length: int, context_parallel_size) -> int:
    """seq / CP for the script's CP (``LaunchContext.profile_seq_length``)."""
    cp = int(context_parallel_size or 1)
    return seq_length // cp if cp > 1 and seq_length % cp == 0 else seq_length


def launch_cp_degrees(argv, seq_length: int, search: bool) -> tuple[int, ...]:
    """The CP degrees a launch plans: the script's ``--context-parallel-size`` (1 without it),
    kept; with ``--poseidon-search-cp`` every power of two dividing the sequence into 2 x CP
    chunks (``SearchOptions.search_cp_degrees``, the script's among them where valid)."""
    from poseidon_plugin.search import SearchOptions

    raw = argvmod.flag_value(argv, "--context-parallel-size", "1")
    try:
        cp = int(raw)
    except (TypeError, ValueError):
        raise PoseidonError(f"--context-parallel-size: expected an integer, got {raw!r}") \
            from None
    if cp < 1:
        raise PoseidonError(f"--context-parallel-size: expected an integer >= 1, got {cp}")
    if search:
        return SearchOptions.search_cp_degrees(seq_length, start=cp)
    return (cp,)


def _search_options(ctx: LaunchContext) -> SearchOptions:
    """The launch's one ``SearchOptions``: the script's batch and sequence, the ``--poseidon-*``
    search options, schedules Megatron can run, threads = this host's cores / its ranks, what
    the framework refuses with the script's flags (``search/rules.py``)."""
    from poseidon_plugin.search import SearchOptions

    opts = ctx.opts
    return SearchOptions(
        global_batch_size=ctx.global_batch_size, seq_length=ctx.seq_length,
        schedules=_launch_schedules(opts.schedules), pruning=opts.pruning,
        tp_degrees=opts.tp_candidates or None,
        micro_batch_sizes=ctx.micro_batch_sizes,
        max_virtual_stages=opts.max_virtual_stages, seed=opts.seed,
        time_budget_s=opts.time_budget_s, training=ctx.training,
        keep_tolerance=opts.keep_within,
        context_parallel=launch_cp_degrees(ctx.argv, ctx.seq_length, opts.search_cp),
        rules=launch_rules(ctx),
        workers=opts.search_workers or max(1, (os.cpu_count() or 1)
                                           // max(1, ctx.env.local_world_size)),
        moe_free_stages=_moe_free_stages_train(),
        **_ep_option(ctx.expert_parallel))


def _moe_free_stages_train() -> bool:
    """Whether the megatron-core the script imports trains a pipeline stage that holds no MoE
    layer (:func:`.judge.installed_trains_moe_free_stages`)."""
    from poseidon_plugin.megatron.launch import judge

    return judge.installed_trains_moe_free_stages()


def _ep_option(expert_parallel: tuple[int, ...] | None) -> dict[str, Any]:
    """``SearchOptions.expert_parallel`` where the search has it (it plans EP)."""
    import dataclasses

    from poseidon_plugin.search import SearchOptions

    if "expert_parallel" not in {f.name for f in dataclasses.fields(SearchOptions)}:
        return {}
    return {"expert_parallel": expert_parallel}


def _rank0_report(ctx: LaunchContext) -> None:
    """``--poseidon-save-plan`` and what the user reads: the plan, the rank map, the flags."""
    if ctx.opts.save_plan:
        try:
            write_atomic(ctx.opts.save_plan, ctx.plan_text)
        except OSError as e:   # checked before profiling; removed since
            raise PoseidonError(f"--poseidon-save-plan {ctx.opts.save_plan}: cannot write "
                                f"({e.strerror})") from None
    dry = " -- dry run: exiting before any model is built" if ctx.opts.dry_run else ""
    mfu_warning = ctx.plan.mfu_warning({t: dt.peak_tflops
                                        for t, dt in ctx.cluster.device_types.items()})
    if mfu_warning:
        log.warning("%s", mfu_warning)
    lines = ["", "=" * 78, f"Poseidon plan ({ctx.backend})", "=" * 78, ctx.plan.table(),
             "", "rank -> stage:"]
    lines += ["  " + s for s in renumber.stage_map(ctx.plan, ctx.renum, ctx.topo)]
    if ctx.stragglers:
        lines += ["", "stragglers (much slower than the rest of their device type):"]
        lines += ["  " + s for s in ctx.stragglers]
    lines += ["", "flags:", "  " + _shell_join(argvmod.backend_flags(ctx.plan, ctx.backend,
                                                                  ctx.mindspeed_layout)),
              "", "command line the script runs with:",
              "  " + _shell_join([ctx.script, *ctx.new_argv]),
              "", f"(planning took {time.perf_counter() - ctx.t_start:.1f} s){dry}", "=" * 78, ""]
    _out("\n".join(lines))


def _shell_join(tokens: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in tokens)


def _all_ranks_leave_dry_run(ctx: LaunchContext) -> None:
    ctx.guarded("dry-run", lambda: ctx.boot.barrier("dry-run"))
    ctx.boot.finish_probe()
    raise SystemExit(0)


def _all_ranks_apply(ctx: LaunchContext) -> AutoResult:
    """Ranks the plan leaves unused exit 0; the others re-join the real process group under their
    new rank, with the environment and (MindSpeed-LLM) patches the script expects."""
    env, renum, plan = ctx.env, ctx.renum, ctx.plan
    if env.rank in renum.unused:
        ctx.boot.finish_probe()
        _out(f"[poseidon rank {env.rank}] this device ({ctx.topo.describe(env.rank)}) is not used "
             f"by the plan ({renum.world_size} of {env.world_size} devices train); exiting with 0")
        raise SystemExit(0)
    new_rank = renum.new_rank_of[env.rank]
    dist_backend = (argvmod.flag_value(ctx.new_argv, "--distributed-backend")
                    or bootstrap.device_backend(ctx.device.kind))
    timeout_min = float(getattr(ctx.args, "distributed_timeout_minutes", 10) or 10)
    ctx.boot.init_main(new_rank, renum.world_size, dist_backend, timeout_min)
    os.environ["POSEIDON_LAUNCH_RANK"] = str(env.rank)
    _set_log_rank(new_rank, env.rank)
    os.environ["POSEIDON_DEVICE_TYPE"] = ctx.topo.infos[env.rank].device_type
    os.environ["RANK"] = str(new_rank)
    os.environ["WORLD_SIZE"] = str(renum.world_size)
    patch_dataset_helpers()
    rng = checkpoint_hooks.rng_flag(ctx.new_argv, plan)   # a TP / PP change: see rng_flag
    if rng:
        ctx.new_argv = [*ctx.new_argv, rng]
    if ctx.backend == "mindspeed-llm":
        sys.argv = [ctx.script, *ctx.new_argv]  # MindSpeed-LLM reads sys.argv
        argvmod.apply_mindspeed_llm(ctx.new_argv)
    log.info("renumbered: launch rank %d is rank %d of %d (stage %d); setup took %.2f s",
             env.rank, new_rank, renum.world_size,
             new_rank // max(1, renum.world_size // plan.pp), time.perf_counter() - ctx.t_start)
    from poseidon_plugin.megatron.launch import built_check

    built_check.install([bool(v) for v in ctx.model.moe_pattern],
                        "MindSpeed-LLM" if ctx.backend == "mindspeed-llm" else "Megatron", _fail,
                        planned_mla=bool(ctx.model.multi_latent_attention))
    _install_straggler_monitor(ctx, plan)   # before the calibration (see straggler.py)
    _install_calibration(plan, ctx.model, ctx.cache_path, ctx.cluster.type_names,
                         getattr(ctx.args, "train_iters", None))
    if argvmod.flag_value(ctx.new_argv, "--save"):   # the plan and devices beside each save
        checkpoint_hooks.install_record(ctx.plan_text,
                                        checkpoint_hooks.topology_devices(ctx.topo))
    framework_state.release()   # pretrain sets Megatron's globals itself, as in a fresh process
    return AutoResult(ctx.new_argv, new_rank, renum.world_size, plan)


def _install_straggler_monitor(ctx: LaunchContext, plan: Plan) -> None:
    """The straggler line (rank 0 names a rank that stays slower than planned, and the plan the
    search would choose with its measured speed); an observer like the calibration:
    ``POSEIDON_STRAGGLER=0`` turns it off, it never stops the training."""
    if os.environ.get("POSEIDON_STRAGGLER", "1") == "0":
        return
    from poseidon_plugin.search import search_plan
    from poseidon_plugin.megatron.calibrate.straggler import install_straggler_monitor, search_suggester

    suggest = None
    try:   # every rank installs the monitor (it gathers each iteration); rank 0 suggests
        if ctx.profiles is not None:   # the launch's rank 0: it searched
            suggest = search_suggester(
                plan, lambda o, db, prev: search_plan(ctx.cluster, ctx.model, o, db,
                                                      previous=prev),
                ctx.profiles, _search_options(ctx))
    except Exception as exc:
        log.warning("straggler: no plan suggestion: %s", exc)
    try:
        replan = ctx.opts.replan_on_straggler and bool(argvmod.flag_value(ctx.new_argv,
                                                                            "--save"))
        record = None
        if replan and ctx.profiles is not None:
            from poseidon_plugin.megatron.calibrate.straggler import record_measured_speeds

            profiles, path = ctx.profiles, ctx.cache_path
            record = lambda found: record_measured_speeds(path, profiles, found)  # noqa: E731
        install_straggler_monitor(plan, ctx.opts.straggler_pct, ctx.opts.straggler_iters,
                                  suggest=suggest, replan=replan, record=record)
    except Exception as exc:
        log.warning("straggler monitor not installed: %s", exc)


def _install_calibration(plan: Plan, model: ModelSpec, cache_path: str,
                         device_types: Sequence[str], train_iters: int | None = None) -> None:
    """Live calibration (one log line: predicted and re-predicted vs measured iteration time;
    measured per-layer times and the per-iteration overhead written back to the profile cache).
    ``POSEIDON_CALIBRATION=0`` turns it off; it never stops the training."""
    if os.environ.get("POSEIDON_CALIBRATION", "1") == "0":
        return
    try:
        from poseidon_plugin.megatron.calibrate.calibration import calibration_windows, install_calibration

        warm, cal, meas = calibration_windows(train_iters)
        install_calibration(plan, model_signature=model.signature(), profile_db_path=cache_path,
                            device_types=device_types, warmup_iterations=warm,
                            calibrate_iterations=cal, measure_iterations=meas,
                            layer_records=not model.is_mixed and int(getattr(plan, "ep", 1)) <= 1)
    except Exception as exc:  # calibration is an observer: report, never fail the launch
        log.warning("calibration not installed: %s", exc)


def _launch_schedules(requested: Sequence[str]) -> tuple[str, ...]:
    """The schedules the plan may pick at launch: what Megatron's get_forward_backward_func runs."""
    from poseidon_plugin.simulator.schedules import LAUNCHABLE_SCHEDULES

    if not requested:
        return LAUNCHABLE_SCHEDULES
    bad = [s for s in requested if s not in LAUNCHABLE_SCHEDULES]
    if bad:
        raise PoseidonError(f"--poseidon-schedules: Megatron can run "
                            f"{', '.join(LAUNCHABLE_SCHEDULES)}; {', '.join(bad)} can only be "
                            "planned offline (poseidon plan)")
    return tuple(requested)


def _torch_device(device: bootstrap.LocalDevice):
    import torch

    if device.kind in ("cuda", "npu"):
        return torch.device(device.kind, device.index)
    return torch.device("cpu")


def _profiled_tps(cluster: Cluster, model: ModelSpec, world_size: int) -> tuple[int, ...]:
    """Every TP degree the search may pick for some device type (so none is only estimated)."""
    from poseidon_plugin.search import tp_candidates

    out = sorted({t for name in cluster.type_names for t in tp_candidates(cluster, model, name)})
    return tuple(t for t in out if world_size % t == 0)


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def _fail(e: BaseException) -> int:
    label = rank_label(os.environ.get("RANK", "?"), os.environ.get("POSEIDON_LAUNCH_RANK"))
    sys.stderr.write(f"[poseidon {label}] error: {e}\n")
    sys.stderr.flush()
    # a refusal of the input (here or on another rank: every rank the same code) exits 2
    return EXIT_USER_ERROR if is_refusal(e) else EXIT_FAILURE


def launch_main(argv: Sequence[str] | None = None) -> int:
    """``python -m poseidon_plugin.launch script.py [args...]``: plan (if asked), then run the script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _out("usage: python -m poseidon_plugin.launch SCRIPT.py [script args...] --poseidon-auto "
             "[--poseidon-dry-run] [--poseidon-emulate FILE] [--poseidon-cluster FILE] ...")
        return 0 if argv else EXIT_USER_ERROR
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        return _fail(PoseidonError(f"{script}: no such script"))
    _script_dir_first(script)  # before planning imports megatron: one megatron for both modes
    try:
        opts, rest = extract_options(rest)
        if opts.auto:
            result = plan_and_apply(script, rest, opts)
            rest = result.argv
    except SystemExit as e:
        return int(e.code or 0)
    except PoseidonError as e:
        return _fail(e)
    except ImportError as e:   # one line: what is missing and the fix (no traceback)
        return _fail(explain_import_error(e, needed_by="--poseidon-auto"))
    run_script(script, rest)
    return 0


def _script_dir_first(script: str) -> None:
    """The script's directory first on sys.path, as ``python script.py`` has it: a Megatron-LM
    checkout's own ``megatron/`` then wins over an installed megatron-core, for the planning
    (which imports megatron) as for the script."""
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir in sys.path:
        sys.path.remove(script_dir)
    sys.path.insert(0, script_dir)


def run_script(script: str, argv: list[str]) -> None:
    """Run the user's script unchanged as ``__main__`` with its directory first on sys.path."""
    _script_dir_first(script)
    sys.argv = [script, *argv]
    from poseidon_plugin.megatron.calibrate.straggler import exit_status

    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:   # after a straggler's checkpoint: the status torchrun relaunches on
        raise SystemExit(exit_status(e.code)) from None
    if exit_status(0) != 0:
        raise SystemExit(exit_status(0))


def auto_main() -> None:
    """``import poseidon_plugin.auto``: the same flow on ``sys.argv`` of the running script."""
    script = sys.argv[0]
    try:
        opts, rest = extract_options(sys.argv[1:])
    except PoseidonError as e:
        raise SystemExit(_fail(e)) from None
    if not opts.auto:
        sys.argv = [script, *rest]
        return
    try:
        result = plan_and_apply(script, rest, opts)
    except PoseidonError as e:
        raise SystemExit(_fail(e)) from None
    except ImportError as e:
        raise SystemExit(_fail(explain_import_error(e, needed_by="--poseidon-auto"))) from None
    sys.argv = [script, *result.argv]
