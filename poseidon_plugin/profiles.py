"""Profile records, the on-disk profile DB, and the analytic estimator.

On-disk format (``ProfileDB.VERSION`` = 1), deterministic (records sorted by key, keys sorted,
2-space indent, trailing newline)::

    {"version": 1, "records": [
      {"device_type": "A2-2", "layer_kind": "decoder", "tp": 2, "micro_batch_size": 1,
       "seq_length": 4096, "model_signature": "h4096-...", "forward_ms": 12.3, "backward_ms": 24.9,
       "activation_bytes": 123456, "param_bytes": 654321, "source": "measured",
       "dtype": "bf16", "attention": "flash", "recompute": "none",
       "env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.9.0", "megatron_core": "0.19.2"},
       "optimizer_ms": 0.8},
      ...]}

``optimizer_ms`` (optional, decoder records): the optimizer step of the layer's parameters on one
device; the cost model adds it, scaled by each stage's parameters, to the stage's post-pipeline
work (``costs.py``). Written only when non-zero.

``op_overheads`` and ``p2p_calls`` (optional top-level lists, written only when non-empty):
megatron's per-op overheads and per-p2p-call costs (``callcosts.py``), measured by ``poseidon
profile`` / the launch's profiler; the search's simulator charges them. Files without them load
as before (their plans are timed as before).

``overheads`` (optional top-level list, written only when non-empty): per-iteration overhead
records (``overhead.py``: what an iteration takes beyond the simulated pipeline, calibrated by
a live run), keyed by the model, sequence, setup and the cluster's device types.

The key is the device type, layer kind, TP, micro-batch, sequence, the model's signature
(``ModelSpec.signature``) and the training setup the layer ran under (``dtype``, ``attention``,
``recompute``: ``TrainingSetup.profile_fields``; absent in older files: bf16, flash, none).
``activation_bytes`` is what one micro-batch keeps for backward on one device under that setup
(the memory model uses it), ``param_bytes`` the layer's parameters on one device in ``dtype``.
``env`` (optional) says what measured it: device name, driver, torch and megatron-core versions.

Merge rule (``put``, ``merge`` and duplicate keys in a file): measured beats calibrated beats
estimated whatever the order; between two records of the same source the later one wins (a
re-profile, a later ``--merge`` input). In one file, two records of one key and source with
different values are refused (which one the plan used would depend on their order); identical
ones are kept once. ``save`` never writes a DB its own loader would refuse.

Provenance (``source``): ``measured`` -- a profiled layer; ``calibrated`` -- the estimator on a
device type whose speed was set from measured layers; ``estimated`` -- the estimator on the
cluster file's peak x efficiency (only for a type no record measured). A decoder estimate of a
type with measured records is scaled from them (``scaled_profile``): source ``calibrated`` with
``scaled_from``, and ``scaled`` in a plan's provenance (``provenance_entry``), naming the records
and the rate, e.g. ``V100 decoder tp2 mbs4 seq4096 bf16/flash/none from measured tp1 mbs1,2
(rate 41.3 TFLOP/s)``. ``diagnose`` names, in one line, why records of a DB cannot
serve a plan (another sequence, model field, setup or device type).

Limits (a hostile file is refused cheaply, naming the record and field): at most
``MAX_DB_BYTES``, no duplicate keys in one JSON object, nesting beyond what the JSON parser
handles is refused, not a traceback; times finite and in (0, ``MAX_LAYER_MS``], byte counts
integers in [0, ``MAX_LAYER_BYTES``], key integers at most ``MAX_KEY_INT``.

Analytic estimator (``estimate_profile``), per TP rank, for one micro-batch:

* decoder: forward = layer FLOPs / tp / (peak x efficiency) + the layer's TP collectives
  (``tp_traffic.py``: a dense layer 2 exchanges of the b*s*h bf16 activation, after attention
  and after the MLP; a MoE layer the attention's, the shared experts', and the ``alltoall``
  token dispatcher's all-gather + reduce-scatter of the k*b*s*h token copies); backward =
  2 x forward compute + the same collectives.
* embedding: compute of b*s*h (a gather; negligible); forward 1 all-reduce of b*s*h (the
  vocab-parallel embedding); backward the scatter-add, no communication.
* output: logits GEMM 2*b*s*h*V/tp + cross-entropy (~5 ops per logit, /tp) forward; the
  vocab-parallel loss all-reduces three b*s fp32 vectors; backward = 2 x GEMM + loss + 1
  all-reduce of b*s*h (the output layer's input gradient).
* all-reduce cost: ``comm.allreduce_ms``, a ring over t ranks, 2(t-1)/t x bytes / bandwidth +
  2(t-1) x latency. The link is the device type's intra-node link when t ranks fit in one node,
  else its inter-node link.
* scaled (``lookup_profile``: a decoder no record measured, of a device type the DB measured
  at another TP / micro-batch / sequence under the same model and setup): the same terms at the
  compute rate the type's closest measured records reached (``scaling_basis``: the key's
  sequence, else the closest; its TP, else the closest; the micro-batch sizes bracketing the
  key's, the rate interpolated on a log scale between them, else the nearest one's), forward
  and backward each at its own measured rate, the measured TP all-reduces' modelled time taken
  out of the measurement first (unless they would explain more than ``COMM_FIT`` of it). The
  cluster file's ``peak_tflops`` plays no part: it serves MFU and the types nothing measured.
* the key's setup: ``full`` recompute adds one whole forward to the backward (its compute and
  its TP collectives: megatron-core re-runs the layer), ``selective`` the core attention's
  compute (megatron-core's default ``recompute_modules``; no collective); activation bytes are
  ``memory.layer_activation_bytes`` for the setup (``memory.layer_input_bytes`` under full
  recompute), embedding and output terms from
  ``memory``; parameter bytes: params per TP rank x the dtype's bytes (output: final norm + the
  output weight, which the last stage holds even when tied, if the pipeline has several stages).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Iterator, Literal, get_args

from . import memory
from .cluster import nominal_peak_tflops
from .comm import allreduce_ms
from .callcosts import (OpOverhead, P2PCall, op_overhead_from_record, op_overhead_to_record,
                        p2p_call_from_record, p2p_call_to_record)
from .errors import (ProfileDBError, SpecError, check_record_fields, record_choice,
                     record_field_error, short_repr)
from .overhead import (SETUP_CHOICES, IterationOverhead, OverheadKey, overhead_from_record,
                       overhead_to_record, wins as _overhead_wins)
from .safeio import name_problem, open_input, write_atomic
from .tp_traffic import layer_tp_comm_ms
from .training import TrainingSetup

LayerKind = Literal["decoder", "embedding", "output"]
Source = Literal["measured", "calibrated", "estimated"]
LAYER_KINDS: tuple[str, ...] = get_args(LayerKind)
SOURCES: tuple[str, ...] = get_args(Source)
BYTES_BF16 = memory.BYTES_BF16
BYTES_FP32 = memory.BYTES_FP32
MAX_DB_BYTES = 64 << 20        # 64 MiB (~150k records)
MAX_LAYER_MS = 3.6e6           # one layer, one micro-batch: at most an hour
MAX_LAYER_BYTES = 1 << 46      # 64 TiB: the most memory a device may have (cluster.py)
MAX_KEY_INT = 1 << 24          # tp, micro_batch_size, seq_length
MAX_KEY_CHARS = 1024           # device_type, model_signature


@dataclass(frozen=True)
class ProfileKey:
    device_type: str
    layer_kind: LayerKind
    tp: int
    micro_batch_size: int
    seq_length: int
    model_signature: str   # ModelSpec.signature-like string: what shapes the layer's cost
    dtype: str = "bf16"        # the training setup the layer ran under
    attention: str = "flash"
    recompute: str = "none"
    # expert-parallel degree the layer ran at (a MoE layer profiled as one EP rank runs it:
    # its num_experts / ep local experts, the tokens routed to them); 1 for every other record
    # and for records of DBs written before EP (the JSON field is written only when > 1)
    ep: int = 1

    def sort_key(self) -> tuple:
        return (self.model_signature, self.device_type, self.layer_kind, self.tp,
                self.micro_batch_size, self.seq_length, self.dtype, self.attention,
                self.recompute, self.ep)

    @property
    def setup(self) -> TrainingSetup:
        return TrainingSetup(recompute=self.recompute, params_dtype=self.dtype,
                             attention=self.attention)

    def describe(self) -> str:
        """Short human form, e.g. ``A100 decoder tp1 mbs2 seq2048 bf16/flash/none``."""
        return (f"{self.device_type} {self.layer_kind} tp{self.tp}"
                + (f" ep{self.ep}" if self.ep != 1 else "")
                + f" mbs{self.micro_batch_size} "
                f"seq{self.seq_length} {self.dtype}/{self.attention}/{self.recompute}")


@dataclass(frozen=True)
class LayerProfile:
    key: ProfileKey
    forward_ms: float
    backward_ms: float
    activation_bytes: int   # kept for backward, per micro-batch, per device (TP-sharded)
    param_bytes: int        # parameters of this layer on one device (TP-sharded), key's dtype
    source: Source = "estimated"
    env: tuple[tuple[str, str], ...] = ()   # what measured it (device, versions), sorted
    optimizer_ms: float = 0.0   # optimizer step of this layer's parameters on one device (0: none)
    # an estimate scaled from measured records of its device type (``scaled_profile``): their
    # keys and the compute rate (TFLOP/s) the scaling used; () / 0.0 otherwise. Not written to
    # a DB file (an estimate is re-derived at every lookup).
    scaled_from: tuple["ProfileKey", ...] = ()
    rate_tflops: float = 0.0


# --------------------------------------------------------------------------- JSON records

_KEY_FIELDS: dict[str, type] = {
    "device_type": str, "layer_kind": str, "tp": int, "micro_batch_size": int,
    "seq_length": int, "model_signature": str,
}
_VALUE_FIELDS = ("forward_ms", "backward_ms", "activation_bytes", "param_bytes")
_RECORD_FIELDS = (set(_KEY_FIELDS) | set(_VALUE_FIELDS) | set(SETUP_CHOICES)
                  | {"source", "env", "optimizer_ms", "ep"})
_RANK = {"estimated": 0, "calibrated": 1, "measured": 2}


def profile_to_record(profile: LayerProfile) -> dict[str, Any]:
    key = profile.key
    return {
        "device_type": key.device_type, "layer_kind": key.layer_kind, "tp": key.tp,
        "micro_batch_size": key.micro_batch_size, "seq_length": key.seq_length,
        "model_signature": key.model_signature, "forward_ms": profile.forward_ms,
        "backward_ms": profile.backward_ms, "activation_bytes": profile.activation_bytes,
        "param_bytes": profile.param_bytes, "source": profile.source,
        "dtype": key.dtype, "attention": key.attention, "recompute": key.recompute,
        **({"env": dict(profile.env)} if profile.env else {}),
        **({"optimizer_ms": profile.optimizer_ms} if profile.optimizer_ms else {}),
        **({"ep": key.ep} if key.ep != 1 else {}),
    }


def profile_from_record(record: object, where: str) -> LayerProfile:
    """Parse one record; ProfileDBError naming ``where`` (e.g. 'db.json: records[3].tp')."""
    def bad(field: str, expected: str, got: object) -> ProfileDBError:
        return record_field_error(where, field, expected, got)

    record = check_record_fields(record, where, _RECORD_FIELDS, (*_KEY_FIELDS, *_VALUE_FIELDS))
    for field, typ in _KEY_FIELDS.items():
        value = record[field]
        if typ is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(field, "an integer >= 1", value)
            if value > MAX_KEY_INT:
                raise bad(field, f"an integer <= {MAX_KEY_INT}", value)
        elif key_string_error(value) is not None:
            raise bad(field, key_string_error(value), value)
    why = name_problem(record["device_type"], type_name=True)   # the cluster YAML's rule
    if why is not None:
        raise bad("device_type", why, record["device_type"])
    if record["layer_kind"] not in LAYER_KINDS:
        raise bad("layer_kind", "one of " + ", ".join(LAYER_KINDS), record["layer_kind"])
    for field in ("forward_ms", "backward_ms", "optimizer_ms"):
        value = record.get(field, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise bad(field, "a number >= 0", value)
        if value > MAX_LAYER_MS or (value == 0 and field != "optimizer_ms"):
            raise bad(field, f"a time > 0 and <= {MAX_LAYER_MS:g} ms (one layer, one "
                      "micro-batch)", value)
    for field in ("activation_bytes", "param_bytes"):
        value = record[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(field, "an integer >= 0", value)
        if value > MAX_LAYER_BYTES:
            raise bad(field, f"at most {MAX_LAYER_BYTES} bytes (64 TiB)", value)
    source = record_choice(record, where, "source", SOURCES, "measured")
    setup = {field: record_choice(record, where, field, allowed, allowed[0])
             for field, allowed in SETUP_CHOICES.items()}
    env = record.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise bad("env", "an object of strings", env)
    ep = record.get("ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= MAX_KEY_INT:
        raise bad("ep", f"an integer in [1, {MAX_KEY_INT}]", ep)
    key = ProfileKey(**{f: record[f] for f in _KEY_FIELDS}, **setup, ep=ep)
    return LayerProfile(key=key, forward_ms=float(record["forward_ms"]),
                        backward_ms=float(record["backward_ms"]),
                        activation_bytes=record["activation_bytes"],
                        param_bytes=record["param_bytes"], source=source,
                        env=tuple(sorted(env.items())),
                        optimizer_ms=float(record.get("optimizer_ms", 0.0)))


def _values(p: LayerProfile) -> tuple:
    """What a record says about its key (``env`` aside: the same times measured twice)."""
    return (p.forward_ms, p.backward_ms, p.activation_bytes, p.param_bytes, p.optimizer_ms)


def _values_text(p: LayerProfile) -> str:
    return (f"forward {p.forward_ms:g} ms, backward {p.backward_ms:g} ms, activations "
            f"{p.activation_bytes} B, params {p.param_bytes} B"
            + (f", optimizer {p.optimizer_ms:g} ms" if p.optimizer_ms else ""))


def key_string_error(value: object) -> str | None:
    """Why ``value`` cannot be a string field of a record's key (device type, layer kind, model
    signature), as the loader says it; None when it can."""
    if not isinstance(value, str) or not value:
        return "a non-empty string"
    if len(value) > MAX_KEY_CHARS:
        return f"a string of at most {MAX_KEY_CHARS} characters"
    return None


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a JSON object as a dict, refusing a key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def _family(key: ProfileKey) -> tuple:
    """What a key shares with the records an estimate of it may be scaled from: everything but
    TP, micro-batch and sequence (an estimate is scaled from records of its own EP degree)."""
    return (key.device_type, key.layer_kind, key.model_signature, key.dtype, key.attention,
            key.recompute, key.ep)


def _wins(new: LayerProfile, old: LayerProfile | None) -> bool:
    """Merge rule: measured > calibrated > estimated; same source -> the newer one."""
    return old is None or _RANK[new.source] >= _RANK[old.source]


class ProfileDB:
    """Versioned JSON profile store: load/save (atomic), get/put; ProfileDBError on a bad file.

    ``ProfileDB(path)`` loads ``path`` if it exists, else starts empty and remembers ``path`` for
    ``save()``. Not thread-safe; one process writes a DB at a time.
    """

    VERSION = 1

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._records: dict[ProfileKey, LayerProfile] = {}
        self._overheads: dict[OverheadKey, IterationOverhead] = {}
        self._op_overheads: dict[str, OpOverhead] = {}
        self._p2p_calls: dict[tuple, P2PCall] = {}
        self._measured_index: dict[tuple, tuple[LayerProfile, ...]] | None = None
        if path is not None and os.path.exists(path):
            loaded = ProfileDB.load(path)
            self._records, self._overheads = loaded._records, loaded._overheads
            self._op_overheads, self._p2p_calls = loaded._op_overheads, loaded._p2p_calls

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
            self._measured_index = None
            return True
        return False

    def measured_of(self, key: ProfileKey) -> tuple[LayerProfile, ...]:
        """The measured records of ``key``'s device type, layer kind, model signature and setup
        (any TP, micro-batch, sequence), sorted by key; indexed once per change of the DB."""
        if self._measured_index is None:
            index: dict[tuple, list[LayerProfile]] = {}
            for p in self.profiles():
                if p.source == "measured":
                    index.setdefault(_family(p.key), []).append(p)
            self._measured_index = {k: tuple(v) for k, v in index.items()}
        return self._measured_index.get(_family(key), ())

    def merge(self, other: "ProfileDB") -> None:
        """Put every record of ``other`` (in its sorted order) by the merge rule."""
        for profile in other.profiles():
            self.put(profile)
        for o in other.overheads():
            self.put_overhead(o)
        for x in other.op_overheads():
            self.put_op_overhead(x)
        for c in other.p2p_calls():
            self.put_p2p_call(c)

    # megatron's per-op overheads and per-p2p-call costs (callcosts.py); the later one wins
    def op_overheads(self) -> list[OpOverhead]:
        return [self._op_overheads[k] for k in sorted(self._op_overheads)]

    def put_op_overhead(self, o: OpOverhead) -> None:
        self._op_overheads[o.key] = o

    def p2p_calls(self) -> list[P2PCall]:
        return [self._p2p_calls[k] for k in sorted(self._p2p_calls)]

    def put_p2p_call(self, c: P2PCall) -> None:
        self._p2p_calls[c.key] = c

    # per-iteration overheads (overhead.py)
    def overheads(self) -> list[IterationOverhead]:
        return [self._overheads[k] for k in sorted(self._overheads, key=OverheadKey.sort_key)]

    def get_overhead(self, key: OverheadKey) -> IterationOverhead | None:
        return self._overheads.get(key)

    def put_overhead(self, overhead: IterationOverhead) -> bool:
        """Insert by the merge rule (calibrated > estimated; same source: the newer)."""
        if _overhead_wins(overhead, self._overheads.get(overhead.key)):
            self._overheads[overhead.key] = overhead
            return True
        return False

    def to_json(self) -> str:
        payload: dict[str, Any] = {"version": self.VERSION,
                                   "records": [profile_to_record(p) for p in self.profiles()]}
        if self._overheads:
            payload["overheads"] = [overhead_to_record(o) for o in self.overheads()]
        if self._op_overheads:
            payload["op_overheads"] = [op_overhead_to_record(o) for o in self.op_overheads()]
        if self._p2p_calls:
            payload["p2p_calls"] = [p2p_call_to_record(c) for c in self.p2p_calls()]
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    def save(self, path: str | None = None) -> None:
        """Write atomically (temporary file in the same directory + ``os.replace``)."""
        target = path or self.path
        if target is None:
            raise ProfileDBError("profile DB has no path to save to")
        directory = os.path.dirname(os.path.abspath(target))
        text = self.to_json()
        # what the loader would refuse is never written (it would poison the DB for every
        # later run): ProfileDBError naming the record instead
        ProfileDB.from_json(text, source=f"{target} (not written)")
        try:
            os.makedirs(directory, exist_ok=True)
            write_atomic(target, text)
        except OSError as exc:
            raise ProfileDBError(f"{target}: cannot write profile DB: {exc.strerror or exc}") \
                from None
        if self.path is None:
            self.path = target

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> "ProfileDB":
        try:
            payload = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise ProfileDBError(f"{source}: not valid JSON (line {exc.lineno}, column "
                                 f"{exc.colno}: {exc.msg})") from None
        except _DuplicateKey as exc:
            raise ProfileDBError(f"{source}: expected unique keys in a JSON object, got "
                                 f"duplicate key {short_repr(exc.args[0])}") from None
        except RecursionError:
            raise ProfileDBError(f"{source}: not valid JSON for a profile DB (nested too "
                                 "deeply)") from None
        except ValueError as exc:   # e.g. an integer of more than 4300 digits
            raise ProfileDBError(f"{source}: not valid JSON ({short_repr(str(exc))})") from None
        if not isinstance(payload, dict):
            raise ProfileDBError(f"{source}: expected a JSON object with 'version' and 'records'")
        version = payload.get("version")
        if version != cls.VERSION:
            raise ProfileDBError(f"{source}: profile DB version {short_repr(version)} is not "
                                 f"supported (expected {cls.VERSION}); re-profile or convert "
                                 "the file")
        extra = set(payload) - {"version", "records", "overheads", "op_overheads", "p2p_calls"}
        if extra:
            raise ProfileDBError(f"{source}: unknown top-level field(s) {sorted(extra)}")
        records = payload.get("records")
        if not isinstance(records, list):
            raise ProfileDBError(f"{source}: records: expected a list, got {short_repr(records)}")
        overheads = payload.get("overheads", [])
        if not isinstance(overheads, list):
            raise ProfileDBError(f"{source}: overheads: expected a list, got "
                                 f"{short_repr(overheads)}")
        db = cls()
        first: dict[ProfileKey, tuple[int, LayerProfile]] = {}
        for i, record in enumerate(records):
            profile = profile_from_record(record, f"{source}: records[{i}]")
            seen = first.setdefault(profile.key, (i, profile))
            if seen[0] != i and seen[1].source == profile.source \
                    and _values(seen[1]) != _values(profile):
                raise ProfileDBError(
                    f"{source}: records[{seen[0]}] and records[{i}] both give "
                    f"({profile.key.describe()}, {profile.source}), with different values "
                    f"({_values_text(seen[1])} vs {_values_text(profile)}); the plan would "
                    "depend on their order: keep one")
            db.put(profile)
        for i, record in enumerate(overheads):
            db.put_overhead(overhead_from_record(record, f"{source}: overheads[{i}]"))
        for name, parse, put in (("op_overheads", op_overhead_from_record, db.put_op_overhead),
                                 ("p2p_calls", p2p_call_from_record, db.put_p2p_call)):
            items = payload.get(name, [])
            if not isinstance(items, list):
                raise ProfileDBError(f"{source}: {name}: expected a list, got "
                                     f"{short_repr(items)}")
            seen_at: dict[Any, tuple[int, Any]] = {}
            for i, record in enumerate(items):
                item = parse(record, f"{source}: {name}[{i}]")
                at, before = seen_at.setdefault(item.key, (i, item))
                if at != i and before != item:   # as for records: the order would decide
                    what = " ".join(map(str, item.key)) if isinstance(item.key, tuple) \
                        else item.key
                    raise ProfileDBError(
                        f"{source}: {name}[{at}] and {name}[{i}] both give {what}, with "
                        "different values; the plan would depend on their order: keep one")
                put(item)
        return db

    @classmethod
    def load(cls, path: str) -> "ProfileDB":
        try:
            with open_input(path, "profile DB") as handle:   # a FIFO: refused, not waited on
                data = handle.read(MAX_DB_BYTES + 1)
        except OSError as exc:
            raise ProfileDBError(f"{path}: cannot read profile DB: {exc.strerror or exc}") \
                from None
        if len(data) > MAX_DB_BYTES:
            raise ProfileDBError(f"{path}: expected a profile DB of at most "
                                 f"{MAX_DB_BYTES >> 20} MiB, got more")
        try:
            text = data.decode("utf-8")
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


def estimate_profile(cluster, model, key: ProfileKey, tflops: float | None = None
                     ) -> LayerProfile:
    """Analytic estimate: FLOPs / (peak x efficiency) plus TP all-reduce cost on the intra-node link;
    source ``calibrated`` when the device type's speed came from measured layers. ``tflops``:
    this compute rate instead of the type's peak x efficiency."""
    if key.layer_kind not in LAYER_KINDS:
        raise ProfileDBError(f"unknown layer kind {key.layer_kind!r}")
    gbps = tp_link_gbps(cluster, key.device_type, key.tp)
    dtype = cluster.device_types[key.device_type]
    if tflops is None:
        tflops = dtype.effective_tflops
    latency = cluster.links.latency_ms
    setup = key.setup
    b, s, t, h = key.micro_batch_size, key.seq_length, key.tp, model.hidden_size
    hidden_ar = allreduce_ms(setup.weight_bytes * b * s * h, t, gbps, latency)
    shape = dict(micro_batch_size=b, seq_length=s, tp=t)

    if key.layer_kind == "decoder":
        compute = _compute_ms(model.layer_forward_flops(b, s) / t, tflops)
        comm = layer_tp_comm_ms(model, b, s, t, gbps, latency, setup.weight_bytes)
        forward = compute + comm
        backward = 2 * compute + comm + _recompute_ms(model, key, tflops, compute, comm)
        if setup.recompute == "full":
            activation = memory.layer_input_bytes(model, **shape)
        else:
            activation = memory.layer_activation_bytes(model, **shape, setup=setup)
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
                        param_bytes=math.ceil(setup.weight_bytes * params),
                        source="calibrated" if dtype.calibrated else "estimated")


