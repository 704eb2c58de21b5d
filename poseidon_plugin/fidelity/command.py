"""``poseidon validate``'s arguments and ``main`` (no torch until cases actually run)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Sequence

from ..errors import PoseidonError, check_writable
from .cases import Emulation, select_cases
from .report import draw_case, format_table, store_call_records, write_json


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (the CLI prints it), not usage + error
        raise PoseidonError(f"validate: {message}")


# bounds of the emulated runs (a typo of a few zeros is refused, not run for days)
MAX_ITERATIONS = 1000       # measured iterations per case (default 30: ~1 s per case)
MAX_LAYER_MS = 1000.0       # emulated ms per layer at speed 1 (default 4 / 8); a case sleeps
                            # ~ layers x M x (fwd + bwd) / speed per iteration


def _layer_ms(text: str) -> float:
    """argparse type of ``--layer-ms``: a finite number of milliseconds in (0, MAX_LAYER_MS]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 < value <= MAX_LAYER_MS:
        raise argparse.ArgumentTypeError(f"expected milliseconds > 0 and <= {MAX_LAYER_MS:g}, "
                                         f"got {text!r}")
    return value


def _check_output(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> None:
    """An output path refused before any run: a directory, a missing parent, no permission, a
    suffix the writer refuses (the CLI's rule for ``poseidon plan --out / --gantt``)."""
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        raise PoseidonError(f"{flag} {path}: expected a file name ending in "
                            f"{' or '.join(suffixes)}")
    check_writable(flag, path)


def _check_args(ns: argparse.Namespace) -> None:
    """Every number and output path of ``poseidon validate``, before torch or any run."""
    if not 1 <= ns.iterations <= MAX_ITERATIONS:
        raise PoseidonError(f"--iterations: expected an integer in [1, {MAX_ITERATIONS}], got "
                            f"{ns.iterations}")
    if not 0 <= ns.discard < ns.iterations:
        raise PoseidonError(f"--discard: expected an integer >= 0 and below --iterations "
                            f"({ns.iterations}), got {ns.discard}")
    if ns.gantt:
        _check_output("--gantt", ns.gantt, (".png", ".svg"))
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise PoseidonError("--gantt needs matplotlib: pip install matplotlib")
    if ns.json:
        _check_output("--json", ns.json)
    if ns.profile_db:
        _check_output("--profile-db", ns.profile_db)
    if ns.calls_from:
        _calls_db(ns.calls_from)   # unreadable or without records: refused before any run


def _calls_db(path: str):
    """The profile DB of ``--calls-from``: loaded (one-line errors as any profile DB), with at
    least one ``op_overheads`` or ``p2p_calls`` record."""
    from ..profiles import ProfileDB

    db = ProfileDB.load(path)
    if not db.op_overheads() and not db.p2p_calls():
        raise PoseidonError(f"--calls-from {path}: the profile DB has no op_overheads or "
                            "p2p_calls records (a launch's profile cache or a poseidon profile "
                            "DB has them)")
    return db


def with_calls_from(results, db, emu):
    """``results`` with the search column re-predicted from ``db``'s per-op / per-call records
    (``predict.search_calls``) instead of the run's own."""
    import dataclasses

    from .predict import predict_dag
    from .report import message_bytes

    return [dataclasses.replace(r, row=dataclasses.replace(r.row, dag_ms=predict_dag(
        r.case, r.profiles, message_bytes(emu), calls_db=db).iteration_time_ms))
        for r in results]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="poseidon validate",
                                description="Measure the simulator against real megatron-core "
                                "pipeline runs on CPU emulation.",
                                epilog="-v / --verbose (before or after 'validate'): debug "
                                "logging on stderr.")
    p.add_argument("--full", action="store_true",
                   help="run the larger case set (default: the standard cases; see --list)")
    p.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                   help="run only these cases (names from the table)")
    p.add_argument("--iterations", type=int, default=30, metavar="N",
                   help="training iterations measured per case (default: %(default)s)")
    p.add_argument("--discard", type=int, default=5, metavar="N",
                   help="first iterations left out of the mean (default: %(default)s)")
    p.add_argument("--layer-ms", type=_layer_ms, nargs=2, default=None, metavar=("FWD", "BWD"),
                   help="emulated forward and backward milliseconds per layer on a device of "
                   f"speed 1 (default: {Emulation.forward_ms_per_layer} "
                   f"{Emulation.backward_ms_per_layer})")
    p.add_argument("--gantt", default=None, metavar="FILE",
                   help="draw measured vs predicted timelines of one case (.png/.svg)")
    p.add_argument("--gantt-case", default=None, help="the case to draw (default: the first)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write every row, stage profile and measured op as JSON to FILE")
    p.add_argument("--profile-db", default=None, metavar="FILE",
                   help="store the measured per-op overheads and p2p call costs of each "
                   "emulated device type in this profile DB (op_overheads / p2p_calls records, "
                   "merged into FILE; the search charges them)")
    p.add_argument("--calls-from", default=None, metavar="DB",
                   help="time the search column with this profile DB's op_overheads / "
                   "p2p_calls records (a launch's profile cache, a poseidon profile DB; its "
                   "types' largest) instead of the run's own measurement")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """``poseidon validate [options]``: argv strings, or the CLI's namespace (its ``args``)."""
    if isinstance(argv, argparse.Namespace):
        argv = list(getattr(argv, "args", None) or [])
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    ns = _parser().parse_args(argv)
    cases = select_cases(ns.cases, ns.full)
    if ns.list:
        for c in cases:
            print(c.describe())
        return 0
    _check_args(ns)
    emu = Emulation()
    if ns.layer_ms:
        emu = Emulation(forward_ms_per_layer=ns.layer_ms[0], backward_ms_per_layer=ns.layer_ms[1])
    gantt_case = ns.gantt_case or (cases[0].name if ns.gantt else None)
    if gantt_case and gantt_case not in {c.name for c in cases}:
        raise PoseidonError(f"--gantt-case {gantt_case!r} is not among the cases run")
    from .harness import run_cases   # torch and megatron-core from here on

    t0 = time.time()
    results = run_cases(cases, emu, ns.iterations, ns.discard, gantt_case=None,
                        progress=lambda m: print(f"poseidon validate: {m}", file=sys.stderr))
    if ns.calls_from:
        results = with_calls_from(results, _calls_db(ns.calls_from), emu)
    rows = [r.row for r in results]
    print(format_table(rows))
    print(f"({len(rows)} cases, {ns.iterations} iterations each, first {ns.discard} discarded; "
          f"{time.time() - t0:.0f} s)")
    if ns.json:
        write_json(results, ns.json)
    if ns.profile_db:
        print(f"profile DB: {store_call_records(results, emu, ns.profile_db)}")
    if ns.gantt:
        res = next(r for r in results if r.case.name == gantt_case)
        print(f"Gantt chart: {draw_case(res, ns.gantt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
