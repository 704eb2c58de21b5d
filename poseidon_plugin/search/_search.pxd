# cython: language_level=3
"""The typed boundary of the branch and bound (``_search.pyx``) and its bounds (``_bounds.pyx``).

Three structs, one concern each:

``ConfigData``   the read-only instance of one outer configuration (schedule, V, d, b, N, M and
                 the stage options): per-option costs, memory limits, the devices of each type
                 and their nodes, the schedule's bound structure. Built once in Python
                 (``search/instance.py`` -> ``_search.ConfigInstance``), shared by every thread.
``SearchState``  what one searcher (one thread) changes while it walks the tree: the incumbent
                 threshold, the decided stages and their costs, the incremental bound terms, the
                 device cursors, its best assignment, the subtree prefix it works on.
``SearchStats``  counters (nodes, plans simulated, branches cut by each rule).

Compile-time limits (an instance beyond them is refused in Python before the search).
"""

cdef enum:
    MAXN = 256     # pipeline stages
    MAXV = 8       # virtual stages (interleaving depth)
    MAXO = 64      # stage options (device type, TP degree)
    MAXT = 16      # device types
    MAXK = 16      # layer kinds


cdef enum RidgeMode:
    RIDGE_OFF = 0      # no layer-level rule
    RIDGE_CUT = 1      # the paper's ridge-like cut (heuristic: may lose the optimum)
    RIDGE_SAFE = 2     # its provably safe form (eager-1f1b, Theorem 2's conditions)


cdef struct Shared:
    # threads of one search_config call: the subtrees (prefixes of the first D stages) handed
    # out one at a time, in the order of the one-thread search, from a shared counter, and the
    # incumbent time (an atomic minimum)
    int next
    int D
    int* buf           # n * 2D: options then layers of each prefix
    int n
    int mlock          # the lock of the memo the searchers share (``Searcher.record``)
    double thr


