# cython: language_level=3
"""Hot loop of the plan search: stage-by-stage branch and bound over (stage option, layers).

One call of :func:`search_config` explores every plan of one *outer configuration*
(schedule, V, d, b, N, M, the allowed stage options; a :class:`ConfigInstance`) and returns the
best one whose time does not exceed the incumbent threshold (a :class:`ConfigResult`).
Everything inside the recursion is typed C, ``nogil``; the types are declared in
``_search.pxd`` (the read-only ``ConfigData``, the per-thread ``SearchState``, the
``SearchStats`` counters) and the bounds live in ``_bounds.pyx``.

Stage option o = (device type, TP degree). For stage x the search chooses an option o and a
layer count l. Placement is the deterministic per-type cursor of ``placement.py``: stage x takes
the next d*t devices of its type (cursor aligned up to a multiple of t inside a node so that no
TP group spans nodes); DP replica r of the stage is the TP group starting at start + r*t.

Iteration time: the simulator's ``PipelineDAG`` (``poseidon_plugin/_core.pyx``), exactly the DAG
semantics of the simulator. :func:`replay_assignment` evaluates one given assignment through the
same cost and bound code (the tests' check of the bound's validity), outside the recursion.

Cost formulas here are twins of the Python originals (each names its original; a test pins each
pair): ``_send_ms``, ``_allreduce_ms`` and ``_chunk_layers``.
"""

from libc.math cimport ceil as c_ceil
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import threading

import numpy as np
cimport numpy as cnp

from poseidon_plugin._core cimport PipelineDAG
from poseidon_plugin.search._bounds cimport (bound, capacity, cap_path, later_costs, low_bound,
                                             rt_limit, rt_cut, pair_prefix)

cnp.import_array()

PREFIXES_PER_THREAD = 256  # threads > 1: split at the first depth with this many subtrees per thread
LIMITS = dict(stages=MAXN, virtual_stages=MAXV, options=MAXO, device_types=MAXT)
RIDGE_MODES = dict(off=RIDGE_OFF, cut=RIDGE_CUT, safe=RIDGE_SAFE)   # ``RidgeMode`` by name

cdef extern from *:
    """
    /* lock-free helpers for the threads of one search_config call (GCC/Clang builtins) */
    #include <stdint.h>
    #include <stddef.h>
    #include <stdlib.h>
    #include <string.h>
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    static inline int psn_fetch_add(int *p, int v) {
        return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
    }
    static inline double psn_load_d(double *p) {
        double v;
        __atomic_load(p, &v, __ATOMIC_RELAXED);
        return v;
    }
    static inline void psn_min_d(double *p, double v) {
        double cur;
        __atomic_load(p, &cur, __ATOMIC_RELAXED);
        while (v < cur && !__atomic_compare_exchange(p, &cur, &v, 1, __ATOMIC_RELAXED,
                                                     __ATOMIC_RELAXED)) {
        }
    }
    static inline void psn_lock(int *l) {
        while (__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE)) {
            while (__atomic_load_n(l, __ATOMIC_RELAXED)) {
            }
        }
    }
    static inline void psn_unlock(int *l) {
        __atomic_store_n(l, 0, __ATOMIC_RELEASE);
    }
    /* the memo's seqlocks: a writer (under the memo's lock) makes a version odd, writes,
       makes it even; a reader that saw one even version before and after read a whole state */
    static inline unsigned psn_load_acq(unsigned *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline unsigned psn_reload(unsigned *p) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        return __atomic_load_n(p, __ATOMIC_RELAXED);
    }
    static inline void psn_write_begin(unsigned *p) {
        __atomic_store_n(p, *p + 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
    }
    static inline void psn_write_end(unsigned *p) {
        __atomic_store_n(p, *p + 1, __ATOMIC_RELEASE);
    }
    static inline void psn_prefetch(const void *p) {
        __builtin_prefetch(p, 0, 1);
    }
    /* the memo's blocks: 64-byte aligned and zeroed. A malloc'd block starts 16 bytes into a
       cache line, so a 128-byte key slot spans three lines and every 64-byte vector two.
       Blocks of PSN_BIG bytes or more come straight from the kernel (Linux: untouched pages
       cost no memory) with 2 MB pages asked for: the table and the pool are far larger than
       the TLB's reach, and a lookup would otherwise pay a page walk besides the cache miss.
       The 16 bytes before a block say where it came from. */
    #define PSN_BIG ((size_t) 1 << 22)
    #define PSN_HUGE ((size_t) 1 << 21)
    static void *psn_alloc(size_t n) {
        char *raw, *p;
        size_t total = 0;
    #if defined(__linux__)
        if (n >= PSN_BIG) {
            total = n + PSN_HUGE + 64;
            raw = (char *) mmap(NULL, total, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (raw == (char *) MAP_FAILED)
                return NULL;
            p = (char *) (((uintptr_t) raw + 64 + PSN_HUGE - 1) & ~(uintptr_t) (PSN_HUGE - 1));
        #if defined(MADV_HUGEPAGE)
            madvise(p, n, MADV_HUGEPAGE);   /* (the block only: n rounded up to 2 MB could
                                               pass the mapping's end) */
        #endif
            ((size_t *) p)[-2] = (size_t) raw;
            ((size_t *) p)[-1] = total;
            return p;
        }
    #endif
        if (posix_memalign((void **) &raw, 64, n + 64) != 0)
            return NULL;
        memset(raw, 0, n + 64);
        p = raw + 64;
        ((size_t *) p)[-2] = (size_t) raw;
        ((size_t *) p)[-1] = total;
        return p;
    }
    static void psn_free(void *p) {
        if (p == NULL)
            return;
    #if defined(__linux__)
        if (((size_t *) p)[-1] != 0) {
            munmap((void *) ((size_t *) p)[-2], ((size_t *) p)[-1]);
            return;
        }
    #endif
        free((void *) ((size_t *) p)[-2]);
    }
    static void *psn_realloc(void *p, size_t old, size_t n) {
        void *q = psn_alloc(n);
        if (q != NULL && p != NULL) {
            memcpy(q, p, old < n ? old : n);
            psn_free(p);
        }
        return q;
    }
    static inline unsigned long long psn_load_acq_u64(unsigned long long *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void psn_store_rel_u64(unsigned long long *p, unsigned long long v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    """
    int psn_fetch_add(int* p, int v) noexcept nogil
    void psn_lock(int* l) noexcept nogil
    void psn_unlock(int* l) noexcept nogil
    double psn_load_d(double* p) noexcept nogil
    unsigned psn_load_acq(unsigned* p) noexcept nogil
    unsigned psn_reload(unsigned* p) noexcept nogil
    void psn_write_begin(unsigned* p) noexcept nogil
    void psn_write_end(unsigned* p) noexcept nogil
    unsigned long long psn_load_acq_u64(unsigned long long* p) noexcept nogil
    void psn_prefetch(const void* p) noexcept nogil
    void* psn_alloc(size_t n) noexcept nogil
    void psn_free(void* p) noexcept nogil
    void* psn_realloc(void* p, size_t old, size_t n) noexcept nogil
    void psn_store_rel_u64(unsigned long long* p, unsigned long long v) noexcept nogil
    void psn_min_d(double* p, double v) noexcept nogil


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# --------------------------------------------------------------------------- cost twins

cdef inline double _send_ms(double num_bytes, double gbps, double latency_ms) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.send_ms`` (0 bytes -> 0 ms)."""
    if num_bytes <= 0.0:
        return 0.0
    return num_bytes * 8.0 / (gbps * 1e6) + latency_ms


cdef inline double _allreduce_ms(double num_bytes, int ranks, double gbps,
                                 double latency_ms) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.allreduce_ms`` (ring: 2(d-1) steps)."""
    if ranks <= 1 or num_bytes <= 0.0:
        return 0.0
    return (2.0 * (ranks - 1) * latency_ms
            + 2.0 * (ranks - 1) / ranks * num_bytes * 8.0 / (gbps * 1e6))


cdef inline double _reduce_scatter_ms(double num_bytes, int ranks, double gbps,
                                      double latency_ms) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.reduce_scatter_ms`` (ring: d-1 steps; an all-gather
    costs the same)."""
    if ranks <= 1 or num_bytes <= 0.0:
        return 0.0
    return ((ranks - 1) * latency_ms
            + (<double>(ranks - 1)) / ranks * num_bytes * 8.0 / (gbps * 1e6))


cdef inline int _ddp_buckets(double params, int ranks, double bucket_params) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.ddp_buckets``."""
    cdef double b, size
    if params <= 0.0:
        return 1
    size = bucket_params if bucket_params > 0.0 else dmax(40000000.0, 1e6 * ranks)
    b = c_ceil(params / size)
    if b > 1073741824.0:                 # comm.MAX_BUCKETS
        return 1073741824
    return 1 if b < 1.0 else <int>b


