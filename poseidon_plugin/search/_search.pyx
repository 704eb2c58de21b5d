# cython: language_level=3
"""Hot loop of the plan search: stage-by-stage branch and bound over (stage option, layers).

One call of :func:`search_config` explores every plan of one *outer configuration*
(schedule, V, d, b, N, M, the allowed stage options) and returns the best one whose time does
not exceed the incumbent threshold. Everything inside the recursion is typed C, ``nogil``.

Stage option o = (device type, TP degree). For stage x the search chooses an option o and a
layer count l. Placement is the deterministic per-type cursor of ``placement.py``: stage x takes
the next d*t devices of its type (cursor aligned up to a multiple of t inside a node so that no
TP group spans nodes); DP replica r of the stage is the TP group starting at start + r*t.

Iteration time: list scheduling over a precomputed topological op order (``OpStructure``),
exactly the DAG semantics of DESIGN.md ("The simulator's semantics").

Lower bound g (valid for every completion; proof in ``search.py`` and tested by hypothesis):
for every decided stage i

    E_i >= max(head_i + sum_c acnt[i,c] fc[i,c],  head_i + sum_c t1cnt[i,c] fc[i,c] + RT_i)
           + M sum_c bc[i,c] + sum_c (M - acnt[i,c]) fc[i,c]
    T   >= E_i + tail_i

with head_i the earliest arrival of the first forward, RT_i the round trip of micro-batch 0
through the later stages (undecided ones bounded below by the remaining layers times the
cheapest per-layer cost), tail_i the backward chain of the last micro-batch down to a stage k
followed by its all-reduce R_k; and, for the undecided stage with the most layers,
    T >= head_{x+1} + M * ceil(L_rem / K) * min(f+b) + tail via stage x.
"""

from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy
from libc.math cimport ceil
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import threading

import numpy as np
cimport numpy as cnp

from poseidon_plugin.simulator._core cimport PipelineDAG

cnp.import_array()

DEF MAXN = 256
DEF MAXV = 8
DEF MAXO = 64
DEF MAXT = 16

cdef extern from *:
    """
    /* lock-free helpers for the threads of one search_config call (GCC/Clang builtins) */
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
    """
    int psn_fetch_add(int* p, int v) noexcept nogil
    double psn_load_d(double* p) noexcept nogil
    void psn_min_d(double* p, double v) noexcept nogil


cdef struct Shared:
    # subtrees (prefixes of the first D stages) handed out to the threads, and the incumbent
    int next
    int nprefix
    int D
    int* buf           # nprefix * 2D: options then layers of each prefix
    double thr


RIDGE_OFF = 0
RIDGE_CUT = 1
RIDGE_SAFE = 2


cdef inline double dmax(double a, double b) noexcept nogil:
    return a if a > b else b


cdef inline double dmin(double a, double b) noexcept nogil:
    return a if a < b else b


cdef inline int _topk_layers(const int* tcap, const int* tcnt, int nt, int K,
                             int* taken) noexcept nogil:
    """Most layers K stages can hold: take the largest caps first (``tcap`` sorted descending,
    ``tcnt[i]`` stages available at ``tcap[i]``). ``taken`` gets how many stages were found."""
    cdef int total = 0, t = 0, i, j
    for i in range(nt):
        if t >= K:
            break
        j = tcnt[i]
        if j > K - t:
            j = K - t
        t += j
        total += j * tcap[i]
    taken[0] = t
    return total


cdef inline int _layers_within(double budget, double coef) noexcept nogil:
    """Most whole layers of cost ``coef`` within ``budget`` (rounded up by a relative 1e-9, so
    float noise never cuts a plan at the threshold), 10^9 for a free layer or a huge budget,
    -1 when the budget is negative."""
    cdef double q
    if coef <= 0.0:
        return 1000000000
    q = budget / coef
    if q < 0:
        return -1
    q = q * (1.0 + 1e-9) + 1e-9
    if q > 1e9:
        return 1000000000
    return <int> q


cdef inline int _insert_group(int* tcap, int* tcnt, int ng, int cap, int cnt) noexcept nogil:
    """Insert (cap, cnt) into the groups sorted by cap descending; returns the new count."""
    cdef int i = ng
    while i > 0 and tcap[i - 1] < cap:
        tcap[i] = tcap[i - 1]
        tcnt[i] = tcnt[i - 1]
        i -= 1
    tcap[i] = cap
    tcnt[i] = cnt
    return ng + 1


cdef inline int _type_groups(int* tcap, int* tcnt, int ng, int best, int cnt,
                             double lbk) noexcept nogil:
    """Insert one type's stage slots: ``cnt`` stages of at most ``best`` layers, and at most
    ``lbk`` layers for the whole type (its free devices times the best layers-per-device ratio
    cap_o / (d t_o) of its options: stages of different TP degrees share the devices). As up to
    three groups: q stages at ``best``, one at the remainder, the rest at 0 layers. The K
    largest slots then give exactly max sum_k min(n_k best_k, lbk_k) over n_k <= cnt_k,
    sum n_k = K (each term is concave in n_k, so the greedy on marginal gains is optimal), and
    the count of slots still tells whether K stages fit at all. Returns the new group count."""
    cdef double full = <double> best * cnt
    cdef int qn, r
    if lbk >= full:
        return _insert_group(tcap, tcnt, ng, best, cnt)
    qn = <int> (lbk / best) if best > 0 else cnt
    if qn > cnt:
        qn = cnt
    r = <int> (lbk - <double> qn * best)
    if r < 0:
        r = 0
    if qn > 0:
        ng = _insert_group(tcap, tcnt, ng, best, qn)
    if qn < cnt:
        ng = _insert_group(tcap, tcnt, ng, r, 1)
        if cnt - qn - 1 > 0:
            ng = _insert_group(tcap, tcnt, ng, 0, cnt - qn - 1)
    return ng


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class BoundStructure:
    """Per-stage constants of one (N, M, schedule, V) that the lower bound needs.

    acnt[s*V + c]: forward ops of chunk c that device s runs before its first backward;
    t1cnt[s*V + c]: forward ops of chunk c up to and including F(s, V-1, mb 0);
    clast: chunk of every device's last op (a backward of the last micro-batch).
    Built by ``search.bound_structure`` from ``schedules.op_orders``.
    """

    cdef public int N, M, V, clast
    cdef int[::1] acnt
    cdef int[::1] t1cnt

    def __init__(self, int N, int M, int V, acnt, t1cnt, int clast):
        self.N = N
        self.M = M
        self.V = V
        self.acnt = np.ascontiguousarray(acnt, dtype=np.int32)
        self.t1cnt = np.ascontiguousarray(t1cnt, dtype=np.int32)
        self.clast = clast

    def arrays(self):
        """(acnt, t1cnt) as lists (for the tests)."""
        return list(self.acnt), list(self.t1cnt)


