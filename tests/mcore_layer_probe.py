"""Run Poseidon's profiler on the importable megatron-core and print what it built (one JSON line).

    python tests/mcore_layer_probe.py <megatron args...>

One gloo process (world 1, TP 1, CPU shims as under --poseidon-emulate): Megatron's parser on the
arguments, the profiler's validated copy, the layer spec the training script would pick, the
layer built from it and timed by ``profile_rank``. A build or timing failure is reported, not
raised (some versions cannot run some layers on CPU). Used by tests/test_mcore_versions.py with a
Megatron-LM tree of each version first on PYTHONPATH.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any


def spec_modules(spec: Any, out: set[str] | None = None) -> set[str]:
    """Class names of every module a ModuleSpec tree names."""
    out = set() if out is None else out
    module = getattr(spec, "module", None)
    if isinstance(module, type):
        out.add(module.__name__)
    subs = getattr(spec, "submodules", None)
    if dataclasses.is_dataclass(subs):
        values = [getattr(subs, f.name) for f in dataclasses.fields(subs)]
    else:
        values = list(vars(subs).values()) if hasattr(subs, "__dict__") else []
    for v in values:
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(item, type):
                out.add(item.__name__)
            elif hasattr(item, "module") or hasattr(item, "submodules"):
                spec_modules(item, out)
    return out


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import megatron.core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.spec_utils import build_module
    from poseidon_plugin.megatron import provenance
    from poseidon_plugin.megatron.emulate import emulation
    from poseidon_plugin.megatron.profile import profiler

    emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="probe",
                                memory_bytes=1 << 34)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("PROBE_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    args = profiler.parse_megatron_args("pretrain_gpt.py", argv)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    vargs = profiler.profiling_args(args, 1, 1, 1, 0)
    config, spec = profiler.layer_config_and_spec(vargs)
    report: dict[str, Any] = {
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "megatron_file": megatron.core.__file__,
        "spec_modules": sorted(spec_modules(spec)),
        "normalization": config.normalization,
        "multi_latent_attention": bool(getattr(config, "multi_latent_attention", False)),
        "num_experts": config.num_moe_experts,
        # what a profile record and the cache key say measured it
        "recorded": dict(provenance.env_entries())["megatron_core"],
        "recorded_path": provenance.megatron_core().path,
    }
    try:
        layer = build_module(spec, config=config, layer_number=1)
        report["modules"] = sorted({type(m).__name__ for m in layer.modules()})
        report["param_bytes"] = sum(p.numel() * p.element_size() for p in layer.parameters())
    except Exception as e:  # noqa: BLE001 - reported
        report["build_error"] = _error(e)
    tensor_parallel.get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    if "modules" in report:
        try:
            (t,) = profiler.profile_rank(args, (1,), (1,), world_size=1, rank=0,
                                         device=torch.device("cpu"), iters=1)
            report["forward_ms"], report["backward_ms"] = t.forward_ms, t.backward_ms
            report["timed_param_bytes"] = t.param_bytes   # the layer profile_rank built
        except Exception as e:  # noqa: BLE001 - reported
            report["time_error"] = _error(e)
    print("PROBE " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