def _recompute_ms(model, key: ProfileKey, tflops: float, forward_compute_ms: float,
                  forward_comm_ms: float) -> float:
    """Backward's extra forward work. ``full``: megatron-core re-runs the whole layer's forward
    (``tensor_parallel.checkpoint``), its compute and its TP collectives. ``selective``: the
    core attention only (megatron-core 0.19's default ``recompute_modules`` = ``["core_attn"]``:
    QK^T, softmax and attention x V, no collective; MLA's core at its own head dims)."""
    if key.recompute == "full":
        return forward_compute_ms + forward_comm_ms
    if key.recompute == "selective":
        core = model.attention.core_forward_flops(key.micro_batch_size, key.seq_length)
        return _compute_ms(core / key.tp, tflops)
    return 0.0


SCALED_KINDS: tuple[str, ...] = ("decoder",)   # layer kinds the profiler measures
COMM_FIT = 0.5   # the modelled TP all-reduces may explain at most this share of a measured time


def _decoder_terms(cluster, model, key: ProfileKey) -> tuple[float, float, float, float]:
    """The decoder estimate's terms (``estimate_profile``): (forward compute, backward compute
    with the setup's recompute, both in ms at 1 TFLOP/s; the TP collectives of the forward,
    of the backward (with a full recompute's re-run forward), ms). At a rate r the estimate is
    forward = fwd / r + comm_f, backward = bwd / r + comm_b."""
    gbps = tp_link_gbps(cluster, key.device_type, key.tp)
    b, s, t = key.micro_batch_size, key.seq_length, key.tp
    comm = layer_tp_comm_ms(model, b, s, t, gbps, cluster.links.latency_ms,
                            key.setup.weight_bytes)
    fwd = _compute_ms(model.layer_forward_flops(b, s) / t, 1.0)
    bwd = 2 * fwd + _recompute_ms(model, key, 1.0, fwd, 0.0)
    return fwd, bwd, comm, comm + (comm if key.recompute == "full" else 0.0)


