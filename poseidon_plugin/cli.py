"""``poseidon`` command line: ``plan`` (offline search), ``profile`` (measure a layer into a profile
DB, or merge DBs; lazy torch) and ``validate`` (lazy).

Every PoseidonError (and every argument mistake) ends as one line
``poseidon: error: <message>`` on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

from .errors import PoseidonError
from .errors import check_writable as _check_writable   # the name cli's callers use
from .safeio import (bound_line, check_distinct, check_type_name, open_input,
                     write_atomic)
from .search.options import PRUNING_MODES, TYPE_ORDERS, SearchOptions
from .simulator.schedules import LAUNCHABLE_SCHEDULES, SCHEDULES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        raise PoseidonError(message)


_VERBOSE = ("-v", "--verbose")
_PLAN_EXAMPLE = """examples:
  poseidon plan --cluster examples/clusters/paper-setting1.yaml --model llama3-8b \\
      --global-batch-size 128 --seq-length 4096 --gantt plan.png
  poseidon plan --cluster my-cluster.yaml --model my-model.yaml --global-batch-size 512 \\
      --seq-length 4096 --profiles profiles.json --time-budget 60 --json --out plan.json

Stage times in the table (fwd/bwd/send ms) are per micro-batch; all-reduce is per iteration.
Bad input: one line "poseidon: error: ..." on stderr, exit status 2."""


def _words(values) -> str:
    return " ".join(str(v) for v in values)


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(*_VERBOSE, action="store_true", default=default,
                        help="debug logging on stderr (before or after the command)")


def _positive_finite_float(text: str) -> float:
    """argparse type: a finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _percent(text: str) -> float:
    """argparse type of ``--tie-tolerance`` and ``--keep-within`` (a percent, as a fraction)."""
    from .search.options import percent_option

    try:
        return percent_option("PCT", text)
    except PoseidonError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def _timeout_seconds(text: str) -> float:
    """argparse type of ``poseidon profile --timeout`` (the launch's --poseidon-timeout rule)."""
    from poseidon_plugin.megatron.launch.options import timeout_seconds

    return timeout_seconds("--timeout", text)


def _check_gantt_path(path: str) -> None:
    """What ``gantt.draw_gantt`` would refuse after the search, refused before it."""
    import importlib.util

    if os.path.splitext(path)[1].lower() not in (".png", ".svg"):
        raise PoseidonError(f"--gantt {path}: expected a file name ending in .png or .svg")
    if importlib.util.find_spec("matplotlib") is None:
        raise PoseidonError("--gantt needs matplotlib: pip install matplotlib")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="poseidon", description="Parallel-plan search for LLM pre-training on "
                "heterogeneous clusters.", epilog="poseidon plan --help: the options and an "
                "example.")
    _add_verbose(p, False)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_plan_parser(sub)
    _add_profile_parser(sub)
    va = sub.add_parser("validate", help="validate the simulator against real runs "
                        "(poseidon validate --help: its options)")
    _add_verbose(va, argparse.SUPPRESS)
    va.add_argument("args", nargs=argparse.REMAINDER,
                    help="the options of poseidon validate (see poseidon validate --help)")
    return p


