# cython: language_level=3
"""Lower bounds and capacity cuts of the plan search's branch and bound.

``_wpos`` and ``wcut`` are longer than the rest of the code base's functions on purpose: they run
at every node of the search, nogil, and are kept in one piece so the C compiler sees the whole
loop (their steps are documented inline).

Declared in ``_bounds.pxd``; used by ``_search.pyx``'s recursion after it decides stage x
(option and layer count). All are valid for every completion of the decided prefix: the
iteration time is a longest path in a DAG with non-negative weights, so any path is a lower
bound. The derivations (stage-level bound, capacity, fill/drain and round-trip cuts) are in
``docs/search.md``; ``tests/test_search.py`` holds them to the exhaustive search.

Stage-level bound g (``bound``): for every decided stage i

    E_i >= max(head_i + sum_c acnt[i,c] fc[i,c],  head_i + sum_c t1cnt[i,c] fc[i,c] + RT_i)
           + M sum_c bc[i,c] + sum_c (M - acnt[i,c]) fc[i,c]
    T   >= E_i + tail_i

with head_i the earliest arrival of the first forward, RT_i the round trip of micro-batch 0
through the later stages (undecided ones bounded below by the remaining layers times the
cheapest per-layer cost), tail_i the backward chain of the last micro-batch down to a stage k
followed by its all-reduce R_k; and, for the undecided stage with the most layers,
    T >= head_{x+1} + M * ceil(L_rem / K) * min(f+b) + tail via stage x.
"""

from libc.math cimport ceil

from poseidon_plugin.search._search cimport (MAXN, MAXT, ConfigData, SearchState, dmax,
                                             dmin, lay_b, lay_f, lay_fb)


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


cdef double bound(const ConfigData* I, SearchState* S, int x, int Lrem) noexcept nogil:
    """Update the incremental bound state of stage x (costs, Pf/Pb[x-1], R[x] and Rb[x] set)
    and return g (the tail uses Rb: R, or below it where R is not monotone in the layers)."""
    cdef int V = I.V, M = I.M, N = I.N, cc, K
    cdef double A, C, Z, fut, g, gy, lay, qx, qy
    cdef int clast = I.clast
    cdef double gp = 0.0, inc, gw = -1e300
    if I.pair and x > 0:
        gp = _pair_bound(I, S, x)
    if x == 0:
        S.head[0] = 0.0
        S.tail[0] = S.Rb[0]
        S.P[0] = 0.0
    else:
        S.head[x] = S.head[x - 1] + S.fc[(x - 1) * V] + S.Pf[x - 1]
        S.tail[x] = dmax(S.Rb[x], S.Pb[x - 1] + S.bc[(x - 1) * V + clast] + S.tail[x - 1])
        S.P[x] = (S.P[x - 1] + S.Pf[x - 1] + S.fc[x * V + V - 1] + S.bc[x * V + V - 1]
                  + S.Pb[x - 1])
    A = S.head[x]
    C = S.head[x]
    Z = 0.0
    for cc in range(V):
        A += I.acnt[x * V + cc] * S.fc[x * V + cc]
        C += I.t1cnt[x * V + cc] * S.fc[x * V + cc]
        Z += M * S.bc[x * V + cc] + (M - I.acnt[x * V + cc]) * S.fc[x * V + cc]
    if x == 0:
        S.MA[0] = A + Z + S.tail[0]
        S.MC[0] = C - S.P[0] + Z + S.tail[0]
    else:
        S.MA[x] = dmax(S.MA[x - 1], A + Z + S.tail[x])
        S.MC[x] = dmax(S.MC[x - 1], C - S.P[x] + Z + S.tail[x])
    K = N - 1 - x
    # (the terms that never decrease with stage x's layers: S.ginc, see below)
    inc = dmax(gp, dmax(S.MA[x], S.MC[x] + S.P[x]))
    fut = 0.0
    if K > 0:
        if V == 1:
            lay = Lrem
        else:
            lay = (Lrem - K * (V - 1)) / <double> V
            if lay < 0:
                lay = 0
        fut = 2.0 * I.minsend * K + lay * S.fbav[x] + S.outav[x]
        if V == 1:
            fut += later_excess(I, S, x, Lrem)
    if I.loop1:
        # double round trip (1F1B order, a_x <= M - 1): F(x, 0), micro-batch 0's round trip
        # to B(x, 0), stage x's ops from B(x, 0) to its last forward F(x, M-1) (M - a_x of
        # each), micro-batch M-1's round trip, B(x, M-1), tail_x; the round trips of the
        # stages i <= x are P[x] - P[i] + the later stages' (>= fut) each
        A = -1e300
        if I.acnt[x] <= M - 1:
            A = (S.head[x] + (M - I.acnt[x] + 1) * (S.fc[x] + S.bc[x]) + S.tail[x]
                 - 2.0 * S.P[x])
        S.MD[x] = A if x == 0 else dmax(S.MD[x - 1], A)
        gp = dmax(gp, S.MD[x] + 2.0 * (S.P[x] + fut))
        if x > 0:
            gp = dmax(gp, _loop_pair(I, S, x, fut))
        # loops over windows of 2..WINDOW_MAX adjacent stages ending at x (kept apart from
        # the rest of g: the memo's soundness marks need to know when they decide a cut)
        gw = _loop_windows(I, S, x, fut)
        if S.MW[x] + 2.0 * (S.P[x] + fut) >= gw:
            gw = S.MW[x] + 2.0 * (S.P[x] + fut)
            S.gwj = S.MWj[x]
            S.gwe = S.MWe[x]
    if I.pair and K > 0:
        # the path above with the undecided last stage as the far stage: stages x+1..N-2 each
        # run >= one layer's f + b in chunk 0 on the two chains, every link >= minsend, and
        # the last stage's part is >= lastmid (one layer per chunk, the output layer)
        qx = _pair_fwd(I, S, x)
        qy = _pair_bwd(I, S, x)
        if x > 0:
            qx = dmax(qx, S.QX[x])
            qy = dmax(qy, S.Qp[x])
        qx = (qx + qy + S.Sg[x] + S.fc[x * V] + S.bc[x * V] + 2.0 * I.minsend * K
              + (K - 1) * S.fbav[x] + S.lastmid[x])
        gp = dmax(gp, qx)
        inc = dmax(inc, qx)
    # S.ginc: the terms of g that never decrease as stage x's layer count grows (its costs,
    # Rb[x] and tail[x] only grow with it): MA, MC + P, the interleaved path bounds (in the
    # last one, stage x's -f and -b of chunk 0 in its two parts cancel with the + f + b). The
    # layer loop bisects with it: a count it cuts is cut with every larger count.
    S.ginc = inc
    if K == 0:
        S.gnw = dmax(dmax(S.MA[x], S.MC[x] + S.P[x]), gp)
        return dmax(S.gnw, gw)
    g = dmax(S.MA[x], S.MC[x] + S.P[x] + fut)
    gy = (S.head[x] + S.fc[x * V] + 2.0 * I.minsend + M * ceil(Lrem / <double> K) * S.fbav[x]
          + S.bc[x * V + clast] + S.tail[x])
    S.gnw = dmax(dmax(g, gy), gp)
    return dmax(S.gnw, gw)


