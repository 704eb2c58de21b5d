# cython: language_level=3
"""Hot path of the simulator: the pipeline DAG's longest path as one ``nogil`` sweep.

The simulator's Cython core (``poseidon_plugin._core``); its Python side (op orders, validated
API, engine model, reference) is the ``poseidon_plugin.simulator`` package.

The DAG (the simulator semantics in ``simulator/pipeline.py``): compute ops F/B of every
(device s, chunk c, micro-batch m); op weight = its compute time. Cross-device edges follow the
*virtual stage* v = c*N + s: F(v-1, m) -> F(v, m) weighted Pf[(v-1) mod N]; B(v+1, m) -> B(v, m)
weighted Pb[v mod N]; F(last v, m) -> B(last v, m) weighted 0. Consecutive ops of one device's
order (from ``poseidon_plugin.simulator.schedules``) are chained with weight 0; the device's last op feeds
R(s) (weight = all-reduce time) and every R(s) feeds the end node.

Because every op has at most two predecessors (previous op on its device, one cross-device
dependency), the longest path is list scheduling with fixed orders:
``start(op) = max(finish(prev), finish(dep) + edge)``, ``finish = start + weight``.

``PipelineDAG`` precomputes, once per (schedule, N, M, V), a topological order of the ops sorted
by DAG level (so consecutive ops are independent and the CPU overlaps them) and, per op, four
int indices (``OpLink``). Evaluation is then a branch-light sweep over a contiguous array.
See ``_core.pxd`` for the C API.
"""

import numpy as np

from libc.stdlib cimport malloc, calloc, free, realloc
from libc.string cimport memcpy

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.simulator import schedules as _schedules


cdef inline double _sweep(const OpLink* lk, int total, const double* w, double* fin,
                          const int* last, int n, const double* R) noexcept nogil:
    """List scheduling over nodes in a topological order: fin[i+1] = max(fin[prev],
    fin[dep] + edge) + weight; returns max over devices of fin[last op] + R."""
    cdef int i, s
    cdef double a, b, best = 0.0
    for i in range(total):
        a = fin[lk[i].prev]
        b = fin[lk[i].dep] + w[lk[i].edge_w]
        if b > a:
            a = b
        fin[i + 1] = a + w[lk[i].node_w]
    for s in range(n):
        a = fin[last[s]] + R[s]
        if a > best:
            best = a
    return best


# ------------------------------------------------------------------ op orders as op ids ------
# The devices' op orders of ``simulator/schedules.py`` written straight into int arrays of op
# ids (``PipelineDAG._build``'s numbering: id = (is_backward * N V + c N + s) * M + mb), with no
# Python object per op: a huge M (131,072 micro-batches) built its orders as millions of
# ``Op`` tuples. ``order_ids`` is the Python view; tests/test_core_orders.py checks it against
# ``schedules.op_orders`` and the engine programs below against ``engine.device_program``.

cdef enum:
    _GPIPE = 0
    _ONE_F_ONE_B = 1
    _EAGER = 2
    _INTERLEAVED = 3


cdef int _kind_of(str schedule, int v) except -1:
    if schedule == "gpipe":
        return _GPIPE
    if schedule == "1f1b" or (schedule == "interleaved-1f1b" and v == 1):
        return _ONE_F_ONE_B
    if schedule == "eager-1f1b":
        return _EAGER
    if schedule == "interleaved-1f1b":
        return _INTERLEAVED
    raise PoseidonError(f"schedule: unknown {schedule!r}")


cdef int* _interleaved_table(int m, int v, int g) except NULL:
    """``schedules.interleaved_table`` as two int arrays in one block: [0, M V) micro-batch,
    [M V, 2 M V) chunk (the caller frees it)."""
    cdef int* t = <int*> malloc(2 * <size_t> m * v * sizeof(int) + sizeof(int))
    if not t:
        raise MemoryError()
    cdef int first, last, c, mb, k = 0, total = m * v
    first = 0
    while first < m:
        last = m if first + g >= m else first + g
        for c in range(v):
            for mb in range(first, last):
                t[k] = mb
                t[total + k] = c
                k += 1
        first += g
    return t


cdef inline int _fid(int n, int m, int s, int c, int mb) noexcept nogil:
    return (c * n + s) * m + mb


cdef inline int _bid(int n, int m, int v, int s, int c, int mb) noexcept nogil:
    return (n * v + c * n + s) * m + mb


cdef void _order_into(int kind, int n, int m, int v, int s, const int* table,
                      int* out) noexcept nogil:
    """Device s's 2 M V op ids in execution order (``schedules.stage_op_order``)."""
    cdef int k, w, i = 0, total
    if kind == _GPIPE:
        for k in range(m):
            out[i] = _fid(n, m, s, 0, k)
            i += 1
        for k in range(m):
            out[i] = _bid(n, m, 1, s, 0, k)
            i += 1
        return
    if kind == _ONE_F_ONE_B or kind == _EAGER:
        w = n - 1 - s if kind == _ONE_F_ONE_B else 2 * (n - 1 - s) + 1
        if w > m:
            w = m
        for k in range(w):
            out[i] = _fid(n, m, s, 0, k)
            i += 1
        for k in range(m - w):
            if kind == _EAGER:
                out[i] = _bid(n, m, 1, s, 0, k)
                out[i + 1] = _fid(n, m, s, 0, w + k)
            else:
                out[i] = _fid(n, m, s, 0, w + k)
                out[i + 1] = _bid(n, m, 1, s, 0, k)
            i += 2
        for k in range(m - w, m):
            out[i] = _bid(n, m, 1, s, 0, k)
            i += 1
        return
    total = m * v
    w = 2 * (n - 1 - s) + (v - 1) * n
    if w > total:
        w = total
    for k in range(w):
        out[i] = _fid(n, m, s, table[total + k], table[k])
        i += 1
    for k in range(total - w):
        out[i] = _fid(n, m, s, table[total + w + k], table[w + k])
        out[i + 1] = _bid(n, m, v, s, v - 1 - table[total + k], table[k])
        i += 2
    for k in range(total - w, total):
        out[i] = _bid(n, m, v, s, v - 1 - table[total + k], table[k])
        i += 1


cdef int _orders_into(str schedule, int n, int m, int v, int* seq) except -1:
    """Every device's order, device s at seq[s * 2 M V]."""
    cdef int kind = _kind_of(schedule, v), s, per = 2 * m * v
    cdef int* table = NULL
    if kind == _INTERLEAVED:
        table = _interleaved_table(m, v, n)
    try:
        with nogil:
            for s in range(n):
                _order_into(kind, n, m, v, s, table, seq + <size_t> s * per)
    finally:
        free(table)
    return 0