def _add_plan_parser(sub) -> None:
    """``poseidon plan``: its inputs, then the search space, the search's control and the
    outputs."""
    from .model import PRESETS

    pl = sub.add_parser("plan", help="search the fastest plan for a cluster file and a model",
                        description="Search the fastest parallel plan (DP, PP, TP, schedule, "
                        "device type and layers\nper stage) and print it with the Megatron-LM "
                        "and MindSpeed-LLM flags and two\nbaselines.",
                        epilog=_PLAN_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_verbose(pl, argparse.SUPPRESS)   # SUPPRESS: "-v plan" is not reset by the sub-parser
    pl.add_argument("--cluster", required=True, metavar="FILE",
                    help="cluster YAML: device types, nodes, links (see examples/clusters/)")
    pl.add_argument("--model", required=True, metavar="NAME|FILE",
                    help=f"model preset ({', '.join(PRESETS)}) or a model YAML file")
    pl.add_argument("--global-batch-size", type=int, required=True, metavar="N",
                    help="global batch size in samples (sequences) per iteration")
    pl.add_argument("--seq-length", type=int, required=True, metavar="TOKENS",
                    help="sequence length in tokens")
    pl.add_argument("--profiles", default=None, metavar="FILE",
                    help="profile DB (JSON, e.g. from `poseidon profile`) of measured per-layer "
                    "times and memory; measured records win over the analytic estimator; an "
                    "error when none is usable unless --allow-estimates (default: estimates)")
    pl.add_argument("--allow-estimates", action="store_true",
                    help="plan on estimates when --profiles has no usable record")
    _add_setup_flags(pl)
    g = pl.add_argument_group("DP communication overlap (as the launch will train)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron's --overlap-grad-reduce: pipeline stage 0's DP gradient sync "
                   "runs in buckets during its last backward (non-interleaved plans)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Megatron's --overlap-param-gather (with --distributed-optimizer): "
                   "stage 0's parameter all-gather overlaps its first forward")
    g.add_argument("--ddp-bucket-size", type=int, default=0, metavar="PARAMS",
                   help="Megatron's --ddp-bucket-size: parameters per DP bucket under the "
                   "overlap (default 0: Megatron's max(4e7, 1e6 x dp))")
    pl.add_argument("--megatron-args", default="", metavar="FLAGS",
                    help="the Megatron-LM / MindSpeed-LLM flags the launch will run with, as one "
                    "quoted string (e.g. \"--no-overlap-p2p-communication --noop-layers 0\"): "
                    "what the framework refuses with them is not searched (the launch applies "
                    "the same rules; docs/search.md, 'Framework rules'), and the installed "
                    "Megatron's parse_args, validate_args and model-config build judge the "
                    "plan's flags with them (a refused configuration is searched again without)")
    _add_plan_search_space(pl)
    _add_plan_search_control(pl)
    _add_plan_outputs(pl)


def _add_plan_search_space(pl) -> None:
    """What ``poseidon plan`` searches: schedules, pruning, TP / CP / EP degrees, micro-batch
    sizes, virtual stages and device-type orders."""
    from .search.options import DEFAULT_MICRO_BATCH_SIZES

    pl.add_argument("--schedules", nargs="+", default=list(LAUNCHABLE_SCHEDULES),
                    choices=list(SCHEDULES), metavar="NAME",
                    help=f"schedules to search, of {_words(SCHEDULES)} (default: "
                    f"{_words(LAUNCHABLE_SCHEDULES)}, the "
                    "ones megatron-core executes; eager-1f1b and gpipe give analysis-only plans "
                    "without launch flags)")
    pl.add_argument("--pruning", choices=list(PRUNING_MODES), default="safe",
                    help="safe (default: exact; the ridge rule only where its theorem's "
                    "assumptions hold), ridge (the paper's ridge rule everywhere: may miss the "
                    "optimum, proves no bound, and turns the dominance memo off, so it is often "
                    "SLOWER than safe: 2x the nodes on paper setting 1 with per-stage TP), none (no ridge rule: the "
                    "exhaustive check)")
    g = pl.add_mutually_exclusive_group()
    g.add_argument("--uniform-tp", dest="tp_mode", action="store_const", const="uniform",
                   help="one TP degree for every stage (default; what stock Megatron-LM and "
                   "MindSpeed-LLM run)")
    g.add_argument("--per-stage-tp", dest="tp_mode", action="store_const", const="per-stage",
                   help="a TP degree per stage (analysis only: needs a FlagScale-style Megatron)")
    pl.set_defaults(tp_mode="uniform")
    pl.add_argument("--micro-batch-sizes", type=int, nargs="+", default=None, metavar="B",
                    help="micro-batch sizes in samples to try (default: "
                    f"{_words(DEFAULT_MICRO_BATCH_SIZES)})")
    pl.add_argument("--tp", dest="tp_degrees", type=int, nargs="+", default=None,
                    metavar="T", help="TP degrees allowed (default: every valid one)")
    cpg = pl.add_mutually_exclusive_group()
    cpg.add_argument("--cp", dest="cp", type=int, nargs="+", default=None, metavar="C",
                     help="context-parallel degrees allowed (default: 1; each divides the "
                     "sequence into 2 x C chunks)")
    cpg.add_argument("--search-cp", action="store_true",
                     help="search context parallelism: 1 and every power of two up to 64 "
                     "that divides the sequence into 2 x CP chunks")
    ge = pl.add_mutually_exclusive_group()
    ge.add_argument("--ep", dest="ep_degrees", type=int, nargs="+", default=None, metavar="N",
                    help="expert-parallel degrees allowed (a MoE model; default: every valid "
                    "one: EP divides the DP degree and the experts; a dense model has EP 1)")
    ge.add_argument("--search-ep", dest="ep_degrees", action="store_const", const=None,
                    help="search every valid expert-parallel degree (the default)")
    pl.add_argument("--max-virtual-stages", type=int, default=2, metavar="V",
                    help="most model chunks per device for interleaved-1f1b (default: "
                    "%(default)s)")
    pl.add_argument("--type-order", choices=list(TYPE_ORDERS), default="any",
                    help="device-type orders searched: any (default: every order, exact), "
                    "blocks (contiguous type blocks only), auto (blocks where a configuration "
                    "has more than 3^20 orders); a restricted space is named in the output")


def _add_plan_search_control(pl) -> None:
    """How ``poseidon plan`` searches: the warm-up, the budget, ties, a kept plan, threads and
    processes, the runner-up and the baselines."""
    pl.add_argument("--warmup-samples", type=int, default=500, metavar="N",
                    help="at most N random feasible plans seed the search's threshold "
                    "(default: %(default)s; 0: none; it stops after 100 draws in a row without a "
                    "faster plan); speed only, the exact plan does not depend on it")
    pl.add_argument("--time-budget", type=_positive_finite_float, default=None, metavar="S",
                    help="wall-clock budget in seconds for everything after the command line "
                    "(loading, the baselines, the search, the runner-up, --gantt): the best plan "
                    "found by then, with its gap to the proven lower bound; a phase cut short "
                    "says so (default: none, search to the end)")
    pl.add_argument("--tie-tolerance", type=_percent, default=0.0, metavar="PCT",
                    help="trade up to PCT %% of speed for the simplest plan: the preferred "
                    "plan among those within PCT %% of the fastest (fewest stages, no "
                    "interleaving, smaller TP, larger micro-batch, then device types by name and "
                    "fewest layers stage by stage; default: 0, the fastest plan)")
    pl.add_argument("--keep", default=None, metavar="PLAN_JSON",
                    help="a previous plan (the JSON of --out / --poseidon-save-plan): returned "
                    "instead of the fastest while it is within --keep-within of it under these "
                    "costs (a re-plan after new profiles keeps its layout through noise)")
    pl.add_argument("--keep-within", type=_percent, default=0.02, metavar="PCT",
                    help="the window of --keep in percent of the fastest plan (default: 2)")
    pl.add_argument("--workers", type=int, default=None, metavar="K",
                    help="search threads (default: every core); the plan does not depend on it")
    pl.add_argument("--distributed", action="store_true",
                    help="share the search among the processes of a torchrun launch "
                    "(torchrun --nproc-per-node K [--nnodes ...] -m poseidon_plugin plan "
                    "--distributed ...): the same plan and bound, rank 0 prints it; "
                    "default --workers: a host's cores / its processes")
    pl.add_argument("--seed", type=int, default=0, metavar="N",
                    help="seed of the warm-up sampling (default: %(default)s); the exact plan "
                    "does not depend on it")
    pl.add_argument("--no-runner-up", action="store_true",
                    help="skip the runner-up: by default, after the search, the fastest plan "
                    "of any other configuration (schedule, PP, DP, TP, micro-batch) and its "
                    "margin over this one are found and shown (how sure the choice is; a "
                    "near-tie under 2%%)")
    pl.add_argument("--no-baselines", action="store_true",
                    help="skip the two baselines (Megatron's even split over all devices; the "
                    "best plan on one device type: a search per type, each under --time-budget);"
                    " the JSON then marks them skipped")


def _add_plan_outputs(pl) -> None:
    """What ``poseidon plan`` writes: the JSON, a file, the Gantt chart."""
    pl.add_argument("--json", action="store_true",
                    help="print the plan as JSON (baselines included) instead of the table")
    pl.add_argument("--out", default=None, metavar="FILE",
                    help="also write the plan JSON (baselines included) to FILE")
    pl.add_argument("--gantt", default=None, metavar="FILE",
                    help="draw the simulated schedule of the plan (.png or .svg): a row per "
                    "stage, idle time, the critical path")


def _add_profile_parser(sub) -> None:
    pr = sub.add_parser(
        "profile", help="measure the model's layer on this machine's device into a profile DB",
        description="Time the model's decoder layer (megatron-core, built from the model spec "
        "and the training setup) on this machine's devices for each TP degree and micro-batch "
        "size and merge the measured records into -o DB (one device type per run). One "
        "process measures TP 1; for TP > 1 run it under torchrun, one process per device: "
        "torchrun --nproc-per-node 4 -m poseidon_plugin profile ... --tp 1 2 4 (real TP "
        "groups; rank 0 writes the DB). "
        "Or merge DBs from several machines: --merge a.json b.json -o db.json.")
    pr.add_argument("-o", "--out", required=True, metavar="DB",
                    help="profile DB to write (records merged into it when it exists)")
    pr.add_argument("--merge", nargs="+", metavar="DB", default=None,
                    help="merge these DBs into -o instead of profiling")
    pr.add_argument("--model", help="model preset name or YAML file")
    pr.add_argument("--seq-length", type=int)
    pr.add_argument("--device-type", metavar="NAME",
                    help="this device's type name, as the cluster file calls it")
    pr.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1])
    pr.add_argument("--tp", type=int, nargs="+", default=[1], metavar="T",
                    help="TP degrees (default 1); each must divide the processes per node "
                    "(torchrun --nproc-per-node) and the model's attention heads")
    pr.add_argument("--ep", type=int, nargs="+", default=[1], metavar="E",
                    help="a MoE layer is profiled as one rank of each EP degree runs it (its "
                    "experts / E local experts, the tokens balanced routing sends them; one "
                    "device suffices); default 1")
    pr.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto",
                    help="auto: CUDA, then NPU, else CPU (megatron-core under CPU shims)")
    pr.add_argument("--iters", type=int, default=5, help="timed repetitions per config")
    pr.add_argument("--timeout", type=_timeout_seconds, default=300.0, metavar="S",
                    help="under torchrun: seconds a rank waits for the others at each step "
                    "before it names the ones missing and stops (default %(default)g)")
    _add_setup_flags(pr, attention_default=None)


