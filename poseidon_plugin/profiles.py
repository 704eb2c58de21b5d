"""Profile records, the on-disk profile DB, and the analytic estimator.

INTERFACE STUB — the contract other modules code against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerKind = Literal["decoder", "embedding", "output"]
Source = Literal["measured", "estimated"]


@dataclass(frozen=True)
class ProfileKey:
    device_type: str
    layer_kind: LayerKind
    tp: int
    micro_batch_size: int
    seq_length: int
    model_signature: str   # ModelSpec.signature-like string: what shapes the layer's cost


@dataclass(frozen=True)
class LayerProfile:
    key: ProfileKey
    forward_ms: float
    backward_ms: float
    activation_bytes: int   # kept for backward, per micro-batch, per device (TP-sharded)
    param_bytes: int        # bf16 parameters of this layer on one device (TP-sharded)
    source: Source = "estimated"


class ProfileDB:
    """Versioned JSON profile store: load/save (atomic), get/put; ProfileDBError on a bad file."""

    VERSION = 1

    def __init__(self, path: str | None = None) -> None: ...
    def get(self, key: ProfileKey) -> LayerProfile | None: ...
    def put(self, profile: LayerProfile) -> None: ...
    def save(self, path: str | None = None) -> None: ...
    @classmethod
    def load(cls, path: str) -> "ProfileDB": ...


def estimate_profile(cluster, model, key: ProfileKey) -> LayerProfile:
    """Analytic estimate: FLOPs / (peak x efficiency) plus TP all-reduce cost on the intra-node link."""
    ...


def lookup_profile(db: ProfileDB | None, cluster, model, key: ProfileKey) -> LayerProfile:
    """Measured record from the DB if present, else the estimate (marked 'estimated')."""
    ...