cdef struct Ctx:
    # configuration
    int N, M, V, d, L, O, T, ridge_mode, ridge_ends, blocks, clast, use_bound, fill_cut
    double act_bytes, latency_ms, cross_gbps, minsend, minfb, minb, outmin, alpha, thr
    double deadline
    # per option
    int opt_type[MAXO]
    int opt_tp[MAXO]
    double of_[MAXO]
    double ob_[MAXO]
    double oef[MAXO]
    double oeb[MAXO]
    double oof[MAXO]
    double oob[MAXO]
    double ogl[MAXO]
    double oge[MAXO]
    double ogo[MAXO]
    int* lmax          # O * N
    int* suffix_lmax   # N + 1: sum over j >= x of max_o lmax[o, j]
    int* suf_omax      # O * (N + 1): max over j >= x of lmax[o, j]
    double ofb[MAXO]   # f + b of one layer, per option
    # per type
    int ndev[MAXT]
    int* node_of       # per type offset + device -> global node
    int* local_of      # local index inside the node
    int type_off[MAXT]
    double intra[MAXT]
    double inter[MAXT]
    int min_dt[MAXT]   # d * min tp usable on this type (0 = unusable)
    # state
    int cursor[MAXT]
    int used[MAXT]
    int st_opt[MAXN]
    int st_l[MAXN]
    int st_start[MAXN]
    double fc[MAXN * MAXV]
    double bc[MAXN * MAXV]
    double Fst[MAXN]
    double Pf[MAXN]
    double Pb[MAXN]
    double R[MAXN]
    double head[MAXN]
    double tail[MAXN]
    double P[MAXN]
    double MA[MAXN]
    double MC[MAXN]
    int rl[MAXO]
    int rdec[MAXO]
    # bound structure
    int* acnt
    int* t1cnt
    int acnt_sufmax[MAXN + 1]   # V = 1: max over j >= x of acnt[j]
    # evaluation buffers (simulator layout: chunk-major c*N + s)
    double* WF
    double* WB
    double* EF
    double* EB
    # best
    int have_best
    double best_T
    int best_opt[MAXN]
    int best_l[MAXN]
    # forced path (tests: bound trace of one assignment)
    int forced
    int f_opt[MAXN]
    int f_l[MAXN]
    double gtrace[MAXN]
    double forced_T
    # subtree prefix (threads): stages x < plen are fixed to (p_opt[x], p_l[x])
    int plen
    int p_opt[MAXN]
    int p_l[MAXN]
    # prefix collection: recurse(collect_D) stores the prefix and returns
    int collect_D
    int* cbuf
    int ncollect
    int ccap
    int coverflow
    Shared* sh
    # stats
    long long nodes, simulated, cut_bound, cut_memory, cut_ridge, cut_devices, improved
    long long cut_capacity
    int timed_out


cdef inline double _send_ms(Ctx* c, double gbps) noexcept nogil:
    return c.act_bytes * 8.0 / (gbps * 1e6) + c.latency_ms


cdef double _link_send(Ctx* c, int o1, int s1, int o2, int s2) noexcept nogil:
    """Slowest replica link between two stages (activation send time, ms)."""
    cdef int k1 = c.opt_type[o1], k2 = c.opt_type[o2]
    cdef int t1 = c.opt_tp[o1], t2 = c.opt_tp[o2]
    cdef int r, n1, n2
    cdef double g, gmin = 1e300
    if k1 != k2:
        return _send_ms(c, c.cross_gbps)
    for r in range(c.d):
        n1 = c.node_of[c.type_off[k1] + s1 + r * t1]
        n2 = c.node_of[c.type_off[k2] + s2 + r * t2]
        g = c.intra[k1] if n1 == n2 else c.inter[k1]
        if g < gmin:
            gmin = g
    return _send_ms(c, gmin)


cdef inline int _ridge_stage(Ctx* c, int x) noexcept nogil:
    if c.ridge_mode == 0:
        return 0
    if c.ridge_ends:
        return 1
    return 1 if (x > 0 and x < c.N - 1) else 0


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


cdef inline int _less_key(Ctx* c) noexcept nogil:
    """Current full assignment lexicographically smaller than the best one?"""
    return _lex_less(c.st_opt, c.st_l, c.best_opt, c.best_l, c.N)


cdef void _stage_costs(Ctx* c, int x, int o, int l) noexcept nogil:
    cdef int V = c.V, cc, lc, N = c.N
    cdef double f = c.of_[o], b = c.ob_[o]
    cdef double F = 0.0
    for cc in range(V):
        lc = l // V + (1 if cc < l % V else 0)
        c.fc[x * V + cc] = lc * f
        c.bc[x * V + cc] = lc * b
    if x == 0:
        c.fc[0] += c.oef[o]
        c.bc[0] += c.oeb[o]
    if x == N - 1:
        c.fc[x * V + V - 1] += c.oof[o]
        c.bc[x * V + V - 1] += c.oob[o]
    for cc in range(V):
        F += c.fc[x * V + cc]
    c.Fst[x] = F


cdef inline void _set_stage(Ctx* c, int x, int o, int l, double ring) noexcept nogil:
    """Chunk costs and all-reduce time of stage x with option o and l layers."""
    cdef double G
    _stage_costs(c, x, o, l)
    if c.d > 1:
        G = l * c.ogl[o]
        if x == 0:
            G += c.oge[o]
        if x == c.N - 1:
            G += c.ogo[o]
        c.R[x] = (2.0 * (c.d - 1) * c.latency_ms
                  + 2.0 * (c.d - 1) / c.d * G * 8.0 / (ring * 1e6))
    else:
        c.R[x] = 0.0


