"""Rows, statistics, the table, the JSON dump and the Gantt chart of a fidelity run (no torch).

``assemble_case`` turns what the spawned workers returned for one case (per rank: profile,
iteration windows, recorded ops) into a ``CaseResult``: the measured time and the predictions.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .cases import Case
from .predict import StageProfile, call_records, predict_dag, predict_engine, predict_eq1

PREDICTORS = ("dag", "eq1", "engine")


@dataclass
class Row:
    case: str
    schedule: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    measured_ms: float
    dag_ms: float
    eq1_ms: float
    engine_ms: float
    measured_std_ms: float = 0.0
    iterations: int = 0

    def error(self, which: str) -> float:
        """Relative error of a prediction: (predicted - measured) / measured."""
        return (getattr(self, f"{which}_ms") - self.measured_ms) / self.measured_ms


def error_stats(rows: Sequence[Row], which: str) -> tuple[float, float]:
    """(median, max) of |relative error| over the rows."""
    if not rows:
        return float("nan"), float("nan")
    errs = [abs(r.error(which)) for r in rows]
    return statistics.median(errs), max(errs)


def format_table(rows: Sequence[Row]) -> str:
    """The fidelity table: one row per case, then the median and max |error| of each
    predictor under its error column. The case and schedule columns are as wide as their
    longest entry (``interleaved-1f1b``), so every column lines up."""
    wc = max([len("case")] + [len(r.case) for r in rows])
    ws = max([len("sched")] + [len(r.schedule) for r in rows])
    head = (f"{'case':<{wc}} {'sched':<{ws}} {'PP':>2} {'M':>3} {'V':>2} {'measured':>10} "
            f"{'search':>9} {'err':>7} {'Eq.(1)':>9} {'err':>7} {'engine':>9} {'err':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case:<{wc}} {r.schedule:<{ws}} {r.pp:>2} {r.num_microbatches:>3} "
            f"{r.virtual_stages:>2} {r.measured_ms:>8.2f}ms "
            f"{r.dag_ms:>9.2f} {100 * r.error('dag'):>+6.1f}% "
            f"{r.eq1_ms:>9.2f} {100 * r.error('eq1'):>+6.1f}% "
            f"{r.engine_ms:>9.2f} {100 * r.error('engine'):>+6.1f}%")
    lines.append("-" * len(head))
    label_w = wc + ws + 2 + 3 + 2 + 10 + 5      # up to the end of the measured column
    for label, agg in (("median |err|", 0), ("max |err|", 1)):
        vals = [error_stats(rows, w)[agg] for w in PREDICTORS]
        lines.append(f"{label:<{label_w}} {'':>9} {100 * vals[0]:>6.1f}% {'':>9} "
                     f"{100 * vals[1]:>6.1f}% {'':>9} {100 * vals[2]:>6.1f}%")
    return "\n".join(lines)


@dataclass
class CaseResult:
    case: Case
    row: Row
    profiles: list[StageProfile]
    measured_records: list[dict]      # one IterationRecord dict per stage (a late iteration)
    ops_per_stage: list[int]
    all_records: list[list[dict]] = field(default_factory=list)


def assemble_case(case: Case, per_rank: list[dict]) -> CaseResult:
    """Measured time and predictions of one case from every rank's worker result: one pipeline
    (dp rank 0) gives the profiles and the timeline, all ranks the span of each iteration (max
    over ranks of its end minus min over ranks of its start)."""
    pipe = sorted((d for d in per_rank if d["dp_rank"] == 0), key=lambda d: d["pp_rank"])
    profiles = [StageProfile(**d["profile"]) for d in pipe]
    n_it = len(per_rank[0]["iterations"])
    spans = [max(d["iterations"][i][1] for d in per_rank)
             - min(d["iterations"][i][0] for d in per_rank) for i in range(n_it)]
    measured = statistics.fmean(spans) * 1e3
    std = statistics.pstdev(spans) * 1e3
    dag = predict_dag(case, profiles)
    row = Row(case.name, case.schedule, case.pp, case.num_microbatches, case.virtual_stages,
              measured, dag.iteration_time_ms, predict_eq1(case, profiles),
              predict_engine(case, profiles).iteration_time_ms, std, n_it)
    records = [d["records"][-1] for d in pipe]
    all_records = [d["records"] for d in pipe] if len(pipe[0]["records"]) > 1 else []
    return CaseResult(case, row, profiles, records, [d["ops_per_iteration"] for d in pipe],
                      all_records)


def draw_case(result: CaseResult, path: str) -> str:
    """Measured timeline (a late iteration) above the engine-aware and the DAG prediction."""
    from ..gantt import draw_gantt
    from poseidon_plugin.megatron.calibrate.recorder import IterationRecord, timeline_from_records

    recs = [IterationRecord.from_dict(d) for d in result.measured_records]
    measured = timeline_from_records(recs, label="measured (megatron-core, CPU emulation)")
    engine = predict_engine(result.case, result.profiles)
    dag = predict_dag(result.case, result.profiles)
    c = result.case
    title = (f"{c.name}: {c.schedule}, PP={c.pp}, V={c.virtual_stages}, M={c.num_microbatches}, "
             f"layers {list(c.layers)}, devices {list(c.devices)}")
    rows = [f"{d} · {n} layer{'s' if n != 1 else ''}" for d, n in zip(c.devices, c.layers)]
    return draw_gantt([measured, engine, dag], path, title=title, stage_labels=rows)


def write_json(results: Sequence[CaseResult], path: str) -> None:
    """Every row, every stage profile and the measured per-op records, by case name."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rows": [asdict(r.row) for r in results],
                   "profiles": {r.case.name: [asdict(p) for p in r.profiles] for r in results},
                   "measured_records": {r.case.name: r.measured_records for r in results}},
                  f, indent=1, sort_keys=True)


def message_bytes(emu) -> int:
    """Bytes of one activation message of the emulation (fp32 seq x micro-batch x hidden)."""
    return 4 * emu.seq_length * emu.micro_batch_size * emu.hidden


def store_call_records(results: Sequence[CaseResult], emu, path: str) -> str:
    """Merge the run's per-type op overhead and p2p call records (``predict.call_records``
    over every case) into the profile DB at ``path``; a one-line summary."""
    from ..profiles import ProfileDB

    ops, calls, _ = call_records([(r.case, r.profiles) for r in results], message_bytes(emu))
    db = ProfileDB(path)
    for o in ops:
        db.put_op_overhead(o)
    for c in calls:
        db.put_p2p_call(c)
    db.save(path)
    return (f"{path}: {len(ops)} op overhead and {len(calls)} p2p call record(s) "
            f"({', '.join(o.device_type for o in ops)})")
