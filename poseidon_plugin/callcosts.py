"""Megatron's per-op and per-p2p-call costs: measured at profiling time, kept in the profile DB,
charged by the search's simulator (``poseidon_plugin._core.EngineDAG``: ``engine.py``'s semantics).

The simulator's compute ops are the layers' profiled forward / backward; megatron-core runs each
inside its ``forward_step`` / ``backward_step`` (the op overhead), and between ops its blocking
p2p calls (``P2PCommunicator``): a call that sends returns ``send_call_ms`` after it is posted,
a call that receives returns ``recv_ready_ms`` after its data has arrived. Both are properties of
the host and the communication stack, not of the layers, so they are measured once per device
type (and, for the calls, per link kind and message size) and stored beside the layer records:
both by ``poseidon profile`` (the calls under torchrun) and by the ``--poseidon-auto`` launch
(``megatron/profile/callcost_profile.py``, ``megatron/profile/op_overhead.py``: each type's op overheads, one
rank pair per link kind for the calls), and by ``poseidon validate --profile-db`` on the CPU
emulation.

Records (the profile DB's optional ``op_overheads`` and ``p2p_calls`` lists)::

    {"device_type": "H100", "forward_ms": 0.21, "backward_ms": 0.34, "source": "measured"}
    {"device_type": "H100", "link": "intra-node", "message_bytes": 16777216,
     "send_call_ms": 0.05, "recv_ready_ms": 0.04, "latency_ms": 0.12, "source": "measured"}

``link``: ``intra-node`` (two stages of one node), ``inter-node`` (same type, two nodes) or
``cross-type``. Merge rule: between two records of one key, the later wins.

How the cost model uses them (``engine_calls``): one value of each for every device of a plan
(the search's DAG is shared by every stage assignment): the op overheads the largest of the
cluster's device types' records, the call costs the largest over the types' records of any
link kind, each interpolated linearly in the message size (the plan's activation bytes) between
the measured sizes (the nearest outside them). No record: 0 (the timing of DBs written before).
``EngineCalls.source`` names the records each cost came from (``measured: op_overheads H100
(forward), H20 (backward); p2p_calls H20 cross-type at 4194304 B (send call), ...``); the plan
JSON's ``timing_model`` carries it beside the four numbers, which alone re-derive its time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import ProfileDBError, check_record_fields, record_field_error
from .safeio import name_problem

LINK_KINDS: tuple[str, ...] = ("intra-node", "inter-node", "cross-type")
MAX_CALL_MS = 3.6e6
MAX_MESSAGE_BYTES = 1 << 46


@dataclass(frozen=True)
class OpOverhead:
    device_type: str
    forward_ms: float
    backward_ms: float
    source: str = "measured"

    @property
    def key(self) -> str:
        return self.device_type


@dataclass(frozen=True)
class P2PCall:
    device_type: str
    link: str
    message_bytes: int
    send_call_ms: float
    recv_ready_ms: float
    latency_ms: float = 0.0
    source: str = "measured"

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.device_type, self.link, self.message_bytes)


def _ms(record: dict, name: str, where: str) -> float:
    v = record.get(name, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0.0 <= v <= MAX_CALL_MS:
        raise record_field_error(where, name, f"a time in [0, {MAX_CALL_MS:g}] ms", v)
    return float(v)


def _name(record: dict, name: str, where: str) -> str:
    v = record.get(name)
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise record_field_error(where, name, "a non-empty string", v)
    why = name_problem(v, type_name=True) if name == "device_type" else None   # the YAML rule
    if why is not None:
        raise record_field_error(where, name, why, v)
    return v


def op_overhead_from_record(record: object, where: str) -> OpOverhead:
    if not isinstance(record, dict):
        raise ProfileDBError(f"{where}: expected an object, got {type(record).__name__}")
    check_record_fields(record, where, {"device_type", "forward_ms", "backward_ms", "source"},
                        {"device_type", "forward_ms", "backward_ms"})
    return OpOverhead(_name(record, "device_type", where), _ms(record, "forward_ms", where),
                      _ms(record, "backward_ms", where),
                      _name(record, "source", where) if "source" in record else "measured")


def p2p_call_from_record(record: object, where: str) -> P2PCall:
    if not isinstance(record, dict):
        raise ProfileDBError(f"{where}: expected an object, got {type(record).__name__}")
    required = {"device_type", "link", "message_bytes", "send_call_ms", "recv_ready_ms"}
    check_record_fields(record, where, required | {"latency_ms", "source"}, required)
    link = record.get("link")
    if link not in LINK_KINDS:
        raise record_field_error(where, "link", f"one of {list(LINK_KINDS)}", link)
    nb = record.get("message_bytes")
    if isinstance(nb, bool) or not isinstance(nb, int) or not 0 < nb <= MAX_MESSAGE_BYTES:
        raise record_field_error(where, "message_bytes",
                                 f"an integer in [1, {MAX_MESSAGE_BYTES}]", nb)
    return P2PCall(_name(record, "device_type", where), link, nb,
                   _ms(record, "send_call_ms", where), _ms(record, "recv_ready_ms", where),
                   _ms(record, "latency_ms", where),
                   _name(record, "source", where) if "source" in record else "measured")


def op_overhead_to_record(o: OpOverhead) -> dict[str, Any]:
    return {"device_type": o.device_type, "forward_ms": o.forward_ms,
            "backward_ms": o.backward_ms, "source": o.source}


def p2p_call_to_record(c: P2PCall) -> dict[str, Any]:
    return {"device_type": c.device_type, "link": c.link, "message_bytes": c.message_bytes,
            "send_call_ms": c.send_call_ms, "recv_ready_ms": c.recv_ready_ms,
            "latency_ms": c.latency_ms, "source": c.source}


def _interp(points: list[tuple[int, float]], x: float) -> float:
    """Linear in the message size between measured sizes, the nearest one outside them."""
    return _interp_from(points, x)[0]


def _interp_from(points: list[tuple[int, float]], x: float) -> tuple[float, tuple[int, ...]]:
    """(``_interp``'s value, the measured sizes it came from: one, or the two around ``x``)."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1], (points[0][0],)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x == x1:
            return y1, (x1,)
        if x < x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0), (x0, x1)
    return points[-1][1], (points[-1][0],)