cdef double _bound(Ctx* c, int x, int Lrem) noexcept nogil:
    """Update the incremental bound state of stage x (costs, Pf/Pb[x-1], R[x] set) and return g."""
    cdef int V = c.V, M = c.M, N = c.N, cc, K
    cdef double A, C, Z, fut, g, gy, lay
    cdef int clast = c.clast
    if x == 0:
        c.head[0] = 0.0
        c.tail[0] = c.R[0]
        c.P[0] = 0.0
    else:
        c.head[x] = c.head[x - 1] + c.fc[(x - 1) * V] + c.Pf[x - 1]
        c.tail[x] = dmax(c.R[x], c.Pb[x - 1] + c.bc[(x - 1) * V + clast] + c.tail[x - 1])
        c.P[x] = (c.P[x - 1] + c.Pf[x - 1] + c.fc[x * V + V - 1] + c.bc[x * V + V - 1]
                  + c.Pb[x - 1])
    A = c.head[x]
    C = c.head[x]
    Z = 0.0
    for cc in range(V):
        A += c.acnt[x * V + cc] * c.fc[x * V + cc]
        C += c.t1cnt[x * V + cc] * c.fc[x * V + cc]
        Z += M * c.bc[x * V + cc] + (M - c.acnt[x * V + cc]) * c.fc[x * V + cc]
    if x == 0:
        c.MA[0] = A + Z + c.tail[0]
        c.MC[0] = C - c.P[0] + Z + c.tail[0]
    else:
        c.MA[x] = dmax(c.MA[x - 1], A + Z + c.tail[x])
        c.MC[x] = dmax(c.MC[x - 1], C - c.P[x] + Z + c.tail[x])
    K = N - 1 - x
    if K == 0:
        return dmax(c.MA[x], c.MC[x] + c.P[x])
    if V == 1:
        lay = Lrem
    else:
        lay = (Lrem - K * (V - 1)) / <double> V
        if lay < 0:
            lay = 0
    fut = 2.0 * c.minsend * K + lay * c.minfb + c.outmin
    g = dmax(c.MA[x], c.MC[x] + c.P[x] + fut)
    gy = (c.head[x] + c.fc[x * V] + 2.0 * c.minsend + M * ceil(Lrem / <double> K) * c.minfb
          + c.bc[x * V + clast] + c.tail[x])
    return dmax(g, gy)


cdef struct TypeCaps:
    # per usable type of the K later stages: top-K slots (cap descending, 3 groups per type)
    int tcap[3 * MAXT]
    int tcnt[3 * MAXT]
    int ng
    # and the fill/drain knapsack's list ((f + b) ascending): cap, count (<= K), type, layers
    double tfb[MAXT]
    int fcap[MAXT]
    int fcnt[MAXT]
    int ftype[MAXT]
    double flb[MAXT]
    int nt


cdef inline void _type_caps(Ctx* c, int x, int K, double budget, int amax,
                     TypeCaps* tc) noexcept nogil:
    """Per type: the most layers one later stage (after x) can hold, cap_o = budget / coef_o
    (coef_o = M (f + b)_o when amax < 0, else (M-1) b_o + (M - amax) f_o: the round-trip
    cut's), clipped to the option's largest memory limit after x and dropped below V; how many
    later stages the type can still host (free devices // the smallest d t, <= K); its cheapest
    (f + b); and the type's layer total bound (free devices x the best cap_o / (d t_o)). Fills
    the top-K slot groups (``_type_groups``) and the knapsack list of ``tc``."""
    cdef int k, o, cap, best, dtmin, cnt, i
    cdef double coef, fbk, ratio, lbk
    tc.nt = 0
    tc.ng = 0
    for k in range(c.T):
        best = -1
        dtmin = 0
        fbk = 0.0
        ratio = 0.0
        for o in range(c.O):
            if c.opt_type[o] != k:
                continue
            if amax < 0:
                coef = c.M * c.ofb[o]
            else:
                coef = (c.M - 1) * c.ob_[o] + (c.M - amax) * c.of_[o]
            cap = _layers_within(budget, coef)
            if cap < 0:
                continue
            if cap > c.suf_omax[o * (c.N + 1) + x + 1]:
                cap = c.suf_omax[o * (c.N + 1) + x + 1]
            if cap < c.V:
                continue
            if cap > best:
                best = cap
            if dtmin == 0 or c.d * c.opt_tp[o] < dtmin:
                dtmin = c.d * c.opt_tp[o]
            if fbk == 0.0 or c.ofb[o] < fbk:
                fbk = c.ofb[o]
            if <double> cap / (c.d * c.opt_tp[o]) > ratio:
                ratio = <double> cap / (c.d * c.opt_tp[o])
        if best < 0:
            continue
        cnt = (c.ndev[k] - c.cursor[k]) // dtmin
        if cnt <= 0:
            continue
        if cnt > K:
            cnt = K
        lbk = (c.ndev[k] - c.cursor[k]) * ratio * (1.0 + 1e-9) + 1e-9
        tc.ng = _type_groups(tc.tcap, tc.tcnt, tc.ng, best, cnt, lbk)
        i = tc.nt
        while i > 0 and tc.tfb[i - 1] > fbk:
            tc.tfb[i] = tc.tfb[i - 1]
            tc.fcap[i] = tc.fcap[i - 1]
            tc.fcnt[i] = tc.fcnt[i - 1]
            tc.ftype[i] = tc.ftype[i - 1]
            tc.flb[i] = tc.flb[i - 1]
            i -= 1
        tc.tfb[i] = fbk
        tc.fcap[i] = best
        tc.fcnt[i] = cnt
        tc.ftype[i] = k
        tc.flb[i] = lbk
        tc.nt += 1


cdef int _capacity(Ctx* c, int x, double avail, int K, double whi) noexcept nogil:
    """Most layers the K stages after x can hold in a completion with T <= thr (-1: none).

    ``avail`` = thr - (a path every later stage j's work lies on besides its own ops):
    head_x + fc[x, 0] + 2 minsend + bc[x, clast] + tail_x (the path of ``gy`` in ``_bound``).
    Stage j with option o and l_j layers runs M l_j (f_o + b_o) of work serially, so
    T >= avail-path + M l_j (f_o + b_o): l_j <= (thr - path) / (M (f_o + b_o)), and l_j <= its
    memory limit. Per type k, a stage takes >= d * t_min(k) of the D_k devices left (alignment
    only wastes more), so at most D_k // (d t_min) stages of type k, each holding at most the
    largest cap of the type's options. Greedy over types (caps descending) gives the maximum of
    this relaxation; fewer than K stages possible -> -1.

    Fill/drain (V = 1 schedules only, where every stage's first op is F(s, 0) and its last op
    B(s, M-1)): the later stage at position p (p = 0..K-1 after x) starts its first forward
    after micro-batch 0's forward through the later stages before it, and after its last
    backward the backward of micro-batch M-1 runs back through them, so with w_i = F_i + B_i
    (>= l_i (f + b)_i) and U_p = sum of w over the later stages before position p:
    M w_p + U_p <= avail - 2 minsend p, i.e. U_{p+1} <= U_p (1 - 1/M) + (avail - 2 minsend p)/M.
    The right side is increasing in U_p, so U_K <= the recursion's value from U_0 = 0 (greedy).
    The layers then satisfy sum_j l_j (f + b)_j <= U_K with per type <= min(cnt_k, K) stages
    of <= cap_k layers and (f + b) >= the type's cheapest: a fractional knapsack, filled
    cheapest (f + b) first, bounds them from above; the smaller of the two bounds is returned.
    ``whi``: an upper limit on U_K = W (``_wcut``'s, from the decided stages' RT term); as
    U_p <= U_K <= whi for every p (w >= 0) and the step is increasing in U_p,
    U_{p+1} <= step(min(U_p bound, whi)) by induction, and U_K <= whi. The last later stage
    holds the output layer (x < N - 1), whose w is >= its layers' (f + b) + outmin, so the
    knapsack's budget is U_K - outmin.
    """
    cdef int total, taken, i, j, p
    cdef double U, lay, room, take
    cdef TypeCaps tc
    _type_caps(c, x, K, avail, -1, &tc)
    total = _topk_layers(tc.tcap, tc.tcnt, tc.ng, K, &taken)
    if taken < K:
        return -1
    if c.V == 1 and c.fill_cut and K > 1:
        U = 0.0
        for p in range(K):
            if U > whi:
                U = whi
            U = U + (avail - 2.0 * c.minsend * p - U) / c.M
        if U > whi:
            U = whi
        U = (U - c.outmin) * (1.0 + 1e-9)
        if U <= 0.0:
            return 0
        lay = 0.0
        for i in range(tc.nt):
            if U <= 0.0:
                break
            room = tc.fcnt[i] * <double> tc.fcap[i]
            if tc.flb[i] < room:
                room = tc.flb[i]
            take = U / tc.tfb[i]
            if take >= room:
                lay += room
                U -= room * tc.tfb[i]
            else:
                lay += take
                U = 0.0
        lay = lay * (1.0 + 1e-9) + 1e-9
        if lay < total:
            total = <int> lay
    return total


