"""Profile records checked against the cluster and the model they will be used with.

``ProfileDB.load`` checks each record on its own (types, finite, in range). A measured record
can still contradict the cluster file: a decoder layer that runs faster than its device type's
``peak_tflops`` allows would give a plan an MFU above 100 %. ``check_profiles`` refuses such a
record, naming it and the field:

    db.json: record (A100, decoder, tp=2, micro-batch 1, seq 4096): forward_ms 1e-06 implies
    1.3e+08 TFLOP/s per device, above A100's peak_tflops (312); a wrong record or a wrong peak

Only records the search can use are checked (measured, this model's signature, a device type of
the cluster). The bound is the FLOPs of ``model`` (``ModelSpec.layer_forward_flops``, the output
GEMM) at 100 % of the peak; the backward pass does twice the forward FLOPs.
"""

from __future__ import annotations

from .errors import ProfileDBError

_SLACK = 1.01  # the FLOP count is a model of the layer; allow 1 % above the peak


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
    if peak is None:        # no stated peak: the type's speed is calibrated from its records
        return
    for field, ms, factor in (("forward_ms", profile.forward_ms, 1.0),
                              ("backward_ms", profile.backward_ms, 2.0)):
        tflops = factor * flops / (ms * 1e-3) / 1e12
        if tflops > _SLACK * peak:
            raise ProfileDBError(
                f"{source}: record ({key.device_type}, {key.layer_kind}, tp={key.tp}, "
                f"micro-batch {key.micro_batch_size}, seq {key.seq_length}): {field} {ms:g} "
                f"implies {tflops:.3g} TFLOP/s per device, above {key.device_type}'s "
                f"peak_tflops ({peak:g}); a wrong record or a wrong peak")


def check_profiles(db, cluster, model, source: str | None = None) -> None:
    """ProfileDBError for the first measured record of ``model`` on ``cluster`` that beats the
    device type's peak."""
    signature = model.signature()
    where = source or db.path or "<profile DB>"
    for profile in db.profiles():
        key = profile.key
        if (profile.source == "measured" and key.model_signature == signature
                and key.device_type in cluster.device_types):
            _check_one(profile, cluster, model, where)


__all__ = ["check_profiles"]