@dataclass(frozen=True)
class EngineCalls:
    """The four costs the search's ``EngineDAG`` charges (ms), and where they came from."""

    op_forward_ms: float = 0.0
    op_backward_ms: float = 0.0
    send_call_ms: float = 0.0
    recv_ready_ms: float = 0.0
    source: str = "none"

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.op_forward_ms, self.op_backward_ms, self.send_call_ms, self.recv_ready_ms)

    def __bool__(self) -> bool:
        return any(self.as_tuple())

    def to_dict(self) -> dict[str, Any]:
        return {"op_forward_ms": self.op_forward_ms, "op_backward_ms": self.op_backward_ms,
                "send_call_ms": self.send_call_ms, "recv_ready_ms": self.recv_ready_ms,
                "source": self.source}


def engine_calls(db, type_names: Iterable[str], message_bytes: float) -> EngineCalls:
    """The costs of a plan on a cluster of ``type_names`` sending ``message_bytes`` per
    activation (module docstring); all 0 (source ``none``) without records."""
    if db is None or not hasattr(db, "op_overheads"):
        return EngineCalls()
    names = set(type_names)
    ops = [o for o in db.op_overheads() if o.device_type in names]
    calls = [c for c in db.p2p_calls() if c.device_type in names]
    if not ops and not calls:
        return EngineCalls()
    named: list[str] = []
    fo = bo = 0.0
    if ops:
        of = max(ops, key=lambda o: (o.forward_ms, o.device_type))
        ob = max(ops, key=lambda o: (o.backward_ms, o.device_type))
        fo, bo = of.forward_ms, ob.backward_ms
        named.append(f"op_overheads {of.device_type} (forward), {ob.device_type} (backward)")
    groups: dict[tuple[str, str], list[P2PCall]] = {}
    for c in calls:
        groups.setdefault((c.device_type, c.link), []).append(c)
    sc = rr = 0.0
    if groups:
        def pick(field: str) -> tuple[float, str]:
            best = max(((_interp_from([(c.message_bytes, getattr(c, field)) for c in g],
                                      message_bytes), key) for key, g in groups.items()),
                       key=lambda t: (t[0][0], t[1]))
            (value, sizes), (dev, link) = best
            return value, f"{dev} {link} at {'-'.join(map(str, sizes))} B"

        sc, at_sc = pick("send_call_ms")
        rr, at_rr = pick("recv_ready_ms")
        named.append(f"p2p_calls {at_sc} (send call), {at_rr} (receive ready)")
    return EngineCalls(fo, bo, sc, rr, "measured: " + "; ".join(named))