cdef double _wpos(Ctx* c, int x, int K, double R, int* pc, double* troom) noexcept nogil:
    """Positional round-trip capacity (V = 1) for W >= Wa, R = A - Wa: an upper bound on the
    layers the K stages after x hold (-1: no completion), and troom[k] = the most layers the
    stages of type k can hold (the sum of its best min(cnt_k, K) positional caps).

    Stage j = x + 1 + p with option o obeys l_j ((M-1) b_o + (M - a_j) f_o) <= A - W <= R
    (``_wcut``'s inequality with its own a_j = acnt[j] <= M) and l_j <= lmax[o, j], so
    l_j <= pc[p, k] = max over the options o of its type k of those caps (-1: no option with
    l_j >= 1 fits). Type k serves at most cnt_k = (D_k) // (d t_min(k)) of the later stages.
    The best assignment sigma of types to positions (each position one type, type k at most
    cnt_k positions) is bounded by weak LP duality: for any u >= 0,
      sum_p pc[p, sigma(p)] = sum_p (pc[p, sigma(p)] - u_sigma(p)) + sum_k n_k u_k
                           <= sum_p max_k (pc[p, k] - u_k) + sum_k cnt_k u_k = D(u)
    (n_k <= cnt_k, u_k >= 0). u is chosen by two sweeps of exact coordinate minimisation
    (u_k = max(0, the (cnt_k + 1)-th largest of pc[p, k] - max_{k' != k} (pc[p, k'] - u_k'))),
    but any u >= 0 gives a valid bound. A position no type can serve, or more than cnt_k
    positions only type k can serve, means no completion.
    """
    cdef int p, j, o, k, k2, cap, aj, T = c.T, M = c.M, N = c.N, n, i, m, sweep, ninf
    cdef double coef, best, other, D, v
    cdef int tav[MAXT]
    cdef double u[MAXT]
    cdef double dl[MAXN]
    for k in range(T):
        if c.min_dt[k] > 0:
            tav[k] = (c.ndev[k] - c.cursor[k]) // c.min_dt[k]
        else:
            tav[k] = 0
        if tav[k] > K:
            tav[k] = K
        u[k] = 0.0
        troom[k] = 0.0
    for p in range(K):
        j = x + 1 + p
        aj = c.acnt[j]
        if aj > M:
            aj = M
        for k in range(T):
            pc[p * T + k] = -1
        for o in range(c.O):
            k = c.opt_type[o]
            if tav[k] <= 0:
                continue
            coef = (M - 1) * c.ob_[o] + (M - aj) * c.of_[o]
            cap = _layers_within(R, coef)
            if cap < 0:
                continue
            if cap > c.lmax[o * N + j]:
                cap = c.lmax[o * N + j]
            if cap < 1:
                continue
            if cap > pc[p * T + k]:
                pc[p * T + k] = cap
    # per type room: the best min(cnt_k, K) positional caps
    for k in range(T):
        if tav[k] <= 0:
            continue
        n = 0
        for p in range(K):
            if pc[p * T + k] >= 0:
                v = pc[p * T + k]
                i = n
                while i > 0 and dl[i - 1] < v:
                    dl[i] = dl[i - 1]
                    i -= 1
                dl[i] = v
                n += 1
        m = tav[k] if tav[k] < n else n
        for i in range(m):
            troom[k] += dl[i]
    # dual sweeps
    for sweep in range(2):
        for k in range(T):
            if tav[k] <= 0:
                continue
            n = 0
            ninf = 0
            for p in range(K):
                if pc[p * T + k] < 0:
                    continue
                other = -1e300
                for k2 in range(T):
                    if k2 != k and pc[p * T + k2] >= 0 and pc[p * T + k2] - u[k2] > other:
                        other = pc[p * T + k2] - u[k2]
                if other <= -1e299:
                    ninf += 1
                    continue
                v = pc[p * T + k] - other
                i = n
                while i > 0 and dl[i - 1] < v:
                    dl[i] = dl[i - 1]
                    i -= 1
                dl[i] = v
                n += 1
            if ninf > tav[k]:
                return -1.0
            # the (cnt_k + 1)-th largest delta overall (the ninf infinite ones come first)
            m = tav[k] - ninf
            if m < n and dl[m] > 0.0:
                u[k] = dl[m]
            else:
                u[k] = 0.0
    D = 0.0
    for k in range(T):
        D += tav[k] * u[k]
    for p in range(K):
        best = -1e300
        for k in range(T):
            if pc[p * T + k] >= 0 and pc[p * T + k] - u[k] > best:
                best = pc[p * T + k] - u[k]
        if best <= -1e299:
            return -1.0
        D += best
    return D * (1.0 + 1e-12) + 1e-9