def _measured_rates(cluster, model, p: LayerProfile) -> tuple[float, float]:
    """(forward, backward) compute rate in TFLOP/s a measured record reached: its modelled
    compute over its time less the modelled TP all-reduces (the whole time where those would
    explain more than ``COMM_FIT`` of it: the link model does not describe that machine)."""
    fwd, bwd, comm_f, comm_b = _decoder_terms(cluster, model, p.key)

    def rate(work: float, ms: float, comm: float) -> float:
        net = ms - comm
        return work / (net if net >= (1 - COMM_FIT) * ms else ms)

    return rate(fwd, p.forward_ms, comm_f), rate(bwd, p.backward_ms, comm_b)


def _closest(values, want: int) -> int:
    """The value nearest ``want`` on a log scale (ties: the smaller)."""
    return min(values, key=lambda v: (abs(math.log(v / want)), v))


def scaling_basis(measured, key: ProfileKey) -> tuple[LayerProfile, ...]:
    """The measured records (same device type, kind, model and setup) an estimate of ``key`` is
    scaled from: at the key's sequence length (else the closest measured one), at its TP degree
    (else the closest measured one, ties to the smaller), the micro-batch sizes bracketing the
    key's (both when measured on either side, else the nearest)."""
    seq = _closest({p.key.seq_length for p in measured}, key.seq_length)
    at_seq = [p for p in measured if p.key.seq_length == seq]
    tp = _closest({p.key.tp for p in at_seq}, key.tp)
    group = sorted((p for p in at_seq if p.key.tp == tp), key=lambda p: p.key.micro_batch_size)
    b = key.micro_batch_size
    below = [p for p in group if p.key.micro_batch_size <= b]
    above = [p for p in group if p.key.micro_batch_size >= b]
    if below and above:
        return (below[-1],) if below[-1] is above[0] else (below[-1], above[0])
    return (below[-1],) if below else (above[0],)


