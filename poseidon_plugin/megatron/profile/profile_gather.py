"""Rank 0's side of profiling: which records a launch needs, the profile cache, the gathered
per-rank timings as ``ProfileDB`` records, and the cluster's compute speed calibrated to them.

The per-rank measurement itself is :mod:`.profiler`; this module only turns what it produced into
``poseidon_plugin.profiles`` records (``ProfileKey`` / ``LayerProfile``) and reads them back.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Collection, Mapping, Sequence

from poseidon_plugin.cluster import Cluster, DeviceType
from poseidon_plugin.errors import ProfileDBError
from poseidon_plugin.model import ModelSpec
from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey
from poseidon_plugin.safeio import NotRegularFile, open_input, write_atomic
from poseidon_plugin.training import TrainingSetup
from poseidon_plugin.megatron import provenance
from poseidon_plugin.megatron.launch.options import default_profile_dir
from poseidon_plugin.megatron.profile.profiler import Aggregate
from poseidon_plugin.megatron.provenance import Component

log = logging.getLogger("poseidon")


# ----------------------------------------------------------------------------------------------
# the profile cache
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheKey:
    """What, besides the layer's shape, makes a profile stale: the frameworks as imported here
    (:mod:`.provenance`: torch, megatron-core, MindSpeed and MindSpeed-LLM on that backend),
    Poseidon's version, and ``extra`` (impl, dtype, emulated speeds)."""

    extra: tuple[str, ...]
    components: tuple[Component, ...]

    @property
    def tag(self) -> str:
        """The cache file's name: every part, hashed."""
        parts = [f"{c.name}={c.describe()}" for c in self.components] + list(self.extra)
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    @property
    def base(self) -> str:
        """The same launch under any versions: where :func:`note_provenance` remembers them."""
        return hashlib.sha256("|".join(self.extra).encode()).hexdigest()[:16]


def cache_key(extra: Sequence[str] = (), backend: str = "megatron") -> CacheKey:
    from poseidon_plugin import __version__

    return CacheKey(tuple(extra), (*provenance.components(backend),
                                   Component("poseidon", str(__version__))))


def versions_tag(extra: Sequence[str] = (), backend: str = "megatron") -> str:
    """The cache key's tag (:class:`CacheKey`)."""
    return cache_key(extra, backend).tag


PROVENANCE_FILE = "cache-versions.json"
MAX_PROVENANCE_BYTES = 16 << 20   # the index of the versions each cache was measured with
"""Beside the cache files: per launch (``CacheKey.base``) the versions its last cache was
measured with, so a change of any of them is said in one line."""


def provenance_changes(profile_dir: str | None, key: CacheKey) -> list[str]:
    """What changed since the last launch like this one (``megatron-core changed 0.19.2 ->
    0.12.1 (/path)``); empty for the first one or when nothing did."""
    import json

    try:
        with open_input(os.path.join(profile_dir or default_profile_dir(), PROVENANCE_FILE)) \
                as f:   # a FIFO there: skipped, not waited on
            before = json.loads(f.read(MAX_PROVENANCE_BYTES)).get(key.base)
    except (OSError, ValueError, AttributeError, NotRegularFile):
        return []
    if not isinstance(before, dict):
        return []
    out = []
    for c in key.components:
        old = before.get(c.name)
        if not isinstance(old, dict) or not isinstance(old.get("version"), str):
            continue
        old_c = Component(c.name, old["version"], str(old.get("path") or ""))
        if old_c.describe() != c.describe():
            out.append(f"{c.name} changed {old_c.for_humans()} -> {c.for_humans()}")
    return out