cdef enum:
    WINDOW_MAX = 8       # stages in a window of ``_loop_windows`` (at most)


cdef double _loop_windows(const ConfigData* I, SearchState* S, int x,
                          double rt) noexcept nogil:
    """Window loops of 1F1B (V = 1, ``loop1``): for k = 2..WINDOW_MAX adjacent stages
    j = x - k + 1 .. x with acnt[i + 1] = acnt[i] - 1 inside and a_j = acnt[j] <= M - 1.
    Sets S.MW[x] (the carried two-round-trip form, less 2 P_x; with its window in MWj / MWe)
    and returns the best one-round-trip form at x (its window in S.gwj / S.gwe; -1e300 when
    no window qualifies). ``rt``: a lower bound on micro-batch 0's round trip through the
    stages after x (0 when x is the last). ``docs/search.md`` has the proof.

    In steady state stage i runs B(i, m) then F(i, m + a_i), so B(x, m) -> B(x-1, m) -> ...
    -> B(j, m) -> F(j, m + a_j) -> F(j+1, m + a_j) -> ... -> F(x, m + a_j) -> B(x, m + k) is
    a path (F(x, m + a_j) = F(x, m + k - 1 + a_x) is followed by B(x, m + k)): a turn runs
    every window stage's work and its links both ways, for k micro-batches. Micro-batch 0
    reaches B(x, 0) after head_x + F_x + its round trip; n = floor((M - 1 - a_j) / k) + 1
    turns (m = 0, k, .., (n-1) k: F(j, m + a_j) exists) end with F(x, q), q = (n-1) k + a_j,
    then one of: (a) stage x's ops from B(x, nk) on (M - nk backwards, max(0, M - nk - a_x)
    forwards) and tail_x; (b) B(x, nk), micro-batch nk's backwards down to j (B_i and the
    links), stage j's M - nk backwards (its forwards are done: nk + a_j > M - 1) and tail_j;
    (c) micro-batch q's round trip through the stages after x, B(x, q), stage x's ops after
    it (M - 1 - q backwards, max(0, M - q - a_x) forwards) and tail_x. (c) holds the round
    trip twice, written like the double round trip: carried as MW (value - 2 P_x), read as
    MW + 2 (P_y + fut) at every later node y."""
    cdef int M = I.M, k, j, aj, ax = I.acnt[x], n, q, c
    cdef double turn = S.fc[x] + S.bc[x], chainb = 0.0, base, A, v, best = -1e300
    if x == 0:
        S.MW[0] = -1e300
        S.MWj[0] = 0
        S.MWe[0] = 0
    else:
        S.MW[x] = S.MW[x - 1]
        S.MWj[x] = S.MWj[x - 1]
        S.MWe[x] = S.MWe[x - 1]
    S.gwj = x
    S.gwe = x
    if ax < 1:
        return best
    for k in range(2, WINDOW_MAX + 1):
        j = x - k + 1
        if j < 0 or I.acnt[j] != I.acnt[j + 1] + 1:
            break
        aj = I.acnt[j]
        if aj > M - 1:
            break
        turn += S.fc[j] + S.bc[j] + S.Pf[j] + S.Pb[j]
        if k > 2:
            chainb += S.bc[j + 1]
        chainb += S.Pb[j]
        n = (M - 1 - aj) // k + 1
        q = (n - 1) * k + aj
        base = S.head[x] + S.fc[x] + n * turn
        c = M - q - ax
        if c < 0:
            c = 0
        A = base + (M - q) * S.bc[x] + c * S.fc[x] + S.tail[x] - 2.0 * S.P[x]
        if A > S.MW[x]:
            S.MW[x] = A
            S.MWj[x] = j
            S.MWe[x] = x
        c = M - n * k - ax
        if c < 0:
            c = 0
        v = base + rt + dmax((M - n * k) * S.bc[x] + c * S.fc[x] + S.tail[x],
                             S.bc[x] + chainb + (M - n * k) * S.bc[j] + S.tail[j])
        if v > best:
            best = v
            S.gwj = j
            S.gwe = x
    return best