def _add_setup_flags(p: argparse.ArgumentParser, attention_default: str | None = "flash"
                     ) -> None:
    """The training setup (``training.TrainingSetup``): what moves memory and time."""
    from .training import ATTENTION, GRAD_DTYPES, PARAM_DTYPES, RECOMPUTE

    g = p.add_argument_group("training setup (as the launch will train)")
    g.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recompute (Megatron's --recompute-granularity; default none)")
    g.add_argument("--distributed-optimizer", action="store_true",
                   help="optimizer state sharded over DP (--use-distributed-optimizer)")
    g.add_argument("--params-dtype", choices=PARAM_DTYPES, default="bf16",
                   help="weights and activations (default bf16)")
    g.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="main gradients and the DP all-reduce (default fp32, as Megatron does "
                   "for bf16 unless --grad-reduce-in-bf16)")
    g.add_argument("--attention", choices=ATTENTION, default=attention_default,
                   help="flash (fused) or unfused (keeps the s x s scores: Megatron's local "
                   "spec); default " + (attention_default or "unfused on the CPU, flash on a "
                                        "GPU / NPU"))


def training_setup(ns, attention: str | None = None):
    from .training import TrainingSetup

    return TrainingSetup(recompute=ns.recompute, distributed_optimizer=ns.distributed_optimizer,
                         params_dtype=ns.params_dtype, grad_dtype=ns.grad_dtype,
                         attention=attention or ns.attention,
                         overlap_grad_reduce=getattr(ns, "overlap_grad_reduce", False),
                         overlap_param_gather=getattr(ns, "overlap_param_gather", False),
                         ddp_bucket_size=getattr(ns, "ddp_bucket_size", 0))


def search_options(ns) -> SearchOptions:
    """The one ``SearchOptions`` of a ``poseidon plan`` command line (validated there)."""
    return SearchOptions(
        global_batch_size=ns.global_batch_size, seq_length=ns.seq_length,
        schedules=tuple(ns.schedules), pruning=ns.pruning, tp_mode=ns.tp_mode,
        tp_degrees=ns.tp_degrees, micro_batch_sizes=ns.micro_batch_sizes,
        expert_parallel=getattr(ns, "ep_degrees", None),
        max_virtual_stages=ns.max_virtual_stages, type_order=ns.type_order,
        warmup_samples=ns.warmup_samples, seed=ns.seed, time_budget_s=ns.time_budget,
        workers=ns.workers, progress=sys.stderr.isatty() or bool(ns.verbose),
        tie_tolerance=ns.tie_tolerance, keep_tolerance=ns.keep_within,
        runner_up=not ns.no_runner_up, training=training_setup(ns),
        context_parallel=(SearchOptions.search_cp_degrees(ns.seq_length) if ns.search_cp
                          else ns.cp))


def _cmd_plan(ns) -> int:
    from .search import search_plan

    if not ns.distributed:
        return _plan(ns, search_plan)
    from poseidon_plugin.megatron.launch.search_transport import searchers_from_environ, wait_seconds

    _check_plan_inputs(ns)   # every rank, before it waits for the others
    _LEAVE_AT_ONCE.append(True)
    with searchers_from_environ(workers=ns.workers,
                                timeout_s=wait_seconds(ns.time_budget)) as group:
        if not group.coordinator:
            group.serve()      # this process's share of every search rank 0 starts
            return 0
        return _plan(ns, group.search)


def _check_plan_inputs(ns) -> None:
    """The options, the cluster and the model read (their one-line errors) before a
    distributed search's rendezvous: a bad input is refused at once, not after the wait."""
    from .cluster import load_cluster
    from .model import get_model

    search_options(ns)
    load_cluster(ns.cluster)
    get_model(ns.model)


