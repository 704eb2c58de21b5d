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

from functools import lru_cache

import numpy as np

from libc.stdlib cimport malloc, free, realloc
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

    def __init__(self, str schedule, int num_stages, int num_microbatches, int virtual_stages=1):
        n, m, v = _schedules.validate_schedule(schedule, num_stages, num_microbatches,
                                               virtual_stages)
        self.schedule = schedule
        self.num_stages = n
        self.num_microbatches = m
        self.virtual_stages = v
        self.num_links = n if schedule == "interleaved-1f1b" else n - 1
        orders = _schedules.op_orders(schedule, n, m, v)
        self._build(orders)

    def _build(self, list orders):
        """Flatten the devices' op orders into ``_links`` in a topological order sorted by
        DAG level (stable): a Kahn-style sweep over the fixed orders, then a counting sort by
        level (hops from the start), so ops of one level are independent and the sweep's CPU
        overlaps them. Ops are numbered id = (is_backward * N V + virtual stage) * M + mb."""
        cdef int n = self.num_stages, m = self.num_microbatches, v = self.virtual_stages
        cdef int nv = n * v, L = self.num_links
        cdef int total = 2 * n * m * v, per = 2 * m * v
        cdef int i, j, s, k, idx, d, lv, top, cnt, link, vs, isb
        cdef int[::1] c
        cdef long long[::1] st_v, ch_v, mb_v, ps_v
        cdef unsigned char[::1] bw_v
        self._wlen = 1 + 2 * nv + 2 * L
        self._links = <OpLink*> malloc(total * sizeof(OpLink))
        self._last = <int*> malloc(n * sizeof(int))
        self._w = <double*> malloc(self._wlen * sizeof(double))
        self._fin = <double*> malloc((total + 1) * sizeof(double))
        if not self._links or not self._last or not self._w or not self._fin:
            raise MemoryError()
        self._w[0] = 0.0
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
            for s in range(n):
                if len(orders[s]) != per:
                    raise PoseidonError(f"internal: device {s} has {len(orders[s])} ops, "
                                        f"expected {per}")
                k = 0
                for op in orders[s]:
                    idx = ((nv if op.is_backward else 0) + op.chunk * n + s) * m + op.microbatch
                    seq[s * per + k] = idx
                    posn[idx] = k
                    k += 1
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
            st_v, ch_v, mb_v, ps_v = st, ch, mb, ps
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
        perm = np.lexsort((ps, st)).astype(np.int64)
        perm.setflags(write=False)
        self.stage_major = perm

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
    the engine's schedule: ``engine.simulate_engine``). Never faster than the paper's DAG:
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
        super().__init__(schedule, num_stages, num_microbatches, virtual_stages)
        from poseidon_plugin.simulator.engine import device_program, walk_programs
        cdef int n = self.num_stages, m = self.num_microbatches, v = self.virtual_stages
        cdef int nv = n * v, L = self.num_links
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
        FO, BO, SC, RR = base, base + 1, base + 2, base + 3
        unbundled = schedule not in ("1f1b", "interleaved-1f1b")
        progs = [device_program(schedule, n, m, s, v, unbundled) for s in range(n)]
        # nodes in a topological order: (prev slot, dep slot, weight index, edge weight index)
        nodes = []
        last = [0] * n
        sent = {}          # message -> slot whose finish is the sender's call time
        for event, s, x in walk_programs(progs):
            if event == "post":
                sent[x] = last[s]
            elif x[0] == "op":
                op = x[1]
                nodes.append((last[s], 0, 1 + (nv if op.is_backward else 0) + op.chunk * n + s,
                              0))
                last[s] = len(nodes)
                if (bo if op.is_backward else fo) > 0.0:    # megatron's step around the model
                    nodes.append((last[s], 0, BO if op.is_backward else FO, 0))
                    last[s] = len(nodes)
            else:
                t_slot = last[s]               # the call starts here
                for r in x[2]:
                    nodes.append((last[s], sent[r], 0, _engine_edge(r, n, nv, L)))
                    last[s] = len(nodes)
                if x[2] and rr > 0.0:          # returns rr after max(t, arrivals)
                    nodes.append((last[s], 0, RR, 0))
                    last[s] = len(nodes)
                if x[1] and sc > 0.0:          # and not before t + sc when it also sends
                    nodes.append((last[s], t_slot, 0, SC) if x[2] else (last[s], 0, SC, 0))
                    last[s] = len(nodes)
        # sort by DAG level (stable), as the paper's DAG is: consecutive nodes are independent
        # and the CPU overlaps them (about 4x faster than the discovery order)
        level = [0] * (len(nodes) + 1)
        for i0, (pv, dp, _, _) in enumerate(nodes):
            level[i0 + 1] = max(level[pv], level[dp]) + 1
        order = sorted(range(len(nodes)), key=lambda j: level[j + 1])
        newslot = [0] * (len(nodes) + 1)
        for new_i, old_i in enumerate(order):
            newslot[old_i + 1] = new_i + 1
        nodes = [(newslot[nodes[j][0]], newslot[nodes[j][1]], nodes[j][2], nodes[j][3])
                 for j in order]
        last = [newslot[x] for x in last]
        cdef int i, total = len(nodes)
        self._enodes = total
        self._elinks = <OpLink*> malloc(max(total, 1) * sizeof(OpLink))
        self._elast = <int*> malloc(n * sizeof(int))
        self._efin = <double*> malloc((total + 1) * sizeof(double))
        if not self._elinks or not self._elast or not self._efin:
            raise MemoryError()
        for i in range(total):
            self._elinks[i].prev = nodes[i][0]
            self._elinks[i].dep = nodes[i][1]
            self._elinks[i].node_w = nodes[i][2]
            self._elinks[i].edge_w = nodes[i][3]
        for i in range(n):
            self._elast[i] = last[i]
        self._efin[0] = 0.0

    def __repr__(self):
        return "Engine" + super().__repr__()

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


@lru_cache(maxsize=256)
def get_dag(str schedule, int num_stages, int num_microbatches, int virtual_stages=1,
            bint engine=False, tuple calls=None):
    """The cached DAG of (schedule, N, M, V). ``engine``: the timing of how megatron-core runs
    it (an ``EngineDAG`` for interleaved-1f1b; 1f1b is the same either way, and eager-1f1b /
    gpipe are not run by megatron-core, so they keep the paper's DAG). ``calls`` (engine only):
    megatron's per-op and per-call overheads ``(op forward, op backward, send call, receive
    ready)`` ms; when any is non-zero, every schedule is timed by an ``EngineDAG`` that charges
    them (``engine.simulate_engine``'s semantics, one value for every device; eager-1f1b and
    gpipe, which megatron-core does not run, with one blocking call per message:
    ``engine.device_program(unbundled=True)``).
    Shared: use ``.copy()`` per thread when calling its ``nogil`` API from several threads."""
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
