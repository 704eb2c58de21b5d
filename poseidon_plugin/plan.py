"""The Plan value: stable JSON, readable table, flags for Megatron-LM and MindSpeed-LLM, rank order.

JSON form (``Plan.to_json``; ``PLAN_FORMAT_VERSION`` = 1): one object, keys sorted, 2-space
indent, floats rounded to 6 decimals, trailing newline, so equal plans give equal bytes::

    {"format_version": 1, "model_name", "cluster_name", "predicted_iteration_time_ms",
     "predicted_tokens_per_s", "model_tflops_per_device", "mfu", "lower_bound_ms", "gap",
     "schedule", "virtual_stages", "microbatch_group_size" (interleaved: megatron-core's
     micro-batch group size per virtual stage the plan was timed and sized with, = pp, its
     default; null otherwise), "dp", "tp" (null when per-stage), "pp", "ep" (expert-parallel
     degree, 1 for a dense model and in older plans), "moe" (the model has experts),
     "mtp_num_layers" (the model's MTP layers, on the last stage: the layout's ``m``; 0 in
     older plans), "moe_token_dispatcher_type" (a MoE model: the token dispatcher the plan
     priced and its flags pin; null for a dense model; older plans: ``alltoall``),
     "micro_batch_size",
     "num_microbatches", "global_batch_size", "seq_length", "num_layers",
     "stages": [{"index", "device_type", "tp", "dp", "layers", "forward_ms", "backward_ms",
                 "send_forward_ms", "send_backward_ms", "allreduce_ms", "optimizer_ms",
                 "overhead_ms", "memory_bytes", "memory_capacity_bytes", "expert_allreduce_ms"
                 (a model with experts: the part of allreduce_ms over expert-DP),
                 "devices": [[{"node", "local_device"}, ...tp], ...dp],
                 "chunk_layers", "chunk_forward_ms", "chunk_backward_ms" (V entries each),
                 "provenance": {"decoder"|"embedding"|"output"|"optimizer": {"source", "record"}}
                 (source: measured / scaled / calibrated / estimated, optimizer also none),
                 "memory": {"params_bytes", "grads_bytes", "optimizer_bytes",
                            "activations_bytes", "reserve_bytes", "total_bytes",
                            "activations_source"}}],
     "links": [{"from_stage", "to_stage", "send_ms", "wrap_around" (interleaved last->first)}],
     "wrap_send_ms", "timing_model": {"name": "engine", "op_forward_ms", "op_backward_ms",
     "send_call_ms", "recv_ready_ms", "source"} (the simulator and megatron's per-op / per-call
     costs it charged, ``callcosts.py``; re-derive with Plan.rederived_iteration_time_ms; the
     string "engine" in older plans: no such costs),
     "iteration_overhead": {"ms", "source", "record"} or null,
     "training": {"recompute", "distributed_optimizer", "params_dtype", "grad_dtype",
                  "attention", "overlap_grad_reduce", "overlap_param_gather"},
     "unused_devices": [{"node", "local_device"}], "node_types": [type per cluster node] (the
     devices the plan was made for; absent in older plans),
     "megatron_args": [...] (null if per-stage TP),
     "mindspeed_llm_args": [...] (null if per-stage TP), "rank_order": [{"rank", "node",
     "local_device"}], "search": {...statistics...},
     "baselines": [{"name", "status", "predicted_iteration_time_ms", "pp", "dp", "tp",
                    "schedule", "speedup", "reason", "cut"}] (only where the plan has them)}

``search`` holds the search's statistics (``SearchStats``), among them how the plan was chosen
when it is not simply the fastest: ``fastest_ms`` (the fastest plan's time, = the lower bound
when exhaustive), ``tie_rule`` (``off``, or ``preferred`` / ``fastest`` / ``timed out`` under
``--tie-tolerance``, whose window is ``tie_tolerance``) and ``previous_plan`` (``none``, ``kept``,
``replaced`` or ``unusable: why``: a launch's previous plan, ``previous_ms`` under today's costs),
and how sure the choice is (``search/runnerup.py``): ``runner_up_status`` (``off``, ``exact``,
``best found``, ``timed out``, ``none``), ``runner_up`` (the fastest plan of any other
configuration: ``schedule``, ``virtual_stages``, ``pp``, ``dp``, ``tp``, ``micro_batch_size``,
``stage_types``, ``stage_tps``, ``layers``), ``runner_up_ms``, ``runner_up_margin`` (its time over
this plan's, minus 1), ``runner_up_bound_ms`` (no other configuration is faster) and, timed out,
``runner_up_open`` (other configurations not ruled out below ``runner_up_ms``); the same for the
plan's own configuration with another device type on some stage: ``layout_status``, ``layout``,
``layout_ms``, ``layout_margin``, ``layout_bound_ms``.

``baselines`` (``poseidon plan`` always sets them): one entry per baseline, ``megatron-default``
(Megatron's even split over every device) and ``best-single-type``; ``status`` is ``ok``,
``no plan`` (``reason`` says why) or ``skipped`` (``--no-baselines``); ``speedup`` is the
baseline's time over the plan's; the other fields are null unless ``ok``. ``cut``: what the
time budget left untried (e.g. ``"A2-2 not searched"``; a baseline with nothing found by then has
status ``no plan`` and a reason starting ``cut at the time budget``), null otherwise.

Provenance: per stage and layer kind it runs, ``source`` is ``measured`` (a profile record),
``calibrated`` (the estimator on a speed set from measured layers) or ``estimated`` (the cluster
file's peak x efficiency); ``record`` is the profile key used (``ProfileKey.describe``).
``memory`` is the predicted peak (= ``memory_bytes``) and its parts; ``activations_source`` says
whether the per-layer activations were measured. Both are empty in plans of older versions.

Per-iteration overhead (``overhead.py``): each stage's ``overhead_ms`` (the same on every stage)
is part of its post-pipeline work (DP all-reduce + optimizer step + overhead), so the iteration
re-derives with it; ``iteration_overhead`` says where it came from (``source`` ``calibrated``:
a live run measured it; ``record``: the key and the plan and iterations it was calibrated on),
null when the profile DB had none (0 ms).

DP synchronisation: ``allreduce_ms`` is the stage's DP gradient all-reduce per iteration, or,
when ``training.distributed_optimizer`` is true, the gradients' reduce-scatter plus the updated
parameters' all-gather; ``optimizer_ms`` is then the step on the rank's 1/dp shard. With
``overlap_grad_reduce`` / ``overlap_param_gather`` stage 0's figure (non-interleaved plans) is
the part its last backward / first forward does not hide (``comm.dp_sync_ms``).

Rank order: Megatron's default order tp-cp-ep-dp-pp:
``rank = stage * (tp * cp * dp) + (dp_rank * cp + cp_rank) * tp + tp_rank`` (uniform TP).

Context parallelism (``cp`` > 1; the key is written only then, a plan without it has CP 1):
every stage holds dp x cp TP groups, ``devices[dp_rank * cp + cp_rank][tp_rank]``; the stage
figures are per CP rank (seq / cp tokens: forward / backward with the ring attention,
activations, sends); ``allreduce_ms`` and ``optimizer_ms`` are over DP x CP, as Megatron
reduces the gradients and shards the distributed optimizer.

Expert parallelism (``ep`` > 1, planned at CP 1): the dense grid is unchanged; the experts'
grid is ETP (= tp) x EP x expert-DP, an EP group being ``ep`` consecutive DP ranks of a stage
(TP-strided), expert-DP = dp / ep; ``expert_allreduce_ms`` is the part of ``allreduce_ms``
that synchronises the routed experts' gradients over expert-DP.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from .costs import chunk_layers, simulator_arrays
from .errors import PoseidonError, short_repr
from .model import MOE_DISPATCHERS
from .simulator.schedules import LAUNCHABLE_SCHEDULES as EXECUTABLE_SCHEDULES

PLAN_FORMAT_VERSION = 1
TIMING_MODEL = "engine"
"""How the search times a plan: ``engine`` = ``_core.EngineDAG`` (as megatron-core executes the
schedule: blocking, bundled p2p calls); ``Plan.rederived_iteration_time_ms`` uses the same."""
NEAR_TIE = 0.02
"""A runner-up margin (``search/runnerup.py``) below this is reported as a near-tie (the
profiler's CI target; the previous-plan rule's default window)."""


def _timing_from_json(tm) -> dict[str, Any]:
    """``Plan`` fields of a JSON ``timing_model``: an object (with the per-op / per-call costs)
    or, in older plans, the bare name (no such costs)."""
    if isinstance(tm, str):
        if tm != TIMING_MODEL:
            raise ValueError(f"timing_model {tm!r} is not {TIMING_MODEL!r}")
        return {}
    if not isinstance(tm, dict) or tm.get("name") != TIMING_MODEL:
        raise ValueError(f"timing_model: expected {{'name': {TIMING_MODEL!r}, ...}}, got {tm!r}")
    calls = tuple(float(tm.get(k, 0.0)) for k in
                  ("op_forward_ms", "op_backward_ms", "send_call_ms", "recv_ready_ms"))
    if any(not (c >= 0.0) or c == float("inf") for c in calls):
        raise ValueError(f"timing_model: expected finite costs >= 0 ms, got {calls}")
    return {"engine_calls": calls, "engine_calls_source": str(tm.get("source", "none"))}


_MISSING = object()
_INT_MAX = 1 << 62          # plan integers: counts, indices, bytes


class _Bad(Exception):
    """A plan JSON field of the wrong shape: (field path, expected, got)."""


def _field(d: dict, key: str, where: str, kind: str, default: Any = _MISSING) -> Any:
    """``d[key]`` checked against ``kind``: int / pos (an integer >= 1) / ms (a finite number
    >= 0) / num (a number) / str / bool / dict / list; a missing key is ``default`` (required
    when none). Raises ``_Bad`` naming the field."""
    path = f"{where}.{key}" if where else key
    value = d.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise _Bad(path, "a value", "missing")
        return default
    if kind in ("int", "pos"):
        lo = 1 if kind == "pos" else 0
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _INT_MAX:
            raise _Bad(path, f"an integer >= {lo}", value)
    elif kind == "num":     # a figure the plan reports (not computed with)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad(path, "a number", value)
    elif kind == "ms":
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0 <= value < float("inf")):
            raise _Bad(path, "a finite number >= 0", value)
    elif not isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind]):
        raise _Bad(path, {"str": "a string", "bool": "true or false", "dict": "an object",
                          "list": "a list"}[kind], value)
    return value


def _slots(items: Any, where: str) -> None:
    if not isinstance(items, list):
        raise _Bad(where, "a list", items)
    for i, x in enumerate(items):
        if not isinstance(x, dict):
            raise _Bad(f"{where}[{i}]", "an object {node, local_device}", x)
        _field(x, "node", f"{where}[{i}]", "int")
        _field(x, "local_device", f"{where}[{i}]", "int")


def check_plan_dict(d: Any) -> None:
    """The structure ``Plan.from_json`` reads, checked up front: PoseidonError naming the first
    field of the wrong shape (a kept or cached plan is read before any search; its fields are
    then used deep inside it)."""
    try:
        _check_plan_dict(d)
    except _Bad as bad:
        path, expected, got = bad.args
        got = got if isinstance(got, str) and got == "missing" else short_repr(got)
        raise PoseidonError(f"plan JSON: {path}: expected {expected}, got {got}") from None


def _check_plan_dict(d: Any) -> None:
    if not isinstance(d, dict):
        raise _Bad("(top level)", "an object", d)
    _field(d, "schedule", "", "str")
    for key in ("virtual_stages", "dp", "micro_batch_size", "num_microbatches",
                "global_batch_size", "seq_length"):
        _field(d, key, "", "pos")
    _field(d, "predicted_iteration_time_ms", "", "ms")
    for key in ("predicted_tokens_per_s", "model_tflops_per_device", "mfu", "lower_bound_ms",
                "gap", "wrap_send_ms"):
        _field(d, key, "", "num", 0.0)
    for key in ("model_name", "cluster_name"):
        _field(d, key, "", "str", "")
    _field(d, "num_layers", "", "int", 0)
    for key in ("cp", "ep"):
        _field(d, key, "", "pos", 1)
    _field(d, "moe", "", "bool", False)
    _field(d, "mtp_num_layers", "", "int", 0)
    dispatcher = d.get("moe_token_dispatcher_type")
    if dispatcher is not None and dispatcher not in MOE_DISPATCHERS:
        raise _Bad("moe_token_dispatcher_type", f"one of {', '.join(MOE_DISPATCHERS)}",
                   dispatcher)
    if d.get("microbatch_group_size") is not None:
        _field(d, "microbatch_group_size", "", "pos")
    _field(d, "search", "", "dict", {})
    _field(d, "training", "", "dict", {})
    if d.get("iteration_overhead") is not None:
        _field(d, "iteration_overhead", "", "dict")
    for i, e in enumerate(_field(d, "baselines", "", "list", [])):
        if not isinstance(e, dict):
            raise _Bad(f"baselines[{i}]", "an object", e)
    _slots(d.get("unused_devices", []), "unused_devices")
    for i, t in enumerate(_field(d, "node_types", "", "list", [])):
        if not isinstance(t, str):
            raise _Bad(f"node_types[{i}]", "a device type name", t)
    stages = _field(d, "stages", "", "list")
    if not stages:
        raise _Bad("stages", "at least one stage", stages)
    for i, s in enumerate(stages):
        where = f"stages[{i}]"
        if not isinstance(s, dict):
            raise _Bad(where, "an object", s)
        _field(s, "index", where, "int")
        _field(s, "device_type", where, "str")
        _field(s, "tp", where, "pos")
        _field(s, "dp", where, "pos")
        _field(s, "layers", where, "int")
        for key in ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
                    "allreduce_ms"):
            _field(s, key, where, "ms")
        for key in ("optimizer_ms", "overhead_ms", "expert_allreduce_ms"):
            _field(s, key, where, "ms", 0.0)
        _field(s, "memory_bytes", where, "int")
        _field(s, "memory_capacity_bytes", where, "int")
        groups = _field(s, "devices", where, "list")
        for j, grp in enumerate(groups):
            _slots(grp, f"{where}.devices[{j}]")
        for key, kind in (("chunk_layers", "int"), ("chunk_forward_ms", "ms"),
                          ("chunk_backward_ms", "ms")):
            items = _field(s, key, where, "list", [])
            for j, x in enumerate(items):
                _field({f"{key}[{j}]": x}, f"{key}[{j}]", where, kind)
        for kind_name, v in _field(s, "provenance", where, "dict", {}).items():
            if not isinstance(v, dict):
                raise _Bad(f"{where}.provenance.{kind_name}", "an object {source, record}", v)
            _field(v, "source", f"{where}.provenance.{kind_name}", "str")
            _field(v, "record", f"{where}.provenance.{kind_name}", "str")
        for part, v in _field(s, "memory", where, "dict", {}).items():
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise _Bad(f"{where}.memory.{part}", "a number or a string", v)


@dataclass(frozen=True)
class DeviceSlot:
    node: int            # cluster node index
    local_device: int    # device index inside the node (LOCAL_RANK on that node)


@dataclass(frozen=True)
class StagePlan:
    index: int
    device_type: str
    tp: int
    dp: int
    layers: int
    forward_ms: float
    backward_ms: float
    send_forward_ms: float      # to the next stage (0 on the last)
    send_backward_ms: float     # gradient from the next stage (0 on the last)
    allreduce_ms: float
    memory_bytes: int
    memory_capacity_bytes: int
    # devices[dp_rank * cp + cp_rank][tp_rank] -> slot; Megatron rank order tp-cp-ep-dp-pp
    devices: tuple[tuple[DeviceSlot, ...], ...] = ()
    # per model chunk (V of them, chunk order; one when V = 1): layers and per-micro-batch times
    chunk_layers: tuple[int, ...] = ()
    chunk_forward_ms: tuple[float, ...] = ()
    chunk_backward_ms: tuple[float, ...] = ()
    # (layer kind, source, record) per layer kind the stage runs
    provenance: tuple[tuple[str, str, str], ...] = ()
    # (part, bytes) of memory_bytes, then ("activations_source", "measured"|"estimated")
    memory_parts: tuple[tuple[str, Any], ...] = ()
    optimizer_ms: float = 0.0   # optimizer step after the DP all-reduce (measured; 0: none)
    overhead_ms: float = 0.0    # the per-iteration overhead (calibrated; 0: none)
    cp: int = 1                 # context parallelism (the plan's)
    expert_allreduce_ms: float = 0.0   # EP > 1: the experts' sync over expert-DP (in allreduce_ms)

    @property
    def post_pipeline_ms(self) -> float:
        """What the stage does after its last backward: DP all-reduce, then optimizer step,
        then the per-iteration overhead."""
        return self.allreduce_ms + self.optimizer_ms + self.overhead_ms


def _tie_text(s: dict, t: float) -> str:
    """The table's line on the tie rule (``search/tiebreak.py``)."""
    tol, fastest = 100 * s["tie_tolerance"], s.get("fastest_ms") or t
    head = f"tie rule ({tol:g}% window, {s.get('tie_queries', 0)} queries): "
    if s["tie_rule"] == "preferred":
        return (head + f"the preferred plan within {tol:g}% of the fastest ({fastest:.2f} ms, "
                f"this one +{100 * (t / fastest - 1):.2f}%): fewest stages, no interleaving, "
                f"then device types by name and fewest layers stage by stage")
    if s["tie_rule"] == "fastest":
        return head + "the fastest plan is also the preferred one in the window"
    return head + "ran out of time; the fastest plan stands"