cdef int _wcut(Ctx* c, int x, double avail, int K, int need, double whi) noexcept nogil:
    """Round-trip capacity cut (V = 1): 1 when no completion with T <= thr places ``need``
    layers on the K stages after x.

    For a later stage j (V = 1: its first op is F(j, 0), its last B(j, M-1), a_j forwards
    before its first backward B(j, 0)), the path of ``_bound``'s RT term through the stages
    after x: micro-batch 0's forward from stage x to j, then its round trip through every stage
    after j, then stage j's remaining M B_j + (M - a_j) F_j, then micro-batch M-1's backward
    from j down to x and ``tail_x``. With w_i = F_i + B_i and W = sum of w over the K later
    stages, T >= cap_path(x) + 2 minsend (K - 1) + W - w_j + M B_j + (M - a_j + 1) F_j,
    so l_j ((M-1) b_o + (M - a_j) f_o) <= A - W with A = avail - 2 minsend (K - 1).
    Write R = A - W. Every per-stage cap below is non-increasing in W:
      g(W)  = min(top-K capacity with caps at R and a_j <= max acnt after x,
                  the positional capacity ``_wpos(R)`` (own a_j, lmax[o, j], LP duality));
      h(W)  = the fractional knapsack: the layers whose (f + b) cost fits the budget W - outmin
              (the last stage's w also holds the output layer, >= outmin), cheapest first, per
              type at most min(cnt_k, K) stages of <= cap_k(R) layers and <= troom_k(R) (the
              type's best positional caps).
    A completion with round trip W_c places need <= min(g(W_c), h(W_c)) layers and has
    W_c <= A2 = min(A, whi) (``whi``: ``_bound``'s RT term with the later stages' round trip
    written as 2 minsend K + W gives W <= thr - MC[x] - P[x] - 2 minsend K).
    Fixpoint: W_0 = need min(f + b) + outmin <= W_c. If W_i <= W_c, the rooms at W_c are <= the
    rooms at W_i, so h's budget must be at least the cheapest cost of ``need`` layers with
    the rooms at W_i: W_c >= W_{i+1} = outmin + that cost. And g(W_c) <= g(W_i). So the cut
    holds as soon as some W_i > A2, g(W_i) < need or the rooms at W_i hold < need layers; the
    iteration stops (no cut) when W stops growing. At the fixpoint W*, min(g, h)(W*) >= need,
    so a piecewise split of [W_0, A2] could not cut either: this is the strongest form of the
    cut with these relaxations, at one positional evaluation per step.
    """
    cdef int o, total, taken, i, it
    cdef int amax = c.acnt_sufmax[x + 1]
    cdef double A, A2, W, Wn, room, cost, rest, fbmin
    cdef TypeCaps tc
    cdef int pc[MAXN * MAXT]
    cdef double troom[MAXT]
    if amax > c.M:
        amax = c.M
    A = avail - 2.0 * c.minsend * (K - 1)
    if A > 1e200:
        return 0
    if A <= 0.0:
        return 1
    fbmin = 1e300
    for o in range(c.O):
        if c.ofb[o] < fbmin:
            fbmin = c.ofb[o]
    if whi < A:
        A2 = whi
    else:
        A2 = A
    W = (need * fbmin + c.outmin) * (1.0 - 1e-9)
    for it in range(16):
        if W > A2:
            return 1
        _type_caps(c, x, K, A - W, amax, &tc)
        total = _topk_layers(tc.tcap, tc.tcnt, tc.ng, K, &taken)
        if taken < K or total < need:
            return 1
        # positional caps: stage j = x + 1 + p with its own a_j (not amax) and lmax[o, j]
        if _wpos(c, x, K, A - W, pc, troom) < need:
            return 1
        # cheapest (f + b) cost of ``need`` layers within the rooms (inverse knapsack)
        rest = need
        cost = 0.0
        for i in range(tc.nt):
            room = tc.fcnt[i] * <double> tc.fcap[i]
            if troom[tc.ftype[i]] < room:
                room = troom[tc.ftype[i]]
            if tc.flb[i] < room:
                room = tc.flb[i]
            if room >= rest:
                cost += rest * tc.tfb[i]
                rest = 0.0
                break
            cost += room * tc.tfb[i]
            rest -= room
        if rest > 1e-9:
            return 1
        Wn = (c.outmin + cost) * (1.0 - 1e-9) - 1e-9
        if Wn <= W * (1.0 + 1e-12):
            return 0
        W = Wn
    return 0


cdef inline double _cap_path(Ctx* c, int x) noexcept nogil:
    return (c.head[x] + c.fc[x * c.V] + 2.0 * c.minsend + c.bc[x * c.V + c.clast] + c.tail[x])


