"""Profile records, the on-disk profile DB, and the analytic estimator.

On-disk format (``ProfileDB.VERSION`` = 1), deterministic (records sorted by key, keys sorted,
2-space indent, trailing newline)::

    {"version": 1, "records": [
      {"device_type": "A2-2", "layer_kind": "decoder", "tp": 2, "micro_batch_size": 1,
       "seq_length": 4096, "model_signature": "h4096-...", "forward_ms": 12.3, "backward_ms": 24.9,
       "activation_bytes": 123456, "param_bytes": 654321, "source": "measured",
       "optimizer_ms": 0.8}, ...]}

``optimizer_ms`` (optional, decoder records): the optimizer step of the layer's parameters on one
device; the cost model adds it, scaled by each stage's parameters, to the stage's post-pipeline
work (``costs.py``). Written only when non-zero.

Merge rule (``put``, ``merge`` and duplicate keys in a file): a measured record beats an
estimated one whatever the order; between two records of the same source the later one wins.

Analytic estimator (``estimate_profile``), per TP rank, for one micro-batch:

* decoder: forward = layer FLOPs / tp / (peak x efficiency) + 2 TP all-reduces of the b*s*h bf16
  activation (Megatron: after attention and after the MLP; with sequence parallelism the same
  volume moves as all-gather + reduce-scatter); backward = 2 x forward compute + 2 all-reduces.
* embedding: compute of b*s*h (a gather; negligible); forward 1 all-reduce of b*s*h (the
  vocab-parallel embedding); backward the scatter-add, no communication.
* output: logits GEMM 2*b*s*h*V/tp + cross-entropy (~5 ops per logit, /tp) forward; the
  vocab-parallel loss all-reduces three b*s fp32 vectors; backward = 2 x GEMM + loss + 1
  all-reduce of b*s*h (the output layer's input gradient).
* all-reduce cost: ``comm.allreduce_ms``, a ring over t ranks, 2(t-1)/t x bytes / bandwidth +
  2(t-1) x latency. The link is the device type's intra-node link when t ranks fit in one node,
  else its inter-node link.
* activation bytes: ``memory.layer_activation_bytes`` (flash / selective assumption), embedding and
  output terms from ``memory``; parameter bytes: bf16 params per TP rank (output: final norm + the
  output weight, which the last stage holds even when tied, if the pipeline has several stages).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Literal, get_args

from . import memory
from .comm import allreduce_ms
from .errors import ProfileDBError, SpecError

LayerKind = Literal["decoder", "embedding", "output"]
Source = Literal["measured", "estimated"]
LAYER_KINDS: tuple[str, ...] = get_args(LayerKind)
SOURCES: tuple[str, ...] = get_args(Source)
BYTES_BF16 = memory.BYTES_BF16
BYTES_FP32 = memory.BYTES_FP32


@dataclass(frozen=True)
class ProfileKey:
    device_type: str
    layer_kind: LayerKind
    tp: int
    micro_batch_size: int
    seq_length: int
    model_signature: str   # ModelSpec.signature-like string: what shapes the layer's cost

    def sort_key(self) -> tuple:
        return (self.model_signature, self.device_type, self.layer_kind, self.tp,
                self.micro_batch_size, self.seq_length)


@dataclass(frozen=True)
class LayerProfile:
    key: ProfileKey
    forward_ms: float
    backward_ms: float
    activation_bytes: int   # kept for backward, per micro-batch, per device (TP-sharded)
    param_bytes: int        # bf16 parameters of this layer on one device (TP-sharded)
    source: Source = "estimated"
    optimizer_ms: float = 0.0   # optimizer step of this layer's parameters on one device (0: none)


# --------------------------------------------------------------------------- JSON records

_KEY_FIELDS: dict[str, type] = {
    "device_type": str, "layer_kind": str, "tp": int, "micro_batch_size": int,
    "seq_length": int, "model_signature": str,
}
_VALUE_FIELDS = ("forward_ms", "backward_ms", "activation_bytes", "param_bytes")
_RECORD_FIELDS = set(_KEY_FIELDS) | set(_VALUE_FIELDS) | {"source", "optimizer_ms"}


def profile_to_record(profile: LayerProfile) -> dict[str, Any]:
    key = profile.key
    return {
        "device_type": key.device_type, "layer_kind": key.layer_kind, "tp": key.tp,
        "micro_batch_size": key.micro_batch_size, "seq_length": key.seq_length,
        "model_signature": key.model_signature, "forward_ms": profile.forward_ms,
        "backward_ms": profile.backward_ms, "activation_bytes": profile.activation_bytes,
        "param_bytes": profile.param_bytes, "source": profile.source,
        **({"optimizer_ms": profile.optimizer_ms} if profile.optimizer_ms else {}),
    }


def profile_from_record(record: object, where: str) -> LayerProfile:
    """Parse one record; ProfileDBError naming ``where`` (e.g. 'db.json: records[3].tp')."""
    def bad(field: str, expected: str, got: object) -> ProfileDBError:
        return ProfileDBError(f"{where}.{field}: expected {expected}, got {got!r}")

    if not isinstance(record, dict):
        raise ProfileDBError(f"{where}: expected an object, got {type(record).__name__}")
    for field in record:
        if field not in _RECORD_FIELDS:
            raise bad(field, "a known field (" + ", ".join(sorted(_RECORD_FIELDS)) + ")",
                      "unknown field")
    for field in (*_KEY_FIELDS, *_VALUE_FIELDS):
        if field not in record:
            raise ProfileDBError(f"{where}.{field}: missing")
    for field, typ in _KEY_FIELDS.items():
        value = record[field]
        if typ is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(field, "an integer >= 1", value)
        elif not isinstance(value, str) or not value:
            raise bad(field, "a non-empty string", value)
    if record["layer_kind"] not in LAYER_KINDS:
        raise bad("layer_kind", "one of " + ", ".join(LAYER_KINDS), record["layer_kind"])
    for field in ("forward_ms", "backward_ms", "optimizer_ms"):
        value = record.get(field, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise bad(field, "a number >= 0", value)
    for field in ("activation_bytes", "param_bytes"):
        value = record[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(field, "an integer >= 0", value)
    source = record.get("source", "measured")
    if source not in SOURCES:
        raise bad("source", "one of " + ", ".join(SOURCES), source)
    key = ProfileKey(**{f: record[f] for f in _KEY_FIELDS})
    return LayerProfile(key=key, forward_ms=float(record["forward_ms"]),
                        backward_ms=float(record["backward_ms"]),
                        activation_bytes=record["activation_bytes"],
                        param_bytes=record["param_bytes"], source=source,
                        optimizer_ms=float(record.get("optimizer_ms", 0.0)))


def _wins(new: LayerProfile, old: LayerProfile | None) -> bool:
    """Merge rule: measured beats estimated; same source -> the newer one."""
    return old is None or not (old.source == "measured" and new.source == "estimated")


class ProfileDB:
    """Versioned JSON profile store: load/save (atomic), get/put; ProfileDBError on a bad file.

    ``ProfileDB(path)`` loads ``path`` if it exists, else starts empty and remembers ``path`` for
    ``save()``. Not thread-safe; one process writes a DB at a time.
    """

    VERSION = 1

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._records: dict[ProfileKey, LayerProfile] = {}
        if path is not None and os.path.exists(path):
            self._records = ProfileDB.load(path)._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[LayerProfile]:
        return iter(self.profiles())

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def profiles(self) -> list[LayerProfile]:
        """All records, sorted by key (deterministic)."""
        return [self._records[k] for k in sorted(self._records, key=ProfileKey.sort_key)]

    def get(self, key: ProfileKey) -> LayerProfile | None:
        return self._records.get(key)

    def put(self, profile: LayerProfile) -> bool:
        """Insert by the merge rule; returns whether ``profile`` was stored."""
        if _wins(profile, self._records.get(profile.key)):
            self._records[profile.key] = profile
            return True
        return False

    def merge(self, other: "ProfileDB") -> None:
        """Put every record of ``other`` (in its sorted order) by the merge rule."""
        for profile in other.profiles():
            self.put(profile)

    def to_json(self) -> str:
        payload = {"version": self.VERSION,
                   "records": [profile_to_record(p) for p in self.profiles()]}
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    def save(self, path: str | None = None) -> None:
        """Write atomically (temporary file in the same directory + ``os.replace``)."""
        target = path or self.path
        if target is None:
            raise ProfileDBError("profile DB has no path to save to")
        directory = os.path.dirname(os.path.abspath(target))
        text = self.to_json()
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".profiles-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
            tmp = None
        except OSError as exc:
            raise ProfileDBError(f"{target}: cannot write profile DB: {exc.strerror or exc}") \
                from None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        if self.path is None:
            self.path = target

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> "ProfileDB":
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileDBError(f"{source}: not valid JSON (line {exc.lineno}, column "
                                 f"{exc.colno}: {exc.msg})") from None
        if not isinstance(payload, dict):
            raise ProfileDBError(f"{source}: expected a JSON object with 'version' and 'records'")
        version = payload.get("version")
        if version != cls.VERSION:
            raise ProfileDBError(f"{source}: profile DB version {version!r} is not supported "
                                 f"(expected {cls.VERSION}); re-profile or convert the file")
        extra = set(payload) - {"version", "records"}
        if extra:
            raise ProfileDBError(f"{source}: unknown top-level field(s) {sorted(extra)}")
        records = payload.get("records")
        if not isinstance(records, list):
            raise ProfileDBError(f"{source}: records: expected a list, got {records!r}")
        db = cls()
        for i, record in enumerate(records):
            db.put(profile_from_record(record, f"{source}: records[{i}]"))
        return db

    @classmethod
    def load(cls, path: str) -> "ProfileDB":
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise ProfileDBError(f"{path}: cannot read profile DB: {exc.strerror or exc}") \
                from None
        except UnicodeDecodeError:
            raise ProfileDBError(f"{path}: not valid JSON (not UTF-8 text)") from None
        db = cls.from_json(text, source=path)
        db.path = path
        return db


# --------------------------------------------------------------------------- estimator

def tp_link_gbps(cluster, device_type: str, tp: int) -> float:
    """The link TP collectives of ``device_type`` run on: intra-node if tp ranks fit in a node."""
    if device_type not in cluster.device_types:
        raise SpecError(cluster.source, f"device_types.{device_type}",
                        "a device type of the cluster", "unknown device type")
    dtype = cluster.device_types[device_type]
    if tp <= cluster.max_intra_node_devices(device_type) or not cluster.nodes_of_type(device_type):
        return dtype.intra_node_gbps
    return min(dtype.intra_node_gbps, cluster.links.inter_node_gbps[device_type])


def _compute_ms(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e12) * 1e3


def estimate_profile(cluster, model, key: ProfileKey) -> LayerProfile:
    """Analytic estimate: FLOPs / (peak x efficiency) plus TP all-reduce cost on the intra-node link."""
    if key.layer_kind not in LAYER_KINDS:
        raise ProfileDBError(f"unknown layer kind {key.layer_kind!r}")
    gbps = tp_link_gbps(cluster, key.device_type, key.tp)
    tflops = cluster.device_types[key.device_type].effective_tflops
    latency = cluster.links.latency_ms
    b, s, t, h = key.micro_batch_size, key.seq_length, key.tp, model.hidden_size
    hidden_ar = allreduce_ms(BYTES_BF16 * b * s * h, t, gbps, latency)
    shape = dict(micro_batch_size=b, seq_length=s, tp=t)

    if key.layer_kind == "decoder":
        compute = _compute_ms(model.layer_forward_flops(b, s) / t, tflops)
        forward = compute + 2 * hidden_ar
        backward = 2 * compute + 2 * hidden_ar
        activation = memory.layer_activation_bytes(model, **shape)
        params = model.layer_param_split().per_device(t)
    elif key.layer_kind == "embedding":
        compute = _compute_ms(float(b * s * h), tflops)
        forward = compute + hidden_ar
        backward = compute
        activation = memory.embedding_activation_bytes(model, **shape)
        word = h * model.vocab_size
        params = word / t + (model.embedding_params() - word)
    else:
        gemm = _compute_ms(model.output_forward_flops(b, s) / t, tflops)
        loss = _compute_ms(model.loss_forward_flops(b, s) / t, tflops)
        loss_ar = 3 * allreduce_ms(BYTES_FP32 * b * s, t, gbps, latency)
        forward = gemm + loss + loss_ar
        backward = 2 * gemm + loss + hidden_ar
        activation = memory.output_activation_bytes(model, **shape)
        params = h * model.vocab_size / t + model.norm_params
    return LayerProfile(key=key, forward_ms=forward, backward_ms=backward,
                        activation_bytes=math.ceil(activation),
                        param_bytes=math.ceil(BYTES_BF16 * params), source="estimated")


def lookup_profile(db: ProfileDB | None, cluster, model, key: ProfileKey) -> LayerProfile:
    """Measured record from the DB if present, else the estimate (marked 'estimated')."""
    if db is not None:
        found = db.get(key)
        if found is not None and found.source == "measured":
            return found
    return estimate_profile(cluster, model, key)


def profile_key(model, device_type: str, layer_kind: LayerKind, tp: int, micro_batch_size: int,
                seq_length: int | None = None) -> ProfileKey:
    """Convenience: the key for ``model`` (signature filled in; seq defaults to the model's)."""
    return ProfileKey(device_type=device_type, layer_kind=layer_kind, tp=tp,
                      micro_batch_size=micro_batch_size,
                      seq_length=model.seq_length if seq_length is None else seq_length,
                      model_signature=model.signature())


__all__ = [
    "LayerKind", "Source", "ProfileKey", "LayerProfile", "ProfileDB", "estimate_profile",
    "lookup_profile", "profile_key", "tp_link_gbps",
]
