"""The simulator family: schedules -> DAG -> iteration time.

========================  ===============================================================
``schedules``             per-device op orders of every schedule (the single source)
``_core`` (Cython)        the DAG longest path: ``PipelineDAG`` (the paper's DAG) and
                          ``EngineDAG`` (as megatron-core runs interleaved plans)
``pipeline``              the validated Python API over ``_core`` (re-exported here)
``engine``                the engine-aware model in pure Python (bundled p2p calls)
``reference``             the DAG built literally in Python (the tests' reference)
``timeline``              ``Timeline``: the per-op start/finish value both simulators (and
                          the recorder of real runs) return
========================  ===============================================================

The simulator consumes per-stage costs and never measures; it imports no torch.
"""

from .pipeline import (SCHEDULES, SimInputs, get_dag, iteration_time_ms, normalize_inputs,
                       simulate_pipeline, static_estimate_ms)
from .timeline import Timeline

__all__ = ["SCHEDULES", "Timeline", "SimInputs", "normalize_inputs", "simulate_pipeline",
           "iteration_time_ms", "static_estimate_ms", "get_dag"]