def scaled_profile(cluster, model, key: ProfileKey, measured) -> LayerProfile:
    """The estimate of ``key`` at the compute rate its device type's measured records reach
    (``scaling_basis``; between two bracketing micro-batch sizes the rate is interpolated on a
    log scale): forward = the key's forward FLOPs / that rate + its TP all-reduces, backward
    likewise at the measured backward rate. The peak in the cluster file plays no part (it
    serves MFU and the types nothing measured). Memory: the analytic figures. Source
    ``calibrated``, with ``scaled_from`` and ``rate_tflops`` saying what it rests on."""
    basis = scaling_basis(measured, key)
    rates = [_measured_rates(cluster, model, p) for p in basis]
    if len(basis) == 2:
        lo, hi = (math.log(p.key.micro_batch_size) for p in basis)
        w = (math.log(key.micro_batch_size) - lo) / (hi - lo)
        (f0, b0), (f1, b1) = rates
        rf, rb = f0 ** (1 - w) * f1 ** w, b0 ** (1 - w) * b1 ** w
    else:
        ((rf, rb),) = rates
    fwd, bwd, comm_f, comm_b = _decoder_terms(cluster, model, key)
    shape = estimate_profile(cluster, model, key, tflops=1.0)   # bytes only
    return replace(shape, forward_ms=fwd / rf + comm_f, backward_ms=bwd / rb + comm_b,
                   source="calibrated", scaled_from=tuple(p.key for p in basis),
                   rate_tflops=(fwd + bwd) / (fwd / rf + bwd / rb))