cdef inline double _loop_pair(const ConfigData* I, SearchState* S, int x,
                              double rt) noexcept nogil:
    """Adjacent-pair bound of 1F1B (V = 1, ``loop1``) for stages j = x - 1 and x, when
    a = acnt[j] <= M - 1 and acnt[x] = a - 1 (else 0). ``rt``: a lower bound on micro-batch
    0's round trip through the stages after x (0 when x is the last).

    In steady state stage j runs B(j, k) then F(j, k + a), stage x runs F(x, k + a) then
    B(x, k + 2), so B(x, k) -> Pb -> B(j, k) -> F(j, k + a) -> Pf -> F(x, k + a) -> B(x, k + 2)
    is a path: each turn runs both stages' work and the link both ways, for two micro-batches.
    The path: micro-batch 0's forward to x (head_x + F_x) and round trip back to B(x, 0);
    n = floor((M - 1 - a) / 2) + 1 turns (k = 0, 2, .., 2n - 2; F(j, k + a) exists); then
    either B(x, 2n), the link, B(j, 2n .. M-1) and tail_j, or stage x's ops from B(x, 2n) to
    B(x, M-1) (M - 2n backwards, c = max(0, M - 2n - a + 1) forwards), the link, B(j, M-1)
    and tail_j. Where two adjacent stages both carry nearly the most work, the link time
    enters once per two micro-batches (LLaMA-3 405B on 512 devices, two adjacent 6-layer
    H100 stages: the plan's 146,930 ms against 144,171 ms of the best one-stage path)."""
    cdef int j = x - 1, M = I.M, a = I.acnt[j], n, c
    cdef double fj, bj, fx, bx, lnk, turn
    if a > M - 1 or a < 2 or I.acnt[x] != a - 1:
        return 0.0
    n = (M - 1 - a) // 2 + 1
    c = M - 2 * n - a + 1
    if c < 0:
        c = 0
    fj = S.fc[j]
    bj = S.bc[j]
    fx = S.fc[x]
    bx = S.bc[x]
    lnk = S.Pf[j] + S.Pb[j]
    turn = fj + bj + fx + bx + lnk
    return (S.head[x] + fx + rt + n * turn + S.Pb[j] + S.tail[j]
            + dmax(bx + (M - 2 * n) * bj, (M - 2 * n) * bx + c * fx + bj))


cdef void later_costs(const ConfigData* I, SearchState* S, int x) noexcept nogil:
    """S.fbav[x] / S.outav[x]: the cheapest one-layer and output-layer f + b over the options
    whose type can still host a later stage (at least d t_min free devices -- alignment only
    needs more -- and, in blocks mode, the type of stage x or one not used yet). Every layer
    after x, and the output layer, runs on such an option, so ``bound``'s undecided terms may
    use them instead of the instance's cheapest (a fast type whose devices are all taken no
    longer lowers them). 1e300 when no type can (no completion: a later cut says so too)."""
    cdef int o, k, kx = I.opt_type[S.st_opt[x]], n = 0, i
    cdef double fb = 1e300, out = 1e300, mid = 1e300
    cdef double tfb[MAXT]
    cdef int slots[MAXT]
    for k in range(I.T):
        tfb[k] = 1e300
        slots[k] = 0
    for o in range(I.O):
        k = I.opt_type[o]
        if I.min_dt[k] <= 0 or I.ndev[k] - S.cursor[k] < I.min_dt[k]:
            continue
        if I.blocks and k != kx and S.used[k]:
            continue
        if lay_fb(I, x, o) < fb:
            fb = lay_fb(I, x, o)
        if lay_fb(I, x, o) < tfb[k]:
            tfb[k] = lay_fb(I, x, o)
        slots[k] = (I.ndev[k] - S.cursor[k]) // I.min_dt[k]
        if I.oof[o] + I.oob[o] < out:
            out = I.oof[o] + I.oob[o]
        if I.midlast[o] < mid:
            mid = I.midlast[o]
    S.fbav[x] = fb
    S.outav[x] = out
    S.lastmid[x] = mid
    # the hosting types cheapest first (insertion sort; ``later_excess`` reads them)
    for k in range(I.T):
        if slots[k] <= 0:
            continue
        i = n
        while i > 0 and S.ltfb[x * MAXT + i - 1] > tfb[k]:
            S.ltfb[x * MAXT + i] = S.ltfb[x * MAXT + i - 1]
            S.lslots[x * MAXT + i] = S.lslots[x * MAXT + i - 1]
            i -= 1
        S.ltfb[x * MAXT + i] = tfb[k]
        S.lslots[x * MAXT + i] = slots[k]
        n += 1
    S.lnt[x] = n


cdef void pair_prefix(const ConfigData* I, SearchState* S, int x) noexcept nogil:
    """Sg[x] = sum_{i<x} (Pf_i + Pb_i + fc[i,0] + bc[i,0]), QX[x] = max over a < x of stage a's
    forward part and Qp[x] = max over c < x of stage c's backward part (``_pair_fwd``,
    ``_pair_bwd``): they depend on the stages < x and the link into x only, so
    ``_place_stage`` sets them once per option of stage x."""
    cdef int a = x - 1
    if x == 0:
        S.Sg[0] = 0.0
        return
    S.Sg[x] = S.Sg[a] + S.Pf[a] + S.Pb[a] + S.fc[a * I.V] + S.bc[a * I.V]
    if x == 1:
        S.QX[1] = _pair_fwd(I, S, a)
        S.Qp[1] = _pair_bwd(I, S, a)
    else:
        S.QX[x] = dmax(S.QX[a], _pair_fwd(I, S, a))
        S.Qp[x] = dmax(S.Qp[a], _pair_bwd(I, S, a))


