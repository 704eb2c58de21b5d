"""Building the ``Plan`` value from a searched assignment.

The search finds (configuration, option per stage, layers per stage) and its time through the
Cython path; ``build_plan`` recomputes everything through the Python cost path
(``instance.time_assignment``), checks that both agree and that every stage fits its memory,
and fills in the per-stage numbers, placement and throughput figures the plan reports.
"""

from __future__ import annotations

from ..costs import CostModel, chunk_layers
from ..plan import DeviceSlot, Plan, StagePlan
from ..profiles import provenance_entry
from .configs import OuterConfig
from .instance import time_assignment


def _stage_plans(cm: CostModel, cfg: OuterConfig, opts, layers, stages, placements
                 ) -> tuple[StagePlan, ...]:
    return tuple(
        StagePlan(index=s, device_type=cm.type_names[cfg.options[opts[s]][0]],
                  tp=cfg.options[opts[s]][1], dp=cfg.dp, cp=cfg.cp, layers=int(layers[s]),
                  forward_ms=st.forward_ms, backward_ms=st.backward_ms,
                  send_forward_ms=st.send_forward_ms, send_backward_ms=st.send_backward_ms,
                  allreduce_ms=st.allreduce_ms, memory_bytes=int(st.memory_bytes),
                  memory_capacity_bytes=int(st.memory_capacity_bytes),
                  optimizer_ms=st.optimizer_ms, overhead_ms=st.overhead_ms,
                  expert_allreduce_ms=st.expert_allreduce_ms,
                  devices=tuple(tuple(DeviceSlot(n, d) for (n, d) in grp)
                                for grp in placements[s].slots),
                  chunk_layers=chunk_layers(int(layers[s]), cfg.virtual_stages),
                  chunk_forward_ms=tuple(st.chunk_forward_ms),
                  chunk_backward_ms=tuple(st.chunk_backward_ms),
                  provenance=tuple(provenance_entry(p) for p in st.provenance)
                  + (("optimizer",) + tuple(st.optimizer_source),),
                  memory_parts=_memory_parts(st))
        for s, st in enumerate(stages))


def _memory_parts(st) -> tuple:
    if st.memory is None:
        return ()
    source = "measured" if st.memory.activations_measured else "estimated"
    return tuple(st.memory.parts().items()) + (("activations_source", source),)


def _throughput(cm: CostModel, cfg: OuterConfig, opts, global_batch_size: int, t_ms: float
                ) -> tuple[float, float]:
    """(model TFLOP/s per device, MFU) of a plan taking ``t_ms`` per iteration."""
    types = [cfg.options[o][0] for o in opts]
    tps = [cfg.options[o][1] for o in opts]
    used = sum(cfg.dp_cp * tp for tp in tps)
    flops = cm.model.model_flops_per_iteration(global_batch_size, cm.full_seq_length)
    tflops_dev = flops / (t_ms / 1e3) / used / 1e12
    dts = [cm.cluster.device_types[cm.type_names[k]] for k in types]
    peaks = [dt.peak_tflops for dt in dts]
    if any(p is None for p in peaks) or any(dt.measured_peak for dt in dts):
        # a type known only from measured layers: no peak to measure MFU against
        return tflops_dev, 0.0
    peak = sum(p * cfg.dp_cp * tp for p, tp in zip(peaks, tps))
    return tflops_dev, flops / (t_ms / 1e3) / (peak * 1e12)


def build_plan(cm: CostModel, cfg: OuterConfig, opts, layers, *, global_batch_size: int,
               predicted_ms: float, lower_bound_ms: float | None = None,
               search_stats: dict | None = None, check: bool = True) -> Plan:
    """The ``Plan`` of one assignment; AssertionError when the Python cost path disagrees with
    ``predicted_ms`` (``check``) or a stage exceeds its memory (both are bugs, not user
    errors)."""
    cm = cm.at_cp(cfg.cp)
    stages, placements, unused, t = time_assignment(cm, cfg, opts, layers)
    if check and abs(t - predicted_ms) > 1e-6 * max(1.0, abs(t)):
        raise AssertionError(f"search and simulator disagree: {predicted_ms} vs {t}")
    for s, st in enumerate(stages):
        if st.memory_bytes > st.memory_capacity_bytes:
            raise AssertionError(f"plan exceeds memory on stage {s}")
    tflops_dev, mfu = _throughput(cm, cfg, opts, global_batch_size, t)
    lb = t if lower_bound_ms is None else min(lower_bound_ms, t)
    return Plan(
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, dp=cfg.dp, cp=cfg.cp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        global_batch_size=global_batch_size, seq_length=cm.full_seq_length,
        stages=_stage_plans(cm, cfg, opts, layers, stages, placements),
        predicted_iteration_time_ms=t, model_name=cm.model.name, cluster_name=cm.cluster.name,
        unused_devices=tuple(DeviceSlot(n, d) for (n, d) in unused),
        search=dict(search_stats or {}),
        predicted_tokens_per_s=global_batch_size * cm.full_seq_length / (t / 1e3),
        model_tflops_per_device=tflops_dev, mfu=mfu, lower_bound_ms=lb,
        gap=(t - lb) / t if t > 0 else 0.0, num_layers=cm.model.num_layers,
        wrap_send_ms=(cm.wrap_send_ms(placements, cfg.micro_batch_size)
                      if cfg.virtual_stages > 1 else 0.0),
        training=cm.training.to_dict(), iteration_overhead=overhead_provenance(cm),
        engine_calls=cm.engine_calls(cfg.micro_batch_size).as_tuple(),
        engine_calls_source=cm.engine_calls(cfg.micro_batch_size).source,
        ep=cfg.ep, moe=bool(getattr(cm.model, "num_experts", 0)),
        mtp_num_layers=int(getattr(cm.model, "mtp_num_layers", 0)),
        moe_token_dispatcher_type=getattr(cm.model, "moe_token_dispatcher_type", "alltoall"),
        node_types=tuple(n.device_type for n in cm.cluster.nodes))


def overhead_provenance(cm: CostModel) -> dict:
    """The plan's ``iteration_overhead``: {"ms", "source", "record"} of the cost model's
    overhead record ({} = none)."""
    o = cm.overhead
    if o is None:
        return {}
    record = o.key.describe() + (f"; {o.calibrated_on}" if o.calibrated_on else "")
    return {"ms": o.overhead_ms, "source": o.source, "record": record}