def lookup_profile(db: ProfileDB | None, cluster, model, key: ProfileKey) -> LayerProfile:
    """Measured record from the DB if present; else, for a layer kind the profiler measures,
    the estimate scaled from the measured records of the same device type (``scaled_profile``)
    when the DB has any; else the estimate on the type's speed (``estimated``/``calibrated``)."""
    if db is not None:
        found = db.get(key)
        if found is not None and found.source == "measured":
            return found
        if key.layer_kind in SCALED_KINDS and hasattr(db, "measured_of"):
            measured = db.measured_of(key)
            if measured:
                return scaled_profile(cluster, model, key, measured)
    return estimate_profile(cluster, model, key)


def scaled_text(profile: LayerProfile) -> str:
    """What a scaled estimate rests on, e.g. ``from measured tp1 mbs1,2 (rate 41.3 TFLOP/s)``
    (the sequence named where it differs from the estimate's); "" for any other record."""
    if not profile.scaled_from:
        return ""
    first = profile.scaled_from[0]
    seq = f" seq{first.seq_length}" if first.seq_length != profile.key.seq_length else ""
    mbs = ",".join(str(k.micro_batch_size) for k in profile.scaled_from)
    rate = profile.rate_tflops
    return (f"from measured tp{first.tp} mbs{mbs}{seq} (rate "
            f"{f'{rate:.1f}' if rate >= 0.1 else f'{rate:.2g}'} TFLOP/s)")