def _previous_text(s: dict) -> str:
    """The table's line on the previous launch's plan (``SearchDriver.keep``)."""
    state, fastest = s["previous_plan"], s.get("fastest_ms")
    if state in ("kept", "replaced"):
        over = 100 * (s["previous_ms"] / fastest - 1)
        return (f"previous plan: {state} ({s['previous_ms']:.2f} ms under these costs, "
                f"{over:+.2f}% over the fastest {fastest:.2f} ms)")
    return f"previous plan: {state}"


RUNNER_UP_STAGES_SHOWN = 4   # the runner-up lines list stage types and layers up to this PP


def _stages_text(r: dict, key: str) -> str:
    """A runner-up plan's stages: layers and types, or (deep plans) where the JSON has them."""
    if r["pp"] <= RUNNER_UP_STAGES_SHOWN:
        return f"layers {'/'.join(map(str, r['layers']))} on {','.join(r['stage_types'])}"
    return f"{len(set(r['stage_types']))} device type(s) over its stages (JSON: search.{key})"


def _proof_text(state: str) -> str:
    return "proven" if state == "exact" else "not proven: --pruning ridge"


def _runner_up_text(s: dict) -> str:
    """The table's line on the runner-up (``search/runnerup.py``): the fastest plan of any
    other configuration, its margin, and whether that is a near-tie."""
    state, q = s["runner_up_status"], s.get("runner_up_queries", 0)
    if state == "none":
        return "runner-up: none (no other configuration has a plan that fits)"
    r, margin = s.get("runner_up"), s.get("runner_up_margin")
    what = ""
    if r:
        tp = "per-stage" if r["tp"] is None else r["tp"]
        what = (f"{r['schedule']}" + (f" (V={r['virtual_stages']})"
                                      if r["virtual_stages"] > 1 else "")
                + f", pp={r['pp']}, dp={r['dp']}, tp={tp}"
                + (f", ep={r['ep']}" if r.get("ep", 1) > 1 else "") + ", micro-batch "
                f"{r['micro_batch_size']}, {_stages_text(r, 'runner_up')}: "
                f"{s['runner_up_ms']:.2f} ms ({100 * margin:+.2f}%)")
    if state == "timed out":
        low, n = s.get("runner_up_bound_ms"), s.get("runner_up_open", 0)
        found = (f"the best other configuration found is {what}; {n} other configuration(s) "
                 f"not ruled out below it" if r else f"no other plan found; {n} "
                 f"configuration(s) not ruled out")
        return (f"runner-up: not settled in time ({q} queries): {found}, none faster than "
                f"{low:.2f} ms")
    line = f"runner-up (fastest other configuration, {_proof_text(state)}): {what}"
    if margin is not None and margin < NEAR_TIE:
        line += (f" -- a near-tie: the two predictions {100 * max(margin, 0) / 2:.2f}% wrong "
                 f"in opposite directions would swap them")
    return line


