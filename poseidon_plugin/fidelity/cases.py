"""The fidelity cases and the emulation's per-layer costs (pure Python, no torch).

A case is one pipeline run: PP degree, per-stage layer split, emulated device type per stage,
schedule, micro-batch count (and V, DP). ``DEFAULT_CASES`` is what ``poseidon validate`` runs;
``--full`` adds ``FULL_EXTRA``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import PoseidonError

DEVICE_SPEEDS: dict[str, float] = {"emu-fast": 1.0, "emu-mid": 0.6, "emu-slow": 0.4}


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str                  # "1f1b" or "interleaved-1f1b"
    layers: tuple[int, ...]        # per stage (device); split over the V chunks for interleaved
    devices: tuple[str, ...]       # emulated device type per stage (keys of DEVICE_SPEEDS)
    num_microbatches: int
    virtual_stages: int = 1
    dp: int = 1

    @property
    def pp(self) -> int:
        return len(self.layers)

    def chunk_layers(self, stage: int) -> list[int]:
        n, v = self.layers[stage], self.virtual_stages
        return [n // v + (1 if c < n % v else 0) for c in range(v)]

    def speed(self, stage: int) -> float:
        return DEVICE_SPEEDS[self.devices[stage]]

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        """Inverse of ``dataclasses.asdict`` (lists back to tuples), for the spawned workers."""
        return cls(**{**d, "layers": tuple(d["layers"]), "devices": tuple(d["devices"])})

    def describe(self) -> str:
        """One line of ``poseidon validate --list``."""
        return (f"{self.name:<18} {self.schedule:<17} V={self.virtual_stages} "
                f"M={self.num_microbatches:<3} dp={self.dp} layers={list(self.layers)} "
                f"devices={list(self.devices)}")


def _c(name, schedule, layers, devices, m, v=1, dp=1) -> Case:
    return Case(name, schedule, tuple(layers), tuple(devices), m, v, dp)


F_, M_, S_ = "emu-fast", "emu-mid", "emu-slow"

DEFAULT_CASES: tuple[Case, ...] = (
    _c("pp2-1f1b-m4", "1f1b", (3, 2), (F_, S_), 4),
    _c("pp2-1f1b-m8", "1f1b", (3, 2), (F_, S_), 8),
    _c("pp2-int2-m4", "interleaved-1f1b", (4, 2), (F_, S_), 4, 2),
    _c("pp4-1f1b-m4", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 4),
    _c("pp4-1f1b-m8", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 8),
    _c("pp4-1f1b-m8b", "1f1b", (2, 4, 4, 2), (S_, F_, F_, M_), 8),
    _c("pp4-int2-m8", "interleaved-1f1b", (4, 4, 2, 4), (F_, M_, S_, M_), 8, 2),
)

FULL_EXTRA: tuple[Case, ...] = (
    _c("pp2-1f1b-m16", "1f1b", (3, 2), (F_, S_), 16),
    _c("pp2-1f1b-m2", "1f1b", (2, 4), (S_, F_), 2),
    _c("pp2-int2-m8", "interleaved-1f1b", (4, 2), (F_, S_), 8, 2),
    _c("pp2-int3-m6", "interleaved-1f1b", (3, 6), (S_, F_), 6, 3),
    _c("pp4-1f1b-m2", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 2),
    _c("pp4-1f1b-m16", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 16),
    _c("pp4-1f1b-m12c", "1f1b", (1, 3, 5, 3), (S_, M_, F_, M_), 12),
    _c("pp4-int2-m4", "interleaved-1f1b", (4, 4, 2, 4), (F_, M_, S_, M_), 4, 2),
    _c("pp4-int2-m16", "interleaved-1f1b", (2, 4, 4, 2), (S_, F_, F_, M_), 16, 2),
    _c("pp2-dp2-1f1b-m8", "1f1b", (3, 2), (F_, S_), 8, 1, 2),
)


def select_cases(names: Sequence[str] | None = None, full: bool = False) -> list[Case]:
    """The cases named (from either set, in the order given), else the default or full set."""
    pool = list(DEFAULT_CASES) + list(FULL_EXTRA)
    if names:
        by_name = {c.name: c for c in pool}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise PoseidonError(f"--cases: unknown case(s) {missing}; known: {sorted(by_name)}")
        return [by_name[n] for n in names]
    return pool if full else list(DEFAULT_CASES)


@dataclass(frozen=True)
class Emulation:
    """Per-layer emulated costs at speed 1.0 (ms); a stage of L layers on a device of speed v
    takes L * x / v."""

    forward_ms_per_layer: float = 4.0
    backward_ms_per_layer: float = 8.0
    optimizer_ms_per_layer: float = 1.0
    allreduce_ms_per_layer: float = 2.0     # emulated DP all-reduce, only when dp > 1
    hidden: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