cdef class Searcher:
    """Holds the context of one search_config call; the recursion runs as nogil methods."""

    cdef Ctx* c
    cdef PipelineDAG dag
    cdef object dag_factory
    cdef int have_dag
    cdef int dag_error

    cdef int ensure_dag(self) noexcept nogil:
        """Build the DAG on the first leaf (the GIL is taken once per configuration)."""
        if self.have_dag:
            return 1
        with gil:
            try:
                self.dag = self.dag_factory()
                if (self.dag.num_stages != self.c.N or self.dag.num_microbatches != self.c.M
                        or self.dag.virtual_stages != self.c.V):
                    raise ValueError("search_config: dag and bound structure disagree")
                self.have_dag = 1
            except BaseException:
                self.dag_error = 1
                self.c.timed_out = 1
                return 0
        return 1

    cdef void leaf(self, int nonridge) noexcept nogil:
        cdef Ctx* c = self.c
        cdef int x, cc, N = c.N, V = c.V
        cdef double T, fmin, fmax
        if nonridge:
            fmin = 1e300
            fmax = 0.0
            for x in range(N):
                fmin = dmin(fmin, c.Fst[x])
                fmax = dmax(fmax, c.Fst[x])
            if fmin >= c.alpha * fmax:
                # covered by Theorem 2: a ridge allocation is at least as good
                c.cut_ridge += 1
                return
        for x in range(N):
            for cc in range(V):
                c.WF[cc * N + x] = c.fc[x * V + cc]
                c.WB[cc * N + x] = c.bc[x * V + cc]
            c.EF[x] = c.Pf[x]
            c.EB[x] = c.Pb[x]
        if not self.ensure_dag():
            return
        c.simulated += 1
        T = self.dag.iteration_time(c.WF, c.WB, c.EF, c.EB, c.R)
        if c.forced:
            c.forced_T = T
        if T > c.thr:
            return
        if (not c.have_best) or T < c.best_T or (T == c.best_T and _less_key(c)):
            c.have_best = 1
            c.best_T = T
            c.improved += 1
            for x in range(N):
                c.best_opt[x] = c.st_opt[x]
                c.best_l[x] = c.st_l[x]
            if T < c.thr:
                c.thr = T
            if c.sh != NULL:
                psn_min_d(&c.sh.thr, T)

    cdef void collect(self, int D) noexcept nogil:
        """Store the current prefix (stages < D) in cbuf (grown as needed; ccap in ints)."""
        cdef Ctx* c = self.c
        cdef int x, ncap, need = (c.ncollect + 1) * 2 * D
        cdef int* nb
        if c.coverflow:
            return
        if need > c.ccap:
            ncap = 2 * c.ccap
            if ncap < need:
                ncap = need
            if ncap < 1024:
                ncap = 1024
            if ncap > (1 << 24):
                c.coverflow = 1
                return
            nb = <int*> realloc(c.cbuf, ncap * sizeof(int))
            if nb == NULL:
                c.coverflow = 1
                return
            c.cbuf = nb
            c.ccap = ncap
        for x in range(D):
            c.cbuf[c.ncollect * 2 * D + x] = c.st_opt[x]
            c.cbuf[c.ncollect * 2 * D + D + x] = c.st_l[x]
        c.ncollect += 1

    cdef void run_shared(self) noexcept nogil:
        """Search the shared prefixes, one at a time, until none is left."""
        cdef Ctx* c = self.c
        cdef Shared* sh = c.sh
        cdef int i, x, D = sh.D
        c.plen = D
        while not c.timed_out:
            i = psn_fetch_add(&sh.next, 1)
            if i >= sh.nprefix:
                break
            for x in range(D):
                c.p_opt[x] = sh.buf[i * 2 * D + x]
                c.p_l[x] = sh.buf[i * 2 * D + D + x]
            self.recurse(0, c.L, 0)
        c.plen = 0

    def _thread_main(self):
        with nogil:
            self.run_shared()

    cdef void recurse(self, int x, int Lrem, int nonridge) noexcept nogil:
        cdef Ctx* c = self.c
        cdef int N = c.N, o, k, t, dt, start, local, l, lo, hi, K, kk, avail, need
        cdef int save_cursor, save_used, save_rl, save_rdec, nr, rstage, it, cap
        cdef double Pfx, ring, g, G, thr_eps
        if c.timed_out:
            return
        c.nodes += 1
        if c.deadline > 0 and (c.nodes & 1023) == 0:
            if _now() > c.deadline:
                c.timed_out = 1
                return
        if c.collect_D > 0 and x == c.collect_D:
            self.collect(x)
            return
        if c.sh != NULL:
            g = psn_load_d(&c.sh.thr)
            if g < c.thr:
                c.thr = g
        K = N - 1 - x
        for o in range(c.O):
            if c.forced and o != c.f_opt[x]:
                continue
            if x < c.plen and o != c.p_opt[x]:
                continue
            k = c.opt_type[o]
            t = c.opt_tp[o]
            if c.blocks and x > 0 and k != c.opt_type[c.st_opt[x - 1]] and c.used[k]:
                continue
            dt = c.d * t
            start = c.cursor[k]
            if start < c.ndev[k]:
                local = c.local_of[c.type_off[k] + start]
                if local % t != 0:
                    start += t - local % t
            if start + dt > c.ndev[k]:
                c.cut_devices += 1
                continue
            # remaining devices must host the K later stages (necessary condition)
            if K > 0:
                avail = 0
                for kk in range(c.T):
                    if c.min_dt[kk] > 0:
                        if kk == k:
                            avail += (c.ndev[kk] - start - dt) // c.min_dt[kk]
                        else:
                            avail += (c.ndev[kk] - c.cursor[kk]) // c.min_dt[kk]
                if avail < K:
                    c.cut_devices += 1
                    continue
            # layers range: memory (lmax), later stages' minimum and maximum capacity
            hi = c.lmax[o * N + x]
            if K == 0:
                if Lrem > hi or Lrem < c.V:
                    c.cut_memory += 1
                    continue
                lo = Lrem
                hi = Lrem
            else:
                if hi > Lrem - K * c.V:
                    hi = Lrem - K * c.V
                lo = Lrem - c.suffix_lmax[x + 1]
                if lo < c.V:
                    lo = c.V
                if hi < lo:
                    c.cut_memory += 1
                    continue
            if c.forced:
                if c.f_l[x] < lo or c.f_l[x] > hi:
                    continue
                lo = c.f_l[x]
                hi = c.f_l[x]
            if x < c.plen:
                if c.p_l[x] < lo or c.p_l[x] > hi:
                    continue
                lo = c.p_l[x]
                hi = c.p_l[x]
            rstage = _ridge_stage(c, x)
            if rstage and c.ridge_mode == 1 and c.rl[o] > 0 and c.rdec[o] and hi > c.rl[o]:
                c.cut_ridge += hi - c.rl[o] if c.rl[o] >= lo else hi - lo + 1
                hi = c.rl[o]
                if hi < lo:
                    continue
            # placement-dependent quantities
            c.st_opt[x] = o
            c.st_start[x] = start
            if x > 0:
                Pfx = _link_send(c, c.st_opt[x - 1], c.st_start[x - 1], o, start)
                c.Pf[x - 1] = Pfx
                c.Pb[x - 1] = Pfx
            if K == 0:
                if c.V > 1:
                    Pfx = _link_send(c, o, start, c.st_opt[0], c.st_start[0])
                    c.Pf[x] = Pfx
                    c.Pb[x] = Pfx
                else:
                    c.Pf[x] = 0.0
                    c.Pb[x] = 0.0
            if c.d > 1:
                if c.node_of[c.type_off[k] + start] == c.node_of[c.type_off[k] + start + dt - 1]:
                    ring = c.intra[k]
                else:
                    ring = c.inter[k]
            else:
                ring = 0.0
            save_cursor = c.cursor[k]
            save_used = c.used[k]
            save_rl = c.rl[o]
            save_rdec = c.rdec[o]
            c.cursor[k] = start + dt
            c.used[k] = 1
            thr_eps = c.thr * (1.0 + 1e-9)
            if c.use_bound and K > 0:
                # capacity: the K later stages hold at most cap(l) layers, cap non-increasing in
                # l (the path grows with l), so l >= Lrem - cap(lo) for every l >= lo: iterate.
                for it in range(6):
                    _set_stage(c, x, o, lo, ring)
                    _bound(c, x, Lrem - lo)
                    cap = _capacity(c, x, thr_eps - _cap_path(c, x), K,
                                    thr_eps - c.MC[x] - c.P[x] - 2.0 * c.minsend * K)
                    if cap < 0:
                        lo = hi + 1
                        break
                    if Lrem - cap <= lo:
                        break
                    lo = Lrem - cap
                    if lo > hi:
                        break
                if lo > hi:
                    c.cut_capacity += 1
            l = hi
            while l >= lo:
                nr = nonridge
                if rstage:
                    if save_rl > 0:
                        if save_rdec and l > save_rl:
                            nr = 1   # only reachable in safe mode (ridge mode clipped hi)
                        c.rdec[o] = 1 if (save_rdec or l < save_rl) else 0
                    c.rl[o] = l
                c.st_l[x] = l
                _set_stage(c, x, o, l, ring)
                g = _bound(c, x, Lrem - l)
                if c.forced:
                    c.gtrace[x] = g
                if c.use_bound and g > thr_eps:
                    c.cut_bound += 1
                elif (c.use_bound and K > 0
                      and _capacity(c, x, thr_eps - _cap_path(c, x), K,
                                    thr_eps - c.MC[x] - c.P[x] - 2.0 * c.minsend * K)
                      < Lrem - l):
                    c.cut_capacity += 1
                elif (c.use_bound and c.fill_cut and c.V == 1 and K > 1
                      and _wcut(c, x, thr_eps - _cap_path(c, x), K, Lrem - l,
                                thr_eps - c.MC[x] - c.P[x] - 2.0 * c.minsend * K)):
                    c.cut_capacity += 1
                elif K == 0:
                    self.leaf(nr)
                else:
                    self.recurse(x + 1, Lrem - l, nr)
                if c.timed_out:
                    break
                thr_eps = c.thr * (1.0 + 1e-9)
                l -= 1
            c.cursor[k] = save_cursor
            c.used[k] = save_used
            c.rl[o] = save_rl
            c.rdec[o] = save_rdec
            if c.timed_out:
                return


