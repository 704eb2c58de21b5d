# cython: language_level=3
"""The root bound's arithmetic (``configs.root_bound``) in C: the capacity bisection over the
values where capacity changes and the fill/drain bisection.

``configs.root_bound`` derives the inputs (per option M (f + b) and d t, per device type its
cheapest option, stage count and devices) and adds the per-iteration overhead; this module
repeats ``configs._root_bound_py``'s steps operation for operation, so both give the same
doubles (``tests/test_search.py`` compares them). Every configuration of a search gets a root
bound before the first plan: on 10,240 devices 14,491 of them, 1.5 s in Python.
"""

from libc.math cimport INFINITY
from libc.stdlib cimport free, malloc, qsort

from poseidon_plugin.search._search cimport MAXO, MAXT


cdef inline long _cap(double a, double t_ms, long limit) noexcept nogil:
    """``configs._cap``: most layers of M (f + b) = a within t_ms, at most ``limit``."""
    cdef double q
    if a <= 0.0:
        return limit
    q = t_ms / a
    if q >= limit:
        return limit
    q = q * (1 + 1e-9) + 1e-9
    if q >= limit:
        return limit
    return <long> q


cdef int _cmp_double(const void* x, const void* y) noexcept nogil:
    cdef double a = (<const double*> x)[0], b = (<const double*> y)[0]
    return (a > b) - (a < b)


cdef struct Roots:
    const double* opt_a      # per option, grouped by type (type order): M (f + b)
    const int* opt_dt        # ... and d t
    const double* type_a     # per type: its cheapest option's M (f + b)
    const int* type_count    # ... most stages (devices // min d t)
    const int* type_dev      # ... devices
    const int* type_first    # ... first option index; type_first[T] = O
    int T, n, m, v, L
    long limit


cdef long _capacity_at(const Roots* r, double t_ms, long* caps, long* cnts) noexcept nogil:
    """``configs._capacity_at``: most layers N stages of time <= t_ms hold (-1: fewer than N
    stages hold V each)."""
    cdef int k, o, i, nc = 0
    cdef long cap, per_device = 0, total = 0, taken = 0, jj, dev_cap, stage_cap
    cdef double ratio, x
    for k in range(r.T):
        cap = _cap(r.type_a[k], t_ms, r.limit)
        if cap >= r.v and r.type_count[k] > 0:
            # insert (cap, count) keeping caps descending (ties: count descending)
            i = nc
            while i > 0 and (caps[i - 1] < cap
                             or (caps[i - 1] == cap and cnts[i - 1] < r.type_count[k])):
                caps[i] = caps[i - 1]
                cnts[i] = cnts[i - 1]
                i -= 1
            caps[i] = cap
            cnts[i] = r.type_count[k]
            nc += 1
            stage_cap = (r.type_count[k] if r.type_count[k] < r.n else r.n) * cap
            if r.type_first[k + 1] - r.type_first[k] == 1:
                per_device += stage_cap
                continue
            ratio = -INFINITY
            for o in range(r.type_first[k], r.type_first[k + 1]):
                x = <double> _cap(r.opt_a[o], t_ms, r.limit) / r.opt_dt[o]
                if x > ratio:
                    ratio = x
            dev_cap = <long> (r.type_dev[k] * ratio * (1 + 1e-12))
            per_device += dev_cap if dev_cap < stage_cap else stage_cap
    for i in range(nc):
        jj = cnts[i] if cnts[i] < r.n - taken else r.n - taken
        taken += jj
        total += jj * caps[i]
    if taken < r.n:
        return -1
    return total if total < per_device else per_device


cdef bint _fill_feasible(const Roots* r, const int* by_a, double t_ms, double extra,
                         double a_n, double g_n, double a_last, double g_last,
                         double last_send) noexcept nogil:
    """``configs._fill_feasible`` (types visited cheapest first, ``by_a``)."""
    cdef long need = r.L, cap, take
    cdef double work = extra, carried
    cdef int i, k
    for i in range(r.T):
        k = by_a[i]
        cap = _cap(r.type_a[k], t_ms, r.limit)
        if cap >= r.v and r.type_count[k] > 0:
            take = (r.type_count[k] if r.type_count[k] < r.n else r.n) * cap
            if take > need:
                take = need
            work += (<double> take * r.type_a[k]) / r.m
            need -= take
            if need == 0:
                break
    if need > 0:
        return False
    if t_ms - last_send - (a_last * t_ms - g_last) / r.v >= 0.0:
        carried = a_n * t_ms - g_n
    else:
        carried = a_n * t_ms
    return work <= carried * (1 + 1e-9)