def provenance_entry(profile: LayerProfile) -> tuple[str, str, str]:
    """A plan's provenance entry of one layer kind: (kind, source, record). A scaled estimate
    reads ``scaled`` with what it was scaled from after the key, so a plan resting on an
    estimate where its device type has measurements says so."""
    if profile.scaled_from:
        return (profile.key.layer_kind, "scaled",
                f"{profile.key.describe()} {scaled_text(profile)}")
    return profile.key.layer_kind, profile.source, profile.key.describe()


def lookup_overhead(db: ProfileDB | None, cluster, model, seq_length: int,
                    setup: TrainingSetup | None = None) -> IterationOverhead | None:
    """The per-iteration overhead record of (model, sequence, setup, the cluster's device
    types), or None (no live run calibrated one: the cost model then adds 0)."""
    if db is None:
        return None
    from .overhead import overhead_key

    return db.get_overhead(overhead_key(model.signature(), seq_length, cluster.type_names,
                                        (setup or TrainingSetup()).profile_fields))


def profile_key(model, device_type: str, layer_kind: LayerKind, tp: int, micro_batch_size: int,
                seq_length: int | None = None, setup: TrainingSetup | None = None) -> ProfileKey:
    """Convenience: the key for ``model`` (signature filled in; seq defaults to the model's)."""
    fields = (setup or TrainingSetup()).profile_fields
    return ProfileKey(device_type=device_type, layer_kind=layer_kind, tp=tp,
                      micro_batch_size=micro_batch_size,
                      seq_length=model.seq_length if seq_length is None else seq_length,
                      model_signature=model.signature(), **fields)


# --------------------------------------------------------------------------- diagnosis