cdef inline double _exposed_ms(double comm_ms, double window_ms, int buckets) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.exposed_ms``."""
    if buckets <= 1 or window_ms <= 0.0:
        return comm_ms
    return dmax(comm_ms / buckets, comm_ms - window_ms * (buckets - 1) / buckets)


cdef inline double _dp_sync_ms(double grad_bytes, double param_bytes, int ranks, double gbps,
                               double latency_ms, int sharded, int buckets,
                               double grad_window_ms, double param_window_ms) noexcept nogil:
    """Twin of ``poseidon_plugin.comm.dp_sync_ms``."""
    if not sharded:
        return _exposed_ms(_allreduce_ms(grad_bytes, ranks, gbps, latency_ms), grad_window_ms,
                           buckets)
    return (_exposed_ms(_reduce_scatter_ms(grad_bytes, ranks, gbps, latency_ms),
                        grad_window_ms, buckets)
            + _exposed_ms(_reduce_scatter_ms(param_bytes, ranks, gbps, latency_ms),
                          param_window_ms, buckets))


cdef inline int _chunk_layers(int layers, int virtual_stages, int chunk) noexcept nogil:
    """Twin of ``poseidon_plugin.costs.chunk_layers`` (one chunk's share)."""
    return layers // virtual_stages + (1 if chunk < layers % virtual_stages else 0)


def twin_send_ms(double num_bytes, double gbps, double latency_ms):
    """``_send_ms`` from Python (the tests pin it to its original)."""
    return _send_ms(num_bytes, gbps, latency_ms)


def twin_allreduce_ms(double num_bytes, int ranks, double gbps, double latency_ms):
    """``_allreduce_ms`` from Python (the tests pin it to its original)."""
    return _allreduce_ms(num_bytes, ranks, gbps, latency_ms)


def twin_dp_sync_ms(double grad_bytes, double param_bytes, int ranks, double gbps,
                    double latency_ms, bint sharded, int buckets=1, double grad_window_ms=0.0,
                    double param_window_ms=0.0):
    """``_dp_sync_ms`` from Python (the tests pin it to its original)."""
    return _dp_sync_ms(grad_bytes, param_bytes, ranks, gbps, latency_ms, sharded, buckets,
                       grad_window_ms, param_window_ms)


def twin_ddp_buckets(double params, int ranks, double bucket_params=0.0):
    """``_ddp_buckets`` from Python (the tests pin it to its original)."""
    return _ddp_buckets(params, ranks, bucket_params)


def twin_chunk_layers(int layers, int virtual_stages):
    """``_chunk_layers`` of every chunk, from Python (the tests pin it to its original)."""
    return tuple(_chunk_layers(layers, virtual_stages, c) for c in range(virtual_stages))


# --------------------------------------------------------------------------- the instance

cdef class BoundStructure:
    """Per-stage constants of one (N, M, schedule, V) that the lower bound needs.

    acnt[s*V + c]: forward ops of chunk c that device s runs before its first backward;
    t1cnt[s*V + c]: forward ops of chunk c up to and including F(s, V-1, mb 0);
    clast: chunk of every device's last op (a backward of the last micro-batch);
    pair_counts (interleaved, optional): ``configs.pair_counts``, the op counts of the
    two-stage path bound (``pair`` = 1 when given);
    loop1: 1 when V = 1 and every stage s runs a_s = acnt[s] forwards, then B(s, k) and
    F(s, k + a_s) alternately (1F1B's order; ``configs.steady_1f1b``): the adjacent-pair
    loop bound of ``_bounds.bound`` holds.
    Built by ``search.configs.bound_structure`` from ``schedules.op_orders``.
    """

    cdef public int N, M, V, clast, pair, loop1
    cdef int[::1] acnt
    cdef int[::1] t1cnt
    cdef int[::1] pcnt

    def __init__(self, int N, int M, int V, acnt, t1cnt, int clast, pair_counts=None,
                 int loop1=0):
        self.N = N
        self.loop1 = loop1
        self.M = M
        self.V = V
        self.acnt = np.ascontiguousarray(acnt, dtype=np.int32)
        self.t1cnt = np.ascontiguousarray(t1cnt, dtype=np.int32)
        self.clast = clast
        self.pair = 0 if pair_counts is None else 1
        if pair_counts is None:
            self.pcnt = np.zeros(1, dtype=np.int32)
        else:
            self.pcnt = np.ascontiguousarray(pair_counts, dtype=np.int32).reshape(-1)
            if self.pcnt.shape[0] != N * 6 * V:
                raise ValueError("BoundStructure: pair counts must have N*3*2*V entries")

    def arrays(self):
        """(acnt, t1cnt, loop1) (for the tests)."""
        return list(self.acnt), list(self.t1cnt), self.loop1


def _i32(a):
    return np.ascontiguousarray(a, dtype=np.int32).reshape(-1)


cdef class ConfigInstance:
    """The read-only ``ConfigData`` of one outer configuration, built once in Python
    (``search/instance.py``) and shared by every search of it (any threshold, any thread).

    Every argument is required (keyword-only); per option o: the (device type, TP) and the
    costs of one layer / the embedding / the output layer (ms, gradient bytes); ``lmax`` (O x N)
    the most layers option o fits at stage x; per device type: device count, offset into the
    flat per-device ``node_of`` / ``local_of`` (global node, index inside the node), intra- and
    inter-node Gbit/s.
    """

    cdef ConfigData data
    cdef readonly BoundStructure structure
    cdef object _keep          # arrays the data points into

    def __init__(self, BoundStructure structure, *, int dp, int num_layers,
                 double act_bytes, double latency_ms, double cross_gbps, double minsend,
                 double minfb, double outmin, double alpha, int ridge_mode, int ridge_ends,
                 int blocks, int use_bound, opt_type, opt_tp, f, b, ef, eb, of, ob, gl, ge, go,
                 lmax, ndev, type_off, intra, inter, node_of, local_of, og=None,
                 double overhead_ms=0.0, bint sharded=False, double wpg=0.5,
                 bint overlap_grad=False, bint overlap_param=False, double gpp=4.0,
                 double bucket=0.0, kinds=None, lmax_from=None, int ep=1, xg=None,
                 kxg=None, chunk_totals=None, fit=None):
        cdef ConfigData* I = &self.data
        cdef int N = structure.N, V = structure.V, O = len(opt_type), T = len(ndev), o, x, k
        if N > MAXN or V > MAXV or O > MAXO or T > MAXT:
            raise ValueError(f"ConfigInstance: N={N}, V={V}, {O} options, {T} types exceed the "
                             f"compiled limits {LIMITS}")
        self.structure = structure
        I.N, I.M, I.V, I.clast = N, structure.M, V, structure.clast
        I.d, I.L, I.O, I.T = dp, num_layers, O, T
        I.act_bytes, I.latency_ms, I.cross_gbps = act_bytes, latency_ms, cross_gbps
        I.overhead_ms = overhead_ms
        I.sharded, I.wpg = sharded, wpg
        I.ovl_grad, I.ovl_param, I.gpp, I.bucket = overlap_grad, overlap_param, gpp, bucket
        I.minsend, I.minfb, I.outmin, I.alpha = minsend, minfb, outmin, alpha
        I.ridge_mode, I.ridge_ends, I.blocks, I.use_bound = ridge_mode, ridge_ends, blocks, use_bound
        for o in range(O):
            I.opt_type[o] = opt_type[o]
            I.opt_tp[o] = opt_tp[o]
            I.of_[o] = f[o]
            I.ob_[o] = b[o]
            I.ofb[o] = I.of_[o] + I.ob_[o]
            I.oef[o] = ef[o]
            I.oeb[o] = eb[o]
            I.oof[o] = of[o]
            I.oob[o] = ob[o]
            I.ogl[o] = gl[o]
            I.oge[o] = ge[o]
            I.ogo[o] = go[o]
            I.oog[o] = og[o] if og is not None else 0.0
            I.oxg[o] = xg[o] if xg is not None else 0.0
        I.ep = ep
        I.kxg = NULL
        if ep < 1 or dp % ep:
            raise ValueError("ConfigInstance: ep must divide dp")
        for k in range(T):
            I.ndev[k] = ndev[k]
            I.type_off[k] = type_off[k]
            I.intra[k] = intra[k]
            I.inter[k] = inter[k]
            I.min_dt[k] = 0
        for o in range(O):
            k = I.opt_type[o]
            if I.min_dt[k] == 0 or dp * I.opt_tp[o] < I.min_dt[k]:
                I.min_dt[k] = dp * I.opt_tp[o]
        lm = _i32(lmax)
        if lm.shape[0] != O * N:
            raise ValueError("ConfigInstance: lmax must have O*N entries")
        lm2 = lm.reshape(O, N)
        # the order the search tries the options in: fastest layer first, then the most memory
        # (the sum of the stages' limits), then as given. Only the visiting order, not the
        # result (ties between plans are broken by the option indices): the dominance memo
        # skips a subtree when one searched before it proved it, and the fast, roomy stages'
        # subtrees prove the most. 70B/10,240's interleaved configuration at 1,648.1 ms, one
        # thread: 10.9 M nodes with its types listed fastest first, 14.2 M listed the other
        # way round and tried as listed; sorted, 10.9 M either way.
        for o, oi in enumerate(sorted(range(O), key=lambda i: (I.ofb[i], -int(lm2[i].sum()), i))):
            I.oorder[o] = oi
        per_stage = lm2.max(axis=0) if O > 0 else np.zeros(N, dtype=np.int32)
        suffix = np.zeros(N + 1, dtype=np.int32)
        somax = np.zeros((O, N + 1), dtype=np.int32)
        for x in range(N - 1, -1, -1):
            suffix[x] = suffix[x + 1] + max(int(per_stage[x]), 0)
            somax[:, x] = np.maximum(somax[:, x + 1], lm2[:, x])
        first = np.full((O, num_layers + 2), N, dtype=np.int32)
        for o in range(O):
            for x in range(N - 1, -1, -1):
                first[o, :max(int(lm2[o, x]), -1) + 1] = x
        arrays = (lm, suffix, _i32(somax), _i32(node_of), _i32(local_of), _i32(first))
        self._keep = arrays
        I.K = 1
        I.kf = I.kb = I.kgl = I.kog = NULL
        I.kpre = I.lmax_from = NULL
        I.xf = I.xb = NULL
        I.ilv = 0
        I.fitcb = NULL
        if kinds is not None:
            # kinds = (kf, kb, kgl, kog: O x K, kpre: K x (L + 1)); lmax_from: O x N x (L + 1)
            # (V = 1), or with V > 1 chunk_totals (V ints summing to L) and fit (the memory)
            kf, kb, kgl, kog, kpre = kinds
            K = len(kpre)
            if ridge_mode != RIDGE_OFF or K > MAXK:
                raise ValueError(f"ConfigInstance: layer kinds need no ridge rule and <= {MAXK}"
                                 " kinds")
            if V == 1 and lmax_from is None:
                raise ValueError("ConfigInstance: layer kinds at V = 1 need lmax_from")
            if V > 1:
                if (chunk_totals is None or fit is None or len(chunk_totals) != V
                        or sum(chunk_totals) != num_layers or min(chunk_totals) < N):
                    raise ValueError("ConfigInstance: layer kinds at V > 1 need chunk_totals "
                                     "(V counts >= N summing to the layers) and fit")
                I.ilv = 1
                I.fitcb = <void*> fit
                for x in range(V):
                    I.ck_tot[x] = chunk_totals[x]
                    I.ck_off[x] = sum(chunk_totals[:x])
                lmax_from = np.zeros(O * N * (num_layers + 1), dtype=np.int32)
            karr = tuple(np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
                         for a in (kf, kb, kgl, kog))
            if any(a.shape[0] != O * K for a in karr):
                raise ValueError("ConfigInstance: per-kind costs must have O*K entries")
            kp = _i32(kpre)
            lf = _i32(lmax_from)
            if kp.shape[0] != K * (num_layers + 1) or lf.shape[0] != O * N * (num_layers + 1):
                raise ValueError("ConfigInstance: kpre / lmax_from of the wrong size")
            # after stage x (>= x + 1 layers assigned): the per-layer minimum over the kinds
            # of layers [x + 1, L), per option (the bounds' costs of the later layers)
            kp2 = kp.reshape(K, num_layers + 1)
            kf2 = karr[0].reshape(O, K)
            kb2 = karr[1].reshape(O, K)
            xf = np.empty((N, O), dtype=np.float64)
            xb = np.empty((N, O), dtype=np.float64)
            for x in range(N):
                # V > 1: a later stage's layers may lie anywhere (chunk-major layout)
                first = min(x + 1, num_layers) if V == 1 else 0
                left = [k for k in range(K) if kp2[k, num_layers] - kp2[k, first] > 0]
                for o in range(O):
                    xf[x, o] = min(kf2[o, k] for k in left) if left else f[o]
                    xb[x, o] = min(kb2[o, k] for k in left) if left else b[o]
            xf = np.ascontiguousarray(xf).reshape(-1)
            xb = np.ascontiguousarray(xb).reshape(-1)
            self._keep = arrays + karr + (kp, lf, xf, xb, fit)
            I.xf = _dbl_ptr(xf)
            I.xb = _dbl_ptr(xb)
            I.K = K
            I.kf = _dbl_ptr(karr[0])
            I.kb = _dbl_ptr(karr[1])
            I.kgl = _dbl_ptr(karr[2])
            I.kog = _dbl_ptr(karr[3])
            I.kpre = _int_ptr(kp)
            I.lmax_from = _int_ptr(lf)
            if kxg is not None:
                kx = np.ascontiguousarray(kxg, dtype=np.float64).reshape(-1)
                if kx.shape[0] != O * K:
                    raise ValueError("ConfigInstance: kxg must have O*K entries")
                self._keep = self._keep + (kx,)
                I.kxg = _dbl_ptr(kx)
        I.lmax = _int_ptr(arrays[0])
        I.suffix_lmax = _int_ptr(arrays[1])
        I.suf_omax = _int_ptr(arrays[2])
        I.node_of = _int_ptr(arrays[3])
        I.local_of = _int_ptr(arrays[4])
        I.firstpos = _int_ptr(arrays[5])
        I.acnt = &structure.acnt[0]
        I.t1cnt = &structure.t1cnt[0]
        I.pair = structure.pair
        I.loop1 = structure.loop1
        I.pcnt = &structure.pcnt[0]
        for o in range(O):
            I.midlast[o] = _mid_last(I, o) if I.pair else 0.0
        I.acnt_sufmax[N] = 0
        for x in range(N - 1, -1, -1):
            I.acnt_sufmax[x] = I.acnt_sufmax[x + 1]
            if V == 1 and structure.acnt[x] > I.acnt_sufmax[x]:
                I.acnt_sufmax[x] = structure.acnt[x]


cdef double _mid_last(const ConfigData* I, int o):
    """The last stage's ops from F(N-1, 0, k*) to B(N-1, 0, 0) (``configs.pair_counts``' part 1
    and that forward) with option o and one layer per chunk, the output layer on chunk V-1:
    the least they take (more layers only take longer)."""
    cdef int V = I.V, cc
    cdef const int* px = I.pcnt + (I.N - 1) * 6 * V
    cdef double f, b, mid = I.of_[o]      # F(N-1, 0, k*): chunk 0 (V > 1: no output layer)
    for cc in range(V):
        f = I.of_[o] + (I.oof[o] if cc == V - 1 else 0.0)
        b = I.ob_[o] + (I.oob[o] if cc == V - 1 else 0.0)
        mid += px[2 * V + cc] * f + px[3 * V + cc] * b
    return mid


cdef const int* _int_ptr(cnp.ndarray a):
    return <const int*> a.data


cdef const double* _dbl_ptr(cnp.ndarray a):
    return <const double*> a.data


cdef class ConfigResult:
    """What one :func:`search_config` call found: ``best`` (None or (time ms, [option per
    stage], [layers per stage])), the ``SearchStats`` counters, whether the deadline stopped
    it, and the thread split (depth and number of subtrees; 0 when searched by one thread)."""

    cdef readonly object best
    cdef readonly long long nodes, simulated, improved
    cdef readonly long long cut_bound, cut_memory, cut_ridge, cut_devices, cut_capacity
    cdef readonly long long cut_dominated
    cdef readonly bint timed_out
    cdef readonly int split_depth, subtrees

    def counters(self):
        """The statistics as a dict (for ``SearchStats``)."""
        return dict(nodes=self.nodes, plans_simulated=self.simulated, cut_bound=self.cut_bound,
                    cut_memory=self.cut_memory, cut_ridge=self.cut_ridge,
                    cut_devices=self.cut_devices, cut_capacity=self.cut_capacity,
                    cut_dominated=self.cut_dominated)


cdef ConfigResult _result(SearchState* S, SearchStats* st, int N, int D, int ncollect):
    cdef ConfigResult r = ConfigResult.__new__(ConfigResult)
    cdef int x
    r.best = None
    if S.have_best:
        r.best = (S.best_T, [S.best_opt[x] for x in range(N)], [S.best_l[x] for x in range(N)])
    r.nodes, r.simulated, r.improved = st.nodes, st.simulated, st.improved
    r.cut_bound, r.cut_memory, r.cut_ridge = st.cut_bound, st.cut_memory, st.cut_ridge
    r.cut_devices, r.cut_capacity = st.cut_devices, st.cut_capacity
    r.cut_dominated = st.cut_dominated
    r.timed_out = S.timed_out != 0
    r.split_depth = D if D > 0 else 0
    r.subtrees = ncollect if D > 0 else 0
    return r


# --------------------------------------------------------------------------- stage costs

cdef double _link_send(const ConfigData* I, int o1, int s1, int o2, int s2) noexcept nogil:
    """Slowest replica link between two stages (activation send time, ms)."""
    cdef int k1 = I.opt_type[o1], k2 = I.opt_type[o2]
    cdef int t1 = I.opt_tp[o1], t2 = I.opt_tp[o2]
    cdef int r, n1, n2
    cdef double g, gmin = 1e300
    if k1 != k2:
        return _send_ms(I.act_bytes, I.cross_gbps, I.latency_ms)
    for r in range(I.d):
        n1 = I.node_of[I.type_off[k1] + s1 + r * t1]
        n2 = I.node_of[I.type_off[k2] + s2 + r * t2]
        g = I.intra[k1] if n1 == n2 else I.inter[k1]
        if g < gmin:
            gmin = g
    return _send_ms(I.act_bytes, gmin, I.latency_ms)


cdef inline int _aligned_start(const ConfigData* I, SearchState* S, int o) noexcept nogil:
    """First device of the next stage of option o's type (cursor aligned so that its TP
    groups stay in a node); -1 when the type's free devices cannot host the stage."""
    cdef int k = I.opt_type[o], t = I.opt_tp[o], start = S.cursor[k], local
    if start < I.ndev[k]:
        local = I.local_of[I.type_off[k] + start]
        if local % t != 0:
            start += t - local % t
    if start + I.d * t > I.ndev[k]:
        return -1
    return start


cdef inline double _place_stage(const ConfigData* I, SearchState* S, int x, int o,
                                int start) noexcept nogil:
    """Decide stage x's option and devices: its send link from stage x-1 (and the wrap-around
    link of an interleaved last stage); returns the Gbit/s of its DP all-reduce ring."""
    cdef int k = I.opt_type[o], dt = I.d * I.opt_tp[o]
    cdef double Pfx
    S.st_opt[x] = o
    S.st_start[x] = start
    if x > 0:
        Pfx = _link_send(I, S.st_opt[x - 1], S.st_start[x - 1], o, start)
        S.Pf[x - 1] = Pfx
        S.Pb[x - 1] = Pfx
    if x == I.N - 1:
        if I.V > 1:
            Pfx = _link_send(I, o, start, S.st_opt[0], S.st_start[0])
            S.Pf[x] = Pfx
            S.Pb[x] = Pfx
        else:
            S.Pf[x] = 0.0
            S.Pb[x] = 0.0
    if I.pair:
        pair_prefix(I, S, x)
    if I.d <= 1:
        return 0.0
    if I.node_of[I.type_off[k] + start] == I.node_of[I.type_off[k] + start + dt - 1]:
        return I.intra[k]
    return I.inter[k]


cdef inline void _chunk_starts(const ConfigData* I, SearchState* S, int x, int* starts
                               ) noexcept nogil:
    """A model of several layer kinds: the first layer of each chunk of stage x, from the
    layers of the stages before it (``costs.stage_layer_ranges``: Megatron's chunk-major
    layout; V = 1: the layers before it)."""
    cdef int cc, c
    for c in range(I.V):
        starts[c] = I.ck_off[c] if I.ilv else 0
        for cc in range(x):
            starts[c] += _chunk_layers(S.st_l[cc], I.V, c)


cdef inline int _chunk_cap(const ConfigData* I, const int* starts, int K) noexcept nogil:
    """Interleaved, several kinds: the most layers stage x (chunks from ``starts``) may hold
    with chunk c's layers of all stages = ck_tot[c] and K later stages holding >= 1 layer of
    each chunk (-1: none): the largest l = V q + t with q + (c < t) <= room_c for every c."""
    cdef int c, q = 1 << 30, room
    for c in range(I.V):
        room = I.ck_off[c] + I.ck_tot[c] - K - starts[c]
        if room < q:
            q = room
    if q < 0:
        return -1
    for c in range(I.V):
        if I.ck_off[c] + I.ck_tot[c] - K - starts[c] == q:
            return I.V * q + c
    return I.V * q


cdef int _fit_layers(const ConfigData* I, int o, int x, const int* starts, int cap
                     ) noexcept nogil:
    """Interleaved, several kinds: the most layers <= cap that option o fits at stage x with
    its chunks from ``starts`` (the Python memory path, ``I.fitcb``; 0 on an error)."""
    cdef int c, got = 0
    with gil:
        try:
            got = (<object> I.fitcb)(o, x, tuple([starts[c] for c in range(I.V)]), cap)
        except BaseException:
            import traceback
            traceback.print_exc()
            got = 0
    return got


cdef int _stage_hi(const ConfigData* I, SearchState* S, int x, int o, int Lrem, int K
                   ) noexcept nogil:
    """The most layers option o may hold at stage x (memory; several kinds: from the
    stage's own layers), K later stages, Lrem layers left."""
    cdef int hi, starts[MAXV]
    if I.K == 1:
        return I.lmax[o * I.N + x]
    if not I.ilv:      # the stage's first layer is the layers assigned before it
        return I.lmax_from[(o * I.N + x) * (I.L + 1) + I.L - Lrem]
    _chunk_starts(I, S, x, starts)
    hi = _chunk_cap(I, starts, K)
    if hi > I.lmax[o * I.N + x]:
        hi = I.lmax[o * I.N + x]
    if hi > Lrem:
        hi = Lrem
    if hi < I.V:
        return hi
    return _fit_layers(I, o, x, starts, hi)


cdef void _set_stage(const ConfigData* I, SearchState* S, int x, int o, int l,
                     double ring) noexcept nogil:
    """Chunk costs, forward total and post-pipeline time (DP all-reduce + optimizer step +
    per-iteration overhead) of stage x with option o and l layers
    (the embedding on chunk 0 of stage 0, the output layer on chunk V-1 of the last stage)."""
    cdef int V = I.V, cc, nb, a, e, k, c, L1 = I.L + 1
    cdef int starts[MAXV]
    cdef int cnt[MAXK]
    cdef bint overlap
    cdef double G, F = 0.0, gw, pw, opt, optk = 0.0, gk, gx = 0.0, Ge = 0.0, ek, esync = 0.0
    if I.K > 1:
        # the layers each chunk holds (V = 1: [a, a + l), a the layers before it; V > 1: the
        # chunk-major layout), each kind at its own costs, as
        # costs.stage_costs(layer_kinds="per-kind"): the embedding / output layer's optimizer
        # step at oog (the first kind's rate)
        _chunk_starts(I, S, x, starts)
        for k in range(I.K):
            cnt[k] = 0
        for cc in range(V):
            S.fc[x * V + cc] = 0.0
            S.bc[x * V + cc] = 0.0
            a = starts[cc] if starts[cc] <= I.L else I.L
            e = a + _chunk_layers(l, V, cc)
            if e > I.L:          # (only a bound_parts probe past the chunk totals)
                e = I.L
            for k in range(I.K):
                c = I.kpre[k * L1 + e] - I.kpre[k * L1 + a]
                cnt[k] += c
                S.fc[x * V + cc] += c * I.kf[o * I.K + k]
                S.bc[x * V + cc] += c * I.kb[o * I.K + k]
        G = 0.0
        for k in range(I.K):
            c = cnt[k]
            gk = c * I.kgl[o * I.K + k]
            G += gk
            optk += (gk * I.kog[o * I.K + k] / I.d) if I.sharded else gk * I.kog[o * I.K + k]
            if I.kxg != NULL and I.kxg[o * I.K + k] != 0.0:
                # the kind's routed experts (costs.stage_costs: comm.expert_optimizer_ms)
                ek = c * I.kxg[o * I.K + k]
                Ge += ek
                optk += (ek * I.kog[o * I.K + k] * I.ep / I.d) if I.sharded \
                    else ek * I.kog[o * I.K + k]
    else:
        for cc in range(V):
            S.fc[x * V + cc] = _chunk_layers(l, V, cc) * I.of_[o]
            S.bc[x * V + cc] = _chunk_layers(l, V, cc) * I.ob_[o]
        G = l * I.ogl[o]
        Ge = l * I.oxg[o]
    if x == 0:
        S.fc[0] += I.oef[o]
        S.bc[0] += I.oeb[o]
        G += I.oge[o]
        gx += I.oge[o]
    if x == I.N - 1:
        S.fc[x * V + V - 1] += I.oof[o]
        S.bc[x * V + V - 1] += I.oob[o]
        G += I.ogo[o]
        gx += I.ogo[o]
    for cc in range(V):
        F += S.fc[x * V + cc]
    S.Fst[x] = F
    gw = 0.0
    pw = 0.0
    nb = 1
    overlap = I.d > 1 and x == 0 and V == 1 and (I.ovl_grad or I.ovl_param)
    if overlap:                          # as costs.stage_costs: only stage 0's chunk 0 buckets
        if I.ovl_grad:
            gw = S.bc[0]
        if I.ovl_param:
            pw = S.fc[0]
        if gw != 0.0 or pw != 0.0:
            nb = _ddp_buckets(G / I.gpp, I.d, I.bucket)
    if I.K > 1:
        opt = optk
        if gx != 0.0:
            opt += (gx * I.oog[o] / I.d) if I.sharded else gx * I.oog[o]
    else:
        opt = (G * I.oog[o] / I.d) if I.sharded else G * I.oog[o]
        if Ge != 0.0:
            opt = opt + ((Ge * I.oog[o] * I.ep / I.d) if I.sharded else Ge * I.oog[o])
    if Ge != 0.0 and I.d // I.ep > 1:
        # the experts' gradients over expert-DP (comm.expert_sync_ms: not overlapped)
        esync = _dp_sync_ms(Ge, Ge * I.wpg, I.d // I.ep, ring, I.latency_ms, I.sharded, 1,
                            0.0, 0.0)
    S.R[x] = (((_dp_sync_ms(G, G * I.wpg, I.d, ring, I.latency_ms, I.sharded, nb, gw, pw)
                if I.d > 1 else 0.0) + esync)
              + opt
              + I.overhead_ms)
    # the bounds' R: with the overlap, stage 0's exposed sync is not monotone in its layers
    # (a longer backward hides more), so it is left out there (a lower bound, monotone in l)
    S.Rb[x] = ((0.0 + esync) + opt + I.overhead_ms) if overlap else S.R[x]


cdef inline int _ridge_stage(const ConfigData* I, int x) noexcept nogil:
    if I.ridge_mode == RIDGE_OFF:
        return 0
    if I.ridge_ends:
        return 1
    return 1 if (x > 0 and x < I.N - 1) else 0


cdef int _lex_less(const int* ao, const int* al, const int* bo, const int* bl,
                   int N) noexcept nogil:
    """Assignment (ao, al) lexicographically smaller than (bo, bl), stage by stage (option,
    then layers): the tie-break between plans of equal time."""
    cdef int x
    for x in range(N):
        if ao[x] != bo[x]:
            return 1 if ao[x] < bo[x] else 0
        if al[x] != bl[x]:
            return 1 if al[x] < bl[x] else 0
    return 0


cdef enum:
    # a leaf of a DAG with at least this many ops checks the deadline itself (``enter``
    # checks it every 1,024 nodes: 1,024 sweeps of a huge M's DAG, ~10 ms each, ran seconds
    # past it)
    DEADLINE_CHECK_OPS = 16384


cdef double _evaluate(const ConfigData* I, SearchState* S, PipelineDAG dag) noexcept nogil:
    """Iteration time of the fully decided assignment in S (the simulator's DAG). A large
    DAG's sweep (DEADLINE_CHECK_OPS) past the deadline stops the search (``enter``)."""
    cdef int x, cc, N = I.N, V = I.V
    cdef double t
    for x in range(N):
        for cc in range(V):
            S.WF[cc * N + x] = S.fc[x * V + cc]
            S.WB[cc * N + x] = S.bc[x * V + cc]
        S.EF[x] = S.Pf[x]
        S.EB[x] = S.Pb[x]
    t = dag.iteration_time(S.WF, S.WB, S.EF, S.EB, S.R)
    if S.deadline > 0 and dag.num_ops >= DEADLINE_CHECK_OPS and _now() > S.deadline:
        S.timed_out = 1
    return t


# --------------------------------------------------------------------------- dominance memo

cdef enum:
    MEMO_VECS = 32           # non-dominated state vectors kept per key (at most)
    MEMO_FIRST = 2           # ... room for this many when a key is first stored, doubled as needed
    MEMO_MIN_SLOTS = 256
    MEMO_MAX_SLOTS = 262144  # keys; the table is wiped when full
    MEMO_POOL = 2097152      # vectors in the pool (144 MiB: nine doubles each); the table is wiped when it is full
    MEMO_W = 9               # head, tail, MA, MC + P, Qp + Sg, MD + 2 P, QX, threshold, MW + 2 P
    MEMO_MAXK = 8 + MAXT     # key length (``Searcher.descend``: 8 + one cursor per type)


cdef struct MemoSlot:
    # one key: its hash (0: empty), its vectors' segment and the key itself, together (one
    # lookup touches one or two cache lines of the table; apart, they were five misses)
    unsigned long long hash
    long off                  # the segment's first vector in the pool
    int nvec
    int room                  # vectors the segment holds
    unsigned ver              # seqlock of the vectors (``fixed``)
    int key[MEMO_MAXK]


cdef struct Memo:
    # open addressing over keys (x, layers left, option, start, layers of stage x, used mask,
    # stage 0's option and start, every type's cursor); per key up to MEMO_VECS vectors of
    # MEMO_W numbers (stage x's bound terms, and the threshold the subtree was searched under)
    # in a segment of a shared pool: a key's segment starts with room for MEMO_FIRST vectors
    # and moves to the pool's end with twice the room when full (most keys keep one or two
    # vectors, a few keep dozens: with a fixed 3 per key, 70B on 10,240 devices' slowest
    # configuration searched 2.5x the nodes). At most about 185 MB for one configuration's
    # search (its threads share the memo: ``Searcher.record``).
    # Threads (``fixed``): the table and the pool are allocated once at their largest (no
    # rehash, no realloc; untouched pages cost no memory), inserts take the memo's lock and
    # lookups take none: a slot's vectors are read between two equal even values of the
    # slot's seqlock ``ver``, the table between two of ``epoch`` (a wipe); a lookup that sees
    # a write under way misses (a miss only costs a search, a false hit would lose plans).
    long nslots
    long nused
    int klen
    int fixed
    unsigned epoch            # seqlock of the whole memo (odd: a wipe under way)
    MemoSlot* slots
    double* pool
    long pool_used            # vectors handed out
    long pool_size            # vectors allocated
    long pool_max             # the pool's limit in vectors (0: MEMO_POOL)


cdef inline int _memo_klen(const ConfigData* I) noexcept nogil:
    """The memo key's length: 8 + one cursor per type (``Searcher.memo_key``), and with
    several kinds interleaved the first layer of each chunk but the last after stage x (the
    memo is off where they do not fit MEMO_MAXK)."""
    return 8 + I.T + (I.V - 1 if I.ilv else 0)


cdef inline unsigned long long _memo_hash(const int* key, int klen) noexcept nogil:
    cdef unsigned long long h = 1469598103934665603ULL
    cdef int i
    for i in range(klen):
        h = (h ^ <unsigned int> key[i]) * 1099511628211ULL
    h ^= h >> 29
    return h | 1ULL


cdef inline void _memo_prefetch(const Memo* m, unsigned long long h) noexcept nogil:
    """Start loading the slot where a lookup of hash h begins (the table is far larger than
    the caches: without it, a lookup waits for memory)."""
    cdef const char* p
    if m.nslots > 0:
        p = <const char*> &m.slots[<long> (h & <unsigned long long> (m.nslots - 1))]
        psn_prefetch(p)                 # (a slot is two cache lines: ``psn_alloc``)
        psn_prefetch(p + 64)


cdef int _memo_alloc(Memo* m, long nslots, int klen) noexcept nogil:
    """The key table (the pool is kept: a rehash moves no vector)."""
    m.slots = <MemoSlot*> psn_alloc(nslots * sizeof(MemoSlot))
    if m.slots == NULL:
        return 0
    m.nslots = nslots
    m.nused = 0
    m.klen = klen
    return 1


cdef void _memo_free_table(Memo* m) noexcept nogil:
    psn_free(m.slots)
    m.slots = NULL
    m.nslots = 0
    m.nused = 0


cdef void _memo_free(Memo* m) noexcept nogil:
    _memo_free_table(m)
    psn_free(m.pool)
    m.pool = NULL
    m.pool_used = 0
    m.pool_size = 0
    m.fixed = 0


cdef void _memo_wipe(Memo* m) noexcept nogil:
    cdef long i
    psn_write_begin(&m.epoch)
    for i in range(m.nslots):
        m.slots[i].hash = 0
    m.nused = 0
    m.pool_used = 0
    psn_write_end(&m.epoch)


cdef int _memo_fix(Memo* m, int klen, long pool_max) noexcept nogil:
    """Make an empty memo ``fixed`` (shared by threads: see ``Memo``); 0 when out of memory
    (it is then left empty and unfixed)."""
    cdef long most = pool_max if pool_max > 0 else MEMO_POOL
    _memo_free(m)
    if not _memo_alloc(m, MEMO_MAX_SLOTS, klen):
        return 0
    m.pool = <double*> psn_alloc(most * MEMO_W * sizeof(double))
    if m.pool == NULL:
        _memo_free(m)
        return 0
    m.pool_size = most
    m.pool_max = most
    m.fixed = 1
    return 1


cdef long _memo_slot(const Memo* m, const int* key, unsigned long long h) noexcept nogil:
    """The key's slot, or the empty slot where it would go."""
    cdef long i = <long> (h & <unsigned long long> (m.nslots - 1))
    while m.slots[i].hash != 0:
        if m.slots[i].hash == h and memcmp(m.slots[i].key, key, m.klen * sizeof(int)) == 0:
            return i
        i = (i + 1) & (m.nslots - 1)
    return i


cdef int _memo_grow(Memo* m) noexcept nogil:
    """Double the key table (rehash); at the largest size wipe it. 0 when out of memory."""
    cdef Memo old = m[0]
    cdef long i, j
    if m.nslots >= MEMO_MAX_SLOTS:
        _memo_wipe(m)
        return 1
    if not _memo_alloc(m, 2 * old.nslots, old.klen):
        m[0] = old
        return 0
    for i in range(old.nslots):
        if old.slots[i].hash == 0:
            continue
        j = _memo_slot(m, old.slots[i].key, old.slots[i].hash)
        m.slots[j] = old.slots[i]
        m.nused += 1
    _memo_free_table(&old)
    return 1


cdef long _memo_take(Memo* m, int n) noexcept nogil:
    """A segment of n vectors at the pool's end (grown as needed); -1 when the pool is at
    its limit (the caller wipes) or out of memory."""
    cdef long need = m.pool_used + n, size
    cdef long most = m.pool_max if m.pool_max > 0 else MEMO_POOL
    cdef double* np
    if need > most:
        return -1
    if need > m.pool_size:
        size = 2 * m.pool_size if m.pool_size > 0 else 4096
        while size < need:
            size *= 2
        if size > most:
            size = most
        np = <double*> psn_realloc(m.pool, m.pool_used * MEMO_W * sizeof(double),
                                   size * MEMO_W * sizeof(double))
        if np == NULL:
            return -1
        m.pool = np
        m.pool_size = size
    m.pool_used = need
    return need - n


cdef inline int _memo_covers(const double* a, const double* b) noexcept nogil:
    """State a (a recorded subtree without a plan) is no larger than state b in every bound
    term and was searched under a threshold no lower than b's."""
    return (a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and a[3] <= b[3]
            and a[4] <= b[4] and a[5] <= b[5] and a[6] <= b[6] and a[7] >= b[7]
            and a[8] <= b[8])


cdef int _memo_dominated(Memo* m, const int* key, unsigned long long h,
                         const double* vec) noexcept nogil:
    """Some vector of the key covers vec. Safe without the lock in a ``fixed`` memo (the
    seqlocks: a write or wipe under way makes it a miss)."""
    cdef long i, mask, off
    cdef int j, n, dom = 0
    cdef unsigned e, v
    cdef unsigned long long hv
    cdef MemoSlot* sl
    cdef const double* base
    if m.nslots == 0:
        return 0
    e = psn_load_acq(&m.epoch)
    if e & 1:
        return 0
    mask = m.nslots - 1
    i = <long> (h & <unsigned long long> mask)
    while True:
        sl = &m.slots[i]
        hv = psn_load_acq_u64(&sl.hash)
        if hv == 0:
            return 0
        if hv == h and memcmp(sl.key, key, m.klen * sizeof(int)) == 0:
            break
        i = (i + 1) & mask
    v = psn_load_acq(&sl.ver)
    if v & 1:
        return 0
    n = sl.nvec
    off = sl.off
    if n > MEMO_VECS or off < 0 or off + n > m.pool_size:
        return 0                        # (a torn read: the checks below would reject it)
    base = &m.pool[off * MEMO_W]
    for j in range(n):
        if _memo_covers(&base[j * MEMO_W], vec):
            dom = 1
            break
    if psn_reload(&sl.ver) != v or psn_reload(&m.epoch) != e:
        return 0
    return dom


cdef void _memo_insert(Memo* m, const int* key, int klen, unsigned long long h,
                       const double* vec) noexcept nogil:
    """Record vec under key (the caller holds the memo's lock when threads share it)."""
    cdef long i, at
    cdef MemoSlot* sl
    if m.nslots == 0:
        if not _memo_alloc(m, MEMO_MIN_SLOTS, klen):
            return
    if 2 * (m.nused + 1) > m.nslots:
        if not _memo_grow(m):
            return
    i = _memo_slot(m, key, h)
    if m.slots[i].hash == 0:
        at = _memo_take(m, MEMO_FIRST)
        if at < 0:
            _memo_wipe(m)
            at = _memo_take(m, MEMO_FIRST)
            if at < 0:
                return
            i = _memo_slot(m, key, h)
        sl = &m.slots[i]
        memcpy(sl.key, key, m.klen * sizeof(int))
        sl.nvec = 0
        sl.room = MEMO_FIRST
        sl.off = at
        m.nused += 1
        psn_store_rel_u64(&sl.hash, h)      # (published after its key and segment)
    sl = &m.slots[i]
    psn_write_begin(&sl.ver)
    _memo_add(m, sl, vec)
    psn_write_end(&sl.ver)


cdef inline void _memo_add(Memo* m, MemoSlot* sl, const double* vec) noexcept nogil:
    """Add vec to a slot's vectors (``_memo_insert``, inside the slot's seqlock)."""
    cdef long at
    cdef int j, n
    cdef double* base
    base = &m.pool[sl.off * MEMO_W]
    n = 0
    for j in range(sl.nvec):            # drop the vectors the new one covers
        if _memo_covers(&base[j * MEMO_W], vec):
            return                      # (already covered: nothing to add)
        if not _memo_covers(vec, &base[j * MEMO_W]):
            if n != j:
                memcpy(&base[n * MEMO_W], &base[j * MEMO_W], MEMO_W * sizeof(double))
            n += 1
    if n == sl.room:
        if n >= MEMO_VECS:
            n -= 1                      # full: the newest replaces the last kept
        else:
            # move the segment to the pool's end with twice the room (the old one is left
            # behind until the next wipe)
            at = _memo_take(m, 2 * n)   # (may move the pool: base is re-read)
            if at < 0:
                n -= 1                  # (pool at its limit: replace, as when full)
                base = &m.pool[sl.off * MEMO_W]
            else:
                memcpy(&m.pool[at * MEMO_W], &m.pool[sl.off * MEMO_W],
                       n * MEMO_W * sizeof(double))
                sl.off = at
                sl.room = 2 * n
                base = &m.pool[at * MEMO_W]
    memcpy(&base[n * MEMO_W], vec, MEMO_W * sizeof(double))
    sl.nvec = n + 1


def twin_memo(ops, long pool_max=0, bint fixed=False):
    """The dominance memo from Python (the tests compare it with a reference): ``ops`` is a
    sequence of (insert, key, vec) with key a tuple of ints (one length) and vec MEMO_W
    floats; returns, per op that is not an insert, whether the memo says vec is dominated.
    ``pool_max``: the pool's limit in vectors (0: MEMO_POOL); ``fixed``: the threads' form
    (allocated once at its largest; lookups without the lock)."""
    cdef Memo m
    cdef int key[MEMO_MAXK]
    cdef double vec[MEMO_W]
    cdef int klen, j
    cdef unsigned long long h
    memset(&m, 0, sizeof(Memo))
    m.pool_max = pool_max
    out = []
    try:
        for insert, k, v in ops:
            klen = len(k)
            if klen < 1 or klen > MEMO_MAXK or len(v) != MEMO_W:
                raise ValueError("twin_memo: a key of 1..MEMO_MAXK ints and MEMO_W numbers")
            for j in range(klen):
                key[j] = k[j]
            for j in range(MEMO_W):
                vec[j] = v[j]
            h = _memo_hash(key, klen)
            if fixed and not m.fixed and not _memo_fix(&m, klen, pool_max):
                raise MemoryError()
            if insert:
                if m.nslots and m.klen != klen:
                    raise ValueError("twin_memo: keys of one length")
                _memo_insert(&m, key, klen, h, vec)
            else:
                out.append(bool(m.nslots and m.klen == klen
                                and _memo_dominated(&m, key, h, vec)))
        return out
    finally:
        _memo_free(&m)


MEMO_WIDTH = MEMO_W
MEMO_KEEP = MEMO_VECS


# --------------------------------------------------------------------------- the recursion

cdef class Searcher:
    """One searcher (one thread) of a search_config call: the shared read-only instance, its
    own state and counters; the recursion runs as nogil methods."""

    cdef const ConfigData* cfg
    cdef SearchState* state
    cdef SearchStats st
    cdef PipelineDAG dag
    cdef object dag_factory
    cdef int have_dag
    cdef int dag_error
    cdef Memo memo
    cdef Memo* mp          # the memo used: its own, or (threads) the first searcher's
    cdef int* mlock        # ... and then the lock every memo call holds (NULL: its own)
    cdef int use_memo

    def __dealloc__(self):
        _memo_free(&self.memo)

    cdef int ensure_dag(self) noexcept nogil:
        """Build the DAG on the first leaf (the GIL is taken once per configuration)."""
        if self.have_dag:
            return 1
        with gil:
            try:
                self.dag = _checked_dag(self.dag_factory(), self.cfg)
                self.have_dag = 1
            except BaseException:
                self.dag_error = 1
                self.state.timed_out = 1
                return 0
        return 1

    cdef void leaf(self, int nonridge) noexcept nogil:
        cdef const ConfigData* I = self.cfg
        cdef SearchState* S = self.state
        cdef int x, N = I.N
        cdef double T, fmin, fmax
        if nonridge:
            fmin = 1e300
            fmax = 0.0
            for x in range(N):
                fmin = dmin(fmin, S.Fst[x])
                fmax = dmax(fmax, S.Fst[x])
            if fmin >= I.alpha * fmax:
                # covered by Theorem 2: a ridge allocation is at least as good
                self.st.cut_ridge += 1
                return
        if not self.ensure_dag():
            return
        self.st.simulated += 1
        T = _evaluate(I, S, self.dag)
        if T > S.thr:
            return
        if (not S.have_best) or T < S.best_T or (
                T == S.best_T and _lex_less(S.st_opt, S.st_l, S.best_opt, S.best_l, N)):
            S.have_best = 1
            S.best_T = T
            self.st.improved += 1
            for x in range(N):
                S.best_opt[x] = S.st_opt[x]
                S.best_l[x] = S.st_l[x]
            if T < S.thr:
                S.thr = T
            if S.sh != NULL:
                psn_min_d(&S.sh.thr, T)

    cdef void collect(self, int D) noexcept nogil:
        """Store the current prefix (stages < D) in cbuf (grown as needed; ccap in ints)."""
        cdef SearchState* S = self.state
        cdef int x, ncap, need = (S.ncollect + 1) * 2 * D
        cdef int* nb
        if S.coverflow:
            return
        if need > S.ccap:
            ncap = 2 * S.ccap
            if ncap < need:
                ncap = need
            if ncap < 1024:
                ncap = 1024
            if ncap > (1 << 24):
                S.coverflow = 1
                return
            nb = <int*> realloc(S.cbuf, ncap * sizeof(int))
            if nb == NULL:
                S.coverflow = 1
                return
            S.cbuf = nb
            S.ccap = ncap
        for x in range(D):
            S.cbuf[S.ncollect * 2 * D + x] = S.st_opt[x]
            S.cbuf[S.ncollect * 2 * D + D + x] = S.st_l[x]
        S.ncollect += 1

    cdef void run_shared(self) noexcept nogil:
        """Search the shared prefixes, one at a time, until none is left."""
        cdef SearchState* S = self.state
        cdef Shared* sh = S.sh
        cdef int i, x, D = sh.D
        S.plen = D
        while not S.timed_out:
            i = psn_fetch_add(&sh.next, 1)
            if i >= sh.n:
                break
            for x in range(D):
                S.p_opt[x] = sh.buf[i * 2 * D + x]
                S.p_l[x] = sh.buf[i * 2 * D + D + x]
            self.recurse(0, self.cfg.L, 0)
        S.plen = 0

    def _thread_main(self):
        with nogil:
            self.run_shared()

    cdef int enter(self, int x) noexcept nogil:
        """Node bookkeeping: count it, check the deadline, pick up the shared incumbent;
        0 when the node is not expanded (timed out, or a prefix to collect)."""
        cdef SearchState* S = self.state
        cdef double g
        if S.timed_out:
            return 0
        self.st.nodes += 1
        if S.deadline > 0 and (self.st.nodes & 1023) == 0:
            if _now() > S.deadline:
                S.timed_out = 1
                return 0
        if S.collect_D > 0 and x == S.collect_D:
            self.collect(x)
            return 0
        if S.sh != NULL:
            g = psn_load_d(&S.sh.thr)
            if g < S.thr:
                S.thr = g
        return 1

    cdef int later_stages_fit(self, int k, int start, int dt, int K) noexcept nogil:
        """The devices left after this stage can host the K later stages (necessary)."""
        cdef const ConfigData* I = self.cfg
        cdef int kk, avail = 0
        for kk in range(I.T):
            if I.min_dt[kk] > 0:
                if kk == k:
                    avail += (I.ndev[kk] - start - dt) // I.min_dt[kk]
                else:
                    avail += (I.ndev[kk] - self.state.cursor[kk]) // I.min_dt[kk]
        return avail >= K

    cdef int dominated(self, const int* key, unsigned long long h,
                       const double* vec) noexcept nogil:
        """The memo's lookup (a shared memo is ``fixed``: no lock, see ``Memo``; a shared
        memo that could not be fixed, out of memory, is read under the lock)."""
        cdef int dom
        if self.mp.fixed:
            return _memo_dominated(self.mp, key, h, vec)
        if self.mlock != NULL:
            psn_lock(self.mlock)
        dom = _memo_dominated(self.mp, key, h, vec)
        if self.mlock != NULL:
            psn_unlock(self.mlock)
        return dom

    cdef void record(self, const int* key, int klen, unsigned long long h,
                     const double* vec) noexcept nogil:
        """The memo's insert (under the lock when the threads share the memo)."""
        if self.mlock != NULL:
            psn_lock(self.mlock)
        _memo_insert(self.mp, key, klen, h, vec)
        if self.mlock != NULL:
            psn_unlock(self.mlock)

    cdef unsigned long long memo_key(self, int x, int Lrem, int o, int start, int l,
                                     int* key) noexcept nogil:
        """The memo key of stage x's choice (``descend``) into ``key``; returns its hash."""
        cdef const ConfigData* I = self.cfg
        cdef SearchState* S = self.state
        cdef int k, used = 0
        cdef int starts[MAXV]
        key[0] = x
        key[1] = Lrem
        key[2] = o
        key[3] = start
        key[4] = l
        for k in range(I.T):
            if S.used[k]:
                used |= 1 << k
            key[8 + k] = S.cursor[k]
        key[5] = used if I.blocks else 0
        key[6] = S.st_opt[0] if I.V > 1 else 0      # (the wrap-around link's far end)
        key[7] = S.st_start[0] if I.V > 1 else 0
        if I.ilv:
            # several kinds, interleaved: where the later stages' chunks start (the layers
            # of chunks 0 .. V-2 assigned so far; chunk V-1's follow from the layers left)
            _chunk_starts(I, S, x + 1, starts)
            for k in range(I.V - 1):
                key[8 + I.T + k] = starts[k]
        return _memo_hash(key, _memo_klen(I))

    cdef void descend(self, int x, int Lrem, int nr, double thr_eps, const int* key,
                      unsigned long long h) noexcept nogil:
        """``recurse(x + 1)`` through the dominance memo (no ridge rule). Every cut of the
        subtree after stage x is a monotone function of the key (x, layers left, stage x's
        option, devices and layers, the device cursors, the used types, and for interleaved
        schedules stage 0's option and devices: the wrap-around link) and of seven numbers:
        head_x, tail_x, MA_x, MC_x + P_x, Qp_x + Sg_x, QX_x and MD_x + 2 P_x (``bound``'s
        recursions, the two-stage path, the double round trip and the capacity, round-trip
        and chain cuts only grow with them; the chain cut's multipliers are any multipliers,
        weak duality). So a subtree that was searched without reaching any leaf (every
        completion cut by a bound, memory or devices) under threshold t proves the same for a
        subtree of the same key whose seven numbers are no smaller, under a threshold <= t: it
        is skipped. The round-trip cut of stage x's choice runs here, after the lookup (which
        costs less); a subtree it cuts is recorded too. Two prefixes with the
        same stages in another order share the key, so the orders of interchangeable stages
        are searched once each way that matters."""
        cdef const ConfigData* I = self.cfg
        cdef SearchState* S = self.state
        cdef int klen = _memo_klen(I), K = I.N - 1 - x
        cdef double vec[MEMO_W]
        cdef long long sim0
        vec[0] = S.head[x]
        vec[1] = S.tail[x]
        vec[2] = S.MA[x]
        vec[3] = S.MC[x] + S.P[x]
        vec[4] = S.Qp[x] + S.Sg[x] if (I.pair and x > 0) else 0.0
        vec[5] = S.MD[x] + 2.0 * S.P[x] if I.loop1 else 0.0
        vec[6] = S.QX[x] if (I.pair and x > 0) else 0.0
        vec[7] = S.thr
        vec[8] = S.MW[x] + 2.0 * S.P[x] if I.loop1 else 0.0
        if self.dominated(key, h, vec):
            self.st.cut_dominated += 1
            return
        if rt_cut(I, S, x, K, Lrem, thr_eps):
            # (after the memo: its lookup is cheaper than this cut; the cut is monotone in
            # the same numbers, so its subtree is recorded like a searched one)
            self.st.cut_capacity += 1
            self.record(key, klen, h, vec)
            return
        sim0 = self.st.simulated
        S.norec[x] = 0
        self.recurse(x + 1, Lrem, nr)
        if S.timed_out or self.st.simulated != sim0 or S.norec[x]:
            return
        vec[7] = S.thr          # (another thread's incumbent may have lowered it)
        self.record(key, klen, h, vec)

    cdef void recurse(self, int x, int Lrem, int nonridge) noexcept nogil:
        """Branch on stage x's option o (device type, TP; in ``oorder``) and layer count l, larger l first;
        see the module docstring and ``docs/search.md`` for the rules. (One piece on purpose:
        the nogil hot loop; placement, costs and bounds are the helpers it calls.)"""
        cdef const ConfigData* I = self.cfg
        cdef SearchState* S = self.state
        cdef int N = I.N, o, k, dt, start, l, lo, hi, K = N - 1 - x
        cdef int save_cursor, save_used, save_rl, save_rdec, nr, rstage, it, cap, pre, a, b, mid, wr
        cdef double ring, g, thr_eps
        cdef int key[MEMO_MAXK]
        cdef unsigned long long h = 0
        cdef int memo_on = (self.use_memo and I.ridge_mode == RIDGE_OFF and I.use_bound
                            and S.collect_D == 0
                            and (not I.ilv or I.T + I.V - 1 <= MAXT))
        cdef int oi
        if not self.enter(x):
            return
        for oi in range(I.O):
            o = I.oorder[oi]
            if x < S.plen and o != S.p_opt[x]:
                continue
            k = I.opt_type[o]
            if I.blocks and x > 0 and k != I.opt_type[S.st_opt[x - 1]] and S.used[k]:
                continue
            dt = I.d * I.opt_tp[o]
            start = _aligned_start(I, S, o)
            if start < 0 or (K > 0 and not self.later_stages_fit(k, start, dt, K)):
                self.st.cut_devices += 1
                continue
            # layers range: memory (lmax), later stages' minimum and maximum capacity
            hi = _stage_hi(I, S, x, o, Lrem, K)
            if K == 0:
                if Lrem > hi or Lrem < I.V:
                    self.st.cut_memory += 1
                    continue
                lo = Lrem
                hi = Lrem
            else:
                if hi > Lrem - K * I.V:
                    hi = Lrem - K * I.V
                lo = Lrem - I.suffix_lmax[x + 1]
                if lo < I.V:
                    lo = I.V
                if hi < lo:
                    self.st.cut_memory += 1
                    continue
            if x < S.plen:
                if S.p_l[x] < lo or S.p_l[x] > hi:
                    continue
                lo = S.p_l[x]
                hi = S.p_l[x]
            rstage = _ridge_stage(I, x)
            if rstage and I.ridge_mode == RIDGE_CUT and S.rl[o] > 0 and S.rdec[o] and hi > S.rl[o]:
                self.st.cut_ridge += hi - S.rl[o] if S.rl[o] >= lo else hi - lo + 1
                hi = S.rl[o]
                if hi < lo:
                    continue
            ring = _place_stage(I, S, x, o, start)
            save_cursor = S.cursor[k]
            save_used = S.used[k]
            save_rl = S.rl[o]
            save_rdec = S.rdec[o]
            S.cursor[k] = start + dt
            S.used[k] = 1
            later_costs(I, S, x)
            thr_eps = S.thr * (1.0 + 1e-9)
            if I.use_bound and K > 0:
                # the terms of g that never increase with l (``_bounds.low_bound``) cut the smallest
                # counts: raise lo past them
                while lo <= hi and low_bound(I, S, x, Lrem - lo) > thr_eps:
                    self.st.cut_bound += 1
                    lo += 1
            if I.use_bound and K > 0 and lo <= hi:
                # capacity: the K later stages hold at most cap(l) layers, cap non-increasing in
                # l (the path grows with l), so l >= Lrem - cap(lo) for every l >= lo: iterate.
                for it in range(6):
                    _set_stage(I, S, x, o, lo, ring)
                    bound(I, S, x, Lrem - lo)
                    cap = capacity(I, S, x, thr_eps - cap_path(I, S, x), K,
                                   rt_limit(I, S, x, K, thr_eps))
                    if cap < 0:
                        lo = hi + 1
                        break
                    if Lrem - cap <= lo:
                        break
                    lo = Lrem - cap
                    if lo > hi:
                        break
                if lo > hi:
                    self.st.cut_capacity += 1
            l = hi
            while l >= lo:
                nr = nonridge
                if rstage:
                    if save_rl > 0:
                        if save_rdec and l > save_rl:
                            nr = 1   # only reachable in safe mode (ridge mode clipped hi)
                        S.rdec[o] = 1 if (save_rdec or l < save_rl) else 0
                    S.rl[o] = l
                S.st_l[x] = l
                _set_stage(I, S, x, o, l, ring)
                g = bound(I, S, x, Lrem - l)
                if I.use_bound and g > thr_eps:
                    self.st.cut_bound += 1
                    if S.gnw <= thr_eps:
                        # a window term cut it: the subtrees of the stages strictly inside
                        # its window (it reads stages before them) must not be recorded
                        for wr in range(S.gwj + 1, S.gwe):
                            S.norec[wr] = 1
                    if S.ginc > thr_eps and l - lo >= 2:
                        # the terms of g that never decrease with l cut l and every larger
                        # count; bisect for the largest smaller count they do not cut
                        a = lo - 1
                        b = l
                        while b - a > 1:
                            mid = (a + b) >> 1
                            _set_stage(I, S, x, o, mid, ring)
                            bound(I, S, x, Lrem - mid)
                            if S.ginc > thr_eps:
                                b = mid
                            else:
                                a = mid
                        self.st.cut_bound += l - 1 - a
                        l = a + 1
                else:
                    pre = memo_on and K > 0 and x + 1 >= S.plen
                    if pre:
                        # the memo's key now, and its slot loading while the capacity cut runs
                        h = self.memo_key(x, Lrem - l, o, start, l, key)
                        _memo_prefetch(self.mp, h)
                    if (I.use_bound and K > 0
                            and capacity(I, S, x, thr_eps - cap_path(I, S, x), K,
                                         rt_limit(I, S, x, K, thr_eps))
                            < Lrem - l):
                        self.st.cut_capacity += 1
                    elif K == 0:
                        self.leaf(nr)
                    elif pre:
                        self.descend(x, Lrem - l, nr, thr_eps, key, h)
                    elif I.use_bound and rt_cut(I, S, x, K, Lrem - l, thr_eps):
                        self.st.cut_capacity += 1
                    else:
                        self.recurse(x + 1, Lrem - l, nr)
                if S.timed_out:
                    break
                thr_eps = S.thr * (1.0 + 1e-9)
                l -= 1
            S.cursor[k] = save_cursor
            S.used[k] = save_used
            S.rl[o] = save_rl
            S.rdec[o] = save_rdec
            if S.timed_out:
                return


cdef PipelineDAG _checked_dag(object dag, const ConfigData* I):
    if not isinstance(dag, PipelineDAG):
        raise TypeError("search_config: expected a PipelineDAG")
    if (dag.num_stages != I.N or dag.num_microbatches != I.M or dag.virtual_stages != I.V):
        raise ValueError("search_config: dag and bound structure disagree")
    return dag


# --------------------------------------------------------------------------- state and threads

cdef SearchState* _new_state(const ConfigData* I, double thr, double deadline) except NULL:
    """A zeroed state with its evaluation buffers (free with ``_free_state``)."""
    cdef SearchState* S = <SearchState*> malloc(sizeof(SearchState))
    if S == NULL:
        raise MemoryError()
    memset(S, 0, sizeof(SearchState))
    S.thr = thr
    S.deadline = deadline
    S.WF = <double*> malloc(I.N * I.V * sizeof(double))
    S.WB = <double*> malloc(I.N * I.V * sizeof(double))
    S.EF = <double*> malloc(I.N * sizeof(double))
    S.EB = <double*> malloc(I.N * sizeof(double))
    if S.WF == NULL or S.WB == NULL or S.EF == NULL or S.EB == NULL:
        _free_state(S)
        raise MemoryError()
    return S


cdef SearchState* _clone_state(const ConfigData* I, SearchState* S) except NULL:
    """A helper thread's state: a copy of S (decided prefix, cursors, threshold, the shared
    block) with its own buffers and no best plan yet."""
    cdef SearchState* h = _new_state(I, S.thr, S.deadline)
    cdef double* wf = h.WF
    cdef double* wb = h.WB
    cdef double* ef = h.EF
    cdef double* eb = h.EB
    memcpy(h, S, sizeof(SearchState))
    h.WF, h.WB, h.EF, h.EB = wf, wb, ef, eb
    h.cbuf = NULL
    h.ccap = 0
    h.have_best = 0
    return h


cdef void _free_state(SearchState* S) noexcept nogil:
    if S == NULL:
        return
    free(S.WF)
    free(S.WB)
    free(S.EF)
    free(S.EB)
    free(S.cbuf)
    free(S)


cdef Searcher _searcher(ConfigInstance inst, SearchState* S, dag, int memo):
    cdef Searcher se = Searcher.__new__(Searcher)
    se.cfg = &inst.data
    se.state = S
    se.use_memo = memo
    se.mp = &se.memo
    se.mlock = NULL
    memset(&se.st, 0, sizeof(SearchStats))
    if isinstance(dag, PipelineDAG):
        se.dag = _checked_dag(dag, se.cfg)
        se.have_dag = 1
    else:
        se.dag_factory = dag
        se.have_dag = 0
    se.dag_error = 0
    return se


cdef void _absorb(Searcher main, Searcher h) noexcept nogil:
    """Fold helper h's counters and best plan into the main searcher."""
    cdef SearchState* c = main.state
    cdef SearchState* hs = h.state
    cdef int x
    main.st.nodes += h.st.nodes
    main.st.simulated += h.st.simulated
    main.st.improved += h.st.improved
    main.st.cut_bound += h.st.cut_bound
    main.st.cut_memory += h.st.cut_memory
    main.st.cut_ridge += h.st.cut_ridge
    main.st.cut_devices += h.st.cut_devices
    main.st.cut_capacity += h.st.cut_capacity
    main.st.cut_dominated += h.st.cut_dominated
    if hs.timed_out:
        c.timed_out = 1
    if hs.have_best and ((not c.have_best) or hs.best_T < c.best_T or (
            hs.best_T == c.best_T
            and _lex_less(hs.best_opt, hs.best_l, c.best_opt, c.best_l, main.cfg.N))):
        c.have_best = 1
        c.best_T = hs.best_T
        for x in range(main.cfg.N):
            c.best_opt[x] = hs.best_opt[x]
            c.best_l[x] = hs.best_l[x]


cdef int _split_depth(Searcher se, int threads):
    """Collect the surviving prefixes of the first D stages, D growing until there are
    PREFIXES_PER_THREAD per thread; 0: no split (timed out, too many, or N too small),
    -1: no prefix survives (no plan)."""
    cdef SearchState* S = se.state
    cdef int D = 0, Dtry
    for Dtry in range(1, se.cfg.N - 1):
        S.collect_D = Dtry
        S.ncollect = 0
        with nogil:
            se.recurse(0, se.cfg.L, 0)
        if S.timed_out or S.coverflow:
            D = 0
            break
        D = Dtry
        if S.ncollect >= PREFIXES_PER_THREAD * threads:
            break
    S.collect_D = 0
    if D > 0 and S.ncollect < 2:
        D = 0 if S.ncollect == 1 else -1   # one subtree: search it alone; none: no plan
    return D


cdef void _run_shared_with(Searcher se, list helpers) except *:
    """``se`` and each helper (in its own thread) take the shared prefixes until none is left;
    the helpers' threads are joined before this returns, also on an error."""
    workers = [threading.Thread(target=h._thread_main, daemon=True) for h in helpers]
    for w in workers:
        w.start()
    try:
        with nogil:
            se.run_shared()
    finally:
        for w in workers:
            w.join()


cdef void _run_threads(ConfigInstance inst, Searcher se, int D, int threads, thread_dag) except *:
    """Search the collected prefixes with ``threads`` searchers sharing the incumbent and the
    first searcher's memo (``Searcher.dominated`` / ``record``). The prefixes are handed out
    in the order the one-thread search meets them (its depth-first order), so a subtree's
    memo records are, as there, mostly written before the later subtrees that find them; with
    many small prefixes (``PREFIXES_PER_THREAD``) only the few searched at the same moment
    miss each other's. (Handing out the orders of one set of stages together, as before,
    searched subtrees before the ones whose records would have cut them: 70B/10,240's
    interleaved configuration at 1,648.1 ms took 17.1 M nodes in that order on one thread
    against 10.9 M depth-first.)"""
    cdef SearchState* S = se.state
    cdef Shared sh
    cdef Searcher h
    cdef int slot
    helpers = []
    sh.next = 0
    sh.D = D
    sh.buf = S.cbuf
    sh.n = S.ncollect
    sh.mlock = 0
    sh.thr = S.thr
    S.sh = &sh
    try:
        for slot in range(1, threads):
            h = _searcher(inst, _clone_state(se.cfg, S), (lambda s=slot: thread_dag(s)),
                          se.use_memo)
            h.mp = se.mp           # one memo for all, under sh.mlock
            h.mlock = &sh.mlock
            helpers.append(h)
        se.mlock = &sh.mlock
        if se.use_memo:
            _memo_fix(se.mp, 8 + se.cfg.T, 0)   # (out of memory: lookups take the lock)
        _run_shared_with(se, helpers)
        for h in helpers:
            _absorb(se, h)
            if h.dag_error:
                h.dag_factory()
                raise RuntimeError("search_config: the DAG factory failed")
    finally:
        S.sh = NULL
        se.mlock = NULL
        for h in helpers:
            _free_state(h.state)
            h.state = NULL


def search_config(ConfigInstance inst, dag, double threshold_ms, double deadline=0.0,
                  int threads=1, thread_dag=None, bint memo=True, prefix=None):
    """Branch and bound over one outer configuration; see the module docstring.

    ``threshold_ms``: plans slower than this are not returned (inf: none); ``deadline``:
    monotonic seconds after which the search stops (0 = none). ``dag`` is the simulator's
    ``PipelineDAG`` of the instance's (schedule, N, M, V), or a callable returning it (called,
    with the GIL, when the first leaf is reached); its workspace is used, so it must not be
    shared with another thread during the call.

    ``threads`` > 1 (and N >= 3): the tree is cut at the first depth D with at least
    PREFIXES_PER_THREAD * threads surviving prefixes (stages < D decided, collected by the
    same recursion and cuts), and ``threads`` searchers (this thread and threads - 1 Python
    threads, all in nogil code) take the prefixes one at a time from a shared counter, sharing
    the incumbent time (an atomic minimum every node reads). ``thread_dag(slot)`` gives each
    helper its own ``PipelineDAG`` (the simulator's workspace is per object). The result is the
    same as with one thread: every searcher keeps the smallest (time, assignment) it meets
    with time <= the threshold, the threshold never drops below the optimum, so every optimal
    assignment is reached, and the results are merged by (time, assignment). Only the
    statistics depend on the interleaving.

    ``memo``: skip subtrees that a searched subtree of the same key dominates
    (``Searcher.descend``; without the ridge rule). Off, the search visits more nodes
    and returns the same plan (the tests compare the two).

    ``prefix``: ``(options, layers)`` of the first stages, fixed (one thread only): the best
    plan that starts with them (the tie rule's queries, ``search/tiebreak.py``).
    """
    cdef SearchState* S = _new_state(&inst.data, threshold_ms, deadline)
    cdef Searcher se
    cdef int D = 0, x
    try:
        se = _searcher(inst, S, dag, memo)
        if prefix is not None:
            popts, players = prefix
            if threads > 1 or len(popts) != len(players) or len(popts) > inst.data.N:
                raise ValueError("search_config: a prefix needs one thread and at most N "
                                 "(option, layers) pairs")
            for x in range(len(popts)):
                if not (0 <= popts[x] < inst.data.O and players[x] >= 1):
                    raise ValueError(f"search_config: prefix stage {x}: option {popts[x]}, "
                                     f"{players[x]} layers")
                S.p_opt[x] = popts[x]
                S.p_l[x] = players[x]
            S.plen = len(popts)
        if threads > 1 and inst.data.N >= 3:
            if thread_dag is None:
                raise ValueError("search_config: threads > 1 needs thread_dag")
            D = _split_depth(se, threads)
        if D > 0:
            _run_threads(inst, se, D, threads, thread_dag)
        elif D == 0:
            with nogil:
                se.recurse(0, inst.data.L, 0)
        if se.dag_error:
            se.dag_factory()   # re-raise the factory's error with its traceback
            raise RuntimeError("search_config: the DAG factory failed")
        return _result(S, &se.st, inst.data.N, D, S.ncollect)
    finally:
        _free_state(S)


def replay_assignment(ConfigInstance inst, PipelineDAG dag, opts, layers,
                      double threshold_ms=1e300):
    """(g after each stage, simulated time) of one complete assignment through the search's own
    placement, cost and bound code (the tests hold every g <= the time). ``threshold_ms``: the
    search's threshold while it computes g (the bounds that read it hold for completions no
    slower than it). ValueError when the assignment does not fit the devices or a stage's
    memory limit."""
    cdef const ConfigData* I = &inst.data
    cdef SearchState* S = _new_state(I, threshold_ms, 0.0)
    cdef int x, o, l, start, N = I.N, Lrem = I.L
    cdef double ring
    _checked_dag(dag, I)
    if len(opts) != N or len(layers) != N or sum(layers) != I.L:
        _free_state(S)
        raise ValueError("replay_assignment: expected N options and N layer counts summing "
                         "to the layers")
    trace = []
    try:
        for x in range(N):
            o, l = opts[x], layers[x]
            start = _aligned_start(I, S, o)
            if start < 0 or l < I.V or l > _stage_hi(I, S, x, o, Lrem, N - 1 - x):
                raise ValueError(f"replay_assignment: stage {x} (option {o}, {l} layers) does "
                                 f"not fit")
            ring = _place_stage(I, S, x, o, start)
            S.cursor[I.opt_type[o]] = start + I.d * I.opt_tp[o]
            S.used[I.opt_type[o]] = 1
            later_costs(I, S, x)
            S.st_l[x] = l
            _set_stage(I, S, x, o, l, ring)
            Lrem -= l
            trace.append(bound(I, S, x, Lrem))
        return trace, _evaluate(I, S, dag)
    finally:
        _free_state(S)



def bound_parts(ConfigInstance inst, opts, layers, int x):
    """For stage x of a prefix (``opts`` and ``layers`` of stages < x as given, stage x with
    option opts[x]): per layer count l of stage x from V to the layers left minus V per later
    stage, (l, g, ginc, low) -- ``bound``'s g, its terms that never decrease with l
    (``S.ginc``, the upper cut's bisection) and ``_bounds.low_bound`` (never increases with
    l; it raises the smallest count). For the tests: both <= g and monotone in l. Memory
    limits are not applied (the bounds do not read them). ValueError when the prefix does
    not fit the devices."""
    cdef const ConfigData* I = &inst.data
    cdef SearchState* S = _new_state(I, 1e300, 0.0)
    cdef int y, o, l, start, N = I.N, Lrem = I.L, K = N - 1 - x
    cdef double ring, g
    if not 0 <= x < N - 1 or len(opts) <= x or len(layers) < x:
        _free_state(S)
        raise ValueError("bound_parts: 0 <= x < N - 1, options for stages <= x, layers < x")
    out = []
    try:
        for y in range(x + 1):
            o = opts[y]
            start = _aligned_start(I, S, o)
            if start < 0:
                raise ValueError(f"bound_parts: stage {y} (option {o}) does not fit")
            ring = _place_stage(I, S, y, o, start)
            S.cursor[I.opt_type[o]] = start + I.d * I.opt_tp[o]
            S.used[I.opt_type[o]] = 1
            later_costs(I, S, y)
            if y < x:
                l = layers[y]
                S.st_l[y] = l
                _set_stage(I, S, y, o, l, ring)
                Lrem -= l
                bound(I, S, y, Lrem)
        for l in range(I.V, Lrem - K * I.V + 1):
            S.st_l[x] = l
            low = low_bound(I, S, x, Lrem - l)
            _set_stage(I, S, x, opts[x], l, ring)
            g = bound(I, S, x, Lrem - l)
            out.append((l, g, S.ginc, low))
        return out
    finally:
        _free_state(S)


# --------------------------------------------------------------------------- subtrees shared by processes

def split_prefixes(ConfigInstance inst, double threshold_ms, double deadline=0.0,
                   int threads=1):
    """The subtrees of one configuration, for searchers in other processes
    (``search/distributed.py``): (D, prefixes, result). The prefixes of the first D stages
    that survive the same recursion and cuts as ``search_config``'s thread split (D growing
    until there are PREFIXES_PER_THREAD x ``threads`` of them), in the one-thread search's
    depth-first order, as an int32 array of n x 2D (options, then layers, of each prefix);
    ``result``: the collection's counters (its ``best`` is None). D = 0: no split (N < 3,
    timed out, too many prefixes, or one subtree: search the configuration whole), D = -1:
    no prefix survives (the configuration has no plan <= the threshold)."""
    cdef SearchState* S = _new_state(&inst.data, threshold_ms, deadline)
    cdef Searcher se
    cdef int D = 0, n
    try:
        se = _searcher(inst, S, None, 0)
        if inst.data.N >= 3:
            D = _split_depth(se, max(1, threads))
        if D > 0:
            n = S.ncollect
            buf = np.empty(n * 2 * D, dtype=np.int32)
            memcpy(<void*> (<cnp.ndarray> buf).data, S.cbuf, n * 2 * D * sizeof(int))
        else:
            buf = np.empty(0, dtype=np.int32)
        res = _result(S, &se.st, inst.data.N, D, S.ncollect)
        return D, buf, res
    finally:
        _free_state(S)


def search_prefixes(ConfigInstance inst, dag, double threshold_ms, double deadline, int D,
                    fetch, int threads=1, thread_dag=None, bint memo=True):
    """Search subtrees of one configuration handed out in chunks (``split_prefixes``'s
    prefixes of depth D, from any process): ``fetch()`` returns the next chunk (an int32
    array of n x 2D) and the incumbent time known now, or None when no chunk is left; each
    chunk's prefixes are shared by ``threads`` searchers as in ``search_config``'s split (one
    memo for every chunk of this call, the incumbent an atomic minimum). The best plan (time
    <= the threshold, smallest (time, assignment)) over every subtree searched; stops at the
    deadline (``timed_out``: some fetched subtree was not searched to the end)."""
    cdef SearchState* S = _new_state(&inst.data, threshold_ms, deadline)
    cdef Searcher se, h
    cdef Shared sh
    cdef int slot, chunks = 0, stopped = 0
    cdef cnp.ndarray[cnp.int32_t, ndim=1] arr
    if D < 1 or D > inst.data.N:
        _free_state(S)
        raise ValueError(f"search_prefixes: depth {D} outside 1..{inst.data.N}")
    if threads > 1 and thread_dag is None:
        _free_state(S)
        raise ValueError("search_prefixes: threads > 1 needs thread_dag")
    helpers = []
    try:
        se = _searcher(inst, S, dag, memo)
        sh.next = 0
        sh.D = D
        sh.buf = NULL
        sh.n = 0
        sh.mlock = 0
        sh.thr = S.thr
        S.sh = &sh
        try:
            for slot in range(1, threads):
                h = _searcher(inst, _clone_state(se.cfg, S), (lambda s=slot: thread_dag(s)),
                              se.use_memo)
                h.mp = se.mp
                h.mlock = &sh.mlock
                helpers.append(h)
            se.mlock = &sh.mlock
            if se.use_memo:
                _memo_fix(se.mp, 8 + se.cfg.T, 0)
            while True:
                got = fetch()
                if got is None:
                    break
                arr = np.ascontiguousarray(got[0], dtype=np.int32)
                if arr.shape[0] % (2 * D):
                    raise ValueError("search_prefixes: a chunk is not n x 2D integers")
                if float(got[1]) < sh.thr:
                    sh.thr = float(got[1])
                sh.buf = <int*> arr.data
                sh.n = arr.shape[0] // (2 * D)
                sh.next = 0
                chunks += 1
                _run_shared_with(se, helpers)
                sh.buf = NULL
                stopped = S.timed_out
                for hh in helpers:
                    h = hh
                    if h.state.timed_out:
                        stopped = 1
                    if h.dag_error:
                        stopped = 1
                if stopped or se.dag_error:
                    break
            for hh in helpers:
                h = hh
                _absorb(se, h)
                if h.dag_error:
                    h.dag_factory()
                    raise RuntimeError("search_prefixes: the DAG factory failed")
            if se.dag_error:
                se.dag_factory()
                raise RuntimeError("search_prefixes: the DAG factory failed")
        finally:
            S.sh = NULL
            se.mlock = NULL
            for hh in helpers:
                h = hh
                _free_state(h.state)
                h.state = NULL
        return _result(S, &se.st, inst.data.N, D, chunks)
    finally:
        _free_state(S)