def root_core(list types, int n, int m, int v, int L, double base, double extra,
              double minsend):
    """The root bound of one configuration before the per-iteration overhead
    (``configs._root_bound_py`` less its ``cm.iteration_overhead_ms``); inf when no plan can
    hold the layers. ``types``: per usable device type in type order, (its cheapest option's
    M (f + b), most stages, devices, ((M (f + b), d t) per option)) -- the
    ``configs._TypeCapacity`` fields."""
    cdef Roots r
    cdef int T = len(types), O = 0, o, i, j, k, nc, lo, hi, mid, p
    cdef long limit = L - (n - 1) * v, jn
    cdef double bound, q, a, g, a_prev, g_prev, lo_t, hi_t, mid_t, mt
    cdef double opt_a[MAXO]
    cdef int opt_dt[MAXO]
    cdef double type_a[MAXT]
    cdef int type_count[MAXT]
    cdef int type_dev[MAXT]
    cdef int type_first[MAXT + 1]
    cdef long caps[MAXT]         # ``_capacity_at``'s work space
    cdef long cnts[MAXT]
    cdef int by_a[MAXT]          # the types by a, ascending (stable)
    if T == 0 or T > MAXT:
        raise ValueError(f"root_core: expected 1 to {MAXT} device types, got {T}")
    type_first[0] = 0
    for k in range(T):
        ta, cnt, dev, opts = types[k]
        type_a[k] = ta
        type_count[k] = cnt
        type_dev[k] = dev
        for oa, odt in opts:
            if O >= MAXO:
                raise ValueError(f"root_core: more than {MAXO} options")
            opt_a[O] = oa
            opt_dt[O] = odt
            O += 1
        type_first[k + 1] = O
    r.opt_a = opt_a
    r.opt_dt = opt_dt
    r.type_a = type_a
    r.type_count = type_count
    r.type_dev = type_dev
    r.type_first = type_first
    r.T, r.n, r.m, r.v, r.L, r.limit = T, n, m, v, L, limit
    jn = limit - v + 1
    if jn <= 0:
        return INFINITY
    cdef double* cands = <double*> malloc(O * jn * sizeof(double))
    if not cands:
        raise MemoryError()
    try:
        nc = 0
        for o in range(O):
            for j in range(v, limit + 1):
                cands[nc] = opt_a[o] * j
                nc += 1
        qsort(cands, nc, sizeof(double), _cmp_double)
        k = 0                      # distinct values, ascending (``sorted(set(...))``)
        for i in range(nc):
            if k == 0 or cands[i] != cands[k - 1]:
                cands[k] = cands[i]
                k += 1
        nc = k
        if _capacity_at(&r, cands[nc - 1], caps, cnts) < L:
            return INFINITY
        lo, hi = 0, nc - 1         # smallest index with capacity >= L
        while lo < hi:
            mid = (lo + hi) // 2
            if _capacity_at(&r, cands[mid], caps, cnts) >= L:
                hi = mid
            else:
                lo = mid + 1
        bound = cands[lo] * (1 - 1e-9)
        if not bound > base:
            bound = base
        if n == 1:
            return bound
        # fill/drain (``configs._fill_carry`` / ``_fill_bound``)
        q = 1.0 - 1.0 / (m * v)
        a = g = a_prev = g_prev = 0.0
        for p in range(n):
            a_prev, g_prev = a, g
            a, g = q * a + 1.0 / m, q * g + 2.0 * minsend * p / m
        for i in range(T):         # types by a, stable
            j = i
            while j > 0 and type_a[by_a[j - 1]] > type_a[i]:
                by_a[j] = by_a[j - 1]
                j -= 1
            by_a[j] = i
        mt = 2.0 * minsend * (n - 1)
        lo_t, hi_t = bound, 2.0 * bound
        while not _fill_feasible(&r, by_a, hi_t, extra, a, g, a_prev, g_prev, mt):
            lo_t, hi_t = hi_t, 2.0 * hi_t
            if hi_t > 1e15:
                return INFINITY
        if _fill_feasible(&r, by_a, lo_t, extra, a, g, a_prev, g_prev, mt):
            return bound
        while hi_t - lo_t > 1e-5 * hi_t:
            mid_t = 0.5 * (lo_t + hi_t)
            if _fill_feasible(&r, by_a, mid_t, extra, a, g, a_prev, g_prev, mt):
                hi_t = mid_t
            else:
                lo_t = mid_t
        return lo_t
    finally:
        free(cands)
