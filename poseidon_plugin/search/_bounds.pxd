# cython: language_level=3
"""Lower bounds and capacity cuts of the branch and bound (implemented in ``_bounds.pyx``).

Every function reads the read-only instance ``I`` and the decided stages of the searcher's
state ``S`` (x = the stage just decided); each returns a bound valid for every completion of the
current prefix. The proofs are in ``docs/search.md``; ``tests/test_search.py`` checks them
against the exhaustive search on random instances.
"""

from libc.math cimport ceil

from poseidon_plugin.search._search cimport MAXT, ConfigData, SearchState, dmax


# Update the incremental bound terms of stage x (its costs, Pf/Pb[x-1] and R[x] already set in
# S) and return the stage-level lower bound g on the iteration time of every completion.
cdef double bound(const ConfigData* I, SearchState* S, int x, int Lrem) noexcept nogil

# The cheapest layer and output-layer f + b over the types that can still host a stage after x
# (free devices >= d t_min; in blocks mode the current type or an unused one): S.fbav[x] and
# S.outav[x], read by ``bound``. Call once stage x's device cursor is set.
cdef void later_costs(const ConfigData* I, SearchState* S, int x) noexcept nogil

# Interleaved two-stage path bound: its terms of the stages < x (I.pair only; call once stage
# x's link from x-1 is set, before ``bound`` of x).
cdef void pair_prefix(const ConfigData* I, SearchState* S, int x) noexcept nogil

# Most layers the K stages after x can hold in a completion with time <= the threshold
# (-1: no completion places K stages). ``avail`` = threshold - cap_path(x); ``whi`` bounds the
# later stages' round-trip work (fill/drain cut, V = 1).
cdef int capacity(const ConfigData* I, SearchState* S, int x, double avail, int K,
                  double whi) noexcept nogil

# Round-trip capacity cut (V = 1): 1 when no completion with time <= the threshold places
# ``need`` layers on the K stages after x.
cdef int wcut(const ConfigData* I, SearchState* S, int x, double avail, int K, int need,
              double whi) noexcept nogil


cdef inline double later_excess(const ConfigData* I, SearchState* S, int x,
                                int Lrem) noexcept nogil:
    """V = 1: how much more than Lrem fbav[x] the Lrem layers after stage x cost (f + b, one
    micro-batch) in every completion with time <= S.thr (``docs/search.md``). The K = N-1-x
    later stages each hold >= 1 layer on their own type and type k (cost c_k, free stage slots
    s_k: ``later_costs``) serves <= s_k of them, so the first layers cost >= the K cheapest
    slots; a stage of type k holds <= u_k = floor(thr / (M c_k)) layers (its M forwards and
    backwards run one at a time), so the other Lrem - K layers cost >= a fractional knapsack
    over the types, cheapest first, type k taking <= s_k (u_k - 1) of them. 0 when the
    types cannot place K stages (another cut says so). Never increases as Lrem falls
    (``low_bound``'s monotonicity) and never decreases as the threshold falls."""
    cdef int K = I.N - 1 - x, n = S.lnt[x], i, left, take
    cdef long e, cap
    cdef double fb = S.fbav[x], out = 0.0, c, u
    cdef const double* tc = &S.ltfb[x * MAXT]
    cdef const int* ts = &S.lslots[x * MAXT]
    if K <= 0 or n == 0:
        return 0.0
    left = K
    for i in range(n):
        take = ts[i] if ts[i] < left else left
        out += take * (tc[i] - fb)
        left -= take
        if left == 0:
            break
    if left > 0:
        return 0.0
    e = Lrem - K
    for i in range(n):
        if e <= 0:
            break
        c = tc[i]
        if c <= 0.0:
            break
        u = S.thr * (1.0 + 1e-9) / (I.M * c)
        if u >= e + 1.0:            # one stage of the type can take every extra layer
            cap = e
        else:
            cap = (<long> u - 1) * ts[i]
            if cap < 0:
                cap = 0
            if cap > e:
                cap = e
        out += cap * (c - fb)
        e -= cap
    return out


cdef inline double low_bound(const ConfigData* I, SearchState* S, int x, int Lrem) noexcept nogil:
    """The part of ``bound``'s g for stage x (K = N - 1 - x > 0 later stages, Lrem layers after
    x) that never grows with stage x's own layer count: its round-trip and gy terms with stage
    x's costs (all >= 0) left out, the later layers' kept. g >= this for every count, and it
    only grows as the count shrinks (Lrem grows), so the counts it cuts are the smallest ones.
    Needs stage x's link (Pf, Pb[x-1]) and ``later_costs`` of x, not x's costs."""
    cdef int V = I.V, K = I.N - 1 - x
    cdef double lay = Lrem, fut, head = 0.0, tailfix = 0.0, rt = 0.0
    if V > 1:
        lay = (Lrem - K * (V - 1)) / <double> V
        if lay < 0:
            lay = 0
    fut = 2.0 * I.minsend * K + lay * S.fbav[x] + S.outav[x]
    if V == 1:
        fut += later_excess(I, S, x, Lrem)
    if x > 0:
        head = S.head[x - 1] + S.fc[(x - 1) * V] + S.Pf[x - 1]
        tailfix = S.Pb[x - 1] + S.bc[(x - 1) * V + I.clast] + S.tail[x - 1]
        rt = S.MC[x - 1] + S.P[x - 1] + S.Pf[x - 1] + S.Pb[x - 1]
    return dmax(rt + fut,
                head + 2.0 * I.minsend + I.M * ceil(Lrem / <double> K) * S.fbav[x] + tailfix)


cdef inline double cap_path(const ConfigData* I, SearchState* S, int x) noexcept nogil:
    """The path every later stage's work lies on besides its own ops (``bound``'s gy path):
    stage x's first forward arrives, its first-chunk forward, two sends, the backward of its
    last chunk and the tail down to stage 0's all-reduce."""
    return (S.head[x] + S.fc[x * I.V] + 2.0 * I.minsend + S.bc[x * I.V + I.clast] + S.tail[x])


cdef inline double rt_limit(const ConfigData* I, SearchState* S, int x, int K,
                            double thr) noexcept nogil:
    """Most round-trip work W (the later stages' w, output layer included) a completion with
    time <= thr can have: ``bound``'s round-trip term MC + P + 2 minsend K + W and, 1F1B,
    its double round trip MD + 2 P + 2 (2 minsend K + W) are both <= thr."""
    cdef double w = thr - S.MC[x] - S.P[x] - 2.0 * I.minsend * K
    cdef double w2
    if I.loop1:
        w2 = 0.5 * (thr - S.MD[x] - 2.0 * S.P[x]) - 2.0 * I.minsend * K
        if w2 < w:
            w = w2
    return w


cdef inline int rt_cut(const ConfigData* I, SearchState* S, int x, int K, int need,
                       double thr) noexcept nogil:
    """``wcut`` of stage x's choice (V = 1, two or more later stages) at threshold thr."""
    return (I.V == 1 and K > 1
            and wcut(I, S, x, thr - cap_path(I, S, x), K, need, rt_limit(I, S, x, K, thr)))