def remember_provenance(profile_dir: str | None, key: CacheKey) -> None:
    """Record ``key``'s versions as this launch's last (best effort: a failure is logged)."""
    import json

    directory = profile_dir or default_profile_dir()
    path = os.path.join(directory, PROVENANCE_FILE)
    try:
        with open_input(path) as f:
            index = json.loads(f.read(MAX_PROVENANCE_BYTES))
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError, NotRegularFile):
        index = {}
    index[key.base] = {c.name: {"version": c.version, **({"path": c.path} if c.path else {})}
                       for c in key.components}
    try:
        os.makedirs(directory, exist_ok=True)
        write_atomic(path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    except (OSError, NotRegularFile) as e:
        log.debug("could not record the profile cache's versions in %s: %s", path, e)


def note_provenance(profile_dir: str | None, key: CacheKey, cached: bool) -> None:
    """One line when a version changed since the last launch like this one (which, from what to
    what), then remember this one's."""
    changes = provenance_changes(profile_dir, key)
    if changes:
        log.info("profile cache: %s, %s", "; ".join(changes),
                 "using the cache measured with these before" if cached else "re-profiling")
    remember_provenance(profile_dir, key)


def names_a_cache_file(profile_dir: str | None, path: str) -> bool:
    """Whether ``path`` is a file of the profile cache directory, or would be one: an existing
    file there, or a name the cache uses (``profiles-*.json``, ``plan-*.json``, the
    provenance index, a ``.corrupt-<time>`` copy)."""
    from poseidon_plugin.safeio import same_file

    directory = profile_dir or default_profile_dir()
    if not same_file(os.path.dirname(os.path.abspath(path)), directory):
        return False
    name = os.path.basename(path)
    return (os.path.lexists(path) or name == PROVENANCE_FILE or ".corrupt-" in name
            or (name.endswith(".json") and name.startswith(("profiles-", "plan-"))))


def cache_path(profile_dir: str | None, tag: str) -> str:
    return os.path.join(profile_dir or default_profile_dir(), f"profiles-{tag}.json")


def load_cache(path: str, reprofile: bool) -> ProfileDB:
    """The profile cache; a corrupt file is moved aside with a warning (profiles are re-measured)."""
    if reprofile or not os.path.exists(path):
        return ProfileDB(None)
    try:
        return ProfileDB.load(path)
    except (ProfileDBError, NotRegularFile) as e:   # a directory or a FIFO there: moved too
        aside = f"{path}.corrupt-{int(time.time())}"
        try:
            os.replace(path, aside)
        except OSError:
            aside = "(could not move it)"
        log.warning("profile cache is unreadable, re-profiling: %s; old file kept as %s", e, aside)
        return ProfileDB(None)


def kind_signatures(model: ModelSpec) -> dict[str, str]:
    """The profile-record signature of each layer kind the profiler measures, by the kind's
    name as ``profiler.ProfiledKind.of_model`` names it: a uniform model's one kind is "" and
    keyed by the model's own signature; a mixed model's kinds by their uniform models'
    (``ModelSpec.kind_model(i).signature()``: the key costs look a kind's records up by)."""
    if not model.is_mixed:
        return {"": model.signature()}
    return {k.name: model.kind_model(i).signature() for i, k in enumerate(model.layer_kinds)}


def keys_carry_ep() -> bool:
    """Whether ``ProfileKey`` has an EP degree (``ProfileKey.ep``): records of a MoE layer
    profiled at EP > 1 are keyed by it."""
    import dataclasses

    return "ep" in {f.name for f in dataclasses.fields(ProfileKey)}


def ep_fields(ep: int) -> dict[str, int]:
    """The ``ProfileKey`` keyword of EP ``ep`` (none at EP 1: the key's default)."""
    if ep <= 1:
        return {}
    if not keys_carry_ep():
        raise ProfileDBError(f"profile records cannot be keyed by EP {ep} here (ProfileKey "
                             "has no EP degree)")
    return {"ep": int(ep)}


def kind_eps(model: ModelSpec, eps: Sequence[int] = (1,)) -> dict[str, tuple[int, ...]]:
    """The EP degrees each kind (:func:`kind_signatures`' names) is profiled at: ``eps`` for
    a MoE kind, 1 for a dense one (``profiler.ProfiledKind.of_model``)."""
    eps = tuple(sorted(set(eps))) or (1,)
    if not model.is_mixed:
        return {"": eps if model.is_moe else (1,)}
    return {k.name: (eps if k.is_moe else (1,)) for k in model.layer_kinds}


def needed_keys(cluster: Cluster, model: ModelSpec, tps: Sequence[int],
                micro_batch_sizes: Sequence[int], seq_length: int,
                setup: TrainingSetup | None = None,
                eps: Sequence[int] = (1,)) -> list[ProfileKey]:
    """One decoder-layer record per (layer kind, EP for a MoE kind, device type, TP degree,
    micro-batch size) of the launch (:func:`kind_signatures`, :func:`kind_eps`)."""
    fields = (setup or TrainingSetup()).profile_fields
    per_kind = kind_eps(model, eps)
    return [ProfileKey(t, "decoder", tp, mbs, seq_length, sig, **fields, **ep_fields(e))
            for name, sig in kind_signatures(model).items() for e in per_kind[name]
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


def measured_records(aggs: Sequence[Aggregate], seq_length: int,
                     model_signature: str | Mapping[str, str],
                     setup: TrainingSetup | None = None,
                     env: Sequence[tuple[str, str]] = (),
                     devices: Mapping[str, str] | None = None) -> list[LayerProfile]:
    """The per-type medians of :func:`.profiler.aggregate` as measured decoder-layer records
    (keyed by the training setup they ran under; ``env`` says what measured them, its
    ``device`` replaced by ``devices[type]``, the device of the ranks that measured that type;
    times on the :data:`TIME_RESOLUTION` grid). ``model_signature``: one signature for every
    record, or per layer kind (``Aggregate.kind`` -> signature, :func:`kind_signatures`): an
    aggregate of a kind it does not name is an error (a record under the wrong key would be
    planned from as another kind's)."""
    fields = (setup or TrainingSetup()).profile_fields
    if isinstance(model_signature, str):
        sig_of = {a.kind: model_signature for a in aggs}
    else:
        sig_of = dict(model_signature)
        unknown = sorted({a.kind for a in aggs} - set(sig_of))
        if unknown:
            raise ValueError(f"profiled layer kind(s) {unknown} not among the model's "
                             f"{sorted(sig_of)}")

    def env_of(device_type: str) -> tuple[tuple[str, str], ...]:
        out = dict(env)
        if devices and device_type in devices:
            out["device"] = devices[device_type]
        return tuple(sorted(out.items()))

    return [LayerProfile(ProfileKey(a.device_type, "decoder", a.tp, a.micro_batch_size, seq_length,
                                    sig_of[a.kind], **fields, **ep_fields(a.ep)),
                         quantize_ms(a.forward_ms), quantize_ms(a.backward_ms),
                         a.activation_bytes, a.param_bytes, source="measured",
                         env=env_of(a.device_type), optimizer_ms=quantize_ms(a.optimizer_ms))
            for a in aggs]


def devices_by_type(infos: Sequence) -> dict[str, str]:
    """Device type -> the device name(s) of its ranks (``discovery.DeviceInfo``: the device's
    own name, the emulated type's under emulation; several, comma-separated, where a cluster
    file renames different devices to one type)."""
    names: dict[str, set[str]] = {}
    for i in infos:
        names.setdefault(i.device_type, set()).add(getattr(i, "device_name", "") or i.device_type)
    return {t: ", ".join(sorted(n)) for t, n in names.items()}


def measurement_env(device_name: str, kind: str,
                    backend: str = "megatron") -> list[tuple[str, str]]:
    """What measured a record: the device's name, torch, the imported megatron-core (and on
    ``backend`` "mindspeed-llm" MindSpeed and MindSpeed-LLM; :mod:`.provenance`) and (``kind``
    "cuda") the CUDA version and driver."""
    import torch

    out = [("device", device_name), *provenance.env_entries(backend)]
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
              setup: TrainingSetup | None = None, eps: Sequence[int] = (1,)) -> Cluster:
    """``cluster`` with each type's compute speed set from its measured decoder layer, so that
    what the search still estimates (embedding, output layer, unprofiled TP degrees) is on the
    same scale.

    Real devices keep their peak and get ``efficiency`` = measured / peak; types in
    ``estimated_peak`` (CPU, emulated) get ``peak_tflops`` = measured and ``efficiency`` 1.
    Types in ``fixed`` (the cluster file sets their speed) are left as they are.
    A model of several layer kinds: the rate is the best over every kind's records, each
    against its own kind's FLOPs (``kind_model``).
    """
    fields = (setup or TrainingSetup()).profile_fields
    kind_models = ([model] if not model.is_mixed
                   else [model.kind_model(i) for i in range(len(model.layer_kinds))])
    # a MoE kind's records at each profiled EP (one EP rank's share of balanced routing does
    # the FLOPs of its own tokens' top-k: the kind's FLOPs, at any EP)
    ep_of = [tuple(sorted(set(eps))) if km.is_moe else (1,) for km in kind_models]
    types: dict[str, DeviceType] = dict(cluster.device_types)
    for name, dt in cluster.device_types.items():
        if name in fixed:
            continue
        rates = []
        for km, kind_eps_ in zip(kind_models, ep_of):
            sig = km.signature()
            for tp, mbs, ep in itertools.product(tps, micro_batch_sizes, kind_eps_):
                p = db.get(ProfileKey(name, "decoder", tp, mbs, seq_length, sig, **fields,
                                      **ep_fields(ep)))
                if p is not None and p.source == "measured" and p.forward_ms > 0:
                    # forward + backward (3x the forward's FLOPs): the rate the whole layer
                    # reaches, the one MFU is measured against (a forward-only rate makes
                    # a backward faster than 2x forward read as MFU > 100%)
                    flops = 3.0 * km.layer_forward_flops(mbs, seq_length) / tp
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