def _plan(ns, search_plan) -> int:
    from .cluster import load_cluster
    from .model import get_model

    options = search_options(ns)
    for flag, path in (("--out", ns.out), ("--gantt", ns.gantt)):
        if path:
            _check_writable(flag, path)
    check_distinct((("--out", ns.out), ("--gantt", ns.gantt)),
                   (("--cluster", ns.cluster), ("--model", _model_file(ns.model)),
                    ("--profiles", ns.profiles), ("--keep", ns.keep)))
    if ns.gantt:
        _check_gantt_path(ns.gantt)
    previous = _read_previous_plan(ns.keep) if ns.keep else None
    budget = _Budget(ns.time_budget, share=0.0 if ns.no_baselines else BASELINE_SHARE,
                     reserve=GANTT_RESERVE_S if ns.gantt else 0.0)
    cluster = load_cluster(ns.cluster)
    model = get_model(ns.model)
    options = options.replace(rules=framework_rules(ns.megatron_args, model.num_layers,
                                                    moe=model.is_moe))
    model = users_dispatcher(model, ns.megatron_args)
    if ns.megatron_args and model.is_moe:   # judged by the installed Megatron: its rule too
        from poseidon_plugin.megatron.launch import judge

        options = options.replace(moe_free_stages=judge.installed_trains_moe_free_stages())
    model_note = model.planning_note()   # what is not yet costed (the user's dispatcher)
    if model_note:
        sys.stderr.write(f"poseidon: warning: {bound_line(model_note)}\n")
    profiles = None
    if ns.profiles:
        profiles = _load_profiles(ns, cluster, model, options)
        from .profile_checks import check_profiles
        check_profiles(profiles, cluster, model)
    from .profiles import calibrate_cluster
    cluster = calibrate_cluster(cluster, profiles, model, options.seq_length, options.training)
    # the baselines first: they seed the search's incumbent (the plan is never slower than one
    # that lies in the searched space)
    results = None if ns.no_baselines else _baseline_results(cluster, model, budget, options,
                                                             profiles)
    seeds = [(name, p) for name, p in (results or {}).items() if not isinstance(p, str)]
    def search(opts):
        return search_plan(cluster, model, budget.search_options(opts), profiles,
                           previous=previous, seeds=seeds)

    plan = _judged(search, options, ns.megatron_args, model) if ns.megatron_args \
        else search(options)
    for line in plan.search.get("excluded", ()):
        sys.stderr.write(f"poseidon: note: {bound_line(line)}\n")
    plan = plan.with_baselines(_baselines(results, plan))
    from .profiles import scaled_estimate_note
    note = scaled_estimate_note(plan, profiles, model, options.seq_length, options.training)
    if note:
        sys.stderr.write(f"poseidon: note: {bound_line(note)}\n")
    if previous is not None:   # what changed since the kept plan (the relaunch's line, offline)
        from poseidon_plugin.megatron.checkpoint.change import kept_plan_summary
        sys.stderr.write(f"poseidon: note: since {ns.keep}: "
                         f"{kept_plan_summary(previous, cluster, plan)}\n")
    _warn_mfu(plan, cluster)
    text = plan.to_json()
    if ns.gantt:
        _draw_plan_gantt(plan, ns.gantt, budget.end)
    if ns.out:
        try:
            write_atomic(ns.out, text)
        except OSError as exc:
            raise PoseidonError(f"--out {ns.out}: cannot write ({exc.strerror})") from None
    if ns.json:
        sys.stdout.write(text)
        return 0
    sys.stdout.write(plan.table(verbose=bool(ns.verbose)))
    origin = _origin_line(plan.search)
    if origin:
        sys.stdout.write(origin + "\n")
    if not ns.no_baselines:
        sys.stdout.write("".join(_baseline_line(e) + "\n" for e in plan.baselines))
    return 0


def users_dispatcher(model, text: str):
    """``model`` with the token dispatcher ``--megatron-args`` chooses (a MoE model): the plan's
    flags keep it and the costs price it (``flex`` and ``alltoall_seq`` as ``alltoall``:
    ``Model.planning_note`` says so); without one, the model's (``alltoall``)."""
    import shlex
    from dataclasses import replace

    from poseidon_plugin.megatron.launch.argv import DISPATCHER_FLAG, flag_value
    from .model import MOE_DISPATCHERS

    value = flag_value(shlex.split(text or ""), DISPATCHER_FLAG)
    if value is None or not model.is_moe:
        return model
    if value not in MOE_DISPATCHERS:
        raise PoseidonError(f"--megatron-args: {DISPATCHER_FLAG} {value!r}: expected one of "
                            f"{', '.join(MOE_DISPATCHERS)}")
    return replace(model, moe_token_dispatcher_type=value)


def _judged(search, options, text: str, model):
    """``--megatron-args``: the fastest plan the installed Megatron accepts, its parse_args,
    validate_args and model-config build run on the model's flags, the setup's, the user's and
    the plan's (``megatron/launch/judge.py``); a refused configuration is searched again without."""
    import shlex

    from poseidon_plugin.megatron.launch import judge

    tokens = shlex.split(text)   # framework_rules split it already

    def refusal(plan):
        if not plan.executable:   # analysis-only plans have no flags to judge
            return None
        return judge.plan_refusal(plan, model, options.seq_length, options.training, tokens)

    return judge.search_accepted(search, options, refusal)


def _warn_mfu(plan, cluster) -> None:
    """One ``poseidon: warning:`` line where the plan's MFU is above 100 %."""
    warning = plan.mfu_warning({t: dt.peak_tflops for t, dt in cluster.device_types.items()})
    if warning:
        sys.stderr.write(f"poseidon: warning: {bound_line(warning)}\n")


def framework_rules(text: str, num_layers: int, moe: bool = False):
    """``--megatron-args "..."``: the framework's rules (``search/rules.py``) its flags imply.
    ``moe``: the model has MoE layers; with flags given and no ``--sequence-parallel`` among
    them the plan keeps MoE at TP 1, as the launch does (no flags: nothing is assumed)."""
    import shlex

    from .search.rules import FrameworkRules

    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise PoseidonError(f"--megatron-args: cannot split {text!r} ({exc})") from None
    launch_refusals(tokens)
    return FrameworkRules.from_argv(tokens, num_layers=num_layers, moe=moe and bool(tokens))