def _layout_text(s: dict) -> str:
    """The table's line on the closest other layout of the plan's configuration
    (``RunnerUp.layout``): another device type on at least one stage."""
    state = s["layout_status"]
    head = "other layout (this configuration, another device type on some stage"
    if state == "none":
        return head + "): none (no other device type fits any stage)"
    r, margin = s.get("layout"), s.get("layout_margin")
    what = ""
    if r:
        what = f"{_stages_text(r, 'layout')}: {s['layout_ms']:.2f} ms ({100 * margin:+.2f}%)"
    if state == "timed out":
        low = s.get("layout_bound_ms")
        return (head + f"): not settled in time: {'best found ' + what if r else 'none found'}"
                f", none faster than {low:.2f} ms")
    line = head + f", {_proof_text(state)}): {what}"
    if margin is not None and margin < NEAR_TIE:
        line += " -- a near-tie: which device type serves which stage matters little here"
    return line


def _r(x: float) -> float:
    return round(float(x), 6)


def _tflops_text(x: float) -> str:
    """One decimal, or three significant digits below 10 (CPU / emulated devices)."""
    return f"{x:.1f}" if x >= 10.0 else f"{x:.3g}"


@dataclass(frozen=True)
class Plan:
    schedule: str
    virtual_stages: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    global_batch_size: int
    seq_length: int
    stages: tuple[StagePlan, ...]
    predicted_iteration_time_ms: float
    model_name: str = ""
    cluster_name: str = ""
    unused_devices: tuple[DeviceSlot, ...] = ()
    search: dict[str, Any] = field(default_factory=dict)
    predicted_tokens_per_s: float = 0.0
    model_tflops_per_device: float = 0.0
    mfu: float = 0.0
    lower_bound_ms: float = 0.0
    gap: float = 0.0
    num_layers: int = 0
    wrap_send_ms: float = 0.0      # interleaved: last stage -> first stage (next chunk)
    baselines: tuple[dict[str, Any], ...] = ()   # see the module docstring; () = not computed
    training: dict[str, Any] = field(default_factory=dict)   # TrainingSetup.to_dict()
    # where the stages' overhead_ms came from: {"ms", "source", "record"}; {} = none
    iteration_overhead: dict[str, Any] = field(default_factory=dict)
    cp: int = 1     # context parallelism: every stage's TP groups are dp x cp
    # megatron's per-op / per-call costs the search charged: (op forward, op backward,
    # send call, receive ready) ms and their source (``callcosts.EngineCalls``)
    engine_calls: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    engine_calls_source: str = "none"
    ep: int = 1                    # expert-parallel degree (Megatron's expert grid: ETP = tp)
    moe: bool = False              # the model has routed experts (the flags then carry EP)
    mtp_num_layers: int = 0        # the model's MTP layers: the layout's 'm's, on the last stage
    # a MoE model's token dispatcher, the one the plan priced (its flags pin it)
    moe_token_dispatcher_type: str = "alltoall"
    node_types: tuple[str, ...] = ()   # per cluster node, its device type: the devices the
    #                                    plan was made for (() = not recorded, older plans)

    # ------------------------------------------------------------------ shape
    @property
    def microbatch_group_size(self) -> int | None:
        """Interleaved: megatron-core's ``microbatch_group_size_per_vp_stage`` the plan's
        time and memory assume: its default, pp (the search and the simulator time that one
        only; a launch passes no flag for it); None otherwise."""
        return self.pp if self.virtual_stages > 1 else None

    @property
    def uniform_tp(self) -> bool:
        return len({s.tp for s in self.stages}) == 1

    @property
    def tp(self) -> int:
        """The TP degree of every stage; PoseidonError for a per-stage-TP plan."""
        tps = {s.tp for s in self.stages}
        if len(tps) != 1:
            raise PoseidonError(f"plan uses per-stage TP degrees {sorted(tps)}; stock Megatron "
                                "needs one --tensor-model-parallel-size")
        return tps.pop()

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    def layout_segments(self) -> list[int]:
        """Decoder layers of each virtual pipeline stage, model order (chunk-major: c*N + s);
        stage s's V chunks split its layers by ``costs.chunk_layers``."""
        splits = [chunk_layers(s.layers, self.virtual_stages) for s in self.stages]
        return [split[c] for c in range(self.virtual_stages) for split in splits]

    def pipeline_layout(self) -> str:
        """Megatron's ``--pipeline-model-parallel-layout``, e.g. ``Et*3|t*5|t*2L``; a model
        with MTP layers has them (``m``) after the last decoder layer, before the loss, where
        megatron-core builds them by default (``Et*3|t*5|t*2mL``): its layout check refuses a
        layout whose ``m`` count is not ``--mtp-num-layers``."""
        segs = self.layout_segments()
        mtp = self.mtp_num_layers
        parts = []
        for i, n in enumerate(segs):
            body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
            if i == 0:
                body = "E" + body
            if i == len(segs) - 1:
                body = body + ("" if mtp == 0 else "m" if mtp == 1 else f"m*{mtp}") + "L"
            parts.append(body)
        return "|".join(parts)

    # ------------------------------------------------------------------ flags
    def megatron_args(self) -> list[str]:
        """argv tokens for megatron-core 0.19's ``pretrain_gpt.py``.

        Interleaving is expressed by the layout's N*V segments alone: megatron 0.19 rejects
        ``--num-virtual-stages-per-pipeline-rank`` together with a layout (it derives V from it).
        """
        self._check_executable()
        args = ["--tensor-model-parallel-size", str(self.tp),
                "--pipeline-model-parallel-size", str(self.pp)]
        if self.cp > 1:
            args += ["--context-parallel-size", str(self.cp)]
        if self.pp > 1 or self.virtual_stages > 1:
            args += ["--pipeline-model-parallel-layout", self.pipeline_layout()]
        args += ["--micro-batch-size", str(self.micro_batch_size),
                 "--global-batch-size", str(self.global_batch_size)]
        return args + self._expert_args()

    def mindspeed_llm_args(self, layout: bool = False) -> list[str]:
        """argv tokens for MindSpeed-LLM.

        ``layout``: the MindSpeed-LLM that runs them registers ``--pipeline-model-parallel-layout``
        (v26.1.0 and later: MindSpeed's backport onto core_r0.12.1); then every split is written
        as the layout. Without it (v2.3.0, or not known: the offline plan) a non-interleaved
        split is ``--num-layer-list``, which MindSpeed-LLM numbers as if the split were even
        (stage 1 of ``2,6`` gets layers 5..10 of 8: the wrong dense / MoE pattern, an IndexError
        in its MoE; v26.1.0's layout numbers them right). MindSpeed-LLM refuses
        ``--num-layer-list`` together with a virtual pipeline ("Dynamic pipeline model and virtual
        pipeline cannot be enabled at the same time"), so an interleaved plan needs the layout; a
        launch on an older MindSpeed-LLM searches no interleaved plan (V = 1).
        """
        self._check_executable()
        args = ["--tensor-model-parallel-size", str(self.tp),
                "--pipeline-model-parallel-size", str(self.pp)]
        if self.cp > 1:   # MindSpeed's ring attention (its other algorithms time differently)
            args += ["--context-parallel-size", str(self.cp),
                     "--context-parallel-algo", "megatron_cp_algo"]
        if self.virtual_stages > 1 or (layout and self.pp > 1):
            args += ["--pipeline-model-parallel-layout", self.pipeline_layout()]
        elif self.pp > 1:
            args += ["--num-layer-list", ",".join(str(n) for n in self.layers_per_stage)]
        args += ["--micro-batch-size", str(self.micro_batch_size),
                 "--global-batch-size", str(self.global_batch_size)]
        return args + self._expert_args()

    def _expert_args(self) -> list[str]:
        """``--expert-model-parallel-size`` of a MoE model's plan (nothing for a dense one),
        ``--sequence-parallel`` where it runs at TP > 1 (megatron-core refuses MoE with TP > 1
        without sequence parallelism; the all-to-all pricing assumes it: tokens / TP per rank),
        and ``--moe-token-dispatcher-type``: the dispatcher the plan priced (megatron-core's
        default is ``allgather``); ``--mtp-num-layers`` where the layout carries MTP layers."""
        mtp = (["--mtp-num-layers", str(self.mtp_num_layers)] if self.mtp_num_layers else [])
        if not (self.moe or self.ep > 1):
            return mtp
        sp = ["--sequence-parallel"] if self.tp > 1 else []
        return (["--expert-model-parallel-size", str(self.ep)] + sp
                + ["--moe-token-dispatcher-type", self.moe_token_dispatcher_type] + mtp)

    @property
    def executable(self) -> bool:
        """Whether stock Megatron-LM / MindSpeed-LLM can run this plan as simulated: one TP
        degree for all stages and a schedule megatron-core implements (1f1b, interleaved)."""
        return self.uniform_tp and self.schedule in EXECUTABLE_SCHEDULES

    def _check_executable(self) -> None:
        if self.schedule not in EXECUTABLE_SCHEDULES:
            raise PoseidonError(
                f"schedule {self.schedule!r} is not one megatron-core executes "
                f"({', '.join(EXECUTABLE_SCHEDULES)}); plan with --schedules "
                f"{' '.join(EXECUTABLE_SCHEDULES)} for a launch")
        self.tp  # raises for per-stage TP

    def rank_order(self) -> list[DeviceSlot]:
        """new_rank -> physical slot, Megatron's default order tp-cp-ep-dp-pp."""
        tp = self.tp
        out: list[DeviceSlot] = []
        for st in self.stages:
            for group in range(self.dp * self.cp):
                for tp_rank in range(tp):
                    out.append(st.devices[group][tp_rank])
        return out

    @property
    def world_size(self) -> int:
        return sum(s.tp * s.dp * self.cp for s in self.stages)

    # ------------------------------------------------------------------ timing
    def links(self) -> list[dict[str, Any]]:
        """Every pipeline link a micro-batch crosses, with its one-way send time (ms; the
        gradient goes back over the same link in the same time): stage s -> s+1, and for an
        interleaved plan the wrap-around link from the last stage to the first (chunk c ->
        chunk c+1)."""
        out = [{"from_stage": s.index, "to_stage": s.index + 1,
                "send_ms": _r(s.send_forward_ms)} for s in self.stages[:-1]]
        if self.virtual_stages > 1:
            out.append({"from_stage": self.pp - 1, "to_stage": 0,
                        "send_ms": _r(self.wrap_send_ms), "wrap_around": True})
        return out

    def simulator_inputs(self):
        """(F, B, Pf, Pb, R) of the simulator from this plan's own numbers alone (per-chunk
        arrays of shape (V, N) when interleaved): what re-derives its predicted time."""
        v = self.virtual_stages
        if v > 1 and any(len(s.chunk_forward_ms) != v or len(s.chunk_backward_ms) != v
                         for s in self.stages):
            raise PoseidonError("plan: per-chunk times missing (a plan JSON written before "
                                "they were recorded); re-plan to re-derive its time")
        return simulator_arrays(self.stages, v, self.wrap_send_ms)

    def rederived_iteration_time_ms(self) -> float:
        """The iteration time the simulator gives for ``simulator_inputs()`` under the timing
        model the search used (``TIMING_MODEL``); equals ``predicted_iteration_time_ms`` up to
        the JSON's 6-decimal rounding."""
        from .simulator.pipeline import iteration_time_ms

        return iteration_time_ms(*self.simulator_inputs(), self.num_microbatches,
                                 self.schedule, self.virtual_stages,
                                 engine=TIMING_MODEL == "engine",
                                 calls=tuple(self.engine_calls))

    def timing_model(self) -> dict[str, Any]:
        """The JSON's ``timing_model``: the simulator and the per-op / per-call costs."""
        fo, bo, sc, rr = self.engine_calls
        return {"name": TIMING_MODEL, "op_forward_ms": _r(fo), "op_backward_ms": _r(bo),
                "send_call_ms": _r(sc), "recv_ready_ms": _r(rr),
                "source": self.engine_calls_source}

    # ------------------------------------------------------------------ JSON
    def with_baselines(self, entries) -> "Plan":
        """This plan with its baselines' entries (``search.baseline_entries``)."""
        return replace(self, baselines=tuple(dict(e) for e in entries))

    def to_dict(self) -> dict[str, Any]:
        uniform = self.uniform_tp
        stages = [{
            "index": s.index, "device_type": s.device_type, "tp": s.tp, "dp": s.dp,
            "layers": s.layers, "forward_ms": _r(s.forward_ms), "backward_ms": _r(s.backward_ms),
            "send_forward_ms": _r(s.send_forward_ms), "send_backward_ms": _r(s.send_backward_ms),
            "allreduce_ms": _r(s.allreduce_ms), "optimizer_ms": _r(s.optimizer_ms),
            "overhead_ms": _r(s.overhead_ms), "memory_bytes": int(s.memory_bytes),
            "memory_capacity_bytes": int(s.memory_capacity_bytes),
            "devices": [[{"node": d.node, "local_device": d.local_device} for d in grp]
                        for grp in s.devices],
            "chunk_layers": list(s.chunk_layers),
            "chunk_forward_ms": [_r(x) for x in s.chunk_forward_ms],
            "chunk_backward_ms": [_r(x) for x in s.chunk_backward_ms],
            "provenance": {kind: {"source": src, "record": rec}
                           for kind, src, rec in s.provenance},
            "memory": dict(s.memory_parts),
            **({"expert_allreduce_ms": _r(s.expert_allreduce_ms)} if self.moe else {}),
        } for s in self.stages]
        out = {
            "format_version": PLAN_FORMAT_VERSION,
            "model_name": self.model_name, "cluster_name": self.cluster_name,
            "predicted_iteration_time_ms": _r(self.predicted_iteration_time_ms),
            "predicted_tokens_per_s": _r(self.predicted_tokens_per_s),
            "model_tflops_per_device": _r(self.model_tflops_per_device),
            "mfu": _r(self.mfu), "lower_bound_ms": _r(self.lower_bound_ms), "gap": _r(self.gap),
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "microbatch_group_size": self.microbatch_group_size, "dp": self.dp,
            "tp": self.tp if uniform else None, "pp": self.pp, "ep": self.ep, "moe": self.moe,
            "mtp_num_layers": self.mtp_num_layers,
            "moe_token_dispatcher_type": self.moe_token_dispatcher_type if self.moe else None,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "global_batch_size": self.global_batch_size, "seq_length": self.seq_length,
            "num_layers": self.num_layers or sum(self.layers_per_stage),
            "stages": stages,
            "unused_devices": [{"node": d.node, "local_device": d.local_device}
                               for d in self.unused_devices],
            "megatron_args": self.megatron_args() if self.executable else None,
            "mindspeed_llm_args": self.mindspeed_llm_args() if self.executable else None,
            "rank_order": ([{"rank": i, "node": d.node, "local_device": d.local_device}
                            for i, d in enumerate(self.rank_order())] if uniform else None),
            "search": _jsonable(self.search),
            "links": self.links(),
            "wrap_send_ms": _r(self.wrap_send_ms),
            "timing_model": self.timing_model(),
            "training": _jsonable(self.training),
            "iteration_overhead": _jsonable(self.iteration_overhead) or None,
        }
        if self.baselines:
            out["baselines"] = _jsonable(list(self.baselines))
        if self.cp > 1:
            out["cp"] = self.cp
        if self.node_types:
            out["node_types"] = list(self.node_types)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except RecursionError:
            raise PoseidonError("plan JSON: malformed (nested too deeply)") from None
        except ValueError as exc:
            raise PoseidonError(f"plan JSON: malformed ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None
        check_plan_dict(d)
        try:
            stages = tuple(StagePlan(
                index=s["index"], device_type=s["device_type"], tp=s["tp"], dp=s["dp"],
                layers=s["layers"], forward_ms=s["forward_ms"], backward_ms=s["backward_ms"],
                send_forward_ms=s["send_forward_ms"], send_backward_ms=s["send_backward_ms"],
                allreduce_ms=s["allreduce_ms"], memory_bytes=s["memory_bytes"],
                memory_capacity_bytes=s["memory_capacity_bytes"],
                optimizer_ms=s.get("optimizer_ms", 0.0), overhead_ms=s.get("overhead_ms", 0.0),
                devices=tuple(tuple(DeviceSlot(x["node"], x["local_device"]) for x in grp)
                              for grp in s["devices"]),
                chunk_layers=tuple(s.get("chunk_layers", ())),
                chunk_forward_ms=tuple(s.get("chunk_forward_ms", ())),
                chunk_backward_ms=tuple(s.get("chunk_backward_ms", ())),
                provenance=tuple((k, v["source"], v["record"])
                                 for k, v in s.get("provenance", {}).items()),
                memory_parts=tuple(s.get("memory", {}).items()), cp=d.get("cp", 1),
                expert_allreduce_ms=s.get("expert_allreduce_ms", 0.0))
                for s in d["stages"])
            group = d.get("microbatch_group_size")
            want = len(stages) if d["virtual_stages"] > 1 else None
            if group is not None and group != want:
                raise PoseidonError(
                    f"plan JSON: microbatch_group_size {group!r} is not the one its time was "
                    f"derived with ({want if want is not None else 'null: not interleaved'}; "
                    f"an interleaved plan is timed with megatron-core's default, pp)")
            return cls(
                schedule=d["schedule"], virtual_stages=d["virtual_stages"], dp=d["dp"],
                micro_batch_size=d["micro_batch_size"], num_microbatches=d["num_microbatches"],
                global_batch_size=d["global_batch_size"], seq_length=d["seq_length"],
                stages=stages, predicted_iteration_time_ms=d["predicted_iteration_time_ms"],
                model_name=d.get("model_name", ""), cluster_name=d.get("cluster_name", ""),
                unused_devices=tuple(DeviceSlot(x["node"], x["local_device"])
                                     for x in d.get("unused_devices", [])),
                search=d.get("search", {}),
                predicted_tokens_per_s=d.get("predicted_tokens_per_s", 0.0),
                model_tflops_per_device=d.get("model_tflops_per_device", 0.0),
                mfu=d.get("mfu", 0.0), lower_bound_ms=d.get("lower_bound_ms", 0.0),
                gap=d.get("gap", 0.0), num_layers=d.get("num_layers", 0),
                wrap_send_ms=d.get("wrap_send_ms", 0.0),
                **_timing_from_json(d.get("timing_model", TIMING_MODEL)),
                baselines=tuple(dict(e) for e in d.get("baselines", ())),
                training=d.get("training", {}),
                iteration_overhead=dict(d.get("iteration_overhead") or {}),
                cp=d.get("cp", 1), ep=int(d.get("ep", 1)), moe=bool(d.get("moe", False)),
                mtp_num_layers=int(d.get("mtp_num_layers", 0)),
                moe_token_dispatcher_type=d.get("moe_token_dispatcher_type") or "alltoall",
                node_types=tuple(d.get("node_types", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise PoseidonError(f"plan JSON: malformed ({type(exc).__name__}: {exc})") from None

    # ------------------------------------------------------------------ table
    def table(self, verbose: bool = False) -> str:
        """The plan as a person reads it. Consecutive stages whose rows are identical (but
        for their nodes) share one row, ``2-29``; ``verbose``: one row per stage (the JSON
        always has every stage)."""
        tp = str(self.tp) if self.uniform_tp else "per-stage"
        head = (f"Plan for {self.model_name or 'model'} on {self.cluster_name or 'cluster'}: "
                f"{self.schedule}" + (f" (V={self.virtual_stages})" if self.virtual_stages > 1
                                      else "")
                + f", pp={self.pp}, dp={self.dp}, tp={tp}"
                + (f", cp={self.cp}" if self.cp > 1 else "")
                + (f", ep={self.ep}" if self.moe or self.ep > 1 else "")
                + f", micro-batch {self.micro_batch_size}"
                f" x {self.num_microbatches} (global {self.global_batch_size}, seq "
                f"{self.seq_length})")
        lines = [head,
                 f"predicted iteration {self.predicted_iteration_time_ms:.2f} ms, "
                 f"{self.predicted_tokens_per_s:,.0f} tokens/s, "
                 f"{_tflops_text(self.model_tflops_per_device)} model TFLOP/s per device, "
                 + (f"MFU {100 * self.mfu:.1f}%" if self.mfu > 0 else
                    "MFU n/a (no device peak known)"),
                 "",
                 "per stage: fwd, bwd and send ms per micro-batch; allred ms per iteration "
                 + ("(DP gradient reduce-scatter + parameter all-gather: distributed optimizer)"
                    if (self.training or {}).get("distributed_optimizer")
                    else "(DP gradient all-reduce)").replace(
                        "DP", "DP x CP" if self.cp > 1 else "DP", 1)
                 + (f"; per CP rank: seq {self.seq_length // self.cp} tokens"
                    if self.cp > 1 else "")
                 + (f"; with EP {self.ep} the routed experts' over expert-DP "
                    f"({self.dp // self.ep} ranks) added" if self.ep > 1 else ""),
                 f"{'stage':>{_STAGE_W}} {'type':<10} {'tp':>3} {'dp':>3} {'layers':>6} "
                 f"{'fwd ms':>9} {'bwd ms':>9} {'send ms':>8} {'allred ms':>9} {'optim ms':>8} "
                 f"{'memory GiB':>20}  nodes"]
        lines += self._stage_rows(verbose)
        lines += self._layer_memory_lines(verbose)
        lines += self._provenance_lines()
        used = self.world_size
        lines.append("")
        lines.append(f"devices used: {used}, unused: {len(self.unused_devices)}")
        if self.executable:
            # shell-safe: the layout flag's '|' and '*' pasted unquoted are a pipe and a glob
            lines.append("megatron:   " + shlex.join(self.megatron_args()))
            lines.append("mindspeed:  " + shlex.join(self.mindspeed_llm_args())
                         + ("  # layout flag: MindSpeed-LLM v26.1.0 or later"
                            if self.virtual_stages > 1 else ""))
        elif not self.uniform_tp:
            lines.append("no launch flags: per-stage TP needs a FlagScale-style Megatron; stock "
                         "Megatron-LM / MindSpeed-LLM take one TP degree (plan with --uniform-tp)")
        else:
            lines.append(f"no launch flags: megatron-core has no {self.schedule} schedule (an "
                         f"analysis result; plan with --schedules "
                         f"{' '.join(EXECUTABLE_SCHEDULES)} for a launch)")
        s = self.search
        if s:
            lines.append(
                f"search: {s.get('plans_simulated', 0)} plans simulated, "
                f"cut by bound {s.get('cut_bound', 0)}, memory {s.get('cut_memory', 0)}, "
                f"ridge {s.get('cut_ridge', 0)}, configs cut at root "
                f"{s.get('configs_cut_root', 0)}/{s.get('configs', 0)}, "
                f"{s.get('seconds', 0)} s, exhaustive: {'yes' if s.get('exhaustive') else 'no'}"
                f", lower bound {self.lower_bound_ms:.2f} ms (gap {100 * self.gap:.2f}%)")
            if s.get("search_space"):
                lines.append(f"searched space: {s['search_space']}")
            if s.get("tie_rule", "off") != "off":
                lines.append(_tie_text(s, self.predicted_iteration_time_ms))
            if s.get("previous_plan", "none") != "none":
                lines.append(_previous_text(s))
            if s.get("runner_up_status", "off") != "off":
                lines.append(_runner_up_text(s))
            if s.get("layout_status", "off") != "off":
                lines.append(_layout_text(s))
        return "\n".join(lines) + "\n"

    def mfu_warning(self, peaks_tflops: dict[str, float | None]) -> str | None:
        """One line when the plan's MFU is above 100 %: the devices would run faster than
        the peak it is measured against (``peaks_tflops``: each device type's
        ``peak_tflops``), naming each of the plan's types and its peak; None otherwise."""
        if self.mfu <= 1.0:
            return None
        types = sorted({s.device_type for s in self.stages})
        named = ", ".join(f"{t} {peaks_tflops[t]:g} TFLOP/s" if peaks_tflops.get(t)
                          else f"{t} (no peak)" for t in types)
        return (f"MFU {100 * self.mfu:.1f}% is above 100%: the predicted time is faster than "
                f"the peak_tflops it is measured against ({named}); the peak is too low for "
                "the device or a measured record is too fast")

    def _stage_rows(self, verbose: bool) -> list[str]:
        """The table's stage rows: consecutive stages alike but for their memory and nodes on
        one row (``2-29``, the memory's range) unless ``verbose``, and a note when merged."""
        gib = 1024 ** 3
        lines: list[str] = []
        rows = [(s.index, (s.device_type, s.tp, s.dp, s.layers, _r2(s.forward_ms),
                           _r2(s.backward_ms), _r2(s.send_forward_ms), _r2(s.allreduce_ms),
                           _r2(s.optimizer_ms), round(s.memory_capacity_bytes / gib, 1)),
                 (round(s.memory_bytes / gib, 1),), {d.node for grp in s.devices for d in grp})
                for s in self.stages]
        groups = _group_rows(rows, verbose)
        for first, last, key, values, nodes in groups:
            typ, tp, dp, layers, fwd, bwd, send, allred, optim, cap = key
            lines.append(f"{_span(first, last):>{_STAGE_W}} {typ:<10} {tp:>3} {dp:>3} "
                         f"{layers:>6} {fwd:>9.2f} {bwd:>9.2f} {send:>8.2f} {allred:>9.2f} "
                         f"{optim:>8.2f} {_value_range(values, 0):>11} / {cap:>6.1f}  "
                         f"{node_ranges(nodes)}")
        if len(groups) < len(rows):
            lines.append("(a-b: stages a to b, the same but for their memory and nodes; "
                         "each stage: poseidon plan -v, or the plan JSON)")
        return lines

    def _layer_memory_lines(self, verbose: bool = False) -> list[str]:
        """A model with experts: each stage's memory by layer kind (the plan JSON's
        ``<kind>_layers`` / ``<kind>_layers_bytes``), e.g. ``stage 0: dense 3 layers 2.1 GiB,
        moe 2 layers 30.4 GiB``, consecutive identical stages on one line (``stages 2-29``)
        unless ``verbose``; nothing for a dense model."""
        gib = 1024 ** 3
        rows = []
        for s in self.stages:
            parts = dict(s.memory_parts)
            kinds = [k[:-len("_layers")] for k in parts if k.endswith("_layers")]
            if kinds:
                rows.append((s.index, tuple((k, parts[k + "_layers"]) for k in kinds),
                             tuple(round(parts.get(k + "_layers_bytes", 0) / gib, 1)
                                   for k in kinds), set()))
        out = [f"  stage{'s' if last > first else ''} {_span(first, last)}: " + ", ".join(
                   f"{k} {n} layers {_value_range(values, j)} GiB" for j, (k, n) in enumerate(key))
               for first, last, key, values, _ in _group_rows(rows, verbose)]
        if out:
            out.insert(0, "memory by layer kind (weights, gradients, optimizer state, "
                          "activations of those layers):")
        return out

    def _overhead_line(self) -> str:
        """The per-iteration overhead's provenance line of the table."""
        if self.iteration_overhead:
            return _overhead_text(self.iteration_overhead)
        return (f"  {'iteration':<9} {'none':<10} {'every stage':<14} +0 ms per iteration (no "
                "live run has calibrated the per-iteration overhead of this model and cluster)")

    def _provenance_lines(self) -> list[str]:
        """One line per (layer kind, source, record) with the stages it serves; the setup."""
        groups: dict[tuple[str, str, str], list[int]] = {}
        for s in self.stages:
            for kind, src, rec in s.provenance:
                groups.setdefault((kind, src, rec), []).append(s.index)
        if not groups:
            return []
        out = ["", "costs from:"]
        for (kind, src, rec), idx in groups.items():
            where = "stage" + ("s " if len(idx) > 1 else " ") + node_ranges(idx, None)
            out.append(f"  {kind:<9} {src:<10} {where:<14} {rec}")
        out.append(self._overhead_line())
        act = {s.index: dict(s.memory_parts).get("activations_source") for s in self.stages}
        measured = [i for i, v in act.items() if v == "measured"]
        if not measured:
            out.append("  activation memory: estimated on every stage")
        else:
            rest = "" if len(measured) == len(act) else ", estimated elsewhere"
            out.append(f"  activation memory: measured on stage(s) "
                       f"{node_ranges(measured, None)}{rest}")
        if self.training:
            t = self.training
            overlap = [n for k, n in (("overlap_grad_reduce", "grad reduce"),
                                      ("overlap_param_gather", "param gather")) if t.get(k)]
            out.append(f"  training setup: recompute {t.get('recompute')}, attention "
                       f"{t.get('attention')}, params {t.get('params_dtype')}, grads "
                       f"{t.get('grad_dtype')}, distributed optimizer "
                       f"{'on' if t.get('distributed_optimizer') else 'off'}, overlap "
                       f"{' + '.join(overlap) if overlap else 'off'}")
        return out


_STAGE_W = 7   # the table's stage column: "100-131"


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _r2(x: float) -> float:
    """As the table prints a time (2 decimals): rows that print the same group."""
    return round(x, 2)


def _group_rows(rows, verbose: bool) -> list[tuple[int, int, tuple, list, set]]:
    """(first, last, key, values, nodes) of ``rows`` (index, key, values, nodes): consecutive
    indices with the same key merged, their values (one tuple per stage) listed and their
    nodes joined; one group per row with ``verbose``."""
    out: list[tuple[int, int, tuple, list, set]] = []
    for index, key, values, nodes in rows:
        if not verbose and out and out[-1][2] == key and out[-1][1] == index - 1:
            first, _, _, vals, seen = out[-1]
            out[-1] = (first, index, key, vals + [values], seen | nodes)
        else:
            out.append((index, index, key, [values], set(nodes)))
    return out


def _value_range(values: list[tuple], j: int) -> str:
    """Value ``j`` of a group's stages: ``30.4``, or ``27.0-35.1`` where they differ."""
    lo, hi = min(v[j] for v in values), max(v[j] for v in values)
    return f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"


def _overhead_text(o: dict[str, Any]) -> str:
    return (f"  {'iteration':<9} {o.get('source', '?'):<10} {'every stage':<14} "
            f"+{float(o.get('ms', 0.0)):.2f} ms per iteration ({o.get('record', '')})")


def node_ranges(nodes, max_ranges: int | None = 8) -> str:
    """Indices as ranges, e.g. ``0-3,8-11,14``; beyond ``max_ranges`` ranges (None: no limit)
    the rest is counted (``0-3,8-11,... +5 ranges, 96 nodes``): the JSON lists every device."""
    xs = sorted(set(nodes))
    runs: list[tuple[int, int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    shown = runs if max_ranges is None else runs[:max_ranges]
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    if len(runs) > len(shown):
        text += f",... +{len(runs) - len(shown)} ranges, {len(xs)} nodes"
    return text


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return _r(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)