cdef inline double _pair_bound(const ConfigData* I, SearchState* S, int x) noexcept nogil:
    """Path bound of interleaved schedules (``configs.pair_counts``) with stage x (x >= 1) as
    the far stage b and the best decided a, c < x: stage a's ops up to F(a, 0, k*), the chunk-0
    forwards of micro-batch k* from a+1 to x, stage x up to B(x, 0, 0), the chunk-0 backwards
    of micro-batch 0 from x-1 down to c, stage c from B(c, 0, 0) to its end, tail_c. With
    head_a and the chains written through Sg, the path is QX-part(a) + Sg[x] + fc[x,0] + mid_x
    + Qp-part(c), the two parts maximised separately (a = c is the two-stage path)."""
    cdef int V = I.V, cc
    cdef const int* px = I.pcnt + x * 6 * V
    cdef double mid = S.fc[x * V]
    for cc in range(V):
        mid += px[2 * V + cc] * S.fc[x * V + cc] + px[3 * V + cc] * S.bc[x * V + cc]
    return S.QX[x] + S.Qp[x] + S.Sg[x] + mid


cdef inline double _pair_fwd(const ConfigData* I, SearchState* S, int a) noexcept nogil:
    """Stage a's forward part of the path: its ops before F(a, 0, k*) (the chain from its
    F(a, 0, k*) on is head_b - head_a - fc[a, 0], so head_a cancels)."""
    cdef int V = I.V, cc
    cdef const int* pa = I.pcnt + a * 6 * V
    cdef double ka = -S.fc[a * V]
    for cc in range(V):
        ka += pa[cc] * S.fc[a * V + cc] + pa[V + cc] * S.bc[a * V + cc]
    return ka


cdef inline double _pair_bwd(const ConfigData* I, SearchState* S, int c) noexcept nogil:
    """Stage c's backward part: its ops from B(c, 0, 0) on and tail_c, less the backward chain
    sum_{i<c} (bc[i,0] + Pb_i) = Sg[c] - head_c and its own B(c, 0, 0) (counted in the chain
    from the far stage)."""
    cdef int V = I.V, cc
    cdef const int* pc = I.pcnt + c * 6 * V
    cdef double kc = S.tail[c] - S.Sg[c] + S.head[c] - S.bc[c * V]
    for cc in range(V):
        kc += pc[4 * V + cc] * S.fc[c * V + cc] + pc[5 * V + cc] * S.bc[c * V + cc]
    return kc


cdef enum:
    CHAIN_RUN_MARGIN = 8
    CHAIN_SEARCH_MARGIN = 1   # (3 before: 405B / 4096's pp = 55 ran 278 k searches for 5.9 k cuts,
                              # all but 100 of them within one layer; 19 % faster at 1)
    CHAIN_MAXK = 128     # ``_chain_cut`` runs for <= 128 later stages of <= 4 usable types
    CHAIN_MAXS = 12      # (its tables stay small enough for a thread's stack)

cdef struct ChainTables:
    # ``_chain_cut``'s states per later position p (3 per usable type): type, layers valued,
    # the (f + b) and b of the layers checked, and the pair constraint into p
    int K
    int nst[CHAIN_MAXK]
    int npair[CHAIN_MAXK]
    double rp[CHAIN_MAXK]
    int sk[CHAIN_MAXK * CHAIN_MAXS]
    int sl[CHAIN_MAXK * CHAIN_MAXS]
    double sw[CHAIN_MAXK * CHAIN_MAXS]
    double sb[CHAIN_MAXK * CHAIN_MAXS]


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


cdef inline void _type_caps(const ConfigData* I, SearchState* S, int x, int K, double budget,
                            int amax, TypeCaps* tc) noexcept nogil:
    """Per type: the most layers one later stage (after x) can hold, cap_o = budget / coef_o
    (coef_o = M (f + b)_o when amax < 0, else (M-1) b_o + (M - amax) f_o: the round-trip
    cut's), clipped to the option's largest memory limit after x and dropped below V; how many
    later stages the type can still host (free devices // the smallest d t, <= K); its cheapest
    (f + b); and the type's layer total bound (free devices x the best cap_o / (d t_o)). Fills
    the top-K slot groups (``_type_groups``) and the knapsack list of ``tc``."""
    cdef int k, o, cap, best, dtmin, cnt, i, j
    cdef double coef, fbk, ratio, lbk
    cdef double step = S.fbav[x] + 2.0 * I.minsend
    cdef int kbest[MAXT]
    cdef int kdt[MAXT]
    cdef double kfb[MAXT]
    cdef double kratio[MAXT]
    tc.nt = 0
    tc.ng = 0
    for k in range(I.T):
        kbest[k] = -1
        kdt[k] = 0
        kfb[k] = 0.0
        kratio[k] = 0.0
    # one pass over the options, each into its type's running values
    for o in range(I.O):
        k = I.opt_type[o]
        if I.ndev[k] - S.cursor[k] <= 0:
            continue
        if amax < 0:
            coef = I.M * lay_fb(I, x, o)
        else:
            coef = (I.M - 1) * lay_b(I, x, o) + (I.M - amax) * lay_f(I, x, o)
        cap = _layers_within(budget, coef)
        if cap < 0:
            continue
        if cap > I.suf_omax[o * (I.N + 1) + x + 1]:
            cap = I.suf_omax[o * (I.N + 1) + x + 1]
        if amax < 0:
            # memory decides where a stage of c layers can be: at stage j >= first(o, c),
            # and the path to stage j also runs through the j - x - 1 stages between
            # (each one's chunk-0 forward and backward, >= one layer, and two sends)
            while cap >= I.V:
                j = I.firstpos[o * (I.L + 2) + cap]
                if j < x + 1:
                    j = x + 1
                if (j < I.N and cap * coef + (j - x - 1) * step
                        <= budget * (1.0 + 1e-9) + 1e-9):
                    break
                cap -= 1
        if cap < I.V:
            continue
        if cap > kbest[k]:
            kbest[k] = cap
        if kdt[k] == 0 or I.d * I.opt_tp[o] < kdt[k]:
            kdt[k] = I.d * I.opt_tp[o]
        if kfb[k] == 0.0 or lay_fb(I, x, o) < kfb[k]:
            kfb[k] = lay_fb(I, x, o)
        if <double> cap / (I.d * I.opt_tp[o]) > kratio[k]:
            kratio[k] = <double> cap / (I.d * I.opt_tp[o])
    for k in range(I.T):
        best = kbest[k]
        dtmin = kdt[k]
        fbk = kfb[k]
        ratio = kratio[k]
        if best < 0:
            continue
        cnt = (I.ndev[k] - S.cursor[k]) // dtmin
        if cnt <= 0:
            continue
        if cnt > K:
            cnt = K
        lbk = (I.ndev[k] - S.cursor[k]) * ratio * (1.0 + 1e-9) + 1e-9
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