def launch_refusals(tokens: list[str]) -> None:
    """What the launch refuses in these flags (``argv.check_refused``: checkpoint args, YAML
    configs, expert TP, CP algorithms, ``--moe-layer-freq``; layers the planner does not model),
    refused here the same way: a plan for flags the launch would not run is no plan."""
    from poseidon_plugin.megatron.launch.argv import check_refused, find_flag
    from .model import unmodelled_flag_refusal

    try:
        check_refused(tokens)
        why = unmodelled_flag_refusal(lambda flag: find_flag(tokens, flag))
        if why is not None:
            raise PoseidonError(why)
    except PoseidonError as exc:
        raise PoseidonError(f"--megatron-args: {exc} (the launch refuses it too)") from None


def _model_file(name: str) -> str | None:
    """``--model``'s file (None for a preset name)."""
    from .model import PRESETS

    return None if name in PRESETS else name


def _read_previous_plan(path: str):
    """``--keep FILE``: the plan JSON read back, or a one-line error naming the file."""
    from .plan import Plan

    try:
        with open_input(path, "--keep") as f:   # a FIFO: refused, not waited on
            text = f.read(64 << 20).decode("utf-8")
    except OSError as exc:
        raise PoseidonError(f"--keep {path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise PoseidonError(f"--keep {path}: not UTF-8 text") from None
    try:
        plan = Plan.from_json(text)
        for i, stage in enumerate(plan.stages):   # echoed in notes: the cluster YAML's rule
            check_type_name(stage.device_type, f"stages[{i}].device_type")
        return plan
    except PoseidonError as exc:
        raise PoseidonError(f"--keep {path}: {exc}") from None


def _baseline_results(cluster, model, budget, options, profiles) -> dict:
    """The two baselines (``search.baseline_results``: a Plan or why none), within their share
    of the budget."""
    from .search import baseline_results

    opts, end = budget.baseline_options(options)
    return baseline_results(cluster, model, opts, profiles, deadline=end)


def _baselines(results, plan) -> tuple[dict, ...]:
    """The JSON entries of the two baselines (marked skipped under --no-baselines); one that
    lies outside the searched space says so (the search could not offer it as a plan)."""
    from .search import baseline_entries, skipped_baseline_entries

    if results is None:
        return skipped_baseline_entries()
    entries = baseline_entries(results, plan.predicted_iteration_time_ms)
    seeds = plan.search.get("seeds", {})
    return tuple(dict(e, note=seeds[e["name"]]) if isinstance(seeds.get(e["name"]), str)
                 else e for e in entries)


def _baseline_line(e: dict) -> str:
    from .search.baselines import CUT

    if e["status"] != "ok":
        reason = e["reason"] or ""
        if reason.startswith(CUT):
            return f"baseline {e['name']}: {reason}"
        what = ("none found in its share of the time budget"
                if "ran out before any plan was found" in reason
                else "no feasible plan")
        return f"baseline {e['name']}: {what}: {reason}"
    speedup = "n/a" if e["speedup"] is None else f"{e['speedup']:.2f}"
    return (f"baseline {e['name']}: {e['predicted_iteration_time_ms']:.2f} ms (pp={e['pp']}, "
            f"dp={e['dp']}, tp={e['tp'] or 'per-stage'}) -> speed-up x{speedup}"
            + (f" ({e['note']})" if e.get("note") else "")
            + (f" ({CUT}: {e['cut']})" if e.get("cut") else ""))


ORIGINS = {"construction": "the best constructed plan", "polish": "the best plan of the "
           "local search from the constructed plans", "warm-up": "the best random plan of the "
           "warm-up", "uniform-TP seed": "the uniform-TP search's plan"}


def _origin_line(s: dict) -> str:
    """Where the search's time ran out before its tree found the plan: what the plan is (the
    best constructed plan, a baseline, ...), one line; "" otherwise."""
    origin = s.get("plan_origin", "")
    if not s.get("timed_out") or origin in ("", "search", "tie rule", "previous plan"):
        return ""
    what = ORIGINS.get(origin, f"{origin}'s plan (no faster plan found)"
                       if origin.startswith("baseline ") else origin)
    return (f"plan found by: {what}: the time budget ran out before the search found a faster "
            f"one")


BASELINE_SHARE = 0.15  # of a --time-budget left after loading: the baselines; the rest: search
BASELINE_OVERRUN_S = 0.5  # a baseline with no plan at its share's end looks on this long, then
                          # is cut (a budget of 1e-9 still prints the baselines it can find)
GANTT_SLACK_S = 0.5    # --gantt may end this long after --time-budget (the run: within 1 s)
MIN_BUDGET_S = 0.05    # a phase whose share ran out still gets this (it returns its best so far)
GANTT_RESERVE_S = 2.5  # of a --time-budget kept for drawing --gantt after the search (405B
                       # pp=63 M=1024: 2.2 CPU-s, matplotlib's import included)


class _Budget:
    """``--time-budget`` covers everything after parsing: loading, the baselines (``share`` of
    what is left when they start), the search (the rest, less ``reserve`` for the Gantt chart
    drawn after it)."""

    def __init__(self, seconds: float | None, share: float, reserve: float = 0.0) -> None:
        self.share, self.reserve = share, reserve
        self.end = None if seconds is None else time.monotonic() + seconds

    def _left(self) -> float:
        return max(MIN_BUDGET_S, self.end - self.reserve - time.monotonic())

    def search_options(self, options: SearchOptions) -> SearchOptions:
        if self.end is None:
            return options
        return options.replace(time_budget_s=self._left())

    def baseline_options(self, options: SearchOptions) -> tuple[SearchOptions, float | None]:
        """The baselines' options and deadline (``time.monotonic()``)."""
        options = options.replace(progress=False)
        if self.end is None:
            return options, None
        s = max(MIN_BUDGET_S, self.share * self._left())
        return (options.replace(time_budget_s=s, overrun_s=BASELINE_OVERRUN_S),
                time.monotonic() + s)


def _load_profiles(ns, cluster, model, options):
    """The DB, one warning line naming why records are unusable; an error when none is usable
    unless ``--allow-estimates``."""
    from .profiles import ProfileDB, diagnose

    db = ProfileDB.load(ns.profiles)
    usable, warning = diagnose(db, cluster, model, options.seq_length, options.training)
    if usable == 0 and not ns.allow_estimates:
        why = f" ({warning})" if warning else ""
        raise PoseidonError(f"--profiles {ns.profiles}: no measured record is usable for this "
                            f"plan{why}; profile this model and setup with `poseidon profile`, "
                            f"or pass --allow-estimates")
    if warning:
        sys.stderr.write(f"poseidon: warning: {bound_line(warning)}\n")
    return db


MAX_GANTT_BOXES = 1 << 15   # forward/backward boxes drawn by --gantt (2 x PP x V x M), within
# GANTT_RESERVE_S: a plan with more is drawn for fewer M (a 14-inch chart shows no more). PP 2,
# M 65,536 on a 2-core host at load ~25: 27 CPU-s and 763 MB unbounded, ~2 CPU-s and 163 MB


def gantt_microbatches(pp: int, virtual_stages: int, num_microbatches: int) -> int:
    """The micro-batches ``--gantt`` draws: all of them while the chart has at most
    ``MAX_GANTT_BOXES`` boxes, else the most that fit, a multiple of PP (the schedule's warm-up,
    steady state and cool-down all show; interleaving needs it); 0: not even PP fit."""
    per_microbatch = 2 * pp * virtual_stages
    if per_microbatch * num_microbatches <= MAX_GANTT_BOXES:
        return num_microbatches
    fit = MAX_GANTT_BOXES // per_microbatch // pp * pp
    return min(fit, num_microbatches)


def gantt_seconds(boxes: int) -> float:
    """What drawing a chart of ``boxes`` boxes is taken to cost (GANTT_RESERVE_S at the most
    boxes; matplotlib's import about 0.5 s)."""
    return 0.5 + (GANTT_RESERVE_S - 0.5) * boxes / MAX_GANTT_BOXES


def _draw_plan_gantt(plan, path: str, end: float | None = None) -> None:
    """``end`` (``time.monotonic()``, the --time-budget's): a chart that would end more than
    GANTT_SLACK_S after it is not drawn (a note says so)."""
    from .gantt import draw_gantt, plan_stage_labels
    from .simulator import simulate_pipeline

    m = gantt_microbatches(plan.pp, plan.virtual_stages, plan.num_microbatches)
    if m == 0:
        sys.stderr.write(f"poseidon: note: --gantt {path}: not drawn: PP={plan.pp} x "
                         f"V={plan.virtual_stages} is more than the {MAX_GANTT_BOXES} boxes a "
                         f"chart draws even for {plan.pp} micro-batches\n")
        return
    need = gantt_seconds(2 * plan.pp * plan.virtual_stages * m)
    if end is not None and time.monotonic() + need > end + GANTT_SLACK_S:
        left = max(0.0, end - time.monotonic())
        sys.stderr.write(f"poseidon: note: --gantt {path}: not drawn: cut at the time budget "
                         f"({left:.1f} s of --time-budget left, the chart takes about "
                         f"{need:.1f} s)\n")
        return
    F, B, Pf, Pb, R = plan.simulator_inputs()
    if plan.schedule == "interleaved-1f1b":
        # the search timed it as megatron-core runs it (bundled p2p calls): draw that schedule
        import numpy as np

        from .simulator.engine import EngineCosts, simulate_engine
        timeline = simulate_engine(EngineCosts.from_profiles(F, B, Pf, R, np.zeros(len(R))),
                                   m, plan.schedule, plan.virtual_stages)
        timeline = timeline.with_label("predicted (as megatron-core runs it)")
    else:
        timeline = simulate_pipeline(F, B, Pf, Pb, R, m, plan.schedule,
                                     plan.virtual_stages).with_label("predicted")
    shown = (f"M={m}" if m == plan.num_microbatches else
             f"drawn for M={m} (the plan's M={plan.num_microbatches})")
    title = (f"{plan.model_name} on {plan.cluster_name}: {plan.schedule}, PP={plan.pp}, "
             f"DP={plan.dp}, {shown}")
    draw_gantt([timeline], path, title=title, stage_labels=plan_stage_labels(plan))
    if m < plan.num_microbatches:
        sys.stderr.write(f"poseidon: note: --gantt {path}: drawn as a pipeline of {m} "
                         f"micro-batches, not the plan's {plan.num_microbatches} (at most "
                         f"{MAX_GANTT_BOXES} boxes; the steady state repeats)\n")
    sys.stderr.write(f"poseidon: wrote {path}\n")


MAX_PROFILE_REPETITIONS = 10_000   # timed repetitions of one `poseidon profile` run: --iters x
                                   # (micro-batch sizes x TP x EP degrees); the default is 5 x 1


def _check_profile_sizes(ns) -> None:
    """``poseidon profile``'s integers, bounded before anything is built: the sequence length and
    the micro-batch sizes as ``poseidon plan`` bounds them (``search/options.py``), ``--iters`` as
    the launch's ``--poseidon-profile-iters``, and the run's total timed repetitions (``--tp``:
    ``check_tps``)."""
    from poseidon_plugin.megatron.launch.options import MAX_PROFILE_ITERS
    from .search.options import MAX_GLOBAL_BATCH_SIZE, MAX_SEQ_LENGTH

    for name, values, limit in (("--micro-batch-sizes", ns.micro_batch_sizes,
                                 MAX_GLOBAL_BATCH_SIZE),
                                ("--seq-length", [ns.seq_length], MAX_SEQ_LENGTH),
                                ("--iters", [ns.iters], MAX_PROFILE_ITERS),
                                ("--ep", ns.ep, None)):
        if any(v < 1 for v in values):
            raise PoseidonError(f"{name}: expected integers >= 1, got {values}")
        if limit is not None and any(v > limit for v in values):
            raise PoseidonError(f"{name}: expected integers <= {limit}, got {values}")
    configs = len(set(ns.micro_batch_sizes)) * len(set(ns.tp)) * len(set(ns.ep))
    if configs * ns.iters > MAX_PROFILE_REPETITIONS:
        raise PoseidonError(f"--iters {ns.iters} x {configs} configurations (micro-batch sizes x "
                            f"--tp x --ep) = {configs * ns.iters} timed repetitions; expected at "
                            f"most {MAX_PROFILE_REPETITIONS}: fewer --iters or fewer sizes")


def _out_of_memory(exc: BaseException, ns) -> PoseidonError | None:
    """A device or host allocation failure while profiling as one line (the sizes to lower);
    None for any other error."""
    import re

    text = str(exc)
    if not (isinstance(exc, MemoryError) or "out of memory" in text.lower()
            or "can't allocate memory" in text):
        return None
    tried = re.search(r"(?:tried|Tried) to allocate ([0-9.]+ ?\w+)", text)
    what = f" (tried to allocate {tried.group(1)})" if tried else ""
    return PoseidonError(f"out of memory profiling --seq-length {ns.seq_length} at micro-batch "
                         f"sizes {_words(ns.micro_batch_sizes)} on --device {ns.device}{what}: "
                         f"profile a shorter sequence or smaller micro-batches")


def _framework_failure(exc: BaseException, model) -> PoseidonError | None:
    """A failure of megatron-core's own layer code this model's settings are known to cause,
    as one line naming the setting (None for any other error). megatron-core 0.15-0.19's
    experts with bias at TP 1 and EP 1 add their bias in place on a view autograd forbids
    (``MLP.forward``: ``output += output_bias ...``; 0.12 did not)."""
    if ("is a view and is being modified inplace" in str(exc) and model.is_moe
            and model.add_bias_linear):
        return PoseidonError(
            f"model {model.name}: megatron-core's MoE experts with bias (add_bias_linear, "
            "Megatron's default) fail in its own forward at TP 1 and EP 1 (an in-place bias add "
            "on a view, megatron-core 0.15 and later): set add_bias_linear: false (Megatron's "
            "--disable-bias-linear, which its grouped-GEMM experts require too), or profile "
            "the MoE layers at --ep > 1")
    return None


def _cmd_profile(ns) -> int:
    from poseidon_plugin.megatron.profile import offline
    from poseidon_plugin.megatron.profile.profile_tps import Processes, check_tps

    procs = Processes.from_environ()   # torchrun's ranks, or one process
    # -o naming an input would write the DB over it (-o is merged into already: not in --merge)
    check_distinct((("-o", ns.out),), [("--model", _model_file(ns.model) if ns.model else None)]
                   + [("--merge", path) for path in ns.merge or ()])
    if ns.merge:
        if procs.rank != 0:   # under torchrun rank 0 merges
            return 0
        total = offline.merge_files(ns.merge, ns.out)
        sys.stderr.write(f"poseidon: merged {len(ns.merge)} DB(s) into {ns.out} "
                         f"({total} records)\n")
        return 0
    missing = [f for f, v in (("--model", ns.model), ("--seq-length", ns.seq_length),
                              ("--device-type", ns.device_type)) if v is None]
    if missing:
        raise PoseidonError(f"poseidon profile needs {', '.join(missing)} (or --merge DB...)")
    from .errors import short_repr
    from .profiles import key_string_error

    why = key_string_error(ns.device_type)   # the DB loader's rule, before any profiling
    if why is not None:
        raise PoseidonError(f"--device-type: expected {why}, got {short_repr(ns.device_type)}")
    _check_profile_sizes(ns)
    check_type_name(ns.device_type, "--device-type")   # the cluster YAML's name rule
    from .model import get_model

    model = get_model(ns.model)
    check_tps(ns.tp, procs, model)   # before torch is imported
    if procs.rank == 0:
        _check_writable("-o", ns.out)
    attention = ns.attention or ("unfused" if ns.device == "cpu" else None)
    if attention is None:   # auto device: decided by what torch sees
        attention = "flash" if offline._pick_device("auto") != "cpu" else "unfused"
    setup = training_setup(ns, attention)
    req = offline.ProfileRequest(model=model, seq_length=ns.seq_length,
                                 device_type=ns.device_type,
                                 micro_batch_sizes=tuple(ns.micro_batch_sizes),
                                 tps=tuple(ns.tp), setup=setup, device=ns.device,
                                 iters=ns.iters, timeout_s=ns.timeout,
                                 eps=tuple(sorted(set(ns.ep))))
    from poseidon_plugin.megatron.profile.profile_output import ProgressLines

    if procs.rank == 0:
        _warn_large_cpu_profile(req, attention)
    calls: list = []
    try:
        records = offline.profile_layers(req, procs, calls,
                                         progress=ProgressLines() if procs.rank == 0 else None)
    except (MemoryError, RuntimeError) as exc:   # torch's OutOfMemoryError is a RuntimeError
        raise _out_of_memory(exc, ns) or _framework_failure(exc, model) or exc from None
    if records is None:   # a torchrun rank other than 0: rank 0 writes
        return 0
    stored, total = offline.write_profiles(records, ns.out, calls)
    for c in calls:
        if not hasattr(c, "link"):   # callcosts.OpOverhead
            print(f"op overhead {c.device_type}: forward {c.forward_ms:.3f} ms, backward "
                  f"{c.backward_ms:.3f} ms (megatron-core's forward_step / backward_step)")
            continue
        print(f"p2p call {c.device_type} {c.link} {c.message_bytes} bytes: send "
              f"{c.send_call_ms:.3f} ms, receive ready {c.recv_ready_ms:.3f} ms, latency "
              f"{c.latency_ms:.3f} ms")
    from poseidon_plugin.megatron.profile.profile_gather import kind_signatures

    kind_of = {sig: name for name, sig in kind_signatures(req.model).items() if name}
    for r in records:
        kind = f" ({kind_of[r.key.model_signature]} layers)" \
            if r.key.model_signature in kind_of else ""
        if getattr(r.key, "ep", 1) > 1:
            kind += f" (one rank of EP {r.key.ep})"
        sys.stdout.write(f"{r.key.describe()}{kind}: forward {r.forward_ms:.3f} ms, backward "
                         f"{r.backward_ms:.3f} ms, activations {r.activation_bytes / 2**20:.2f} "
                         f"MiB, params {r.param_bytes / 2**20:.2f} MiB\n")
    sys.stderr.write(f"poseidon: wrote {stored} measured record(s) to {ns.out} ({total} "
                     f"records); plan with --attention {setup.attention} --recompute "
                     f"{setup.recompute} --params-dtype {setup.params_dtype}\n")
    return 0


def _warn_large_cpu_profile(req, attention: str) -> None:
    """One warning up front when ``poseidon profile`` runs on a CPU a layer that takes minutes
    (``profile_output.cpu_size_warning``)."""
    from poseidon_plugin.megatron.profile import offline
    from poseidon_plugin.megatron.profile.profile_output import cpu_size_warning
    from .memory import layer_activation_bytes

    if offline._pick_device(req.device) != "cpu":
        return
    model = req.model
    configs = len(req.tps) * len(req.micro_batch_sizes) * len(model.layer_kinds)
    act = layer_activation_bytes(model, micro_batch_size=max(req.micro_batch_sizes),
                                 seq_length=req.seq_length, tp=1, setup=req.setup)
    line = cpu_size_warning(model, req.seq_length, req.micro_batch_sizes, configs, act)
    if line:
        sys.stderr.write(f"poseidon: warning: {bound_line(line)}\n")


def _cmd_validate(ns) -> int:
    from .fidelity import main as fidelity_main

    return int(fidelity_main(ns.args) or 0)


REPORT_GRACE_S = 10.0   # a failing torchrun rank > 0 of `poseidon profile` waits this long


def _leave_the_report_to_rank0(argv: list[str]) -> None:
    """``poseidon profile`` under torchrun: a rank > 0 that fails waits before it reports, so
    the error is one line: an argument error every rank finds alike, or a rank's failure, which
    rank 0 names (posted to the store), is reported by rank 0, and torchrun stops the other
    ranks when it exits. A rank still running after ``REPORT_GRACE_S`` reports it itself."""
    if "profile" not in argv:
        return
    from poseidon_plugin.megatron.profile.profile_tps import Processes

    try:
        procs = Processes.from_environ()
    except PoseidonError:
        return
    if procs.rank > 0:
        time.sleep(REPORT_GRACE_S)


def _glue_megatron_args(argv: list[str]) -> list[str]:
    """``--megatron-args "--no-overlap-p2p-communication"`` as ``--megatron-args=...``: argparse
    would take a lone value that starts with ``--`` for an option of its own."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--megatron-args" and i + 1 < len(argv):
            out.append(f"--megatron-args={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


class _StdoutError(PoseidonError):
    """Standard output cannot be written (full, closed, a closed pipe)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(f"cannot write to standard output: {exc.strerror or exc}")
        self.broken_pipe = isinstance(exc, BrokenPipeError)


class _Stdout:
    """``sys.stdout`` during ``main``: a write or flush that fails raises ``_StdoutError`` (one
    line, exit 2; a closed pipe: quiet), a closed standard output (None) fails its first write
    (after ``--out`` and ``--gantt`` are written)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def _call(self, name: str, *args):
        if self.stream is None:
            import errno
            raise _StdoutError(OSError(errno.EBADF, "it is closed"))
        try:
            return getattr(self.stream, name)(*args)
        except OSError as exc:
            raise _StdoutError(exc) from None

    def write(self, text: str) -> int:
        return self._call("write", text)

    def flush(self) -> None:
        if self.stream is not None:   # nothing written, nothing to fail
            self._call("flush")

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _robust_streams() -> None:
    """A character the terminal's encoding lacks (a cluster name under an ASCII locale) is
    written as a backslash escape, not a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):   # None (closed), not a TextIOWrapper
            pass
    if sys.stderr is None:   # closed: nothing can be reported
        sys.stderr = open(os.devnull, "w", encoding="utf-8")