cdef struct ConfigData:
    # ---- the configuration
    int N, M, V, d, L
    int O                          # stage options
    int T                          # device types
    int ridge_mode, ridge_ends     # RidgeMode; ridge rule on the end stages too
    int blocks                     # 1: only contiguous device-type blocks
    int use_bound                  # 0: exhaustive (pruning 'none')
    double act_bytes               # activation bytes of one micro-batch (one send)
    double latency_ms, cross_gbps
    double minsend                 # fastest possible activation send (ms)
    double minfb                   # cheapest f + b of one layer over the options
    double outmin                  # cheapest output-layer f + b over the options
    double alpha                   # safe ridge: Theorem 2's balance factor
    # ---- per option o = (device type, TP degree)
    int opt_type[MAXO]
    int opt_tp[MAXO]
    double of_[MAXO]               # one layer's forward / backward (ms)
    double ob_[MAXO]
    double ofb[MAXO]               # of_ + ob_
    int oorder[MAXO]               # the options in the order the search tries them
    double oef[MAXO]               # embedding forward / backward (stage 0)
    double oeb[MAXO]
    double oof[MAXO]               # output layer forward / backward (last stage)
    double oob[MAXO]
    double ogl[MAXO]               # gradient bytes of one layer / the embedding / the output
    double oge[MAXO]
    double ogo[MAXO]
    double oog[MAXO]               # optimizer ms per gradient byte (R = all-reduce + G * oog + X)
    # ---- expert parallelism (EP > 1): a layer's routed-expert gradient bytes per option (oxg,
    #      uniform model) or per option and kind (kxg, NULL: none); synced over dp / ep ranks
    #      (comm.expert_sync_ms) and stepped at ep / d (comm.expert_optimizer_ms)
    int ep
    double oxg[MAXO]
    const double* kxg
    double overhead_ms             # X: the per-iteration overhead, in every stage's R
    int sharded                    # 1: distributed optimizer (DP sync = reduce-scatter of the
    #                                gradients + all-gather of the parameters; step / d)
    double wpg                     # parameter bytes per gradient byte (the all-gather's bytes)
    int ovl_grad, ovl_param        # --overlap-grad-reduce / --overlap-param-gather (stage 0, V 1)
    double gpp                     # gradient bytes per parameter (the DDP bucket count)
    double bucket                  # DDP bucket, parameters (0: megatron's default)
    const int* lmax                # O * N: most layers option o fits at stage x (memory)
    const int* suffix_lmax         # N + 1: sum over j >= x of max_o lmax[o, j]
    const int* suf_omax            # O * (N + 1): max over j >= x of lmax[o, j]
    const int* firstpos            # O * (L + 2): first stage j with lmax[o, j] >= c (N: none)
    # ---- layer kinds (a mixed model, V = 1): K > 1 and the per-kind arrays; K = 1: none (the
    #      per-option figures above are then exact). With K > 1, of_ / ob_ are each option's
    #      minimum over the kinds (the bounds' per-layer lower bounds), lmax its maximum over
    #      the stage's first layer (an upper bound), and the stage costs and memory come from
    #      the layers a stage holds: its first layer is the layers of the stages before it.
    int K
    const double* kf               # O * K: one layer of kind k on option o (forward ms)
    const double* kb               # O * K: backward ms
    const double* kgl              # O * K: gradient bytes
    const double* kog              # O * K: optimizer ms per gradient byte
    const int* kpre                # K * (L + 1): layers of kind k among layers [0, i)
    const int* lmax_from           # O * N * (L + 1): most layers option o fits at stage x
    #                                from first layer a (memory)
    const double* xf               # N * O: after stage x (layers >= x + 1), one layer's
    const double* xb               # forward / backward lower bound: the minimum over the kinds
    #                                of layers [x + 1, L) (the bounds' per-layer costs)
    # ---- layer kinds with interleaving (K > 1, V > 1): Megatron's layout is chunk-major, so
    #      chunk c of stage x starts at ck_off[c] + (chunk-c layers of the stages before x),
    #      ck_off[c] the layers of chunks < c; ck_tot[c] = the layers of chunk c over all stages,
    #      fixed by the configuration (``OuterConfig.chunk_totals``). Memory: ``fitcb``, a
    #      Python callable (o, x, chunk starts, cap) -> the most layers <= cap that fit
    int ilv
    int ck_tot[MAXV]
    int ck_off[MAXV]
    void* fitcb
    # ---- per device type
    int ndev[MAXT]
    int type_off[MAXT]             # offset of the type's devices in node_of / local_of
    double intra[MAXT]             # intra- / inter-node link (Gbit/s)
    double inter[MAXT]
    int min_dt[MAXT]               # d * smallest TP of the type's options (0: unusable)
    const int* node_of             # per type offset + device -> global node
    const int* local_of            # device -> local index inside its node
    # ---- the schedule's bound structure (``BoundStructure``)
    int clast                      # chunk of every device's last op
    const int* acnt                # N * V: forwards of chunk c before the first backward
    const int* t1cnt               # N * V: forwards of chunk c up to F(s, V-1, mb 0)
    int acnt_sufmax[MAXN + 1]      # V = 1: max over j >= x of acnt[j]
    int pair                       # 1: the two-stage path bound (interleaved)
    int loop1                      # 1: V = 1 with 1F1B's steady state (adjacent-pair loop)
    const int* pcnt                # N * 3 * 2 * V: its op counts (``configs.pair_counts``)
    double midlast[MAXO]           # pair: the last stage's part of the path with option o and
                                   # one layer per chunk (``_bounds.bound``'s last-stage term)