cdef int capacity(const ConfigData* I, SearchState* S, int x, double avail, int K,
                  double whi) noexcept nogil:
    """Most layers the K stages after x can hold in a completion with T <= thr (-1: none).

    ``avail`` = thr - (a path every later stage j's work lies on besides its own ops):
    head_x + fc[x, 0] + 2 minsend + bc[x, clast] + tail_x (the path of ``gy`` in ``bound``).
    Stage j with option o and l_j layers runs M l_j (f_o + b_o) of work serially, so
    T >= avail-path + M l_j (f_o + b_o): l_j <= (thr - path) / (M (f_o + b_o)), and l_j <= its
    memory limit. Per type k, a stage takes >= d * t_min(k) of the D_k devices left (alignment
    only wastes more), so at most D_k // (d t_min) stages of type k, each holding at most the
    largest cap of the type's options. Greedy over types (caps descending) gives the maximum of
    this relaxation; fewer than K stages possible -> -1.

    Fill/drain (every stage's first op is F(s, chunk 0, 0) and its last op B(s, chunk clast,
    M-1); applied for V = 1 and for clast = 0, which interleaved-1f1b has): the later stage at
    position p (p = 0..K-1 after x) starts its first forward after micro-batch 0's chunk-0
    forward through the later stages before it, and after its last backward chunk 0's
    backward of micro-batch M-1 runs back through them. Chunk 0 holds >= l_i / V of a stage's
    layers (``chunk_layers``: larger chunks first), so with w_i = F_i + B_i (all chunks,
    >= l_i (f + b)_i) and U_p = sum of w over the later stages before position p:
    M w_p + U_p / V <= avail - 2 minsend p, i.e.
    U_{p+1} <= U_p (1 - 1/(M V)) + (avail - 2 minsend p)/M.
    The right side is increasing in U_p, so U_K <= the recursion's value from U_0 = 0 (greedy).
    The layers then satisfy sum_j l_j (f + b)_j <= U_K with per type <= min(cnt_k, K) stages
    of <= cap_k layers and (f + b) >= the type's cheapest: a fractional knapsack, filled
    cheapest (f + b) first, bounds them from above; the smaller of the two bounds is returned.
    ``whi`` (V = 1 only: for V > 1 the RT term holds chunk V-1's round trip, not W): an upper
    limit on U_K = W (``wcut``'s, from the decided stages' RT term); as
    U_p <= U_K <= whi for every p (w >= 0) and the step is increasing in U_p,
    U_{p+1} <= step(min(U_p bound, whi)) by induction, and U_K <= whi. The last later stage
    holds the output layer (x < N - 1), whose w is >= its layers' (f + b) + outmin, so the
    knapsack's budget is U_K - outmin.
    """
    cdef int total, taken, i, j, p
    cdef double U, lay, room, take, r, invm
    cdef TypeCaps tc
    _type_caps(I, S, x, K, avail, -1, &tc)
    total = _topk_layers(tc.tcap, tc.tcnt, tc.ng, K, &taken)
    if taken < K:
        return -1
    if K > 1 and (I.V == 1 or I.clast == 0):
        if I.V > 1:
            whi = 1e300     # (the RT term bounds chunk V-1's round trip only, not W)
        U = 0.0
        r = 1.0 - 1.0 / (<double> I.V * I.M)     # (one multiply-add per step: the two
        invm = 1.0 / I.M                         # divisions were a third of this cut)
        for p in range(K):
            if U > whi:
                U = whi
            U = U * r + (avail - 2.0 * I.minsend * p) * invm
        if U > whi:
            U = whi
        U = (U - I.outmin) * (1.0 + 1e-9)
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


cdef inline void _sort_desc(double* val, int* cnt, int n) noexcept nogil:
    """Sort the n groups (val[i], cnt[i]) by val descending (insertion sort: n is small)."""
    cdef int i, j, c
    cdef double v
    for i in range(1, n):
        v = val[i]
        c = cnt[i]
        j = i
        while j > 0 and val[j - 1] < v:
            val[j] = val[j - 1]
            cnt[j] = cnt[j - 1]
            j -= 1
        val[j] = v
        cnt[j] = c


cdef inline double _kth_desc(double* val, int* cnt, int n, int k) noexcept nogil:
    """The value at index k (0-based) of the multiset {val[i] x cnt[i]} sorted descending,
    -1e300 past its end (the groups are sorted in place)."""
    cdef int i
    _sort_desc(val, cnt, n)
    for i in range(n):
        if k < cnt[i]:
            return val[i]
        k -= cnt[i]
    return -1e300