PREFIXES_PER_THREAD = 8   # threads > 1: split at the first depth with this many subtrees per thread


cdef inline int _less_best(Ctx* a, Ctx* b) noexcept nogil:
    """a's best assignment lexicographically smaller than b's?"""
    return _lex_less(a.best_opt, a.best_l, b.best_opt, b.best_l, a.N)


cdef void _absorb(Ctx* c, Ctx* h) noexcept nogil:
    """Fold helper h's statistics and best plan into c."""
    cdef int x
    c.nodes += h.nodes
    c.simulated += h.simulated
    c.cut_bound += h.cut_bound
    c.cut_memory += h.cut_memory
    c.cut_ridge += h.cut_ridge
    c.cut_devices += h.cut_devices
    c.cut_capacity += h.cut_capacity
    c.improved += h.improved
    if h.timed_out:
        c.timed_out = 1
    if h.have_best and ((not c.have_best) or h.best_T < c.best_T
                        or (h.best_T == c.best_T and _less_best(h, c))):
        c.have_best = 1
        c.best_T = h.best_T
        for x in range(c.N):
            c.best_opt[x] = h.best_opt[x]
            c.best_l[x] = h.best_l[x]


def search_config(BoundStructure st, dag, dict cfg, int threads=1, thread_dag=None):
    """Branch and bound over one outer configuration; see the module docstring.

    ``cfg`` keys: d, L, act_bytes, latency_ms, cross_gbps, minsend, minfb, outmin, alpha,
    ridge_mode, ridge_ends, blocks, threshold_ms, deadline (monotonic seconds, 0 = none),
    opt_type, opt_tp, f, b, ef, eb, of, ob, gl, ge, go (per option), lmax (O x N),
    ndev, type_off, intra, inter (per type), node_of, local_of (flat per type devices).
    ``dag`` is the simulator's ``PipelineDAG`` of the same (schedule, N, M, V), or a callable
    returning it (called, with the GIL, when the first leaf is reached); its workspace is
    used, so it must not be shared with another thread during the call.
    Returns a dict with best (None or (time, [opt], [layers])) and statistics.

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
    """
    cdef Searcher se = Searcher.__new__(Searcher)
    cdef Searcher h
    cdef Ctx* c = <Ctx*> malloc(sizeof(Ctx))
    cdef Ctx* hc
    cdef Shared* sh = NULL
    cdef int D, Dtry, slot
    if c == NULL:
        raise MemoryError()
    se.c = c
    c.cbuf = NULL
    c.sh = NULL
    helpers = []
    if isinstance(dag, PipelineDAG):
        se.dag = dag
        se.have_dag = 1
    else:
        se.dag_factory = dag
        se.have_dag = 0
    se.dag_error = 0
    cdef int N = st.N, V = st.V, O, T, o, x, k
    cdef cnp.ndarray[cnp.int32_t, ndim=1] lmax_a
    cdef cnp.ndarray[cnp.int32_t, ndim=1] suf_a
    cdef cnp.ndarray[cnp.int32_t, ndim=1] somax_a
    cdef cnp.ndarray[cnp.int32_t, ndim=1] node_a
    cdef cnp.ndarray[cnp.int32_t, ndim=1] local_a
    c.WF = NULL
    c.WB = NULL
    c.EF = NULL
    c.EB = NULL
    try:
        if se.have_dag and (dag.num_stages != N or dag.num_microbatches != st.M
                            or dag.virtual_stages != V):
            raise ValueError("search_config: dag and bound structure disagree")
        O = len(cfg["opt_type"])
        T = len(cfg["ndev"])
        if N > MAXN or V > MAXV or O > MAXO or T > MAXT:
            raise ValueError("search_config: instance too large for the compiled limits")
        c.N = N
        c.M = st.M
        c.V = V
        c.clast = st.clast
        c.acnt = &st.acnt[0]
        c.t1cnt = &st.t1cnt[0]
        c.d = cfg["d"]
        c.L = cfg["L"]
        c.O = O
        c.T = T
        c.ridge_mode = cfg["ridge_mode"]
        c.ridge_ends = cfg["ridge_ends"]
        c.blocks = cfg["blocks"]
        c.use_bound = cfg.get("use_bound", 1)
        c.fill_cut = cfg.get("fill_cut", 1)
        c.acnt_sufmax[N] = 0
        if V == 1:
            for x in range(N - 1, -1, -1):
                c.acnt_sufmax[x] = c.acnt_sufmax[x + 1]
                if st.acnt[x] > c.acnt_sufmax[x]:
                    c.acnt_sufmax[x] = st.acnt[x]
        forced = cfg.get("forced")
        c.forced = 0
        c.forced_T = -1.0
        if forced is not None:
            c.forced = 1
            c.use_bound = 0
            c.ridge_mode = 0
            c.blocks = 0
            for x in range(N):
                c.f_opt[x] = forced[0][x]
                c.f_l[x] = forced[1][x]
                c.gtrace[x] = -1.0
        c.act_bytes = cfg["act_bytes"]
        c.latency_ms = cfg["latency_ms"]
        c.cross_gbps = cfg["cross_gbps"]
        c.minsend = cfg["minsend"]
        c.minfb = cfg["minfb"]
        c.outmin = cfg["outmin"]
        c.alpha = cfg["alpha"]
        c.thr = cfg["threshold_ms"]
        c.deadline = cfg["deadline"]
        for o in range(O):
            c.opt_type[o] = cfg["opt_type"][o]
            c.opt_tp[o] = cfg["opt_tp"][o]
            c.of_[o] = cfg["f"][o]
            c.ob_[o] = cfg["b"][o]
            c.oef[o] = cfg["ef"][o]
            c.oeb[o] = cfg["eb"][o]
            c.oof[o] = cfg["of"][o]
            c.oob[o] = cfg["ob"][o]
            c.ogl[o] = cfg["gl"][o]
            c.oge[o] = cfg["ge"][o]
            c.ogo[o] = cfg["go"][o]
            c.ofb[o] = c.of_[o] + c.ob_[o]
            c.rl[o] = 0
            c.rdec[o] = 0
        lmax_a = np.ascontiguousarray(cfg["lmax"], dtype=np.int32).reshape(-1)
        if lmax_a.shape[0] != O * N:
            raise ValueError("lmax must have O*N entries")
        c.lmax = <int*> lmax_a.data
        suf = np.zeros(N + 1, dtype=np.int32)
        lm = lmax_a.reshape(O, N).max(axis=0) if O > 0 else np.zeros(N, dtype=np.int32)
        for x in range(N - 1, -1, -1):
            suf[x] = suf[x + 1] + max(int(lm[x]), 0)
        suf_a = suf
        c.suffix_lmax = <int*> suf_a.data
        somax = np.zeros((O, N + 1), dtype=np.int32)
        lm2 = lmax_a.reshape(O, N)
        for x in range(N - 1, -1, -1):
            somax[:, x] = np.maximum(somax[:, x + 1], lm2[:, x])
        somax_a = np.ascontiguousarray(somax).reshape(-1)
        c.suf_omax = <int*> somax_a.data
        node_a = np.ascontiguousarray(cfg["node_of"], dtype=np.int32)
        local_a = np.ascontiguousarray(cfg["local_of"], dtype=np.int32)
        c.node_of = <int*> node_a.data
        c.local_of = <int*> local_a.data
        for k in range(T):
            c.ndev[k] = cfg["ndev"][k]
            c.type_off[k] = cfg["type_off"][k]
            c.intra[k] = cfg["intra"][k]
            c.inter[k] = cfg["inter"][k]
            c.cursor[k] = 0
            c.used[k] = 0
            c.min_dt[k] = 0
        for o in range(O):
            k = c.opt_type[o]
            if c.min_dt[k] == 0 or c.d * c.opt_tp[o] < c.min_dt[k]:
                c.min_dt[k] = c.d * c.opt_tp[o]
        c.WF = <double*> malloc(N * V * sizeof(double))
        c.WB = <double*> malloc(N * V * sizeof(double))
        c.EF = <double*> malloc(N * sizeof(double))
        c.EB = <double*> malloc(N * sizeof(double))
        if c.WF == NULL or c.WB == NULL or c.EF == NULL or c.EB == NULL:
            raise MemoryError()
        for x in range(N):
            c.Pf[x] = 0.0
            c.Pb[x] = 0.0
        c.have_best = 0
        c.best_T = 0.0
        c.nodes = 0
        c.simulated = 0
        c.cut_bound = 0
        c.cut_memory = 0
        c.cut_ridge = 0
        c.cut_devices = 0
        c.cut_capacity = 0
        c.improved = 0
        c.timed_out = 0
        c.plen = 0
        c.collect_D = 0
        c.ncollect = 0
        c.ccap = 0
        c.coverflow = 0
        D = 0
        if threads > 1 and N >= 3 and not c.forced:
            if thread_dag is None:
                raise ValueError("search_config: threads > 1 needs thread_dag")
            for Dtry in range(1, N - 1):
                c.collect_D = Dtry
                c.ncollect = 0
                with nogil:
                    se.recurse(0, c.L, 0)
                if c.timed_out or c.coverflow:
                    D = 0
                    break
                D = Dtry
                if c.ncollect >= PREFIXES_PER_THREAD * threads:
                    break
            c.collect_D = 0
        if D > 0 and c.ncollect < 2:
            D = 0 if c.ncollect == 1 else -1   # one subtree: search it alone; none: no plan
        if D > 0:
            sh = <Shared*> malloc(sizeof(Shared))
            if sh == NULL:
                raise MemoryError()
            sh.next = 0
            sh.nprefix = c.ncollect
            sh.D = D
            sh.buf = c.cbuf
            sh.thr = c.thr
            c.sh = sh
            for slot in range(1, threads):
                h = Searcher.__new__(Searcher)
                hc = <Ctx*> malloc(sizeof(Ctx))
                if hc == NULL:
                    raise MemoryError()
                memcpy(hc, c, sizeof(Ctx))
                h.c = hc
                hc.cbuf = NULL
                hc.WF = NULL
                hc.WB = NULL
                hc.EF = NULL
                hc.EB = NULL
                helpers.append(h)
                hc.WF = <double*> malloc(N * V * sizeof(double))
                hc.WB = <double*> malloc(N * V * sizeof(double))
                hc.EF = <double*> malloc(N * sizeof(double))
                hc.EB = <double*> malloc(N * sizeof(double))
                if hc.WF == NULL or hc.WB == NULL or hc.EF == NULL or hc.EB == NULL:
                    raise MemoryError()
                hc.nodes = 0
                hc.simulated = 0
                hc.cut_bound = 0
                hc.cut_memory = 0
                hc.cut_ridge = 0
                hc.cut_devices = 0
                hc.cut_capacity = 0
                hc.improved = 0
                hc.have_best = 0
                h.dag_factory = (lambda s=slot: thread_dag(s))
                h.have_dag = 0
                h.dag_error = 0
            workers = [threading.Thread(target=h._thread_main, daemon=True) for h in helpers]
            for w in workers:
                w.start()
            try:
                with nogil:
                    se.run_shared()
            finally:
                for w in workers:
                    w.join()
            for h in helpers:
                _absorb(c, h.c)
                if h.dag_error:
                    h.dag_factory()
                    raise RuntimeError("search_config: the DAG factory failed")
        elif D == 0:
            with nogil:
                se.recurse(0, c.L, 0)
        if se.dag_error:
            se.dag_factory()   # re-raise the factory's error with its traceback
            raise RuntimeError("search_config: the DAG factory failed")
        best = None
        if c.have_best:
            best = (c.best_T, [c.best_opt[x] for x in range(N)], [c.best_l[x] for x in range(N)])
        return {
            "best": best,
            "nodes": c.nodes,
            "simulated": c.simulated,
            "cut_bound": c.cut_bound,
            "cut_memory": c.cut_memory,
            "cut_ridge": c.cut_ridge,
            "cut_devices": c.cut_devices,
            "cut_capacity": c.cut_capacity,
            "timed_out": bool(c.timed_out),
            "gtrace": [c.gtrace[x] for x in range(N)] if c.forced else None,
            "forced_T": c.forced_T if c.forced else None,
            "split_depth": D if D > 0 else 0,
            "subtrees": c.ncollect if D > 0 else 0,
        }
    finally:
        for h in helpers:
            if h.c != NULL:
                free(h.c.WF)
                free(h.c.WB)
                free(h.c.EF)
                free(h.c.EB)
                free(h.c)
                h.c = NULL
        free(sh)
        free(c.cbuf)
        se.c = NULL
        free(c.WF)
        free(c.WB)
        free(c.EF)
        free(c.EB)
        free(c)
