"""``poseidon`` command line: ``plan`` (offline search), ``profile`` (measure a layer into a profile
DB, or merge DBs; lazy torch) and ``validate`` (lazy).

Every PoseidonError (and every argument mistake) ends as one line
``poseidon: error: <message>`` on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import PoseidonError
from .search.options import PRUNING_MODES, TYPE_ORDERS, SearchOptions
from .simulator.schedules import LAUNCHABLE_SCHEDULES, SCHEDULES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        raise PoseidonError(message)


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="poseidon", description="Parallel-plan search for LLM pre-training on "
                "heterogeneous clusters.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    pl = sub.add_parser("plan", help="search the fastest plan for a cluster file and a model")
    pl.add_argument("--cluster", required=True, help="cluster YAML file")
    pl.add_argument("--model", required=True, help="model preset name or YAML file")
    pl.add_argument("--global-batch-size", type=int, required=True)
    pl.add_argument("--seq-length", type=int, required=True)
    pl.add_argument("--profiles", default=None,
                    help="profile DB (JSON, e.g. from `poseidon profile`); measured records win "
                    "over the estimator; an error when none is usable unless --allow-estimates")
    pl.add_argument("--allow-estimates", action="store_true",
                    help="plan on estimates when --profiles has no usable record")
    _add_setup_flags(pl)
    pl.add_argument("--schedules", nargs="+", default=list(LAUNCHABLE_SCHEDULES),
                    choices=list(SCHEDULES),
                    help="schedules to search (default: the ones megatron-core executes; "
                    "eager-1f1b and gpipe give analysis-only plans without launch flags)")
    pl.add_argument("--pruning", choices=list(PRUNING_MODES), default="safe")
    g = pl.add_mutually_exclusive_group()
    g.add_argument("--uniform-tp", dest="tp_mode", action="store_const", const="uniform")
    g.add_argument("--per-stage-tp", dest="tp_mode", action="store_const", const="per-stage")
    pl.set_defaults(tp_mode="uniform")
    pl.add_argument("--micro-batch-sizes", type=int, nargs="+", default=None)
    pl.add_argument("--tp", dest="tp_degrees", type=int, nargs="+", default=None,
                    metavar="T", help="TP degrees allowed (default: every valid one)")
    pl.add_argument("--max-virtual-stages", type=int, default=2)
    pl.add_argument("--type-order", choices=list(TYPE_ORDERS), default="any",
                    help="device-type orders searched: any (default: every order, exact), "
                    "blocks (contiguous type blocks only), auto (blocks where a configuration "
                    "has more than 3^20 orders); a restricted space is named in the output")
    pl.add_argument("--warmup-samples", type=int, default=500)
    pl.add_argument("--time-budget", type=float, default=None, metavar="S")
    pl.add_argument("--workers", type=int, default=None,
                    help="search threads (default: every core); the plan does not depend on it")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--no-baselines", action="store_true", help="skip the two baselines")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--out", default=None, help="also write the plan JSON to this file")
    pl.add_argument("--gantt", default=None, metavar="FILE",
                    help="draw the simulated schedule of the plan (.png or .svg)")
    _add_profile_parser(sub)
    va = sub.add_parser("validate", help="validate the simulator against real runs")
    va.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _add_profile_parser(sub) -> None:
    pr = sub.add_parser(
        "profile", help="measure the model's layer on this machine's device into a profile DB",
        description="Time the model's decoder layer (megatron-core, built from the model spec "
        "and the training setup) on this machine's device for each micro-batch size and merge "
        "the measured records into -o DB (one device type per run; TP 1 only: one process "
        "measures no TP group, TP > 1 comes from a --poseidon-auto launch or is calibrated). "
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
    pr.add_argument("--tp", type=int, nargs="+", default=[1], help="TP degrees: 1 only")
    pr.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto",
                    help="auto: CUDA, then NPU, else CPU (megatron-core under CPU shims)")
    pr.add_argument("--iters", type=int, default=5, help="timed repetitions per config")
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
                         attention=attention or ns.attention)


def search_options(ns) -> SearchOptions:
    """The one ``SearchOptions`` of a ``poseidon plan`` command line (validated there)."""
    return SearchOptions(
        global_batch_size=ns.global_batch_size, seq_length=ns.seq_length,
        schedules=tuple(ns.schedules), pruning=ns.pruning, tp_mode=ns.tp_mode,
        tp_degrees=ns.tp_degrees, micro_batch_sizes=ns.micro_batch_sizes,
        max_virtual_stages=ns.max_virtual_stages, type_order=ns.type_order,
        warmup_samples=ns.warmup_samples, seed=ns.seed, time_budget_s=ns.time_budget,
        workers=ns.workers, progress=sys.stderr.isatty(), training=training_setup(ns))


def _cmd_plan(ns) -> int:
    from .cluster import load_cluster
    from .model import get_model
    from .search import baseline_plans, search_plan

    options = search_options(ns)
    cluster = load_cluster(ns.cluster)
    model = get_model(ns.model)
    profiles = None
    if ns.profiles:
        profiles = _load_profiles(ns, cluster, model, options)
    from .profiles import calibrate_cluster
    cluster = calibrate_cluster(cluster, profiles, model, options.seq_length, options.training)
    plan = search_plan(cluster, model, options, profiles)
    text = plan.to_json()
    if ns.gantt:
        _draw_plan_gantt(cluster, model, plan, profiles, ns.gantt)
    if ns.out:
        try:
            with open(ns.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise PoseidonError(f"--out {ns.out}: cannot write ({exc.strerror})") from None
    if ns.json:
        sys.stdout.write(text)
        return 0
    sys.stdout.write(plan.table())
    if not ns.no_baselines:
        _write_baselines(baseline_plans(cluster, model, options.replace(progress=False),
                                        profiles), plan.predicted_iteration_time_ms)
    return 0


def _load_profiles(ns, cluster, model, options):
    """The DB, one warning line naming why records are unusable; an error when none is usable
    unless ``--allow-estimates``."""
    from .profiles import ProfileDB, diagnose

    db = ProfileDB.load(ns.profiles)
    usable, warning = diagnose(db, cluster, model, options.seq_length, options.training)
    if warning:
        sys.stderr.write(f"poseidon: warning: {warning}\n")
    if usable == 0 and not ns.allow_estimates:
        raise PoseidonError(f"--profiles {ns.profiles}: no measured record is usable for this "
                            f"plan (see the warning); profile this model and setup with "
                            f"`poseidon profile`, or pass --allow-estimates")
    return db


def _write_baselines(base: dict, t_ms: float) -> None:
    for name, bp in base.items():
        if bp is None:
            sys.stdout.write(f"baseline {name}: no feasible plan\n")
        else:
            bt = bp.predicted_iteration_time_ms
            sys.stdout.write(f"baseline {name}: {bt:.2f} ms (pp={bp.pp}, dp={bp.dp}, "
                             f"tp={bp.stages[0].tp}) -> speed-up x{bt / t_ms:.2f}\n")


def _draw_plan_gantt(cluster, model, plan, profiles, path: str) -> None:
    from .costs import plan_simulator_inputs
    from .gantt import draw_gantt
    from .simulator import simulate_pipeline

    F, B, Pf, Pb, R = plan_simulator_inputs(cluster, model, plan, profiles)
    if plan.schedule == "interleaved-1f1b":
        # the search timed it as megatron-core runs it (bundled p2p calls): draw that schedule
        import numpy as np

        from .simulator.engine import EngineCosts, simulate_engine
        timeline = simulate_engine(EngineCosts.from_profiles(F, B, Pf, R, np.zeros(len(R))),
                                   plan.num_microbatches, plan.schedule, plan.virtual_stages)
        timeline = timeline.with_label("predicted (as megatron-core runs it)")
    else:
        timeline = simulate_pipeline(F, B, Pf, Pb, R, plan.num_microbatches, plan.schedule,
                                     plan.virtual_stages).with_label("predicted")
    title = (f"{plan.model_name} on {plan.cluster_name}: {plan.schedule}, PP={plan.pp}, "
             f"DP={plan.dp}, M={plan.num_microbatches}")
    draw_gantt([timeline], path, title=title)
    sys.stderr.write(f"poseidon: wrote {path}\n")


def _cmd_profile(ns) -> int:
    from .megatron import offline

    if ns.merge:
        total = offline.merge_files(ns.merge, ns.out)
        sys.stderr.write(f"poseidon: merged {len(ns.merge)} DB(s) into {ns.out} "
                         f"({total} records)\n")
        return 0
    missing = [f for f, v in (("--model", ns.model), ("--seq-length", ns.seq_length),
                              ("--device-type", ns.device_type)) if v is None]
    if missing:
        raise PoseidonError(f"poseidon profile needs {', '.join(missing)} (or --merge DB...)")
    for name, values in (("--micro-batch-sizes", ns.micro_batch_sizes), ("--tp", ns.tp),
                         ("--seq-length", [ns.seq_length]), ("--iters", [ns.iters])):
        if any(v < 1 for v in values):
            raise PoseidonError(f"{name}: expected integers >= 1, got {values}")
    from .model import get_model

    model = get_model(ns.model)
    attention = ns.attention or ("unfused" if ns.device == "cpu" else None)
    if attention is None:   # auto device: decided by what torch sees
        attention = "flash" if offline._pick_device("auto") != "cpu" else "unfused"
    setup = training_setup(ns, attention)
    req = offline.ProfileRequest(model=model, seq_length=ns.seq_length,
                                 device_type=ns.device_type,
                                 micro_batch_sizes=tuple(ns.micro_batch_sizes),
                                 tps=tuple(ns.tp), setup=setup, device=ns.device,
                                 iters=ns.iters)
    records = offline.profile_layers(req)
    stored, total = offline.write_profiles(records, ns.out)
    for r in records:
        sys.stdout.write(f"{r.key.describe()}: forward {r.forward_ms:.3f} ms, backward "
                         f"{r.backward_ms:.3f} ms, activations {r.activation_bytes / 2**20:.2f} "
                         f"MiB, params {r.param_bytes / 2**20:.2f} MiB\n")
    sys.stderr.write(f"poseidon: wrote {stored} measured record(s) to {ns.out} ({total} "
                     f"records); plan with --attention {setup.attention} --recompute "
                     f"{setup.recompute} --params-dtype {setup.params_dtype}\n")
    return 0


def _cmd_validate(ns) -> int:
    from .fidelity import main as fidelity_main

    return int(fidelity_main(ns.args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["validate"]:
            # argparse's REMAINDER drops leading options after a sub-command: pass them through.
            logging.basicConfig(level=logging.WARNING, format="poseidon: %(levelname)s: %(message)s")
            return _cmd_validate(argparse.Namespace(args=argv[1:]))
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
    except PoseidonError as exc:
        msg = " ".join(str(exc).split())
        sys.stderr.write(f"poseidon: error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("poseidon: error: interrupted\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
