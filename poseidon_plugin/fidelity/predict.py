"""The three predictions of a case's iteration time from its stage profiles (no torch).

(a) the search's own model: the DAG the search times plans with (``poseidon_plugin._core``'s
``get_dag(..., engine=True, calls=...)``), charged with megatron's per-op and per-call costs the
way the search charges them from a profile DB (``search_calls``: the stages' measured costs as
``callcosts`` records, one per emulated device type, then ``callcosts.engine_calls``), the link
time the measured one-way latency; without measured costs the paper's DAG, (b) Eq. (1)
(``simulator.static_estimate_ms``), (c) the engine-aware model (``simulator.engine``). (a) and (c)
return a ``simulator.timeline.Timeline``; (b) a number. The per-stage tail R[s] given to (a) and
(b) is the measured finalize + optimizer time of stage s (what the plugin would profile as the
stage's all-reduce); (c) models the tail as megatron runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from ..callcosts import EngineCalls, OpOverhead, P2PCall, engine_calls
from ..simulator import iteration_time_ms, simulate_pipeline, static_estimate_ms
from ..simulator.engine import EngineCosts, simulate_engine
from ..simulator.timeline import Timeline
from .cases import Case


@dataclass
class StageProfile:
    """What the plugin would profile for one stage (ms)."""

    forward_ms: list[float]          # per chunk
    backward_ms: list[float]         # per chunk
    send_ms: float                   # activation send on the link stage -> next (ring)
    finalize_ms: float               # gradient finalisation (DP all-reduce)
    optimizer_ms: float              # optimizer step (incl. the grad-norm all-reduce)
    # engine overheads (forward_step / backward_step / p2p call costs with zero-time layers)
    overhead: dict[str, float] = field(default_factory=dict)


def _profile_arrays(case: Case, profiles: Sequence[StageProfile]):
    n, v = case.pp, case.virtual_stages
    fwd = np.array([[profiles[s].forward_ms[c] for s in range(n)] for c in range(v)])
    bwd = np.array([[profiles[s].backward_ms[c] for s in range(n)] for c in range(v)])
    links = n if case.schedule == "interleaved-1f1b" else n - 1
    send = np.array([profiles[s].send_ms for s in range(links)])
    tail = np.array([p.finalize_ms + p.optimizer_ms for p in profiles])
    return fwd, bwd, send, tail


class _Records:
    """The few ``ProfileDB`` methods ``callcosts.engine_calls`` reads."""

    def __init__(self, ops, calls) -> None:
        self._ops, self._calls = ops, calls

    def op_overheads(self):
        return self._ops

    def p2p_calls(self):
        return self._calls


def call_records(cases_profiles, message_bytes: int) -> tuple[list, list, float | None]:
    """(op overhead records, p2p call records, median latency ms or None) of the emulated
    device types, as ``poseidon profile`` would store them: each type's record is the median
    over its stages (of every (case, profiles) pair given) of what they measured
    (``harness``: the schedule with zero-time layers, megatron's own p2p calls)."""
    per_type: dict[str, list[dict]] = {}
    for case, profiles in cases_profiles:
        for s, p in enumerate(profiles):
            per_type.setdefault(case.devices[s], []).append(p.overhead)
    ops, calls, lat = [], [], []
    for dev in sorted(per_type):
        ov = per_type[dev]
        med = (lambda k: float(np.median([o[k] for o in ov])) if all(k in o for o in ov)
               else None)
        if med("forward_ms") is not None:
            ops.append(OpOverhead(dev, med("forward_ms"), med("backward_ms")))
        if med("send_call_ms") is not None:
            calls.append(P2PCall(dev, "intra-node", max(int(message_bytes), 1),
                                 med("send_call_ms"), med("recv_ready_ms"),
                                 med("latency_ms") or 0.0))
            lat.append(med("latency_ms") or 0.0)
    return ops, calls, (float(np.median(lat)) if lat else None)


def search_calls(case: Case, profiles: Sequence[StageProfile], message_bytes: int,
                 calls_db=None) -> tuple[EngineCalls, float | None]:
    """(the costs the search would charge, the link latency ms or None): the case's
    ``call_records``, then ``callcosts.engine_calls`` as the cost model calls it. ``calls_db``
    (``poseidon validate --calls-from``): a profile DB's own records instead (written by a launch
    or ``poseidon profile``), every device type of it standing for every emulated device (the
    largest of its types' records, as a cluster of those types would be charged), the latency
    the median of its call records'."""
    if calls_db is not None:
        types = ({o.device_type for o in calls_db.op_overheads()}
                 | {c.device_type for c in calls_db.p2p_calls()})
        lat = [c.latency_ms for c in calls_db.p2p_calls()]
        return (engine_calls(calls_db, types, max(int(message_bytes), 1)),
                float(np.median(lat)) if lat else None)
    ops, calls, latency = call_records([(case, profiles)], message_bytes)
    return engine_calls(_Records(ops, calls), case.devices, max(int(message_bytes), 1)), latency


def predict_dag(case: Case, profiles: Sequence[StageProfile], message_bytes: int = 1,
                calls_db=None) -> Timeline:
    """The search's model (module docstring), labelled "predicted, search's model": its time is
    the search's C sweep; the per-op rows are the paper DAG's (1f1b without measured costs,
    with its critical path) or ``engine.simulate_engine``'s with the same uniform costs and
    the tail as one per-stage term (the same time: the tests hold them equal)."""
    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    calls, latency = search_calls(case, profiles, message_bytes, calls_db)
    if latency is not None and calls:
        send = np.full(send.shape, latency)
    f, b = (fwd[0], bwd[0]) if case.virtual_stages == 1 else (fwd, bwd)
    t = iteration_time_ms(f, b, send, send, tail, case.num_microbatches, case.schedule,
                          case.virtual_stages, engine=True,
                          calls=calls.as_tuple() if calls else None)
    if not calls and case.schedule == "1f1b":       # the paper's DAG: with its critical path
        tl = simulate_pipeline(f, b, send, send, tail, case.num_microbatches, case.schedule,
                               case.virtual_stages)
    else:
        n = case.pp
        fo, bo, sc, rr = calls.as_tuple()
        costs = EngineCosts(fwd, bwd, send, tail, np.zeros(n), np.full(n, sc), np.full(n, rr),
                            np.full(n, fo), np.full(n, bo))
        tl = simulate_engine(costs, case.num_microbatches, case.schedule, case.virtual_stages)
    return replace(tl, iteration_time_ms=t).with_label("predicted, search's model")


def predict_eq1(case: Case, profiles: Sequence[StageProfile]) -> float:
    """Eq. (1) on the per-device totals (for interleaved: the chunks of a device summed)."""
    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    n = case.pp
    return static_estimate_ms(fwd.sum(0), bwd.sum(0), send[:n - 1], send[:n - 1], tail,
                              case.num_microbatches)


def predict_engine(case: Case, profiles: Sequence[StageProfile]) -> Timeline:
    """The engine-aware model (``simulator.engine``), labelled "predicted, engine-aware"."""
    fwd, bwd, send, _ = _profile_arrays(case, profiles)
    costs = EngineCosts.from_profiles(fwd, bwd, send,
                                      [p.finalize_ms for p in profiles],
                                      [p.optimizer_ms for p in profiles],
                                      [p.overhead for p in profiles])
    tl = simulate_engine(costs, case.num_microbatches, case.schedule, case.virtual_stages)
    return tl.with_label("predicted, engine-aware")
