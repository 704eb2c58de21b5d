"""Rank 0's side of profiling: which records a launch needs, the profile cache, the gathered
per-rank timings as ``ProfileDB`` records, and the cluster's compute speed calibrated to them.

The per-rank measurement itself is :mod:`.profiler`; this module only turns what it produced into
``poseidon_plugin.profiles`` records (``ProfileKey`` / ``LayerProfile``) and reads them back.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import replace
from types import MappingProxyType
from typing import Collection, Sequence

from ..cluster import Cluster, DeviceType
from ..errors import ProfileDBError
from ..model import ModelSpec
from ..profiles import LayerProfile, ProfileDB, ProfileKey
from ..training import TrainingSetup
from .options import default_profile_dir
from .profiler import Aggregate

log = logging.getLogger("poseidon")


# ----------------------------------------------------------------------------------------------
# the profile cache
# ----------------------------------------------------------------------------------------------


def versions_tag(extra: Sequence[str] = ()) -> str:
    """What, besides the layer's shape, makes a profile stale: library versions, impl, dtype."""
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - a source checkout of Megatron-LM
        mcore = "src"
    from .. import __version__

    parts = [f"torch{torch.__version__}", f"mcore{mcore}", f"poseidon{__version__}", *extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path(profile_dir: str | None, tag: str) -> str:
    return os.path.join(profile_dir or default_profile_dir(), f"profiles-{tag}.json")


def load_cache(path: str, reprofile: bool) -> ProfileDB:
    """The profile cache; a corrupt file is moved aside with a warning (profiles are re-measured)."""
    if reprofile or not os.path.exists(path):
        return ProfileDB(None)
    try:
        return ProfileDB.load(path)
    except ProfileDBError as e:
        aside = f"{path}.corrupt-{int(time.time())}"
        try:
            os.replace(path, aside)
        except OSError:
            aside = "(could not move it)"
        log.warning("profile cache is unreadable, re-profiling: %s; old file kept as %s", e, aside)
        return ProfileDB(None)


def needed_keys(cluster: Cluster, model: ModelSpec, tps: Sequence[int],
                micro_batch_sizes: Sequence[int], seq_length: int,
                setup: TrainingSetup | None = None) -> list[ProfileKey]:
    """One decoder-layer record per (device type, TP degree, micro-batch size) of the launch."""
    sig = model.signature()
    fields = (setup or TrainingSetup()).profile_fields
    return [ProfileKey(t, "decoder", tp, mbs, seq_length, sig, **fields)
            for t in cluster.type_names for tp in tps for mbs in micro_batch_sizes]


def all_measured(db: ProfileDB, keys: Sequence[ProfileKey]) -> bool:
    """Whether ``db`` holds a measured record for every key (then nothing is profiled)."""
    return all((p := db.get(k)) is not None and p.source == "measured" for k in keys)


# ----------------------------------------------------------------------------------------------
# gathered timings -> records
# ----------------------------------------------------------------------------------------------


TIME_RESOLUTION = 0.02
"""Measured times are rounded to a geometric grid of this relative step (the profiler's CI target):
differences below it are measurement noise, and two launches whose medians land in the same
grid cell plan from identical numbers (the same plan)."""


def quantize_ms(value: float, resolution: float = TIME_RESOLUTION) -> float:
    """``value`` rounded to the nearest point of the grid ``(1 + resolution) ** k`` (0 stays 0)."""
    if value <= 0.0:
        return 0.0
    step = math.log1p(resolution)
    return float(f"{math.exp(round(math.log(value) / step) * step):.6g}")


def measured_records(aggs: Sequence[Aggregate], seq_length: int, model_signature: str,
                     setup: TrainingSetup | None = None,
                     env: Sequence[tuple[str, str]] = ()) -> list[LayerProfile]:
    """The per-type medians of :func:`.profiler.aggregate` as measured decoder-layer records
    (keyed by the training setup they ran under; ``env`` says what measured them; times on
    the :data:`TIME_RESOLUTION` grid)."""
    fields = (setup or TrainingSetup()).profile_fields
    return [LayerProfile(ProfileKey(a.device_type, "decoder", a.tp, a.micro_batch_size, seq_length,
                                    model_signature, **fields),
                         quantize_ms(a.forward_ms), quantize_ms(a.backward_ms),
                         a.activation_bytes, a.param_bytes, source="measured",
                         env=tuple(sorted(env)), optimizer_ms=quantize_ms(a.optimizer_ms))
            for a in aggs]


def measurement_env(device_name: str, kind: str) -> list[tuple[str, str]]:
    """What measured a record: the device's name, torch, megatron-core and (``kind`` "cuda")
    the CUDA version and driver."""
    import torch

    out = [("device", device_name), ("torch", torch.__version__)]
    try:
        from importlib.metadata import version

        out.append(("megatron_core", version("megatron-core")))
    except Exception:  # noqa: BLE001 - a source checkout
        out.append(("megatron_core", "src"))
    if kind == "cuda" and getattr(torch.version, "cuda", None):
        out.append(("cuda", str(torch.version.cuda)))
        try:
            import subprocess

            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,"
                                  "noheader"], capture_output=True, text=True, timeout=10)
            if drv.returncode == 0 and drv.stdout.strip():
                out.append(("driver", drv.stdout.strip().splitlines()[0]))
        except (OSError, subprocess.SubprocessError):
            pass
    return out


# ----------------------------------------------------------------------------------------------
# calibration of the cluster's compute speed
# ----------------------------------------------------------------------------------------------


def calibrate(cluster: Cluster, db: ProfileDB, model: ModelSpec, tps: Sequence[int],
              micro_batch_sizes: Sequence[int], seq_length: int, *,
              fixed: Collection[str] = (), estimated_peak: Collection[str] = (),
              setup: TrainingSetup | None = None) -> Cluster:
    """``cluster`` with each type's compute speed set from its measured decoder layer, so that
    what the search still estimates (embedding, output layer, unprofiled TP degrees) is on the
    same scale.

    Real devices keep their peak and get ``efficiency`` = measured / peak; types in
    ``estimated_peak`` (CPU, emulated) get ``peak_tflops`` = measured and ``efficiency`` 1.
    Types in ``fixed`` (the cluster file sets their speed) are left as they are.
    """
    sig = model.signature()
    fields = (setup or TrainingSetup()).profile_fields
    types: dict[str, DeviceType] = dict(cluster.device_types)
    for name, dt in cluster.device_types.items():
        if name in fixed:
            continue
        rates = []
        for tp in tps:
            for mbs in micro_batch_sizes:
                p = db.get(ProfileKey(name, "decoder", tp, mbs, seq_length, sig, **fields))
                if p is not None and p.source == "measured" and p.forward_ms > 0:
                    # forward + backward (3x the forward's FLOPs): the rate the whole layer
                    # reaches, the one MFU is measured against (a forward-only rate makes a
                    # backward faster than 2x forward read as MFU > 100%)
                    flops = 3.0 * model.layer_forward_flops(mbs, seq_length) / tp
                    rates.append(flops / ((p.forward_ms + p.backward_ms) * 1e-3) / 1e12)
        if not rates:
            continue
        measured = max(rates)  # TFLOP/s actually reached (communication included for tp > 1)
        if name in estimated_peak or dt.peak_tflops is None or measured > dt.peak_tflops:
            types[name] = replace(dt, peak_tflops=round(measured, 6), efficiency=1.0,
                                  calibrated=True)
        else:
            types[name] = replace(dt, efficiency=round(max(1e-6, measured / dt.peak_tflops), 6),
                                  calibrated=True)
    return replace(cluster, device_types=MappingProxyType(types))
