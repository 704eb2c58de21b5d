"""The simulator's DAGs built in typed Cython (issue 30 item 2: a huge M built millions of Python
objects per DAG): ``_core.order_ids`` is ``schedules.op_orders``; ``EngineDAG``'s nodes from its
C programs time every plan bit-identically to the Python builder it replaced (kept below as the
reference: ``engine.device_program`` + ``walk_programs``, swept in Python with the same IEEE
additions and maxima); ``configs.bound_structure`` from the op ids equals the one from the
op orders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_plugin._core import decode_ids, get_dag, order_ids
from poseidon_plugin.simulator.engine import device_program, link_index, walk_programs
from poseidon_plugin.simulator.schedules import op_orders

SCHEDULES = ["1f1b", "interleaved-1f1b", "eager-1f1b", "gpipe"]


def _shape(n, k, schedule, rng):
    """(n, m, v) valid for the schedule (interleaved with V > 1: M a multiple of N)."""
    if schedule == "interleaved-1f1b":
        v = k                            # 1 included: interleaved with V = 1 is 1F1B
        if v > 1:
            return n, n * int(rng.integers(1, 6)), v
        return n, int(rng.integers(1, 12)), 1
    return n, int(rng.integers(1, 12)), 1


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10**6), schedule=st.sampled_from(SCHEDULES),
       n=st.integers(1, 6), k=st.integers(1, 4))
def test_order_ids_are_the_op_orders(seed, schedule, n, k):
    rng = np.random.default_rng(seed)
    if schedule == "interleaved-1f1b" and k > 1 and n < 2:
        n = 2
    n, m, v = _shape(n, k, schedule, rng)
    ids = order_ids(schedule, n, m, v)
    want = op_orders(schedule, n, m, v)
    assert ids.shape == (n, 2 * m * v)
    for s in range(n):
        isb, ch, dev, mb = decode_ids(ids[s], n, m, v)
        got = list(zip(isb.tolist(), ch.tolist(), mb.tolist()))
        assert got == [(o.is_backward, o.chunk, o.microbatch) for o in want[s]]
        assert set(dev.tolist()) == {s}


# ------------------------------------------------------------------ the replaced builder

def _reference_engine_time(schedule, n, m, v, calls, F, B, Pf, Pb, R):
    """The pre-Cython ``EngineDAG`` builder (Python objects per op and message), swept in
    Python: the time every plan had before."""
    nv, L = n * v, (n if schedule == "interleaved-1f1b" else n - 1)
    fo, bo, sc, rr = calls
    w = [0.0] + list(F) + list(B) + list(Pf) + list(Pb) + [fo, bo, sc, rr]
    base = 1 + 2 * nv + 2 * L
    FO, BO, SC, RR = base, base + 1, base + 2, base + 3
    unbundled = schedule not in ("1f1b", "interleaved-1f1b")
    progs = [device_program(schedule, n, m, s, v, unbundled) for s in range(n)]

    def edge(msg):
        lo = link_index(msg, n)
        return 0 if lo >= L else 1 + 2 * nv + (0 if msg[0] == "F" else L) + lo

    nodes, last, sent = [], [0] * n, {}
    for event, s, x in walk_programs(progs):
        if event == "post":
            sent[x] = last[s]
        elif x[0] == "op":
            op = x[1]
            nodes.append((last[s], 0, 1 + (nv if op.is_backward else 0) + op.chunk * n + s, 0))
            last[s] = len(nodes)
            if (bo if op.is_backward else fo) > 0.0:
                nodes.append((last[s], 0, BO if op.is_backward else FO, 0))
                last[s] = len(nodes)
        else:
            t_slot = last[s]
            for r in x[2]:
                nodes.append((last[s], sent[r], 0, edge(r)))
                last[s] = len(nodes)
            if x[2] and rr > 0.0:
                nodes.append((last[s], 0, RR, 0))
                last[s] = len(nodes)
            if x[1] and sc > 0.0:
                nodes.append((last[s], t_slot, 0, SC) if x[2] else (last[s], 0, SC, 0))
                last[s] = len(nodes)
    fin = [0.0] * (len(nodes) + 1)
    for i, (p, d, nw, ew) in enumerate(nodes):
        a, b = fin[p], fin[d] + w[ew]
        fin[i + 1] = (b if b > a else a) + w[nw]
    return max(fin[last[s]] + R[s] for s in range(n)), len(nodes)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), schedule=st.sampled_from(SCHEDULES),
       n=st.integers(1, 6), k=st.integers(1, 4), zeros=st.integers(0, 15))
def test_engine_dag_is_bit_identical_to_the_python_builder(seed, schedule, n, k, zeros):
    rng = np.random.default_rng(seed)
    if schedule == "interleaved-1f1b" and k > 1 and n < 2:
        n = 2
    n, m, v = _shape(n, k, schedule, rng)
    L = n if schedule == "interleaved-1f1b" else n - 1
    calls = tuple(0.0 if zeros >> i & 1 else float(rng.uniform(0, 1)) for i in range(4))
    if not any(calls) and schedule != "interleaved-1f1b":
        calls = (0.0, 0.0, 0.0, 0.3)        # an EngineDAG (all zero: the paper's DAG)
    F, B = rng.uniform(0.1, 9, n * v), rng.uniform(0.1, 17, n * v)
    Pf, Pb, R = rng.uniform(0, 2, L), rng.uniform(0, 2, L), rng.uniform(0, 5, n)
    dag = get_dag(schedule, n, m, v, True, calls)
    assert type(dag).__name__ == "EngineDAG"
    got = dag.time_ms(F, B, Pf, Pb, R)
    want, nodes = _reference_engine_time(schedule, n, m, v, calls, F, B, Pf, Pb, R)
    assert got == want                      # bit-identical, not approximately
    assert dag.num_engine_nodes == nodes
    c = dag.copy()
    assert c.time_ms(F, B, Pf, Pb, R) == want


def test_engine_dag_at_a_large_m_matches_the_python_builder():
    """One larger interleaved shape (eleven micro-batch groups)."""
    rng = np.random.default_rng(7)
    n, m, v = 4, 4 * 11, 3
    F, B = rng.uniform(0.1, 9, n * v), rng.uniform(0.1, 17, n * v)
    Pf, Pb, R = rng.uniform(0, 2, n), rng.uniform(0, 2, n), rng.uniform(0, 5, n)
    for calls in (None, (0.2, 0.1, 0.05, 0.07)):
        got = get_dag("interleaved-1f1b", n, m, v, True, calls).time_ms(F, B, Pf, Pb, R)
        assert got == _reference_engine_time("interleaved-1f1b", n, m, v, calls or (0.0,) * 4,
                                             F, B, Pf, Pb, R)[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bound_structure_from_ids_equals_the_op_orders(schedule):
    from poseidon_plugin.search.configs import (bound_structure_from_ids,
                                                bound_structure_from_orders, pair_counts,
                                                pair_counts_from_ids)

    rng = np.random.default_rng(3)
    for _ in range(25):
        n = int(rng.integers(2 if schedule == "interleaved-1f1b" else 1, 7))
        k = int(rng.integers(1, 4))
        n, m, v = _shape(n, k, schedule, rng)
        a = bound_structure_from_ids(schedule, n, m, v)
        b = bound_structure_from_orders(schedule, n, m, v)
        assert (a.arrays(), a.clast, a.pair) == (b.arrays(), b.clast, b.pair), (n, m, v)
        if v > 1:
            want = pair_counts(op_orders(schedule, n, m, v), v)
            got = pair_counts_from_ids(order_ids(schedule, n, m, v), n, m, v)
            assert (got is None) == (want is None)
            if want is not None:
                assert np.array_equal(got, want)


def test_dag_cache_is_bounded_by_bytes_and_keeps_the_newest():
    from poseidon_plugin._core import DagCache, PipelineDAG

    small = PipelineDAG("1f1b", 2, 4, 1)
    big = PipelineDAG("1f1b", 4, 64, 1)
    assert big.nbytes > 10 * small.nbytes > 0
    c = DagCache(max_bytes=3 * small.nbytes, max_entries=10)
    built = []

    def make(d):
        built.append(d)
        return d

    for k in range(3):
        c.get(("s", k), lambda: make(small))
    assert len(c) == 3 and c.bytes == 3 * small.nbytes
    assert c.get(("s", 0), lambda: make(None)) is small and len(built) == 3   # a hit
    assert c.get(("big",), lambda: make(big)) is big     # over the bound alone: still kept
    assert len(c) == 1 and c.bytes == big.nbytes
    c.get(("s", 5), lambda: make(small))                 # the big one goes, the newest stays
    assert len(c) == 1 and c.bytes == small.nbytes
    e = DagCache(max_bytes=1 << 40, max_entries=2)
    for k in range(4):
        e.get(k, lambda: small)
    assert len(e) == 2


def test_engine_dag_builds_the_papers_dag_only_when_asked():
    """An EngineDAG times plans without the paper's DAG (half a huge M's build); simulate,
    predecessor_slots and copies (before or after) still give the paper's DAG's answers."""
    from poseidon_plugin._core import EngineDAG, PipelineDAG

    rng = np.random.default_rng(11)
    n, m, v = 4, 8, 2
    args = [rng.uniform(0.1, 5, n * v), rng.uniform(0.1, 9, n * v), rng.uniform(0, 1, n),
            rng.uniform(0, 1, n), rng.uniform(0, 3, n)]
    e = EngineDAG("interleaved-1f1b", n, m, v, (0.1, 0.2, 0.3, 0.4))
    p = PipelineDAG("interleaved-1f1b", n, m, v)
    assert e.op_stage is None                               # not built yet
    before = e.nbytes
    early = e.copy()
    t = e.time_ms(*args)
    assert early.time_ms(*args) == t
    got, want = e.simulate(*args), p.simulate(*args)
    assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1:], want[1:]))
    assert e.nbytes > before + p.nbytes // 2                # built now
    assert all(np.array_equal(a, b) for a, b in zip(e.predecessor_slots(),
                                                    p.predecessor_slots()))
    assert np.array_equal(e.last_op_slots(), p.last_op_slots())
    assert np.array_equal(e.paper_dag_arrays()[5], p.stage_major)
    late = e.copy()
    assert late.time_ms(*args) == t == e.time_ms(*args)     # the call costs' slots kept
    assert np.array_equal(late.op_stage, p.op_stage)
    assert early.paper_dag_arrays()[0] is not None and early.time_ms(*args) == t