_SIG_NAMES = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size")
_SIG_WORDS = {"swiglu": ("swiglu", True), "gelu": ("swiglu", False),
              "rmsnorm": ("normalization", "RMSNorm"), "layernorm": ("normalization", "LayerNorm"),
              "bias": ("add_bias_linear", True), "nobias": ("add_bias_linear", False),
              "untied": ("untie_embeddings", True), "tied": ("untie_embeddings", False)}


def signature_fields(signature: str) -> dict[str, object]:
    """``ModelSpec.signature()`` read back as model fields (unparsed tails kept as ``other``)."""
    out: dict[str, object] = {}
    tokens = signature.split("-")
    for name, token in zip(_SIG_NAMES, tokens):
        out[name] = int(token[1:]) if token[1:].isdigit() else token
    rest = tokens[len(_SIG_NAMES):]
    i = 0
    while i < len(rest):
        token = rest[i]
        if token in _SIG_WORDS:
            field, value = _SIG_WORDS[token]
            out[field] = value
        elif token == "pos" and i + 1 < len(rest):
            out["position_embedding_type"] = rest[i + 1]
            i += 1
        elif token == "moe":
            out["moe"] = "-".join(rest[i + 1:])
            break
        else:
            out.setdefault("other", token)
        i += 1
    out.setdefault("moe", "none")
    return out


def signature_diff(have: str, want: str) -> list[str]:
    """Model fields that differ between two signatures: ``"add_bias_linear (True vs False)"``."""
    a, b = signature_fields(have), signature_fields(want)
    return [f"{k} ({a.get(k)} vs {b.get(k)})" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def record_models(model) -> dict[str, Any]:
    """The models whose signatures key ``model``'s records, by signature: the model itself and,
    for a mixed model, each layer kind's uniform model (``ModelSpec.kind_model(i)``: what
    ``poseidon profile`` and the launch record a kind as, and what the costs look it up by)."""
    out = {model.signature(): model}
    if getattr(model, "is_mixed", False):
        for i in range(len(model.layer_kinds)):
            one = model.kind_model(i)
            out.setdefault(one.signature(), one)
    return out


def _closest_signature(have: str, signatures) -> str:
    """Of ``signatures``, the one ``have`` differs least from (the one to name the diff to)."""
    return min(signatures, key=lambda s: (len(signature_diff(have, s)), s))


def _mismatch(key: ProfileKey, signatures, seq_length: int, setup_fields: dict[str, str],
              types: tuple[str, ...]) -> str | None:
    """Why a record's key cannot serve the plan (the first difference), or None."""
    if key.model_signature not in signatures:
        signature = _closest_signature(key.model_signature, signatures)
        diff = signature_diff(key.model_signature, signature)
        return (", ".join(diff[:3]) + " differ" + ("s" if len(diff) == 1 else "")) if diff \
            else "model signature differs"
    if key.seq_length != seq_length:
        return f"seq {key.seq_length} (planning seq {seq_length})"
    for field, value in setup_fields.items():
        if getattr(key, field) != value:
            return f"{field} {getattr(key, field)} (planning {value})"
    if key.device_type not in types:
        return f"device type {key.device_type} not in the cluster"
    return None


def diagnose(db: ProfileDB, cluster, model, seq_length: int,
             setup: TrainingSetup | None = None) -> tuple[int, str | None]:
    """(measured records usable for this plan, one warning line naming why the others are not).

    A record is usable when its model signature (the model's, or for a mixed model one layer
    kind's: :func:`record_models`), sequence length, setup (dtype, attention, recompute) and
    device type match the plan's. The line counts each reason, e.g.
    ``profiles: 54 of 54 measured record(s) unusable: seq 2048 (planning seq 4096) x54``.
    """
    fields = (setup or TrainingSetup()).profile_fields
    signatures, types = tuple(record_models(model)), cluster.type_names
    measured = [p for p in db.profiles() if p.source == "measured"]
    reasons: dict[str, int] = {}
    usable = 0
    for p in measured:
        why = _mismatch(p.key, signatures, seq_length, fields, types)
        if why is None:
            usable += 1
        else:
            reasons[why] = reasons.get(why, 0) + 1
    if not reasons:
        return usable, None
    bad = len(measured) - usable
    parts = [f"{why} x{n}" if n > 1 else why
             for why, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))]
    shown = "; ".join(parts[:3]) + (f"; {len(parts) - 3} more reason(s)" if len(parts) > 3 else "")
    return usable, (f"profiles: {bad} of {len(measured)} measured record(s) unusable for "
                    f"{model.name} at seq {seq_length}: {shown}")


def measured_decoders(db: ProfileDB | None, signature: str, setup: TrainingSetup | None = None,
                      seq_length: int | None = None) -> list[LayerProfile]:
    """The DB's measured decoder records of a model (its signature) under a training setup, at
    ``seq_length`` (any when None); empty without a DB."""
    fields = (setup or TrainingSetup()).profile_fields
    return [p for p in (db.profiles() if db is not None else [])
            if p.source == "measured" and p.key.layer_kind == "decoder"
            and p.key.model_signature == signature
            and (seq_length is None or p.key.seq_length == seq_length)
            and all(getattr(p.key, f) == v for f, v in fields.items())]


