"""The simulator family: schedules -> DAG -> iteration time.

========================  ===============================================================
``schedules``             per-device op orders of every schedule (the single source)
``pipeline``              the validated Python API over the Cython core
                          ``poseidon_plugin._core`` (``PipelineDAG``: the paper's DAG;
                          ``EngineDAG``: as megatron-core runs interleaved plans); its
                          names are re-exported here
``engine``                the engine-aware model in pure Python (bundled p2p calls)
``reference``             the DAG built literally in Python (the tests' reference)
``timeline``              ``Timeline``: the per-op start/finish value both simulators (and
                          the recorder of real runs) return
========================  ===============================================================

The simulator consumes per-stage costs and never measures; it imports no torch.

The layers import one way: ``schedules``, ``timeline`` <- ``engine`` <- ``poseidon_plugin._core``
<- ``pipeline``. The core imports ``simulator.schedules`` (so this package's ``__init__`` runs
first), hence ``pipeline``'s names are re-exported on first use (PEP 562), not imported here:
importing them here would make ``_core`` -> ``simulator`` -> ``pipeline`` -> ``_core`` a cycle.
"""

from .timeline import Timeline

_PIPELINE_NAMES = ("SCHEDULES", "SimInputs", "get_dag", "iteration_time_ms", "normalize_inputs",
                   "simulate_pipeline", "static_estimate_ms")

__all__ = ["SCHEDULES", "Timeline", "SimInputs", "normalize_inputs", "simulate_pipeline",
           "iteration_time_ms", "static_estimate_ms", "get_dag"]


def __getattr__(name: str):
    if name in _PIPELINE_NAMES:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