cdef struct SearchState:
    double thr                     # incumbent threshold: plans slower than this are cut
    double deadline                # monotonic seconds, 0 = none
    int timed_out
    # decided stages x < current depth
    int cursor[MAXT]               # next free device of each type
    int used[MAXT]                 # type already serves a stage (blocks mode)
    int st_opt[MAXN]
    int st_l[MAXN]
    int st_start[MAXN]
    double fc[MAXN * MAXV]         # per (stage, chunk) forward / backward of one micro-batch
    double bc[MAXN * MAXV]
    double Fst[MAXN]               # stage forward total
    double Pf[MAXN]                # link sends (Pf[N-1]: the interleaved wrap-around)
    double Pb[MAXN]
    double R[MAXN]                 # post-pipeline work: DP sync + optimizer step + X
    double Rb[MAXN]                # the R the bounds use: R, but stage 0's DP sync counted 0
    #                                under the DP overlap (its exposed part can shrink as the
    #                                stage's layers grow; every bound term must not)
    # incremental bound terms (``_bounds.stage_bound``)
    double head[MAXN]
    double tail[MAXN]
    double P[MAXN]
    double MA[MAXN]
    double MC[MAXN]
    double MD[MAXN]                # 1F1B double round trip: max over i <= x (``_bounds.bound``)
    double MW[MAXN]                # 1F1B window loop with two round trips: max over windows
    #                                ending at i <= x (``_bounds._loop_windows``), less 2 P_i
    int MWj[MAXN]                  # ... the first and last stage of the window that gives it
    int MWe[MAXN]
    double gnw                     # ``bound``'s g without the window terms (k >= 2 stages)
    int gwj                        # ... the window whose term is the rest of g: first / last
    int gwe                        #     stage (the memo's soundness marks, ``recurse``)
    int norec[MAXN]                # 1: the memo must not record the subtree of stage r (a cut
    #                                in it read a window that starts before r and ends after)
    double Sg[MAXN]                # two-stage path: chunk-0 round trip of the stages < x
    double Qp[MAXN]                # ... max over c < x of stage c's backward part (``pair_prefix``)
    double QX[MAXN]                # ... max over a < x of stage a's forward part
    double lastmid[MAXN]           # after stage x: min midlast over the options that can host it
    double ginc                    # ``bound``'s terms that never decrease with stage x's layers
    double fbav[MAXN]              # after stage x: cheapest layer f + b / output layer f + b
    double outav[MAXN]             # ... over the types that can still host a stage (``later_costs``)
    int lnt[MAXN]                  # V = 1, after stage x: the types that can host a later stage,
    double ltfb[MAXN * MAXT]       # cheapest first: their cheapest layer f + b and free stage
    int lslots[MAXN * MAXT]        # slots (``later_costs``; ``_bounds.later_excess``)
    # ridge rule memory per option
    int rl[MAXO]
    int rdec[MAXO]
    # evaluation buffers in the simulator's layout (chunk-major c*N + s)
    double* WF
    double* WB
    double* EF
    double* EB
    # best assignment found (time <= thr)
    int have_best
    double best_T
    int best_opt[MAXN]
    int best_l[MAXN]
    # subtree prefix (threads): stages x < plen are fixed to (p_opt[x], p_l[x])
    int plen
    int p_opt[MAXN]
    int p_l[MAXN]
    # prefix collection: the recursion stores prefixes of depth collect_D and returns
    int collect_D
    int* cbuf
    int ncollect
    int ccap
    int coverflow
    Shared* sh


cdef struct SearchStats:
    long long nodes
    long long simulated            # plans timed by the DAG
    long long improved             # incumbent improvements
    long long cut_bound            # stage-level lower bound above the threshold
    long long cut_memory           # no layer count fits memory / the later stages
    long long cut_ridge            # layer-level ridge rule
    long long cut_devices          # not enough devices left
    long long cut_capacity         # capacity / fill-drain / round-trip cuts
    long long cut_dominated        # subtrees a searched one of the same key dominates


cdef inline double lay_f(const ConfigData* I, int x, int o) noexcept nogil:
    """A lower bound on one layer's forward on option o among the layers after stage x (every
    layer for a uniform model: of_)."""
    return I.xf[x * I.O + o] if I.K > 1 else I.of_[o]


cdef inline double lay_b(const ConfigData* I, int x, int o) noexcept nogil:
    return I.xb[x * I.O + o] if I.K > 1 else I.ob_[o]


cdef inline double lay_fb(const ConfigData* I, int x, int o) noexcept nogil:
    return (I.xf[x * I.O + o] + I.xb[x * I.O + o]) if I.K > 1 else I.ofb[o]


cdef inline double dmax(double a, double b) noexcept nogil:
    return a if a > b else b


cdef inline double dmin(double a, double b) noexcept nogil:
    return a if a < b else b