cdef double _wpos(const ConfigData* I, SearchState* S, int x, int K, double R, int* pc,
                  int* gcnt, int* ngroups, int* tav, double* troom,
                  double* uout, int dual, double cut) noexcept nogil:
    """Positional round-trip capacity (V = 1) for W >= Wa, R = A - Wa: an upper bound on the
    layers the K stages after x hold (-1: no completion), and troom[k] = the most layers the
    stages of type k can hold (the sum of its best min(cnt_k, K) positional caps). Also
    returned: the rows pc (G = *ngroups groups of gcnt[g] consecutive positions), the counts
    tav[k] = cnt_k and the multipliers uout (``_chain_cut`` reads them). With dual = 0 only
    the rows, counts and rooms are set (the bound returned is 1e300: not computed). A bound
    of the coordinate sweeps below ``cut`` is returned at once (the caller's cut holds; the
    descent below is for the bounds that do not cut, and for ``_chain_cut``'s multipliers:
    without it 405B on 4096 devices' pp = 55 searched 48 % more nodes).

    Stage j = x + 1 + p with option o obeys l_j ((M-1) b_o + (M - a_j) f_o) <= A - W <= R
    (``wcut``'s inequality with its own a_j = acnt[j] <= M) and l_j <= lmax[o, j], so
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
    cdef int p, j, o, k, k2, cap, aj, T = I.T, M = I.M, N = I.N, n, i, m, sweep, ninf
    cdef int g, G = 0, same, nmask, it, sg, ok
    cdef double coef, best, other, D, D2, bestD
    cdef int bestm, bests
    cdef int act[MAXT]
    cdef double u[MAXT]
    cdef double u2[MAXT]
    cdef double dl[MAXN]
    cdef int dc[MAXN]
    cdef int* gp
    for k in range(T):
        if I.min_dt[k] > 0:
            tav[k] = (I.ndev[k] - S.cursor[k]) // I.min_dt[k]
        else:
            tav[k] = 0
        if tav[k] > K:
            tav[k] = K
        u[k] = 0.0
        troom[k] = 0.0
    # the rows pc[p, .], consecutive equal rows kept once as a group of gcnt positions (the
    # caps repeat over long runs of positions: the sums below are over groups x counts)
    for p in range(K):
        j = x + 1 + p
        aj = I.acnt[j]
        if aj > M:
            aj = M
        gp = pc + G * T
        for k in range(T):
            gp[k] = -1
        for o in range(I.O):
            k = I.opt_type[o]
            if tav[k] <= 0:
                continue
            coef = (M - 1) * lay_b(I, x, o) + (M - aj) * lay_f(I, x, o)
            cap = _layers_within(R, coef)
            if cap < 0:
                continue
            if cap > I.lmax[o * N + j]:
                cap = I.lmax[o * N + j]
            if cap < 1:
                continue
            if cap > gp[k]:
                gp[k] = cap
        same = G > 0
        if same:
            for k in range(T):
                if gp[k] != gp[k - T]:
                    same = 0
                    break
        if same:
            gcnt[G - 1] += 1
        else:
            gcnt[G] = 1
            G += 1
    ngroups[0] = G
    # per type room: the best min(cnt_k, K) positional caps
    for k in range(T):
        if tav[k] <= 0:
            continue
        n = 0
        for g in range(G):
            if pc[g * T + k] >= 0:
                dl[n] = pc[g * T + k]
                dc[n] = gcnt[g]
                n += 1
        m = tav[k]
        _sort_desc(dl, dc, n)
        i = 0
        while m > 0 and i < n:
            troom[k] += dl[i] * (dc[i] if dc[i] < m else m)
            m -= dc[i]
            i += 1
    if not dual:
        return 1e300
    # dual sweeps
    for sweep in range(2):
        for k in range(T):
            if tav[k] <= 0:
                continue
            n = 0
            ninf = 0
            for g in range(G):
                if pc[g * T + k] < 0:
                    continue
                other = -1e300
                for k2 in range(T):
                    if k2 != k and pc[g * T + k2] >= 0 and pc[g * T + k2] - u[k2] > other:
                        other = pc[g * T + k2] - u[k2]
                if other <= -1e299:
                    ninf += gcnt[g]
                    continue
                dl[n] = pc[g * T + k] - other
                dc[n] = gcnt[g]
                n += 1
            if ninf > tav[k]:
                return -1.0
            # the (cnt_k + 1)-th largest delta overall (the ninf infinite ones come first)
            m = tav[k] - ninf
            u[k] = 0.0
            best = _kth_desc(dl, dc, n, m)
            if best > 0.0:
                u[k] = best
    D = _wdual(pc, gcnt, G, T, tav, u)
    if D < 0.0:
        return -1.0
    for k in range(T):
        uout[k] = u[k]
    if D < cut:
        return D * (1.0 + 1e-12) + 1e-9
    # steepest descent over the moves u +- (1 on a subset S of the types): D is L-natural
    # convex in u (the dual of a transportation problem), so a u no such move improves is a
    # minimum (Murota), and the bound is then the assignment's exact optimum (the LP is
    # integral). Coordinate sweeps alone stop at kinks: 405B on 512 devices, 45 stages, an
    # H100 stage first: 131 layers where the optimum is 124 (< 125 needed: a cut).
    nmask = 0
    for k in range(T):
        if tav[k] > 0:
            act[nmask] = k
            nmask += 1
    if nmask <= 6:
        for it in range(64):
            bestD = D
            bestm = 0
            bests = 0
            for m in range(1, 1 << nmask):
                for sg in range(-1, 2, 2):
                    ok = 1
                    for i in range(nmask):
                        if (m >> i) & 1:
                            u2[act[i]] = u[act[i]] + sg
                            if u2[act[i]] < 0.0:
                                ok = 0
                        else:
                            u2[act[i]] = u[act[i]]
                    if not ok:
                        continue
                    D2 = _wdual(pc, gcnt, G, T, tav, u2)
                    if D2 >= 0.0 and D2 < bestD - 1e-9:
                        bestD = D2
                        bestm = m
                        bests = sg
            if bestm == 0:
                break
            for i in range(nmask):
                if (bestm >> i) & 1:
                    u[act[i]] += bests
            D = bestD
        for k in range(T):
            uout[k] = u[k]
    return D * (1.0 + 1e-12) + 1e-9


cdef inline double _wdual(const int* pc, const int* gcnt, int G, int T, const int* tav,
                          const double* u) noexcept nogil:
    """D(u) = sum_k cnt_k u_k + sum_g gcnt_g max_k (pc[g, k] - u_k) (``_wpos``); -1 when a
    group has no type."""
    cdef int g, k
    cdef double D = 0.0, best
    for k in range(T):
        D += tav[k] * u[k]
    for g in range(G):
        best = -1e300
        for k in range(T):
            if pc[g * T + k] >= 0 and pc[g * T + k] - u[k] > best:
                best = pc[g * T + k] - u[k]
        if best <= -1e299:
            return -1.0
        D += gcnt[g] * best
    return D


cdef int _chain_cut(const ConfigData* I, int x, int K, double R, int need, const double* u0,
                    const int* pc, const int* gcnt, int G, const int* cnt) noexcept nogil:
    """Adjacent-pair capacity cut of 1F1B (``loop1``, V = 1): 1 when the K stages after x
    cannot hold ``need`` layers in a completion with T <= thr.

    Two later stages j, j+1 (a = acnt[j] <= M - 1, acnt[j+1] = a - 1) lie on the loop path
    of ``_loop_pair``; written like ``wcut``'s one-stage path (the rest of the path is
    cap_path(x), the K - 1 other links twice and W), with w, b per layer of the stages' types
    (the cheapest over a type's options) and n = floor((M - 1 - a) / 2) + 1:
      n (l_j w_j + l_{j+1} w_{j+1}) + (M - 2n - 1) max(l_j b_j, l_{j+1} b_{j+1})
          <= R - 2 n minsend,   R = A - W,
    beside each stage's own cap (``_wpos``'s rows pc at R, in groups of gcnt positions: its
    one-stage path and memory; cnt: its type counts). The type
    counts are relaxed with the multipliers u >= 0 of ``_wpos`` (weak duality: any u >= 0
    gives an upper bound): most layers <= sum_k cnt_k u_k + max over type and layer sequences
    of sum_p (l_p - u_k(p)) under the caps and the pair constraints, a chain DP over the
    positions whose state is the previous stage's (type, layers). The layer choices of a
    (position, type) are its cap, cap - 1 and "cap - 2 or fewer" (valued cap - 2, checked
    against its neighbours as one layer): an over-estimate, so still an upper bound.
    Where heavy stages may not sit side by side (two adjacent A100 stages of 2 layers on
    405B over 512 devices), this sees what the one-stage caps do not: 46 stages at
    143,990 ms, one-stage optimum 126 layers, with the pairs 120.
    The multipliers: ``_wpos``'s (optimal without the pairs), then, while the bound is within
    CHAIN_SEARCH_MARGIN layers of ``need``, up to three rounds of the best single +-1 change
    (49 stages at 143,990 ms: 126 at _wpos's u, 123 with u_A100-80 lowered by one)"""
    cdef int T = I.T, M = I.M, p = 0, j, k, o, i, g, r, cap, aj, nst, nt = 0, rnd, bk, bs, sg
    cdef double wmin[MAXT]
    cdef double bmin[MAXT]
    cdef double u[MAXT]
    cdef ChainTables ct
    cdef double v, bestv, cand
    if K > CHAIN_MAXK:
        return 0
    for k in range(T):
        wmin[k] = 1e300
        bmin[k] = 1e300
        u[k] = u0[k]
        if cnt[k] > 0:
            nt += 1
    if nt > CHAIN_MAXS // 3:
        return 0
    for o in range(I.O):
        k = I.opt_type[o]
        if lay_fb(I, x, o) < wmin[k]:
            wmin[k] = lay_fb(I, x, o)
        if lay_b(I, x, o) < bmin[k]:
            bmin[k] = lay_b(I, x, o)
    ct.K = K
    for g in range(G):
        for r in range(gcnt[g]):
            j = x + 1 + p
            nst = 0
            for k in range(T):
                cap = pc[g * T + k]
                for i in range(3):
                    if cap - i < 1:
                        break
                    ct.sk[p * CHAIN_MAXS + nst] = k
                    ct.sl[p * CHAIN_MAXS + nst] = cap - i
                    ct.sw[p * CHAIN_MAXS + nst] = (cap - i if i < 2 else 1) * wmin[k]
                    ct.sb[p * CHAIN_MAXS + nst] = (cap - i if i < 2 else 1) * bmin[k]
                    nst += 1
            if nst == 0:
                return 1
            ct.nst[p] = nst
            # the pair constraint between positions p - 1 and p (stages j - 1, j)
            ct.npair[p] = 0
            if p > 0:
                aj = I.acnt[j - 1]
                if aj <= M - 1 and aj >= 2 and I.acnt[j] == aj - 1:
                    ct.npair[p] = (M - 1 - aj) // 2 + 1
            ct.rp[p] = (R - 2.0 * ct.npair[p] * I.minsend) * (1.0 + 1e-9) + 1e-9
            p += 1
    v = _chain_eval(&ct, cnt, T, M, u)
    if v < need:
        return 1
    if v >= need + CHAIN_SEARCH_MARGIN:
        return 0
    for rnd in range(3):
        bestv = v
        bk = -1
        bs = 0
        for k in range(T):
            if cnt[k] <= 0:
                continue
            for sg in range(-1, 2, 2):
                if u[k] + sg < 0.0:
                    continue
                u[k] += sg
                cand = _chain_eval(&ct, cnt, T, M, u)
                u[k] -= sg
                if cand < bestv - 1e-9:
                    bestv = cand
                    bk = k
                    bs = sg
        if bk < 0:
            return 0
        u[bk] += bs
        v = bestv
        if v < need:
            return 1
    return 0


cdef double _chain_eval(const ChainTables* ct, const int* cnt, int T, int M,
                        const double* u) noexcept nogil:
    """``_chain_cut``'s bound at multipliers u: sum_k cnt_k u_k + the chain DP's maximum
    (-1e300 when no sequence fits). The previous position's values are kept in descending
    order, so each state takes the first one its pair constraint allows."""
    cdef int p, i, i2, q, n, npv = 0, nst, base, pbase, k
    cdef double D = 0.0, best, lhs, b1, b2, v
    cdef double pv[CHAIN_MAXS]
    cdef double sv[CHAIN_MAXS]
    cdef int order[CHAIN_MAXS]
    for k in range(T):
        D += cnt[k] * u[k]
    for p in range(ct.K):
        nst = ct.nst[p]
        base = p * CHAIN_MAXS
        pbase = base - CHAIN_MAXS
        n = ct.npair[p]
        for i in range(nst):
            if p == 0:
                best = 0.0
            else:
                best = -1e300
                for q in range(npv):
                    i2 = order[q]
                    if pv[i2] <= -1e299:
                        break
                    if n > 0:
                        b1 = ct.sb[pbase + i2]
                        b2 = ct.sb[base + i]
                        lhs = (n * (ct.sw[pbase + i2] + ct.sw[base + i])
                               + (M - 2 * n - 1) * (b1 if b1 > b2 else b2))
                        if lhs > ct.rp[p]:
                            continue
                    best = pv[i2]
                    break
            if best <= -1e299:
                sv[i] = -1e300
            else:
                sv[i] = best + ct.sl[base + i] - u[ct.sk[base + i]]
        # pv = sv, and order = its indices by value, descending (insertion sort, <= 12)
        for i in range(nst):
            v = sv[i]
            pv[i] = v
            q = i
            while q > 0 and pv[order[q - 1]] < v:
                order[q] = order[q - 1]
                q -= 1
            order[q] = i
        npv = nst
    best = -1e300
    for i in range(npv):
        if pv[i] > best:
            best = pv[i]
    if best <= -1e299:
        return -1e300
    return (D + best) * (1.0 + 1e-12) + 1e-9


cdef int wcut(const ConfigData* I, SearchState* S, int x, double avail, int K, int need,
              double whi) noexcept nogil:
    """Round-trip capacity cut (V = 1): 1 when no completion with T <= thr places ``need``
    layers on the K stages after x.

    For a later stage j (V = 1: its first op is F(j, 0), its last B(j, M-1), a_j forwards
    before its first backward B(j, 0)), the path of ``bound``'s RT term through the stages
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
    W_c <= A2 = min(A, whi) (``whi``: ``bound``'s RT term with the later stages' round trip
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
    cdef int amax = I.acnt_sufmax[x + 1]
    cdef double A, A2, W, Wn, room, cost, rest, fbmin
    cdef TypeCaps tc
    cdef int pc[MAXN * MAXT]
    cdef int gcnt[MAXN]
    cdef int tav[MAXT]
    cdef int ng = 0
    cdef double troom[MAXT]
    cdef double u[MAXT]
    cdef double wp = 1e300, Rw = 0.0
    if amax > I.M:
        amax = I.M
    A = avail - 2.0 * I.minsend * (K - 1)
    if A > 1e200:
        return 0
    if A <= 0.0:
        return 1
    fbmin = 1e300
    for o in range(I.O):
        if lay_fb(I, x, o) < fbmin:
            fbmin = lay_fb(I, x, o)
    if whi < A:
        A2 = whi
    else:
        A2 = A
    W = (need * fbmin + I.outmin) * (1.0 - 1e-9)
    for it in range(16):
        if W > A2:
            return 1
        _type_caps(I, S, x, K, A - W, amax, &tc)
        total = _topk_layers(tc.tcap, tc.tcnt, tc.ng, K, &taken)
        if taken < K or total < need:
            return 1
        # positional caps: stage j = x + 1 + p with its own a_j (not amax) and lmax[o, j];
        # their dual bound only at the fixpoint below (the caps only fall as W grows)
        Rw = A - W
        _wpos(I, S, x, K, Rw, pc, gcnt, &ng, tav, troom, u, 0, 0.0)
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
        Wn = (I.outmin + cost) * (1.0 - 1e-9) - 1e-9
        if Wn <= W * (1.0 + 1e-12):
            break
        W = Wn
    if W > A2:
        return 1
    # the positional dual at the last W (and the rows for ``_chain_cut``)
    Rw = A - W
    wp = _wpos(I, S, x, K, Rw, pc, gcnt, &ng, tav, troom, u, 1, need)
    if wp < need:
        return 1
    # the pairs take a few layers off the one-stage optimum (3-6 on 405B / 512): the chain DP
    # only runs where that can decide (it costs a third of the nodes per second elsewhere:
    # per-stage TP setting 5 reached a 6.9 % gap in 60 s with it everywhere, 4.4 % without)
    if I.loop1 and K >= 2 and wp < need + CHAIN_RUN_MARGIN:
        return _chain_cut(I, x, K, Rw, need, u, pc, gcnt, ng, tav)
    return 0


