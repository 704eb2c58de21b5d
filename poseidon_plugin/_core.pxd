# cython: language_level=3
"""C-level API of the pipeline DAG simulator, for other Cython modules (the plan search).

Usage from another .pyx::

    from poseidon_plugin._core cimport PipelineDAG
    from poseidon_plugin._core import get_dag   # cached per (schedule, N, M, V)

    cdef PipelineDAG dag = get_dag("1f1b", N, M, 1)
    cdef double t
    with nogil:
        t = dag.iteration_time(&F[0], &B[0], &Pf[0], &Pb[0], &R[0])

A ``PipelineDAG`` is built once per (schedule, num_stages N, num_microbatches M, virtual_stages V)
and holds the op DAG flattened in a topological order. ``iteration_time`` then evaluates the
longest path (= list scheduling with fixed per-device op orders) for one weight vector in one
tight sweep, no Python objects, no allocation.

Input layout (all times in ms, finite, >= 0 -- *not* checked at this level):

- ``F``, ``B``: per-(chunk, device) forward / backward time of one micro-batch, ``V*N`` doubles,
  chunk-major: entry ``c*N + s`` is chunk c on device s. (V = 1: simply ``F[s]``.) For
  interleaved-1f1b these are per-chunk times (a device's whole-layer time divided by V when the
  chunks are equal).
- ``Pf``, ``Pb``: ``num_links`` doubles. ``Pf[s]`` is the activation send device s -> s+1,
  ``Pb[s]`` the gradient send device s+1 -> s. ``num_links`` is N-1, except for
  interleaved-1f1b where it is N: entry N-1 is the wrap-around link device N-1 -> device 0
  (used between chunk c on device N-1 and chunk c+1 on device 0, and back).
- ``R``: per-device DP all-reduce time, ``N`` doubles.

Thread safety: ``iteration_time`` writes into the instance's private workspace, so one instance
must not be used by two threads at the same time; ``PipelineDAG.copy()`` gives an independent
instance sharing nothing mutable (the cached instances from ``get_dag`` are meant for the GIL-
holding Python wrappers).
"""

ctypedef struct OpLink:
    int prev      # finish-slot of the previous op on the same device (0 = none -> time 0)
    int dep       # finish-slot of the cross-device dependency (0 = none -> time 0)
    int node_w    # index of the op's compute time in the weight buffer
    int edge_w    # index of the dependency edge's weight in the weight buffer (0 = zero slot)


cdef class PipelineDAG:
    cdef readonly str schedule
    cdef readonly int num_stages          # N
    cdef readonly int num_microbatches    # M
    cdef readonly int virtual_stages      # V
    cdef readonly int num_ops             # 2*N*M*V compute ops
    cdef readonly int num_links           # length of Pf / Pb: N-1, or N for interleaved-1f1b
    cdef readonly object op_stage         # numpy int64 [num_ops], topological order
    cdef readonly object op_chunk
    cdef readonly object op_microbatch
    cdef readonly object op_is_backward   # numpy bool
    cdef readonly object op_position      # index of the op in its device's execution order
    cdef readonly object stage_major      # permutation: topo indices sorted by (device, position)

    cdef OpLink* _links      # [num_ops]
    cdef int* _last          # [N] finish-slot of each device's last op (its R(s) predecessor)
    cdef double* _w          # weight buffer: [0]=0, F (VN), B (VN), Pf (L), Pb (L)
    cdef double* _fin        # finish workspace: [0]=0 (start), op i -> slot i+1
    cdef int _wlen

    # Fill the weight buffer (cheap: 2VN + 2L doubles).
    cdef void _load(self, const double* F, const double* B, const double* Pf,
                    const double* Pb) noexcept nogil

    # Iteration time (ms) for one weight vector: max over devices of
    # finish(last op of s) + R[s]. Layout of the arguments: see the module docstring.
    cdef double iteration_time(self, const double* F, const double* B, const double* Pf,
                               const double* Pb, const double* R) noexcept nogil

    # Full evaluation: per op (topological order) its start and finish time and whether the
    # binding predecessor was the cross-device dependency (1) or the previous op on the device
    # (0); per device the all-reduce start/finish. Returns the iteration time.
    cdef double simulate_into(self, const double* F, const double* B, const double* Pf,
                              const double* Pb, const double* R, double* op_start,
                              double* op_finish, unsigned char* via_dep,
                              double* ar_start, double* ar_finish) noexcept nogil

    cdef _copy_into(self, PipelineDAG other)


# The pipeline as megatron-core executes it (blocking, bundled p2p calls); overrides
# iteration_time, same inputs (see _core.pyx).
cdef class EngineDAG(PipelineDAG):
    cdef OpLink* _elinks     # [_enodes] ops and receive nodes in a topological order
    cdef int* _elast         # [N] slot of each device's last node
    cdef double* _efin       # finish workspace, slot 0 = time 0
    cdef int _enodes
    cdef readonly tuple calls  # (op forward, op backward, send call, receive ready) ms
