"""``poseidon`` command line: ``plan`` (offline search) and ``validate`` (lazy).

Every PoseidonError (and every argument mistake) ends as one line
``poseidon: error: <message>`` on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from .errors import PoseidonError
from .search.options import PRUNING_MODES, TYPE_ORDERS, SearchOptions
from .simulator.schedules import LAUNCHABLE_SCHEDULES, SCHEDULES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        raise PoseidonError(message)


def _positive_finite_float(text: str) -> float:
    """argparse type: a finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _check_writable(flag: str, path: str) -> None:
    """PoseidonError unless ``path`` can be written: checked before the search, so a typo in an
    output path costs nothing. An existing file is left untouched."""
    if os.path.isdir(path):
        raise PoseidonError(f"{flag} {path}: cannot write (is a directory)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        why = "not a directory" if os.path.exists(directory) else "no such directory"
        raise PoseidonError(f"{flag} {path}: cannot write ({why}: {directory})")
    target = path if os.path.exists(path) else directory
    if not os.access(target, os.W_OK):
        raise PoseidonError(f"{flag} {path}: cannot write (permission denied)")


def _check_gantt_path(path: str) -> None:
    """What ``gantt.draw_gantt`` would refuse after the search, refused before it."""
    import importlib.util

    if os.path.splitext(path)[1].lower() not in (".png", ".svg"):
        raise PoseidonError(f"--gantt {path}: expected a file name ending in .png or .svg")
    if importlib.util.find_spec("matplotlib") is None:
        raise PoseidonError("--gantt needs matplotlib: pip install matplotlib")


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
    pl.add_argument("--profiles", default=None, help="profile DB (JSON); estimates otherwise")
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
    pl.add_argument("--time-budget", type=_positive_finite_float, default=None, metavar="S")
    pl.add_argument("--workers", type=int, default=None,
                    help="search threads (default: every core); the plan does not depend on it")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--no-baselines", action="store_true", help="skip the two baselines")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--out", default=None, help="also write the plan JSON to this file")
    pl.add_argument("--gantt", default=None, metavar="FILE",
                    help="draw the simulated schedule of the plan (.png or .svg)")
    va = sub.add_parser("validate", help="validate the simulator against real runs")
    va.add_argument("args", nargs=argparse.REMAINDER)
    return p


def search_options(ns) -> SearchOptions:
    """The one ``SearchOptions`` of a ``poseidon plan`` command line (validated there)."""
    return SearchOptions(
        global_batch_size=ns.global_batch_size, seq_length=ns.seq_length,
        schedules=tuple(ns.schedules), pruning=ns.pruning, tp_mode=ns.tp_mode,
        tp_degrees=ns.tp_degrees, micro_batch_sizes=ns.micro_batch_sizes,
        max_virtual_stages=ns.max_virtual_stages, type_order=ns.type_order,
        warmup_samples=ns.warmup_samples, seed=ns.seed, time_budget_s=ns.time_budget,
        workers=ns.workers, progress=sys.stderr.isatty())


def _cmd_plan(ns) -> int:
    from .cluster import load_cluster
    from .model import get_model
    from .search import baseline_plans, search_plan

    options = search_options(ns)
    for flag, path in (("--out", ns.out), ("--gantt", ns.gantt)):
        if path:
            _check_writable(flag, path)
    if ns.gantt:
        _check_gantt_path(ns.gantt)
    cluster = load_cluster(ns.cluster)
    model = get_model(ns.model)
    profiles = None
    if ns.profiles:
        from .profile_checks import check_profiles
        from .profiles import ProfileDB
        profiles = ProfileDB.load(ns.profiles)
        check_profiles(profiles, cluster, model)
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
        if ns.command == "validate":
            return _cmd_validate(ns)
        raise PoseidonError("expected a command: plan or validate (see poseidon --help)")
    except PoseidonError as exc:
        msg = " ".join(str(exc).split())
        sys.stderr.write(f"poseidon: error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("poseidon: error: interrupted\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