def scaled_estimate_note(plan, db: ProfileDB | None, model, seq_length: int,
                         setup: TrainingSetup | None = None) -> str | None:
    """One line when the plan runs a device type at a configuration (TP degree, micro-batch
    size, sequence) its decoder was not measured at while the DB measured that type at another:
    the choice then rests on an estimate scaled from those measurements (provenance
    ``scaled``) compared with measurements. None otherwise."""
    measured: dict[str, list[ProfileKey]] = {}
    for p in (p for sig in record_models(model) for p in measured_decoders(db, sig, setup)):
        measured.setdefault(p.key.device_type, []).append(p.key)
    mbs = getattr(plan, "micro_batch_size", None)
    hits: dict[tuple[str, int], list[int]] = {}
    for st in plan.stages:
        src = {kind: source for kind, source, _ in st.provenance}.get("decoder")
        # only a scaled decoder (provenance "scaled") is "scaled from that type's measured
        # rate"; an estimate not scaled from them (e.g. another EP degree) is not
        if src == "scaled" and st.device_type in measured:
            hits.setdefault((st.device_type, st.tp), []).append(st.index)
    if not hits:
        return None
    parts, tps, sizes = [], set(), set()
    for (name, tp), idx in hits.items():
        keys = measured[name]
        at_seq = [k for k in keys if k.seq_length == seq_length]
        at_tp = [k for k in at_seq if k.tp == tp]
        where = f"stage(s) {','.join(map(str, idx))} run {name} at TP {tp}"
        if not at_seq:
            seqs = "/".join(map(str, sorted({k.seq_length for k in keys})))
            why = f", measured only at seq {seqs} (planning seq {seq_length})"
        elif not at_tp:
            why = f", measured only at TP {'/'.join(map(str, sorted({k.tp for k in at_seq})))}"
            have = sorted({k.micro_batch_size for k in at_seq})
            if mbs and mbs not in have:
                where += f" micro-batch {mbs}"
                why += f" and micro-batch {'/'.join(map(str, have))}"
                sizes |= set(have) | {mbs}
        else:
            have = sorted({k.micro_batch_size for k in at_tp})
            where += f" micro-batch {mbs}"
            why = f", measured only at micro-batch {'/'.join(map(str, have))} there"
            sizes |= set(have) | ({mbs} if mbs else set())
        tps |= {tp} | {k.tp for k in at_seq}
        parts.append(where + why)
    flags = []
    if len(tps) > 1:
        flags.append(f"--tp {' '.join(map(str, sorted(tps)))}")
    if sizes:
        flags.append(f"--micro-batch-sizes {' '.join(map(str, sorted(sizes)))}")
    text = ("; ".join(parts) + ": its decoder is scaled from that type's measured rate "
            "(`costs from:` names the records): ")
    if not flags:
        return text + f"profile at seq {seq_length} to compare measured with measured"
    limit = " / ".join(f.split()[0] for f in flags)
    return text + (f"profile `{' '.join(flags)}` to compare measured with measured, or plan "
                   f"with {limit} limited to the measured ones")


unprofiled_tp_note = scaled_estimate_note   # the former name (TP only)


# --------------------------------------------------------------------------- calibration

def calibrate_cluster(cluster, db: ProfileDB | None, model, seq_length: int,
                      setup: TrainingSetup | None = None):
    """``cluster`` with each device type that has measured decoder records given the rate they
    reach (the median over its records), so the layers no record measured (embedding, output)
    are estimated on the same scale as the measured ones (the decoder at a configuration no
    record measured is scaled from the closest records: ``scaled_profile``). A type with
    ``peak_tflops`` keeps it (MFU is measured against it) with ``efficiency`` = rate / peak:
    where a type has measurements they set its speed, not the file. A type without one: a
    device known by name (:func:`~poseidon_plugin.cluster.nominal_peak_tflops`) keeps its peak
    with ``efficiency`` = rate / peak; another gets ``peak_tflops`` = the rate, ``efficiency``
    1 and ``measured_peak`` (no MFU). SpecError naming the field when a type has neither a peak
    nor a measured record. Records at ``seq_length`` are used; a type measured only at other
    sequence lengths is rated from those."""
    models = record_models(model)   # a mixed model's kinds are recorded by their own models
    every = [p for sig in models for p in measured_decoders(db, sig, setup)]
    types = dict(cluster.device_types)
    for name in cluster.type_names:
        dt = types[name]
        mine = [p for p in every if p.key.device_type == name]
        near = [p for p in mine if p.key.seq_length == seq_length] or mine
        rates = [models[p.key.model_signature].layer_forward_flops(
                     p.key.micro_batch_size, p.key.seq_length) / p.key.tp
                 / (p.forward_ms * 1e-3) / 1e12 for p in near if p.forward_ms > 0]
        if not rates:
            if dt.peak_tflops is None:
                raise SpecError(cluster.source, f"device_types.{name}.peak_tflops",
                                "a peak (no usable measured decoder record of this type to "
                                "calibrate from)", "missing")
            continue
        rate = statistics.median(rates)
        peak = dt.peak_tflops if dt.peak_tflops is not None else nominal_peak_tflops(name)
        if peak is not None and (dt.peak_tflops is not None or rate <= peak):
            # the file's (or a known device's) peak for MFU; the measured rate for the estimates
            types[name] = replace(dt, peak_tflops=peak,
                                  efficiency=float(f"{max(1e-9, rate / peak):.9g}"),
                                  calibrated=True)
        else:                                          # the rate stands in for the peak
            types[name] = replace(dt, peak_tflops=round(rate, 6), efficiency=1.0,
                                  calibrated=True, measured_peak=True)
    return replace(cluster, device_types=MappingProxyType(types))


__all__ = [
    "LayerKind", "Source", "ProfileKey", "LayerProfile", "ProfileDB", "estimate_profile",
    "lookup_profile", "lookup_overhead", "profile_key", "tp_link_gbps", "diagnose", "signature_diff",
    "calibrate_cluster", "measured_decoders", "record_models", "unprofiled_tp_note", "scaled_estimate_note",
    "scaled_profile", "scaling_basis", "provenance_entry", "scaled_text",
]
