"""The ``--poseidon-auto`` flow, run on every rank before the user's script builds anything.

    options -> refuse -> [emulation] -> bootstrap -> discovery + link probe -> profiling (or cache)
      -> gather -> search on rank 0 -> broadcast plan + checksum -> [dry-run: print, exit 0]
      -> renumber ranks + real process group -> rewrite argv -> the user's script

Entry points: :func:`launch_main` (``python -m poseidon_plugin.launch script.py ...``) and
:func:`auto_main` (``import poseidon_plugin.auto`` at the top of the script).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import runpy
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..errors import DistributedError, PoseidonError
from . import argv as argvmod
from .options import PoseidonOptions, default_profile_dir, extract_options

log = logging.getLogger("poseidon")

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1


# ----------------------------------------------------------------------------------------------
# logging and small helpers
# ----------------------------------------------------------------------------------------------


def _setup_logging(rank: int | None) -> None:
    if getattr(_setup_logging, "done", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    prefix = "[poseidon]" if rank is None else f"[poseidon rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("POSEIDON_LOG_LEVEL", "INFO").upper())
    log.propagate = False
    _setup_logging.done = True  # type: ignore[attr-defined]


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


def _maybe_inject_fault(phase: str, rank: int) -> None:
    """Test hook: POSEIDON_FAULT_INJECT='phase:rank:hang|raise|exit' makes one rank misbehave."""
    spec = os.environ.get("POSEIDON_FAULT_INJECT")
    if not spec:
        return
    f_phase, f_rank, mode = (spec.split(":") + ["", "", ""])[:3]
    if f_phase != phase or str(rank) != f_rank:
        return
    log.warning("fault injection: %s in %s", mode, phase)
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "exit":
        os._exit(17)
    raise RuntimeError(f"injected fault in {phase}")


def _planner() -> tuple[Callable[..., Any], Callable[[str], Any]]:
    """(search_plan, plan_from_json). POSEIDON_PLANNER='module' swaps both (tests, experiments)."""
    override = os.environ.get("POSEIDON_PLANNER")
    if override:
        mod = importlib.import_module(override)
        return mod.search_plan, mod.plan_from_json
    from ..plan import Plan
    from ..search import search_plan

    return search_plan, Plan.from_json


def plan_checksum(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def versions_tag(extra: Sequence[str] = ()) -> str:
    """What, besides the layer's shape, makes a profile stale: library versions, impl, dtype."""
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - a source checkout of Megatron-LM
        mcore = "src"
    from .. import __version__

    parts = [f"torch{torch.__version__}", f"mcore{mcore}", f"poseidon{__version__}", *extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# the flow
# ----------------------------------------------------------------------------------------------


@dataclass
class AutoResult:
    """What :func:`plan_and_apply` leaves behind on a rank that goes on to train."""

    argv: list[str]
    new_rank: int
    world_size: int
    plan: Any


def _profile_cache_path(opts: PoseidonOptions, tag: str) -> str:
    return os.path.join(opts.profile_dir or default_profile_dir(), f"profiles-{tag}.json")


def _load_cache(path: str, reprofile: bool):
    """The profile cache; a corrupt file is moved aside with a warning (profiles are re-measured)."""
    from ..errors import ProfileDBError
    from ..profiles import ProfileDB

    if reprofile or not os.path.exists(path):
        return ProfileDB(None)
    try:
        return ProfileDB.load(path)
    except ProfileDBError as e:
        aside = f"{path}.corrupt-{int(time.time())}"
        try:
            os.replace(path, aside)
        except OSError:
            aside = "(could not move it)"
        log.warning("profile cache is unreadable, re-profiling: %s; old file kept as %s", e, aside)
        return ProfileDB(None)


def plan_and_apply(script: str, argv: list[str], opts: PoseidonOptions) -> AutoResult:
    """Everything before the user's script. Returns on ranks that train; exits on the others."""
    from . import bootstrap, discovery, emulation, profiler, renumber
    from .compat import CPU_EMULATION_FLAGS, CPU_INCOMPATIBLE_BOOL_FLAGS, patch_dataset_helpers

    argvmod.check_refused(argv)
    env = bootstrap.LaunchEnv.from_environ()
    _setup_logging(env.rank)
    _enable_stack_dumps()
    t_start = time.perf_counter()

    # -- emulation and device ----------------------------------------------------------------
    emu = emulation.load_emulation(opts.emulate_file) if opts.emulate_file else None
    if emu is not None:
        etype = emu.type_of(env.rank)
        emulation.install_cpu_shims(local_rank=env.local_rank, device_count=env.local_world_size,
                                    device_name=etype.name,
                                    memory_bytes=int(etype.memory_gib * (1 << 30)))
        emulation.install_slowdown(etype.slowdown)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))
        dropped = [f for f in CPU_INCOMPATIBLE_BOOL_FLAGS if argvmod.find_flag(argv, f)]
        if dropped and env.rank == 0:
            log.info("emulation: dropping CUDA-only %s; appending %s", " ".join(dropped),
                     " ".join(CPU_EMULATION_FLAGS))
        argv = argvmod.strip_flags(argv, bool_flags=CPU_INCOMPATIBLE_BOOL_FLAGS) + list(CPU_EMULATION_FLAGS)
        device = bootstrap.setup_device(env.local_rank, emulated_name=etype.name,
                                        emulated_memory_bytes=int(etype.memory_gib * (1 << 30)))
        host = emu.host_of(env.rank) or bootstrap.hostname()
    else:
        # TP > 1 may be chosen: Megatron asserts this before any CUDA context exists (pre-Blackwell)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        device = bootstrap.setup_device(env.local_rank)
        if device.kind == "cpu":
            raise PoseidonError("no GPU or NPU found on this rank; to rehearse the launch on CPU "
                                "add --poseidon-emulate FILE (see examples/emulate-2types.yaml)")
        host = bootstrap.hostname()
    backend = argvmod.detect_backend(opts.backend, script)
    if backend == "mindspeed-llm":
        if opts.max_virtual_stages > 1:
            opts = replace(opts, max_virtual_stages=1)  # --num-layer-list has no interleaving
        if emu is None:
            argvmod.import_mindspeed_llm(script, argv)

    # -- model hyper-parameters (Megatron's own parser, nothing validated) --------------------
    args = profiler.parse_megatron_args(script, argv)
    from ..model import model_from_megatron_args

    model = model_from_megatron_args(args, name=os.path.basename(script))
    gbs = args.global_batch_size
    if gbs is None:
        raise PoseidonError("--poseidon-auto needs --global-batch-size (the plan chooses DP and the "
                            "micro-batch size around it)")
    mbs_list = opts.micro_batch_sizes or (int(args.micro_batch_size or 1),)
    if not any(int(gbs) % b == 0 for b in mbs_list):
        raise PoseidonError(f"--global-batch-size {gbs} is not divisible by any micro-batch size "
                            f"candidate ({', '.join(map(str, mbs_list))}): no plan can split it; "
                            "change the global batch or --poseidon-micro-batch-sizes")

    # -- bootstrap ----------------------------------------------------------------------------
    overrides = discovery.load_overrides(opts.cluster_file)
    boot = bootstrap.Bootstrap(env, opts.timeout_s)
    t0 = time.perf_counter()
    boot.start()
    log.debug("bootstrap: %.2f s", time.perf_counter() - t0)

    def guarded(phase: str, fn: Callable[[], Any]) -> Any:
        def body() -> Any:
            _maybe_inject_fault(phase, env.rank)
            return fn()
        return bootstrap.run_guarded(boot, phase, body)

    try:
        # -- discovery ------------------------------------------------------------------------
        me = discovery.DeviceInfo(
            rank=env.rank, local_rank=env.local_rank, host=host,
            device_type=discovery.rename_type(device.name, overrides),
            memory_bytes=device.memory_bytes, kind=device.kind,
            speed_hint=(emu.type_of(env.rank).speed if emu is not None else 1.0))
        infos = guarded("discovery", lambda: boot.all_gather_object(me, "discovery"))
        topo = discovery.group_nodes(infos)
        assert boot.sync is not None
        boot.sync.names = {i.rank: topo.describe(i.rank) for i in infos}
        t0 = time.perf_counter()
        skip = discovery.links_given(overrides, topo.node_types)
        links = guarded("link-probe", lambda: discovery.measure_links(boot, topo, device, skip))
        cluster_data = discovery.cluster_dict(topo, links, overrides,
                                              source=opts.cluster_file or "<discovered>")
        from ..cluster import cluster_from_dict

        cluster = cluster_from_dict(cluster_data, source=opts.cluster_file or "<discovered>")
        if env.rank == 0:
            log.info("discovered %d rank(s) on %d node(s): %s; link probe %.2f s", env.world_size,
                     len(topo.nodes), ", ".join(f"{t} x{cluster.devices_of_type(t)}"
                                                for t in cluster.type_names),
                     time.perf_counter() - t0)

        # -- profiling (or the cache) ---------------------------------------------------------
        tps = opts.tp_candidates or _search_tps(cluster, model, args, topo, env.world_size)
        emu_tag = [f"emu:{n}={t.speed}" for n, t in sorted(emu.types.items())] if emu else []
        tag = versions_tag([f"impl:{getattr(args, 'transformer_impl', '')}",
                            f"bf16:{bool(args.bf16)}", f"fp16:{bool(args.fp16)}", *emu_tag])
        cache_path = _profile_cache_path(opts, tag)
        from ..profiles import LayerProfile, ProfileKey

        sig = model.signature()
        needed = [ProfileKey(t, "decoder", tp, mbs, int(args.seq_length), sig)
                  for t in cluster.type_names for tp in tps for mbs in mbs_list]
        db = None
        cached = False
        if env.rank == 0:
            db = _load_cache(cache_path, opts.reprofile)
            cached = all((p := db.get(k)) is not None and p.source == "measured" for k in needed)
        cached = guarded("profile-cache", lambda: boot.broadcast_object(cached, "profile-cache"))
        stragglers: list[str] = []
        t0 = time.perf_counter()
        if cached:
            if env.rank == 0:
                log.info("profiles: all %d from the cache %s (no profiling)", len(needed), cache_path)
        else:
            dev = _torch_device(device)
            timings = guarded("profiling", lambda: profiler.profile_rank(
                args, tps, mbs_list, world_size=env.world_size, rank=env.rank, device=dev,
                iters=opts.profile_iters, checkpoint=boot.barrier))
            gathered = guarded("profiling-gather",
                               lambda: boot.all_gather_object(timings, "profiling-gather"))
            if env.rank == 0:
                assert db is not None
                aggs, stragglers = profiler.aggregate(dict(enumerate(gathered)),
                                                      {i.rank: i.device_type for i in infos})
                for a in aggs:
                    db.put(LayerProfile(ProfileKey(a.device_type, "decoder", a.tp, a.micro_batch_size,
                                                   int(args.seq_length), sig),
                                        a.forward_ms, a.backward_ms, a.activation_bytes,
                                        a.param_bytes, source="measured"))
                try:
                    db.save(cache_path)
                except PoseidonError as e:
                    log.warning("could not write the profile cache: %s", e)
                log.info("profiling: %d config(s) x %d rank(s) in %.2f s; cache %s", len(tps) *
                         len(mbs_list), env.world_size, time.perf_counter() - t0, cache_path)
                for a in aggs:
                    log.info("  %-12s tp=%d mbs=%d  fwd %8.2f ms  bwd %8.2f ms  act %6.1f MiB  "
                             "(median of %d)", a.device_type, a.tp, a.micro_batch_size, a.forward_ms,
                             a.backward_ms, a.activation_bytes / 2**20, a.ranks)
                for s in stragglers:
                    log.warning("straggler: %s", s)

        # -- calibrate the cluster's compute speed to the measurements (rank 0 searches) -------
        if env.rank == 0:
            assert db is not None
            cluster_data = discovery.calibrate(cluster_data, db, model, tps, mbs_list,
                                               int(args.seq_length), overrides,
                                               [i.device_type for i in infos
                                                if i.kind not in ("cuda", "npu")])
            cluster = cluster_from_dict(cluster_data, source=opts.cluster_file or "<discovered>")

        # -- search on rank 0, broadcast with checksum ----------------------------------------
        search_plan, plan_from_json = _planner()
        payload = None
        if env.rank == 0:
            def do_search() -> tuple[str, str]:
                t1 = time.perf_counter()
                kwargs: dict[str, Any] = dict(
                    global_batch_size=int(gbs), seq_length=int(args.seq_length), profiles=db,
                    pruning=opts.pruning, micro_batch_sizes=tuple(mbs_list),
                    max_virtual_stages=opts.max_virtual_stages, time_budget_s=opts.time_budget_s,
                    seed=opts.seed, tp_degrees=opts.tp_candidates or None,
                    workers=opts.search_workers or max(1, (os.cpu_count() or 1)
                                                       // max(1, env.local_world_size)))
                kwargs["schedules"] = _launch_schedules(opts.schedules)
                plan = search_plan(cluster, model, **kwargs)
                log.info("search: %.2f s", time.perf_counter() - t1)
                text = plan.to_json()
                return text, plan_checksum(text)
            payload = guarded("search", do_search)
        else:
            boot.phase("search")
        text, digest = guarded("plan-broadcast", lambda: boot.broadcast_object(payload, "plan-broadcast"))
        if plan_checksum(text) != digest:
            raise DistributedError(f"rank {env.rank}: the plan received from rank 0 fails its "
                                   "checksum (corrupted broadcast)")
        plan = plan_from_json(text)
        renum = renumber.renumber(plan.rank_order(), topo, env.world_size)
        new_argv = argvmod.rewrite_argv(argv, plan, backend)
        guarded("plan-verified", lambda: boot.barrier("plan-verified"))

        if env.rank == 0:
            if opts.save_plan:
                with open(opts.save_plan, "w", encoding="utf-8") as f:
                    f.write(text)
            _report(plan, renum, topo, script, new_argv, backend, stragglers,
                    time.perf_counter() - t_start, dry_run=opts.dry_run)

        # -- dry-run: everyone leaves before any model is built --------------------------------
        if opts.dry_run:
            guarded("dry-run", lambda: boot.barrier("dry-run"))
            boot.finish_probe()
            raise SystemExit(0)

        # -- apply ----------------------------------------------------------------------------
        guarded("apply", lambda: boot.barrier("apply"))
    except BaseException:
        if boot.probe_up:
            boot.finish_probe()
        raise

    if env.rank in renum.unused:
        boot.finish_probe()
        _out(f"[poseidon rank {env.rank}] this device ({topo.describe(env.rank)}) is not used by "
             f"the plan ({renum.world_size} of {env.world_size} devices train); exiting with 0")
        raise SystemExit(0)
    new_rank = renum.new_rank_of[env.rank]
    dist_backend = argvmod.flag_value(new_argv, "--distributed-backend") or (
        "hccl" if device.kind == "npu" else "nccl")
    timeout_min = float(getattr(args, "distributed_timeout_minutes", 10) or 10)
    boot.init_main(new_rank, renum.world_size, dist_backend, timeout_min)
    os.environ["POSEIDON_LAUNCH_RANK"] = str(env.rank)
    os.environ["POSEIDON_DEVICE_TYPE"] = me.device_type
    os.environ["RANK"] = str(new_rank)
    os.environ["WORLD_SIZE"] = str(renum.world_size)
    patch_dataset_helpers()
    if backend == "mindspeed-llm":
        sys.argv = [script, *new_argv]  # MindSpeed-LLM reads sys.argv
        argvmod.apply_mindspeed_llm(new_argv)
    log.info("launch rank %d -> rank %d of %d (stage %d); setup took %.2f s", env.rank, new_rank,
             renum.world_size, new_rank // max(1, renum.world_size // int(plan.pp)),
             time.perf_counter() - t_start)
    _install_calibration(plan, model, cache_path)
    return AutoResult(new_argv, new_rank, renum.world_size, plan)


def _install_calibration(plan: Any, model: Any, cache_path: str) -> None:
    """Live calibration (one log line predicted vs measured after the first iterations, measured
    per-layer times written back to the profile cache). ``POSEIDON_CALIBRATION=0`` turns it off;
    it never stops the training."""
    if os.environ.get("POSEIDON_CALIBRATION", "1") == "0":
        return
    try:
        from .calibration import install_calibration
        install_calibration(plan, model_signature=model.signature(), profile_db_path=cache_path)
    except Exception as exc:  # calibration is an observer: report, never fail the launch
        log.warning("calibration not installed: %s", exc)


# What Megatron's get_forward_backward_func can run: the plan may only pick these at launch.
LAUNCH_SCHEDULES = ("1f1b", "interleaved-1f1b")


def _launch_schedules(requested: Sequence[str]) -> tuple[str, ...]:
    if not requested:
        return LAUNCH_SCHEDULES
    bad = [s for s in requested if s not in LAUNCH_SCHEDULES]
    if bad:
        raise PoseidonError(f"--poseidon-schedules: Megatron can run {', '.join(LAUNCH_SCHEDULES)}; "
                            f"{', '.join(bad)} can only be planned offline (poseidon plan)")
    return tuple(requested)


def _torch_device(device: Any):
    import torch

    if device.kind in ("cuda", "npu"):
        return torch.device(device.kind, device.index)
    return torch.device("cpu")


def _search_tps(cluster: Any, model: Any, args: Any, topo: Any, world_size: int) -> tuple[int, ...]:
    """Every TP degree the search may pick for some device type (so none is only estimated)."""
    try:
        from ..search import tp_candidates
    except ImportError:
        return _default_tps(args, topo, world_size)
    out = sorted({t for name in cluster.type_names for t in tp_candidates(cluster, model, name)})
    return tuple(t for t in out if world_size % t == 0)


def _default_tps(args: Any, topo: Any, world_size: int) -> tuple[int, ...]:
    """Powers of two that fit in every node and divide heads, query groups and the world."""
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) \
        and args.num_query_groups else heads
    smallest_node = min(len(n) for n in topo.nodes)
    out = []
    t = 1
    while t <= smallest_node:
        if heads % t == 0 and groups % t == 0 and world_size % t == 0:
            out.append(t)
        t *= 2
    return tuple(out)


def _report(plan: Any, renum: Any, topo: Any, script: str, new_argv: list[str], backend: str,
            stragglers: list[str], setup_s: float, dry_run: bool) -> None:
    from . import renumber

    lines = ["", "=" * 78, f"Poseidon plan ({backend})", "=" * 78]
    table = plan.table() if hasattr(plan, "table") else None
    lines.append(table if table else repr(plan))
    lines += ["", "rank -> stage:"]
    lines += ["  " + s for s in renumber.stage_map(plan, renum, topo)]
    if stragglers:
        lines += ["", "stragglers (much slower than the rest of their device type):"]
        lines += ["  " + s for s in stragglers]
    lines += ["", "flags:", "  " + " ".join(_shell_quote(a) for a in argvmod.plan_flags(plan, backend)), "",
              "command line the script runs with:",
              "  " + " ".join(_shell_quote(a) for a in [script, *new_argv]),
              "", f"(planning took {setup_s:.1f} s)" + (" -- dry run: exiting before any model is "
                                                        "built" if dry_run else ""), "=" * 78, ""]
    _out("\n".join(lines))


def _shell_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def _fail(e: BaseException) -> int:
    rank = os.environ.get("POSEIDON_LAUNCH_RANK") or os.environ.get("RANK", "?")
    sys.stderr.write(f"[poseidon rank {rank}] error: {e}\n")
    sys.stderr.flush()
    return EXIT_USER_ERROR if isinstance(e, PoseidonError) and not isinstance(e, DistributedError) \
        else EXIT_FAILURE


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
    try:
        opts, rest = extract_options(rest)
        if opts.auto:
            result = plan_and_apply(script, rest, opts)
            rest = result.argv
    except SystemExit as e:
        return int(e.code or 0)
    except PoseidonError as e:
        return _fail(e)
    run_script(script, rest)
    return 0


def run_script(script: str, argv: list[str]) -> None:
    """Run the user's script unchanged as ``__main__`` with its directory on sys.path."""
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


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
    sys.argv = [script, *result.argv]