def _silence_stdout(stream) -> None:
    """After a failed write: the unwritten buffer goes to /dev/null (else the interpreter's
    exit flush fails again and prints a traceback-like message)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (AttributeError, ValueError, OSError):   # None, or not a file (pytest's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    rc = _main_streams(argv)
    if argv is None and _LEAVE_AT_ONCE:   # a program, not a call (tests pass argv)
        _leave(rc)
    return rc


# set when this process joined a torch.distributed group (``plan --distributed``): torch's
# teardown of the group and its store at interpreter exit took 3-5 s after the plan was out
_LEAVE_AT_ONCE: list[bool] = []


def _leave(rc: int) -> None:
    """Exit with ``rc`` at once, the standard streams flushed (no interpreter teardown)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(rc)


def _main_streams(argv: list[str] | None) -> int:
    _robust_streams()
    stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        rc = _main(argv)
        sys.stdout.flush()
        return rc
    except _StdoutError as exc:
        _silence_stdout(stdout)
        if exc.broken_pipe:   # `poseidon plan ... | head`: the reader left; quietly
            return 141        # as a process killed by SIGPIPE reports (128 + 13)
        sys.stderr.write(f"poseidon: error: {exc}\n")
        return 2
    finally:
        sys.stdout = stdout


def _main(argv: list[str] | None = None) -> int:
    argv = _glue_megatron_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lead = next((i for i, a in enumerate(argv) if a not in _VERBOSE), len(argv))
        if argv[lead:lead + 1] == ["validate"]:
            # argparse's REMAINDER drops leading options after a sub-command: pass them through
            # (all but -v, which may come before or after the command).
            rest = argv[lead + 1:]
            verbose = lead > 0 or any(a in _VERBOSE for a in rest)
            logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                                format="poseidon: %(levelname)s: %(message)s")
            return _cmd_validate(argparse.Namespace(args=[a for a in rest if a not in _VERBOSE]))
        ns = _build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING,
                            format="poseidon: %(levelname)s: %(message)s")
        if ns.command == "plan":
            return _cmd_plan(ns)
        if ns.command == "profile":
            return _cmd_profile(ns)
        if ns.command == "validate":
            return _cmd_validate(ns)
        raise PoseidonError("expected a command: plan, profile or validate (see poseidon --help)")
    except _StdoutError:
        raise
    except (PoseidonError, ImportError) as exc:
        if not isinstance(exc, PoseidonError):   # one line: what is missing and the fix
            from poseidon_plugin.megatron.imports import explain

            command = next((a for a in argv if a in ("plan", "profile", "validate")), "")
            exc = explain(exc, needed_by=f"poseidon {command}".strip())
        _leave_the_report_to_rank0(argv)
        msg = bound_line(" ".join(str(exc).split()))   # a name from a file: escaped
        sys.stderr.write(f"poseidon: error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("poseidon: error: interrupted\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