def order_ids(str schedule, int num_stages, int num_microbatches, int virtual_stages=1):
    """(N, 2 M V) int32 array: row s is device s's op ids in execution order
    (``schedules.op_orders`` without an object per op). Decode an id with ``decode_ids``."""
    n, m, v = _schedules.validate_schedule(schedule, num_stages, num_microbatches,
                                           virtual_stages)
    out = np.empty((n, 2 * m * v), dtype=np.intc)
    cdef int[:, ::1] o = out
    _orders_into(schedule, n, m, v, &o[0, 0])
    return out


def decode_ids(ids, int num_stages, int num_microbatches, int virtual_stages=1):
    """(is_backward, chunk, device, micro-batch) arrays of op ids (``order_ids``)."""
    a = np.asarray(ids, dtype=np.int64)
    n, m, nv = num_stages, num_microbatches, num_stages * virtual_stages
    vs = (a // m) % nv
    return a >= nv * m, vs // n, vs % n, a % m


# ------------------------------------------------------------------ engine programs in C -----
# ``EngineDAG``'s nodes built from the devices' programs (``engine.device_program``: compute ops
# and blocking calls) without a Python object per op or per message. A message is named by its
# sender's op id (each op sends at most one). Per device the program is emitted as a chain of
# nodes; a receive node's dependency is first the message (negative: -(id + 1)), resolved once
# every chain is built to the sender's node before the call that posts it (``walk_programs``'s
# "post"). A Kahn sweep over the chains then gives a topological order (and finds a deadlock),
# the DAG levels, and a stable counting sort by level the final slots.

cdef struct _Nodes:
    int* prev
    int* dep
    int* w
    int* e
    int size
    int cap


cdef int _nodes_grow(_Nodes* x) except -1:
    cdef int cap = x.cap * 2 if x.cap else 1024
    cdef int* p = <int*> realloc(x.prev, cap * sizeof(int))
    if p:
        x.prev = p
    cdef int* d = <int*> realloc(x.dep, cap * sizeof(int))
    if d:
        x.dep = d
    cdef int* ww = <int*> realloc(x.w, cap * sizeof(int))
    if ww:
        x.w = ww
    cdef int* ee = <int*> realloc(x.e, cap * sizeof(int))
    if ee:
        x.e = ee
    if not p or not d or not ww or not ee:
        raise MemoryError()
    x.cap = cap
    return 0


cdef struct _Emit:
    int n, m, v, nv, L, s
    int FO, BO, SC, RR          # weight slots of the four call costs
    bint fo, bo, sc, rr         # which are > 0
    int last                    # slot of the device's last node (0: none yet)
    int* post                   # message -> slot before the call that sent it (-1: not sent)


cdef inline int _push(_Nodes* x, int prev, int dep, int w, int e) except -1:
    if x.size == x.cap:
        _nodes_grow(x)
    x.prev[x.size] = prev
    x.dep[x.size] = dep
    x.w[x.size] = w
    x.e[x.size] = e
    x.size += 1
    return x.size           # its slot


cdef inline int _send_msg(_Emit* st, int op) noexcept nogil:
    """The message op sends (its own id), -1: none (the pipeline's last F / first B)."""
    cdef int half = st.nv * st.m, vs
    if op < half:
        vs = op // st.m
        return op if vs < st.nv - 1 else -1
    vs = (op - half) // st.m
    return op if vs > 0 else -1


cdef inline int _recv_msg(_Emit* st, int op) noexcept nogil:
    """The message op needs (its sender's op id), -1: none."""
    cdef int half = st.nv * st.m, vs
    if op < half:
        vs = op // st.m
        return op - st.m if vs > 0 else -1
    vs = (op - half) // st.m
    return op + st.m if vs < st.nv - 1 else -1


cdef inline int _edge_of(_Emit* st, int msg) noexcept nogil:
    """Weight slot of a message's link time (``engine.link_index``): an activation from device
    a uses Pf[a]; a gradient from device a uses Pb[(a - 1) mod N] (the wrap-around is N-1)."""
    cdef int half = st.nv * st.m, a, lo
    if msg < half:
        a = (msg // st.m) % st.n
        lo = a
        return 0 if lo >= st.L else 1 + 2 * st.nv + lo
    a = ((msg - half) // st.m) % st.n
    lo = a - 1 if a > 0 else st.n - 1
    return 0 if lo >= st.L else 1 + 2 * st.nv + st.L + lo


cdef int _op(_Nodes* x, _Emit* st, int op) except -1:
    cdef int half = st.nv * st.m
    cdef bint isb = op >= half
    cdef int vs = (op // st.m) % st.nv
    st.last = _push(x, st.last, 0, 1 + (st.nv if isb else 0) + vs, 0)
    if (st.bo if isb else st.fo):
        st.last = _push(x, st.last, 0, st.BO if isb else st.FO, 0)
    return 0


cdef int _call(_Nodes* x, _Emit* st, int s0, int s1, int r0, int r1) except -1:
    """A blocking call sending messages s0, s1 and receiving r0, r1 (-1: none)."""
    if s0 < 0 and s1 < 0 and r0 < 0 and r1 < 0:
        return 0
    cdef int t_slot = st.last
    if s0 >= 0:
        st.post[s0] = st.last
    if s1 >= 0:
        st.post[s1] = st.last
    if r0 >= 0:
        st.last = _push(x, st.last, -(r0 + 1), 0, _edge_of(st, r0))
    if r1 >= 0:
        st.last = _push(x, st.last, -(r1 + 1), 0, _edge_of(st, r1))
    if (r0 >= 0 or r1 >= 0) and st.rr:
        st.last = _push(x, st.last, 0, st.RR, 0)
    if (s0 >= 0 or s1 >= 0) and st.sc:
        if r0 >= 0 or r1 >= 0:
            st.last = _push(x, st.last, t_slot, 0, st.SC)
        else:
            st.last = _push(x, st.last, 0, st.SC, 0)
    return 0


cdef int _program(_Nodes* x, _Emit* st, int kind, bint unbundled, const int* ops,
                  const int* table) except -1:
    """Device st.s's program (``engine.device_program``) as nodes; ``ops``: its op order."""
    cdef int n = st.n, m = st.m, v = st.v, s = st.s, per = 2 * m * v
    cdef int i, k, w, r, total, j, f, b, nf, nb, msg
    cdef bint all_warm
    if unbundled:
        for i in range(per):
            _call(x, st, -1, -1, _recv_msg(st, ops[i]), -1)
            _op(x, st, ops[i])
            _call(x, st, _send_msg(st, ops[i]), -1, -1, -1)
        return 0
    if kind == _ONE_F_ONE_B:
        # forwards F(0, k) and backwards B(0, k) in micro-batch order
        w = n - 1 - s
        if w > m:
            w = m
        r = m - w
        for i in range(w):
            f = _fid(n, m, s, 0, i)
            _call(x, st, -1, -1, _recv_msg(st, f), -1)
            _op(x, st, f)
            _call(x, st, _send_msg(st, f), -1, -1, -1)
        if r > 0:
            _call(x, st, -1, -1, _recv_msg(st, _fid(n, m, s, 0, w)), -1)
        for i in range(r):
            f = _fid(n, m, s, 0, w + i)
            b = _bid(n, m, 1, s, 0, i)
            _op(x, st, f)
            _call(x, st, _send_msg(st, f), -1, _recv_msg(st, b), -1)
            _op(x, st, b)
            nf = _recv_msg(st, _fid(n, m, s, 0, w + i + 1)) if i < r - 1 else -1
            _call(x, st, _send_msg(st, b), -1, nf, -1)
        for i in range(r, m):
            b = _bid(n, m, 1, s, 0, i)
            _call(x, st, -1, -1, _recv_msg(st, b), -1)
            _op(x, st, b)
            _call(x, st, _send_msg(st, b), -1, -1, -1)
        return 0
    # interleaved: virtual micro-batch k runs F(table[k]) and B(reversed chunk)
    total = m * v
    w = 2 * (n - 1 - s) + (v - 1) * n
    if w > total:
        w = total
    all_warm = w == total
    _call(x, st, -1, -1, _recv_msg(st, _fid(n, m, s, table[total], table[0])), -1)
    for k in range(w):
        f = _fid(n, m, s, table[total + k], table[k])
        _op(x, st, f)
        nf = _recv_f(st, table, k) if k != total - 1 else -1
        if k == w - 1 and not all_warm:
            b = _bid(n, m, v, s, v - 1 - table[total], table[0])
            _call(x, st, _send_msg(st, f), -1, nf, _recv_msg(st, b))
        else:
            _call(x, st, _send_msg(st, f), -1, nf, -1)
    r = total - w
    for k in range(r):
        f = _fid(n, m, s, table[total + w + k], table[w + k])
        b = _bid(n, m, v, s, v - 1 - table[total + k], table[k])
        _op(x, st, f)
        _op(x, st, b)
        nf = _recv_f(st, table, w + k) if k != r - 1 else -1
        _call(x, st, _send_msg(st, f), _send_msg(st, b), nf, _recv_b(st, table, k))
    if all_warm:
        b = _bid(n, m, v, s, v - 1 - table[total], table[0])
        _call(x, st, -1, -1, _recv_msg(st, b), -1)
    for k in range(r, total):
        b = _bid(n, m, v, s, v - 1 - table[total + k], table[k])
        _op(x, st, b)
        nb = _recv_b(st, table, k) if k != total - 1 else -1
        _call(x, st, _send_msg(st, b), -1, nb, -1)
    return 0


cdef inline int _recv_f(_Emit* st, const int* table, int k) noexcept nogil:
    """What the call after forward k receives (``device_program``'s recv_f): the next
    forward's input, or on device 0 the activation device N-1 made N-1 virtual micro-batches
    earlier (sent by its F of that chunk), none after the last chunk."""
    cdef int n = st.n, m = st.m, v = st.v, total = m * v, j
    if st.s > 0:
        return _recv_msg(st, _fid(n, m, st.s, table[total + k + 1], table[k + 1])) \
            if k + 1 < total else -1
    j = k - (n - 1)
    if j < 0 or table[total + j] == v - 1:
        return -1
    return _fid(n, m, n - 1, table[total + j], table[j])


cdef inline int _recv_b(_Emit* st, const int* table, int k) noexcept nogil:
    cdef int n = st.n, m = st.m, v = st.v, total = m * v, j, bc
    if st.s < n - 1:
        return _recv_msg(st, _bid(n, m, v, st.s, v - 1 - table[total + k + 1], table[k + 1])) \
            if k + 1 < total else -1
    j = k - (n - 1)
    if j < 0:
        return -1
    bc = v - 1 - table[total + j]
    if bc == 0:
        return -1
    return _bid(n, m, v, 0, bc, table[j])


cdef class PipelineDAG:
    """Precomputed DAG structure of one (schedule, N, M, V); evaluate it for many weights."""

    def __cinit__(self):
        self._links = NULL
        self._last = NULL
        self._w = NULL
        self._fin = NULL

    def __dealloc__(self):
        free(self._links)
        free(self._last)
        free(self._w)
        free(self._fin)

    def __init__(self, str schedule, int num_stages, int num_microbatches, int virtual_stages=1,
                 list orders=None, bint build=True):
        """``orders`` (tests only): per device a list of ``schedules.Op`` to build from instead
        of the schedule's own orders (``order_ids``). ``build`` False (``EngineDAG``): only
        the weight buffer now; ``_build`` runs when the paper's DAG is first needed."""
        n, m, v = _schedules.validate_schedule(schedule, num_stages, num_microbatches,
                                               virtual_stages)
        self.schedule = schedule
        self.num_stages = n
        self.num_microbatches = m
        self.virtual_stages = v
        self.num_links = n if schedule == "interleaved-1f1b" else n - 1
        self.num_ops = 2 * n * m * v
        if build:
            self._build(orders)
            return
        self._wlen = 1 + 2 * n * v + 2 * self.num_links
        self._w = <double*> malloc(self._wlen * sizeof(double))
        if not self._w:
            raise MemoryError()
        self._w[0] = 0.0

    def _build(self, list orders=None):
        """Flatten the devices' op orders into ``_links`` in a topological order sorted by
        DAG level (stable): a Kahn-style sweep over the fixed orders, then a counting sort by
        level (hops from the start), so ops of one level are independent and the sweep's CPU
        overlaps them. Ops are numbered id = (is_backward * N V + virtual stage) * M + mb."""
        cdef int n = self.num_stages, m = self.num_microbatches, v = self.virtual_stages
        cdef int nv = n * v, L = self.num_links
        cdef int total = 2 * n * m * v, per = 2 * m * v
        cdef int i, j, s, k, idx, d, lv, top, cnt, link, vs, isb
        cdef int[::1] c
        cdef long long[::1] st_v, ch_v, mb_v, ps_v, pm_v
        cdef unsigned char[::1] bw_v
        if self._w == NULL:           # (an EngineDAG's build later keeps its weight buffer)
            self._wlen = 1 + 2 * nv + 2 * L
            self._w = <double*> malloc(self._wlen * sizeof(double))
            if self._w:
                self._w[0] = 0.0
        self._links = <OpLink*> malloc(total * sizeof(OpLink))
        self._last = <int*> malloc(n * sizeof(int))
        self._fin = <double*> malloc((total + 1) * sizeof(double))
        if not self._links or not self._last or not self._w or not self._fin:
            raise MemoryError()
        self._fin[0] = 0.0
        self.num_ops = total
        # every array below is one int per op; freed at the end whatever happens
        cdef int* seq = <int*> malloc(7 * total * sizeof(int) + (2 * n + total + 2) * sizeof(int))
        if not seq:
            raise MemoryError()
        cdef int* posn = seq + total        # id -> position in its device's order
        cdef int* topo = posn + total       # topological order (ids)
        cdef int* placed = topo + total     # id -> 1 once in topo
        cdef int* waiter = placed + total   # id -> the device blocked on it (-1: none)
        cdef int* level = waiter + total
        cdef int* slot = level + total      # id -> finish slot (sorted index + 1)
        cdef int* ptr = slot + total        # per device: next position
        cdef int* work = ptr + n            # stack of devices to advance (<= n + total)
        try:
            if orders is None:
                _orders_into(self.schedule, n, m, v, seq)
            else:
                for s in range(n):
                    if len(orders[s]) != per:
                        raise PoseidonError(f"internal: device {s} has {len(orders[s])} ops, "
                                            f"expected {per}")
                    for k, op in enumerate(orders[s]):
                        seq[s * per + k] = ((nv if op.is_backward else 0) + op.chunk * n + s) \
                            * m + op.microbatch
            for s in range(n):
                for k in range(per):
                    posn[seq[s * per + k]] = k
            for i in range(total):
                placed[i] = 0
                waiter[i] = -1
            for s in range(n):
                ptr[s] = 0
                work[s] = n - 1 - s
            top = n
            cnt = 0
            while top > 0:
                top -= 1
                s = work[top]
                while ptr[s] < per:
                    idx = seq[s * per + ptr[s]]
                    d = _dep_id(idx, nv, m)
                    if d >= 0 and not placed[d]:
                        waiter[d] = s
                        break
                    placed[idx] = 1
                    topo[cnt] = idx
                    cnt += 1
                    ptr[s] += 1
                    if waiter[idx] >= 0:
                        work[top] = waiter[idx]
                        top += 1
                        waiter[idx] = -1
            if cnt != total:
                raise PoseidonError(
                    f"internal: schedule {self.schedule!r} (N={n}, M={m}, V={v}) deadlocks: "
                    f"{cnt} of {total} ops can run")
            # levels in topological order, then a stable counting sort by level
            lv = 0
            for i in range(total):
                idx = topo[i]
                j = 0
                if posn[idx] > 0:
                    j = level[seq[_dev_of(idx, n, m) * per + posn[idx] - 1]] + 1
                d = _dep_id(idx, nv, m)
                if d >= 0 and level[d] + 1 > j:
                    j = level[d] + 1
                level[idx] = j
                if j > lv:
                    lv = j
            counts = np.zeros(lv + 2, dtype=np.intc)
            c = counts
            for i in range(total):
                c[level[topo[i]] + 1] += 1
            for j in range(lv + 1):
                c[j + 1] += c[j]
            for i in range(total):
                idx = topo[i]
                slot[idx] = c[level[idx]] + 1
                c[level[idx]] += 1
            st = np.empty(total, dtype=np.int64)
            ch = np.empty(total, dtype=np.int64)
            mb = np.empty(total, dtype=np.int64)
            bw = np.empty(total, dtype=bool)
            ps = np.empty(total, dtype=np.int64)
            perm = np.empty(total, dtype=np.int64)   # stage-major: (device, position) order
            st_v, ch_v, mb_v, ps_v, pm_v = st, ch, mb, ps, perm
            bw_v = bw.view(np.uint8)
            for k in range(total):
                idx = topo[k]
                i = slot[idx] - 1
                isb = idx // (nv * m)
                vs = (idx // m) % nv
                st_v[i] = vs % n
                ch_v[i] = vs // n
                mb_v[i] = idx % m
                bw_v[i] = isb
                ps_v[i] = posn[idx]
                s = vs % n
                pm_v[s * per + posn[idx]] = i
                self._links[i].prev = (slot[seq[s * per + posn[idx] - 1]] if posn[idx] > 0
                                       else 0)
                d = _dep_id(idx, nv, m)
                self._links[i].dep = slot[d] if d >= 0 else 0
                # weight buffer: [0]=0, F at 1 + vs, B at 1 + nv + vs, Pf at 1 + 2nv + link,
                # Pb at 1 + 2nv + L + link (vs = chunk*N + device = the virtual stage)
                self._links[i].node_w = 1 + (nv if isb else 0) + vs
                if d < 0 or d // (nv * m) != isb:   # no dependency, or the F -> B turnaround
                    self._links[i].edge_w = 0
                elif not isb:                        # F(vs-1) -> F(vs) over link (vs-1) mod N
                    link = (vs - 1) % n
                    self._links[i].edge_w = 1 + 2 * nv + link
                else:                                # B(vs+1) -> B(vs) over link vs mod N
                    link = vs % n
                    self._links[i].edge_w = 1 + 2 * nv + L + link
            for s in range(n):
                self._last[s] = slot[seq[s * per + per - 1]]
        finally:
            free(seq)
        for arr in (st, ch, mb, bw, ps):
            arr.setflags(write=False)
        self.op_stage, self.op_chunk, self.op_microbatch = st, ch, mb
        self.op_is_backward, self.op_position = bw, ps
        perm.setflags(write=False)
        self.stage_major = perm

    @property
    def nbytes(self):
        """Bytes this DAG holds (its links, workspace and per-op arrays; ``DagCache``)."""
        if self._links == NULL:
            return self._wlen * sizeof(double)
        return (self.num_ops * (sizeof(OpLink) + sizeof(double)) + self._wlen * sizeof(double)
                + sum(a.nbytes for a in (self.op_stage, self.op_chunk, self.op_microbatch,
                                         self.op_is_backward, self.op_position,
                                         self.stage_major)))

    def __repr__(self):
        return (f"PipelineDAG(schedule={self.schedule!r}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches}, "
                f"virtual_stages={self.virtual_stages})")

    def copy(self):
        """An independent instance (own workspace) of the same structure."""
        cdef PipelineDAG other = type(self).__new__(type(self))
        self._copy_into(other)
        return other

    cdef _copy_into(self, PipelineDAG other):
        cdef int total = self.num_ops
        other.schedule = self.schedule
        other.num_stages = self.num_stages
        other.num_microbatches = self.num_microbatches
        other.virtual_stages = self.virtual_stages
        other.num_links = self.num_links
        other.num_ops = total
        other._wlen = self._wlen
        if self._links == NULL:       # an EngineDAG whose paper DAG is not built (yet)
            other._w = <double*> malloc(self._wlen * sizeof(double))
            if not other._w:
                raise MemoryError()
            other._w[0] = 0.0
            return
        other._links = <OpLink*> malloc(total * sizeof(OpLink))
        other._last = <int*> malloc(self.num_stages * sizeof(int))
        other._w = <double*> malloc(self._wlen * sizeof(double))
        other._fin = <double*> malloc((total + 1) * sizeof(double))
        if not other._links or not other._last or not other._w or not other._fin:
            raise MemoryError()
        memcpy(other._links, self._links, total * sizeof(OpLink))
        memcpy(other._last, self._last, self.num_stages * sizeof(int))
        other._w[0] = 0.0
        other._fin[0] = 0.0
        other.op_stage, other.op_chunk = self.op_stage, self.op_chunk
        other.op_microbatch, other.op_is_backward = self.op_microbatch, self.op_is_backward
        other.op_position, other.stage_major = self.op_position, self.stage_major

    # ---------------------------------------------------------------- C level (nogil) -------
    cdef void _load(self, const double* F, const double* B, const double* Pf,
                    const double* Pb) noexcept nogil:
        cdef int nv = self.num_stages * self.virtual_stages, L = self.num_links, k
        cdef double* w = self._w
        for k in range(nv):
            w[1 + k] = F[k]
            w[1 + nv + k] = B[k]
        for k in range(L):
            w[1 + 2 * nv + k] = Pf[k]
            w[1 + 2 * nv + L + k] = Pb[k]

    cdef double iteration_time(self, const double* F, const double* B, const double* Pf,
                               const double* Pb, const double* R) noexcept nogil:
        self._load(F, B, Pf, Pb)
        return _sweep(self._links, self.num_ops, self._w, self._fin, self._last,
                      self.num_stages, R)

    cdef double simulate_into(self, const double* F, const double* B, const double* Pf,
                              const double* Pb, const double* R, double* op_start,
                              double* op_finish, unsigned char* via_dep,
                              double* ar_start, double* ar_finish) noexcept nogil:
        cdef int i, s, total = self.num_ops
        cdef const OpLink* lk = self._links
        cdef const double* w = self._w
        cdef double* fin = self._fin
        cdef double a, b, best
        self._load(F, B, Pf, Pb)
        for i in range(total):
            a = fin[lk[i].prev]
            b = fin[lk[i].dep] + w[lk[i].edge_w]
            # ties go to the cross-device dependency when there is one
            if lk[i].dep != 0 and b >= a:
                a = b
                via_dep[i] = 1
            else:
                via_dep[i] = 0
            op_start[i] = a
            fin[i + 1] = a + w[lk[i].node_w]
            op_finish[i] = fin[i + 1]
        best = 0.0
        for s in range(self.num_stages):
            ar_start[s] = fin[self._last[s]]
            ar_finish[s] = ar_start[s] + R[s]
            if ar_finish[s] > best:
                best = ar_finish[s]
        return best

    # ---------------------------------------------------------------- Python level ----------
    def time_ms(self, const double[::1] F, const double[::1] B, const double[::1] Pf,
                const double[::1] Pb, const double[::1] R):
        """Iteration time (ms). Arrays: contiguous float64 in the layout of ``_core.pxd``.

        Lengths are checked; values are not (``simulator/pipeline.py`` validates them once)."""
        _check(self, F, B, Pf, Pb, R)
        return self.iteration_time(_ptr(F), _ptr(B), _ptr(Pf), _ptr(Pb), _ptr(R))

    def time_ms_batch(self, const double[:, ::1] F, const double[:, ::1] B,
                      const double[:, ::1] Pf, const double[:, ::1] Pb,
                      const double[:, ::1] R):
        """Iteration times of K weight vectors at once: row k of every (K, len) array is one
        problem (layout of ``_core.pxd``). Returns a float64 array of K times (one C loop)."""
        cdef Py_ssize_t k, K = F.shape[0]
        if B.shape[0] != K or Pf.shape[0] != K or Pb.shape[0] != K or R.shape[0] != K:
            raise PoseidonError("time_ms_batch: every array needs the same number of rows")
        out = np.empty(K, dtype=np.float64)
        if K == 0:
            return out
        _check(self, F[0], B[0], Pf[0], Pb[0], R[0])
        cdef double[::1] o = out
        # The GIL stays held: the instance's workspace is shared by every Python caller of
        # this (cached) DAG. The loop itself is pure C.
        for k in range(K):
            o[k] = self.iteration_time(&F[k, 0], &B[k, 0],
                                       _ptr_nogil(Pf, k), _ptr_nogil(Pb, k), &R[k, 0])
        return out

    def time_ms_repeated(self, const double[::1] F, const double[::1] B,
                         const double[::1] Pf, const double[::1] Pb, const double[::1] R,
                         long repeats):
        """Benchmark helper: evaluate the same inputs ``repeats`` times in one C loop
        (so the caller can time the C sweep without Python call overhead)."""
        _check(self, F, B, Pf, Pb, R)
        cdef long r
        cdef double t = 0.0
        cdef const double* f = _ptr(F)
        cdef const double* b = _ptr(B)
        cdef const double* pf = _ptr(Pf)
        cdef const double* pb = _ptr(Pb)
        cdef const double* ar = _ptr(R)
        for r in range(repeats):  # GIL held on purpose, see time_ms_batch
            t = self.iteration_time(f, b, pf, pb, ar)
        return t

    def simulate(self, const double[::1] F, const double[::1] B, const double[::1] Pf,
                 const double[::1] Pb, const double[::1] R):
        """Full evaluation. Returns (time_ms, op_start, op_finish, via_dep, ar_start, ar_finish);
        per-op arrays are in this DAG's topological order (see ``op_stage`` etc.)."""
        _check(self, F, B, Pf, Pb, R)
        start = np.empty(self.num_ops, dtype=np.float64)
        finish = np.empty(self.num_ops, dtype=np.float64)
        via = np.empty(self.num_ops, dtype=np.uint8)
        ar0 = np.empty(self.num_stages, dtype=np.float64)
        ar1 = np.empty(self.num_stages, dtype=np.float64)
        cdef double[::1] st = start, fi = finish, a0 = ar0, a1 = ar1
        cdef unsigned char[::1] vd = via
        t = self.simulate_into(_ptr(F), _ptr(B), _ptr(Pf), _ptr(Pb), _ptr(R),
                               &st[0], &fi[0], &vd[0], &a0[0], &a1[0])
        return t, start, finish, via.astype(bool), ar0, ar1

    def predecessor_slots(self):
        """(prev, dep): per op, the topological index + 1 of its previous op on the device and
        of its cross-device dependency; 0 means none."""
        prev = np.empty(self.num_ops, dtype=np.int64)
        dep = np.empty(self.num_ops, dtype=np.int64)
        cdef int i
        for i in range(self.num_ops):
            prev[i] = self._links[i].prev
            dep[i] = self._links[i].dep
        return prev, dep

    def last_op_slots(self):
        """Per device: topological index + 1 of its last op (the all-reduce's predecessor)."""
        return np.array([self._last[s] for s in range(self.num_stages)], dtype=np.int64)


cdef _check(PipelineDAG self, const double[::1] F, const double[::1] B, const double[::1] Pf,
            const double[::1] Pb, const double[::1] R):
    cdef int nv = self.num_stages * self.virtual_stages
    if F.shape[0] != nv or B.shape[0] != nv:
        raise PoseidonError(f"forward/backward: expected {nv} per-(chunk, stage) times, "
                            f"got {F.shape[0]} and {B.shape[0]}")
    if Pf.shape[0] != self.num_links or Pb.shape[0] != self.num_links:
        raise PoseidonError(f"send_forward/send_backward: expected {self.num_links} times, "
                            f"got {Pf.shape[0]} and {Pb.shape[0]}")
    if R.shape[0] != self.num_stages:
        raise PoseidonError(f"allreduce: expected {self.num_stages} times, got {R.shape[0]}")


cdef inline const double* _ptr(const double[::1] a) noexcept:
    """Data pointer of a contiguous memoryview, NULL when empty (never dereferenced then)."""
    if a.shape[0] == 0:
        return NULL
    return &a[0]


cdef inline int _dep_id(int idx, int nv, int m) noexcept nogil:
    """Cross-device dependency of op ``idx`` (``PipelineDAG._build``'s numbering), -1: none.
    F(vs, mb) <- F(vs - 1, mb); B(vs, mb) <- B(vs + 1, mb), and the last virtual stage's
    B(nv - 1, mb) <- its F(nv - 1, mb)."""
    cdef int half = nv * m, vs
    if idx < half:
        vs = idx // m
        return idx - m if vs > 0 else -1
    vs = (idx - half) // m
    if vs < nv - 1:
        return idx + m
    return idx - half


cdef inline int _dev_of(int idx, int n, int m) noexcept nogil:
    """Device of op ``idx``."""
    return (idx // m) % n


cdef class EngineDAG(PipelineDAG):
    """The pipeline as megatron-core runs it (``engine.py`` with zero call and op overheads):
    every device executes its program of compute ops and *blocking* communication calls; a
    call posts its sends when reached (they arrive one link time later) and returns when
    everything it receives has arrived. For ``1f1b`` this equals the paper's DAG; for
    ``interleaved-1f1b`` megatron bundles a forward's send with the next backward's
    (``send_forward_backward_recv_forward_backward``), so an activation leaves only after
    the backward that follows it, and the next forward waits for the next gradient too.

    Same inputs and C API as ``PipelineDAG`` (the search uses it unchanged); the overriding
    ``iteration_time`` sweeps a chain of nodes per device in one topological order: each op,
    and one zero-weight node per received message (predecessor: the previous node on the
    device; dependency: the sender's node before its call, plus the link time). The inherited
    ``simulate`` / ``predecessor_slots`` still describe the paper's DAG (op-level detail of
    the engine's schedule: ``engine.simulate_engine``), built on their first call (the
    ``op_*`` attributes are None until then; ``paper_dag_arrays``). Never faster than the paper's DAG:
    every op starts no earlier (induction over the topological order).

    ``calls`` = (op forward, op backward, send call, receive ready) ms (``get_dag``; the
    profile DB's ``callcosts`` records): an op node is followed by a node of its op overhead;
    a call's receive nodes by one of ``receive ready`` (the call returns that long after its
    last message arrived); a call that sends returns no earlier than ``send call`` after it
    started (a node whose dependency is the call's start with that edge weight). Constant
    slots after the inputs in the weight buffer hold the four. Exactly ``simulate_engine``
    with the same costs on every device and a zero-time sync (tests/test_engine_calls.py)."""

    def __cinit__(self):
        self._elinks = NULL
        self._elast = NULL
        self._efin = NULL
        self._enodes = 0

    def __dealloc__(self):
        free(self._elinks)
        free(self._elast)
        free(self._efin)

    def __init__(self, str schedule, int num_stages, int num_microbatches,
                 int virtual_stages=1, tuple calls=None):
        # the paper's DAG (op arrays, simulate) only when asked for: a huge M's costs as much
        # as the engine's nodes (PP 8, V 2, M 131,072: 0.5 CPU-s and 0.27 GB)
        super().__init__(schedule, num_stages, num_microbatches, virtual_stages, None, False)
        fo, bo, sc, rr = _call_costs(calls)
        self.calls = (fo, bo, sc, rr)
        # four constant slots after the inputs: op overheads (F, B), send call, receive ready
        cdef int base = self._wlen
        self._wlen = base + 4
        cdef double* w2 = <double*> realloc(self._w, self._wlen * sizeof(double))
        if not w2:
            raise MemoryError()
        self._w = w2
        self._w[base], self._w[base + 1], self._w[base + 2], self._w[base + 3] = fo, bo, sc, rr
        _engine_build(self, schedule, fo, bo, sc, rr, base)

    def __repr__(self):
        return "Engine" + super().__repr__()

    @property
    def nbytes(self):
        return PipelineDAG.nbytes.__get__(self) + self._enodes * (sizeof(OpLink) + sizeof(double))

    def _base(self):
        """Build the paper's DAG (``PipelineDAG._build``) on first use."""
        if self._links == NULL:
            PipelineDAG._build(self)

    def simulate(self, F, B, Pf, Pb, R):
        """The paper's DAG's ``simulate`` (op-level detail of the engine's schedule:
        ``engine.simulate_engine``)."""
        self._base()
        return PipelineDAG.simulate(self, F, B, Pf, Pb, R)

    def predecessor_slots(self):
        self._base()
        return PipelineDAG.predecessor_slots(self)

    def last_op_slots(self):
        self._base()
        return PipelineDAG.last_op_slots(self)

    def paper_dag_arrays(self):
        """(op_stage, op_chunk, op_microbatch, op_is_backward, op_position, stage_major) of
        the paper's DAG, built on first use (the attributes are None until then)."""
        self._base()
        return (self.op_stage, self.op_chunk, self.op_microbatch, self.op_is_backward,
                self.op_position, self.stage_major)

    @property
    def num_engine_nodes(self):
        """Nodes of the engine's sweep (ops, their overheads, receives, call returns)."""
        return self._enodes

    cdef _copy_into(self, PipelineDAG other):
        PipelineDAG._copy_into(self, other)
        cdef EngineDAG o = <EngineDAG> other
        cdef int total = self._enodes
        o._enodes = total
        o._elinks = <OpLink*> malloc(max(total, 1) * sizeof(OpLink))
        o._elast = <int*> malloc(self.num_stages * sizeof(int))
        o._efin = <double*> malloc((total + 1) * sizeof(double))
        if not o._elinks or not o._elast or not o._efin:
            raise MemoryError()
        memcpy(o._elinks, self._elinks, total * sizeof(OpLink))
        memcpy(o._elast, self._elast, self.num_stages * sizeof(int))
        o._efin[0] = 0.0
        memcpy(o._w + self._wlen - 4, self._w + self._wlen - 4, 4 * sizeof(double))
        o.calls = self.calls

    cdef double iteration_time(self, const double* F, const double* B, const double* Pf,
                               const double* Pb, const double* R) noexcept nogil:
        self._load(F, B, Pf, Pb)
        return _sweep(self._elinks, self._enodes, self._w, self._efin, self._elast,
                      self.num_stages, R)


cdef int _engine_build(EngineDAG self, str schedule, double fo, double bo, double sc,
                       double rr, int base) except -1:
    """Fill ``_elinks`` / ``_elast`` from the devices' programs (see above)."""
    cdef int n = self.num_stages, m = self.num_microbatches, v = self.virtual_stages
    cdef int per = 2 * m * v, total_ops = 2 * n * m * v, kind = _kind_of(schedule, v)
    cdef bint unbundled = schedule not in ("1f1b", "interleaved-1f1b")
    cdef _Nodes x
    cdef _Emit st
    x.prev = x.dep = x.w = x.e = NULL
    x.size = x.cap = 0
    cdef int* ops = <int*> malloc(<size_t> per * sizeof(int) + sizeof(int))
    cdef int* table = NULL
    cdef int* beg = <int*> malloc((n + 1) * sizeof(int))
    cdef int* level = NULL
    cdef int* order = NULL
    cdef int* whead = NULL
    cdef int* wnext = NULL
    cdef int* ptr = NULL
    cdef int* stack = NULL
    cdef int s, i, d, lv, top, cnt, total, maxlv, p, y
    st.post = <int*> malloc(<size_t> total_ops * sizeof(int) + sizeof(int))
    try:
        if not ops or not beg or not st.post:
            raise MemoryError()
        if kind == _INTERLEAVED:
            table = _interleaved_table(m, v, n)
        st.n, st.m, st.v, st.nv, st.L = n, m, v, n * v, self.num_links
        st.FO, st.BO, st.SC, st.RR = base, base + 1, base + 2, base + 3
        st.fo, st.bo, st.sc, st.rr = fo > 0.0, bo > 0.0, sc > 0.0, rr > 0.0
        for i in range(total_ops):
            st.post[i] = -1
        for s in range(n):
            beg[s] = x.size
            st.s = s
            st.last = 0
            _order_into(kind, n, m, v, s, table, ops)
            _program(&x, &st, kind, unbundled, ops, table)
        beg[n] = x.size
        total = x.size
        # the receives' dependencies: the sender's slot before the call that posts the message
        for i in range(total):
            d = x.dep[i]
            if d < 0:
                d = st.post[-d - 1]
                if d < 0:
                    raise PoseidonError(f"engine model: the device programs deadlock (a message "
                                        f"is received but never sent; a bug)")
                x.dep[i] = d
        # Kahn's sweep over the chains: a topological order (order), the level of every slot
        level = <int*> malloc((<size_t> total + 1) * sizeof(int))
        order = <int*> malloc((<size_t> total + 1) * sizeof(int))
        whead = <int*> malloc((<size_t> total + 1) * sizeof(int))
        wnext = <int*> malloc(n * sizeof(int))
        ptr = <int*> malloc(n * sizeof(int))
        stack = <int*> malloc(n * sizeof(int))
        if not level or not order or not whead or not wnext or not ptr or not stack:
            raise MemoryError()
        with nogil:
            level[0] = 0
            for i in range(1, total + 1):
                level[i] = -1
                whead[i] = -1
            for s in range(n):
                ptr[s] = beg[s]
                stack[s] = n - 1 - s
            top = n
            cnt = 0
            maxlv = 0
            while top > 0:
                top -= 1
                s = stack[top]
                while ptr[s] < beg[s + 1]:
                    i = ptr[s]
                    d = x.dep[i]
                    if level[d] < 0:                  # the sender has not reached its call
                        wnext[s] = whead[d]
                        whead[d] = s
                        break
                    p = x.prev[i]
                    lv = (level[p] if level[p] > level[d] else level[d]) + 1
                    level[i + 1] = lv
                    if lv > maxlv:
                        maxlv = lv
                    order[cnt] = i
                    cnt += 1
                    ptr[s] += 1
                    y = whead[i + 1]
                    while y >= 0:
                        stack[top] = y
                        top += 1
                        y = wnext[y]
                    whead[i + 1] = -1
        if cnt != total:
            raise PoseidonError("engine model: the device programs deadlock (a bug)")
        # a stable counting sort by level (consecutive nodes independent: the sweep's CPU
        # overlaps them): whead becomes the per-level cursor, then slot -> new slot
        free(whead)
        whead = <int*> calloc(<size_t> maxlv + 2, sizeof(int))
        if not whead:
            raise MemoryError()
        self._enodes = total
        self._elinks = <OpLink*> malloc(max(total, 1) * sizeof(OpLink))
        self._elast = <int*> malloc(n * sizeof(int))
        self._efin = <double*> malloc((<size_t> total + 1) * sizeof(double))
        if not self._elinks or not self._elast or not self._efin:
            raise MemoryError()
        with nogil:
            for i in range(total):
                whead[level[i + 1]] += 1          # levels are 1..maxlv
            d = 0
            for lv in range(maxlv + 1):
                p = whead[lv]
                whead[lv] = d
                d += p
            for i in range(total):               # order[] in topological order -> new slots
                y = order[i]
                lv = level[y + 1]
                level[y + 1] = whead[lv] + 1      # level[] now holds the new slot
                whead[lv] += 1
            level[0] = 0
            for i in range(total):
                y = level[i + 1] - 1
                self._elinks[y].prev = level[x.prev[i]]
                self._elinks[y].dep = level[x.dep[i]]
                self._elinks[y].node_w = x.w[i]
                self._elinks[y].edge_w = x.e[i]
            for s in range(n):
                self._elast[s] = level[beg[s + 1]] if beg[s + 1] > beg[s] else 0
            self._efin[0] = 0.0
    finally:
        free(x.prev)
        free(x.dep)
        free(x.w)
        free(x.e)
        free(ops)
        free(table)
        free(beg)
        free(st.post)
        free(level)
        free(order)
        free(whead)
        free(wnext)
        free(ptr)
        free(stack)
    return 0


def _engine_edge(tuple msg, int n, int nv, int L):
    """Weight-buffer index of a message's link time (``engine.link_index``): activations use
    Pf, gradients Pb."""
    from poseidon_plugin.simulator.engine import link_index
    lo = link_index(msg, n)
    if lo >= L:
        return 0
    return 1 + 2 * nv + (0 if msg[0] == "F" else L) + lo


def _call_costs(calls) -> tuple:
    """(op forward, op backward, send call, receive ready) overheads in ms (``engine.py``'s
    ``fwd_overhead_ms``, ``bwd_overhead_ms``, ``send_call_ms``, ``recv_ready_ms``, one value
    for every device), finite and >= 0; None: all 0."""
    if calls is None:
        return (0.0, 0.0, 0.0, 0.0)
    out = tuple(float(c) for c in calls)
    if len(out) != 4 or any(not (c >= 0.0) or c == float("inf") for c in out):
        raise PoseidonError(f"engine call costs: expected 4 finite times >= 0 ms (op forward, "
                            f"op backward, send call, receive ready), got {calls!r}")
    return out


DAG_CACHE_BYTES = 1 << 30   # the DAGs kept built (a huge M: hundreds of MB each), see DagCache
DAG_CACHE_ENTRIES = 256


class DagCache:
    """Least-recently-used DAGs bounded by their bytes (``nbytes``) and their count: a DAG of
    131,072 micro-batches holds ~0.3 GB, and 256 of them (an lru of 256 by count) held 5.8 GB.
    The newest DAG always stays, however large (it is the one being timed)."""

    def __init__(self, max_bytes: int = DAG_CACHE_BYTES, max_entries: int = DAG_CACHE_ENTRIES):
        from collections import OrderedDict
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._d = OrderedDict()
        self.bytes = 0

    def get(self, key, build):
        got = self._d.get(key)
        if got is not None:
            self._d.move_to_end(key)
            return got
        got = build()
        self._d[key] = got
        self.bytes += got.nbytes
        while len(self._d) > 1 and (self.bytes > self.max_bytes
                                    or len(self._d) > self.max_entries):
            _, old = self._d.popitem(last=False)
            self.bytes -= old.nbytes
        return got

    def clear(self):
        self._d.clear()
        self.bytes = 0

    def __contains__(self, key):
        return key in self._d

    def __len__(self):
        return len(self._d)


_DAGS = DagCache()


def get_dag(str schedule, int num_stages, int num_microbatches, int virtual_stages=1,
            bint engine=False, tuple calls=None):
    """The cached DAG of (schedule, N, M, V) (``DagCache``: bounded by bytes). ``engine``: the
    timing of how megatron-core runs
    it (an ``EngineDAG`` for interleaved-1f1b; 1f1b is the same either way, and eager-1f1b /
    gpipe are not run by megatron-core, so they keep the paper's DAG). ``calls`` (engine only):
    megatron's per-op and per-call overheads ``(op forward, op backward, send call, receive
    ready)`` ms; when any is non-zero, every schedule is timed by an ``EngineDAG`` that charges
    them (``engine.simulate_engine``'s semantics, one value for every device; eager-1f1b and
    gpipe, which megatron-core does not run, with one blocking call per message:
    ``engine.device_program(unbundled=True)``).
    Shared: use ``.copy()`` per thread when calling its ``nogil`` API from several threads."""
    return _DAGS.get(_dag_key(schedule, num_stages, num_microbatches, virtual_stages, engine,
                              calls), lambda: _make_dag(schedule, num_stages, num_microbatches,
                                            virtual_stages, engine, calls))


def _dag_key(schedule, num_stages, num_microbatches, virtual_stages=1, engine=False,
             calls=None):
    return (schedule, num_stages, num_microbatches, virtual_stages, bool(engine), calls)


def dag_is_built(str schedule, int num_stages, int num_microbatches, int virtual_stages=1,
                 bint engine=False, tuple calls=None):
    """Whether ``get_dag`` of these arguments returns a DAG already built (no build cost)."""
    return _dag_key(schedule, num_stages, num_microbatches, virtual_stages, engine,
                    calls) in _DAGS


def _make_dag(str schedule, int num_stages, int num_microbatches, int virtual_stages,
              bint engine, tuple calls):
    costs = _call_costs(calls)
    if engine and any(costs):
        return EngineDAG(schedule, num_stages, num_microbatches, virtual_stages, costs)
    if engine and schedule == "interleaved-1f1b":
        return EngineDAG(schedule, num_stages, num_microbatches, virtual_stages)
    return PipelineDAG(schedule, num_stages, num_microbatches, virtual_stages)


cdef inline const double* _ptr_nogil(const double[:, ::1] a, Py_ssize_t row) noexcept nogil:
    """Row pointer of a C-contiguous 2-D memoryview, NULL when rows are empty."""
    if a.shape[1] == 0:
        return NULL
    return &a[row, 0]
