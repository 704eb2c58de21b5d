"""Profile records checked against the cluster and the model they will be used with.

``ProfileDB.load`` checks each record on its own (types, finite, in range). A measured record
can still contradict the cluster file: a decoder layer that runs faster than its device type's
``peak_tflops`` allows would give a plan an MFU above 100 %. ``check_profiles`` refuses such a
record, naming it and the field:

    db.json: record (A100, decoder, tp=2, micro-batch 1, seq 4096): forward_ms 1e-06 implies
    1.3e+08 TFLOP/s per device, above A100's peak_tflops (312); a wrong record or a wrong peak

A measured record absurdly slow for its layer (below ``MIN_PEAK_FRACTION`` of the peak, or
``MIN_TFLOPS`` with no peak stated: slower than any device, e.g. 3.5e6 ms for a small layer, a
unit slip) is refused likewise: the search would route around that type, and an estimate scaled
from its rate would be meaningless.

Only records the search can use are checked (measured, this model's signature or, for a mixed
model, one layer kind's, checked with that kind's FLOPs; a device type of the cluster). The bound is the FLOPs of ``model`` (``ModelSpec.layer_forward_flops``, the output
GEMM) at 100 % of the peak; the backward pass does twice the forward FLOPs.
"""

from __future__ import annotations

from .errors import ProfileDBError

_SLACK = 1.01  # the FLOP count is a model of the layer; allow 1 % above the peak
# slower than this is no real measurement: a layer on a CPU, timed with all its framework
# overhead, reaches >= 1e-5 of an accelerator's peak; 3.5e6 ms for tiny-gpt's layer is 3e-10
MIN_PEAK_FRACTION = 1e-8
MIN_TFLOPS = 1e-6        # 1 MFLOP/s: the floor where the cluster file states no peak


def _forward_flops(model, key) -> float | None:
    """FLOPs of one forward pass of the record's layer on one TP rank (None: not counted)."""
    b, s = key.micro_batch_size, key.seq_length
    if key.layer_kind == "decoder":
        return model.layer_forward_flops(b, s) / key.tp
    if key.layer_kind == "output":
        return model.output_forward_flops(b, s) / key.tp
    return None   # embedding: a gather, no model FLOPs


def _check_one(profile, cluster, model, source: str) -> None:
    key = profile.key
    flops = _forward_flops(model, key)
    if flops is None:
        return
    peak = cluster.device_types[key.device_type].peak_tflops
    floor = MIN_TFLOPS if peak is None else max(MIN_TFLOPS, MIN_PEAK_FRACTION * peak)
    for field, ms, factor in (("forward_ms", profile.forward_ms, 1.0),
                              ("backward_ms", profile.backward_ms, 2.0)):
        tflops = factor * flops / (ms * 1e-3) / 1e12
        what = (f"{source}: record ({key.device_type}, {key.layer_kind}, tp={key.tp}, "
                f"micro-batch {key.micro_batch_size}, seq {key.seq_length}): {field} {ms:g} "
                f"implies {tflops:.3g} TFLOP/s per device")
        # no stated peak: the type's speed is calibrated from its records (no upper bound)
        if peak is not None and tflops > _SLACK * peak:
            raise ProfileDBError(f"{what}, above {key.device_type}'s peak_tflops ({peak:g}); "
                                 "a wrong record or a wrong peak")
        if tflops < floor:
            bound = (f"{MIN_PEAK_FRACTION:g} of {key.device_type}'s peak_tflops ({peak:g})"
                     if peak is not None and floor > MIN_TFLOPS else f"{MIN_TFLOPS:g} TFLOP/s")
            raise ProfileDBError(f"{what}, below {bound}: implausibly slow for this layer; a "
                                 "wrong record (a unit slip?)")


def check_profiles(db, cluster, model, source: str | None = None) -> None:
    """ProfileDBError for the first measured record of ``model`` on ``cluster`` that beats the
    device type's peak or is absurdly slow for its layer."""
    from .profiles import record_models

    models = record_models(model)   # a mixed model's kinds: each checked with its own FLOPs
    where = source or db.path or "<profile DB>"
    for profile in db.profiles():
        key = profile.key
        if (profile.source == "measured" and key.model_signature in models
                and key.device_type in cluster.device_types):
            _check_one(profile, cluster, models[key.model_signature], where)


__all__ = ["check_profiles"]
