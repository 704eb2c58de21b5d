"""The per-iteration overhead: what a training iteration takes beyond the simulated pipeline.

The simulator times the pipeline (per-stage forward / backward, the sends) and each stage's
post-pipeline work (DP all-reduce + optimizer step). A real iteration has more: the
tied-embedding and grad-norm all-reduces that line the stages up, Megatron's per-iteration work
(zeroing the gradient buffers, the learning-rate step, the loss reduction), DP replicas waiting
for each other, and -- on a host whose cores the ranks share -- hand-offs between pipeline
stages delayed by the scheduler. The live calibration (``megatron/calibrate/calibration.py``) measures
this as one number per iteration: the mean measured iteration time of its calibration
iterations minus the time the simulator gives the plan with the stage compute measured in
those same iterations (``iteration_fit.py``). The cost model adds it to every stage's
post-pipeline term (``costs.py``), so the search times every plan with it.

Record (``IterationOverhead``), kept in the profile DB next to the layer records (the file's
``overheads`` list)::

    {"model_signature": "...", "seq_length": 128, "dtype": "bf16", "attention": "unfused",
     "recompute": "none", "device_types": "emu-fast,emu-slow", "overhead_ms": 95.3,
     "source": "calibrated", "calibrated_on": "1f1b pp=2 dp=2 tp=1 mbs=1 m=8, iterations 2-4"}

Key: the model, the sequence, the training setup and the cluster's device types (sorted). Merge
rule as for layers: ``calibrated`` beats ``estimated``; between two of one source the later wins.
Provenance in plans: ``calibrated`` (a live run measured it), or no record (``none``: 0 ms).

Limits: one number for every plan of a (model, setup, types): it is exact for the plan it was
calibrated on; for a plan with more pipeline stages or micro-batches the hand-off part (if the
host adds one) grows, which one constant does not follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from .errors import (ProfileDBError, check_record_fields, record_choice,
                     record_field_error)
from .safeio import name_problem

OverheadSource = Literal["calibrated", "estimated"]
OVERHEAD_SOURCES: tuple[str, ...] = ("calibrated", "estimated")
MAX_OVERHEAD_MS = 3.6e6   # an hour per iteration
_RANK = {"estimated": 0, "calibrated": 1}


@dataclass(frozen=True)
class OverheadKey:
    model_signature: str
    seq_length: int
    device_types: str            # the cluster's device type names, sorted, comma-joined
    dtype: str = "bf16"
    attention: str = "flash"
    recompute: str = "none"

    def sort_key(self) -> tuple:
        return (self.model_signature, self.seq_length, self.device_types, self.dtype,
                self.attention, self.recompute)

    def describe(self) -> str:
        return (f"{self.device_types} seq{self.seq_length} "
                f"{self.dtype}/{self.attention}/{self.recompute}")


@dataclass(frozen=True)
class IterationOverhead:
    key: OverheadKey
    overhead_ms: float
    source: OverheadSource = "calibrated"
    calibrated_on: str = ""      # the plan and iterations it was measured on


def overhead_key(model_signature: str, seq_length: int, type_names: Iterable[str],
                 setup_fields: dict[str, str]) -> OverheadKey:
    """The key of a cluster's device types (any order) and a training setup's profile fields."""
    return OverheadKey(model_signature, int(seq_length), ",".join(sorted(type_names)),
                       **setup_fields)


def wins(new: IterationOverhead, old: IterationOverhead | None) -> bool:
    """Merge rule: calibrated > estimated; same source -> the newer one."""
    return old is None or _RANK[new.source] >= _RANK[old.source]


def overhead_to_record(o: IterationOverhead) -> dict[str, Any]:
    k = o.key
    return {"model_signature": k.model_signature, "seq_length": k.seq_length,
            "device_types": k.device_types, "dtype": k.dtype, "attention": k.attention,
            "recompute": k.recompute, "overhead_ms": o.overhead_ms, "source": o.source,
            **({"calibrated_on": o.calibrated_on} if o.calibrated_on else {})}


_FIELDS = {"model_signature", "seq_length", "device_types", "dtype", "attention", "recompute",
           "overhead_ms", "source", "calibrated_on"}
# the training-setup fields of profile and overhead records: allowed values, default first
SETUP_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("bf16", "fp16", "fp32"), "attention": ("flash", "unfused"),
    "recompute": ("none", "selective", "full")}


def overhead_from_record(record: object, where: str) -> IterationOverhead:
    """Parse one record; ProfileDBError naming ``where`` and the field."""
    def bad(field: str, expected: str, got: object) -> ProfileDBError:
        return record_field_error(where, field, expected, got)

    record = check_record_fields(record, where, _FIELDS,
                                 ("model_signature", "seq_length", "device_types", "overhead_ms"))
    for field in ("model_signature", "device_types"):
        v = record[field]
        if not isinstance(v, str) or not v or len(v) > 1024:
            raise bad(field, "a non-empty string of at most 1024 characters", v)
    for name in record["device_types"].split(","):   # each by the cluster YAML's rule
        why = name_problem(name, type_name=True)
        if why is not None:
            raise bad("device_types", f"comma-separated device types ({why})",
                      record["device_types"])
    seq = record["seq_length"]
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= 1 << 24:
        raise bad("seq_length", "an integer in [1, 16777216]", seq)
    ms = record["overhead_ms"]
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) \
            or not 0.0 <= ms <= MAX_OVERHEAD_MS:
        raise bad("overhead_ms", f"a number in [0, {MAX_OVERHEAD_MS:g}] (ms per iteration)", ms)
    source = record_choice(record, where, "source", OVERHEAD_SOURCES, "calibrated")
    setup = {field: record_choice(record, where, field, allowed, allowed[0])
             for field, allowed in SETUP_CHOICES.items()}
    on = record.get("calibrated_on", "")
    if not isinstance(on, str) or len(on) > 1024:
        raise bad("calibrated_on", "a string of at most 1024 characters", on)
    key = OverheadKey(record["model_signature"], seq, record["device_types"], **setup)
    return IterationOverhead(key, float(ms), source, on)
