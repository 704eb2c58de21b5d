"""Parsing numbers with units (the communication cost formulas are in ``comm.py``).

A spec field carries its unit in its name (``memory_gib``, ``intra_node_gbps``, ``latency_ms``,
``peak_tflops``). Its value may be a bare number, read in that unit, or a string with an explicit
unit, converted to it::

    memory_gib: 64            -> 64 GiB
    memory_gib: "64 GiB"      -> 64 GiB
    memory_gib: "80 GB"       -> 74.5 GiB  (GB is SI: 10**9 bytes; GiB is 2**30 bytes)
    inter_node_gbps: "25 GB/s"  -> 200 Gbit/s
    latency_ms: "10 us"       -> 0.01 ms
    peak_tflops: "1.2 PFLOPs" -> 1200 TFLOP/s

A string whose unit is unknown, or belongs to another quantity ("64 Gbps" for a memory), raises
``SpecError`` naming the file and the field.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from .errors import SpecError

Quantity = Literal["memory", "bandwidth", "time", "compute"]

BYTES_PER_GIB = 1 << 30

# factor that converts one <unit> into the field's canonical unit (GiB, Gbit/s, ms, TFLOP/s)
_UNITS: dict[Quantity, dict[str, float]] = {
    "memory": {
        "b": 1 / BYTES_PER_GIB, "byte": 1 / BYTES_PER_GIB, "bytes": 1 / BYTES_PER_GIB,
        "kib": 2**10 / BYTES_PER_GIB, "mib": 2**20 / BYTES_PER_GIB, "gib": 1.0, "tib": 2**10,
        "kb": 1e3 / BYTES_PER_GIB, "mb": 1e6 / BYTES_PER_GIB, "gb": 1e9 / BYTES_PER_GIB,
        "tb": 1e12 / BYTES_PER_GIB,
    },
    "bandwidth": {
        "bps": 1e-9, "kbps": 1e-6, "mbps": 1e-3, "gbps": 1.0, "tbps": 1e3,
        "bit/s": 1e-9, "kbit/s": 1e-6, "mbit/s": 1e-3, "gbit/s": 1.0, "tbit/s": 1e3,
        "kb/s": 8e-6, "mb/s": 8e-3, "gb/s": 8.0, "tb/s": 8e3,
        "mib/s": 8 * 2**20 / 1e9, "gib/s": 8 * 2**30 / 1e9,
    },
    "time": {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3},
    "compute": {
        "gflops": 1e-3, "tflops": 1.0, "pflops": 1e3,
        "gflop/s": 1e-3, "tflop/s": 1.0, "pflop/s": 1e3,
    },
}
# Bits (lower-case b) and bytes (upper-case B) differ only in case for "Gb/s" vs "GB/s";
# these are matched case-sensitively before the case-insensitive table above.
_CASE_SENSITIVE_BANDWIDTH = {"Kb/s": 1e-6, "Mb/s": 1e-3, "Gb/s": 1.0, "Tb/s": 1e3}

_NUMBER_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s\d].*?)?\s*$")


def parse_quantity(value: object, kind: Quantity, *, source: str, field: str,
                   expected: str | None = None) -> float:
    """Read ``value`` (a bare number in the field's unit, or "<number> <unit>") as a float.

    Raises ``SpecError(source, field, ...)`` for a boolean, a non-numeric value, an unknown unit,
    or a non-finite number. The sign is not checked here (see ``positive_quantity``).
    """
    what = expected or f"a number or a string '<number> <{kind} unit>'"
    if isinstance(value, bool):
        raise SpecError(source, field, what, value)
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None or (match.group(2) or "").startswith(":"):   # "1:30": no base 60
            raise SpecError(source, field, what, value)
        number = float(match.group(1))
        unit = match.group(2)
        if unit:
            factor = _CASE_SENSITIVE_BANDWIDTH.get(unit) if kind == "bandwidth" else None
            if factor is None:
                factor = _UNITS[kind].get(unit.lower())
            if factor is None:
                known = ", ".join(sorted({u for u in _UNITS[kind]}))
                raise SpecError(source, field, f"a {kind} unit (one of: {known})", value)
            number *= factor
    else:
        raise SpecError(source, field, what, value)
    if not math.isfinite(number):
        raise SpecError(source, field, "a finite number", value)
    return number


def positive_quantity(value: object, kind: Quantity, *, source: str, field: str) -> float:
    """``parse_quantity`` that also requires the result to be > 0."""
    number = parse_quantity(value, kind, source=source, field=field)
    if number <= 0:
        raise SpecError(source, field, "a number > 0", value)
    return number

