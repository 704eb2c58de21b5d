"""CPU emulation: the emulation file, the torch.cuda shims and the per-type slowdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from poseidon_plugin.errors import SpecError
from poseidon_plugin.megatron.emulation import emulation_from_dict, load_emulation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_file_loads():
    spec = load_emulation(os.path.join(ROOT, "examples", "emulate-2types.yaml"))
    assert spec.ranks == ("emu-slow", "emu-slow", "emu-fast", "emu-fast")
    assert spec.type_of(0).slowdown == pytest.approx(4.0)  # speed 0.25
    assert spec.type_of(3).slowdown == 1.0


@pytest.mark.parametrize("data, field", [
    ({"device_types": {"a": {"speed": 2}}, "ranks": ["a"]}, "device_types.a.speed"),
    ({"device_types": {"a": {"speed": 0.5, "memory_gib": 0}}, "ranks": ["a"]}, "device_types.a.memory_gib"),
    ({"device_types": {"a": {}}, "ranks": ["b"]}, "ranks[0]"),
    ({"device_types": {"a": {}}, "ranks": ["a"], "hosts": ["x", "y"]}, "hosts"),
    ({"device_types": {"a": {"sped": 1}}, "ranks": ["a"]}, "device_types.a"),
    ({"ranks": ["a"]}, "device_types"),
])
def test_bad_emulation_files_name_the_field(data, field):
    with pytest.raises(SpecError, match=field.replace("[", r"\[").replace("]", r"\]")):
        emulation_from_dict(data, source="emu.yaml")


def test_rank_beyond_the_list_is_an_error():
    spec = emulation_from_dict({"device_types": {"a": {}}, "ranks": ["a"]}, source="emu.yaml")
    with pytest.raises(SpecError, match="launch rank 3"):
        spec.type_of(3)


_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from poseidon_plugin.megatron import emulation, profiler
    emulation.install_cpu_shims(device_name="emu-x", memory_bytes=8 << 30)
    import torch, torch.distributed as dist
    assert torch.cuda.is_available() and torch.cuda.get_device_name() == "emu-x"
    x = torch.ones(3, device="cuda").cuda() + torch.zeros(3, device=torch.cuda.current_device())
    assert x.device.type == "cpu" and x.to("cuda:0").device.type == "cpu"
    assert torch.tensor([1.0], dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls = []
    orig = emulation._pad
    emulation._pad = lambda s: calls.append(s)
    emulation.install_slowdown(3.0)
    args = profiler.parse_megatron_args("x.py", (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 1 --bf16 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm "
        "--transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion "
        "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
        "--no-gradient-accumulation-fusion --tokenizer-type NullTokenizer --vocab-size 128 "
        "--some-unknown-flag 3").split())
    out = profiler.profile_rank(args, [1], [1, 2], world_size=1, rank=0,
                                device=torch.device("cpu"), iters=3)
    print(json.dumps({"timings": [t.__dict__ for t in out], "pads": len(calls)}))
""")


@pytest.mark.integration
def test_shims_run_a_real_megatron_layer_on_cpu_with_slowdown():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    t1, t2 = result["timings"]
    assert (t1["micro_batch_size"], t2["micro_batch_size"]) == (1, 2)
    for t in (t1, t2):
        assert t["forward_ms"] > 0 and t["backward_ms"] > 0 and t["param_bytes"] > 0
    assert t2["activation_bytes"] > t1["activation_bytes"] > 0
    # every forward and every backward of the layer was padded: per config the untimed activation
    # pass, the warm-up (3) and the timed repetitions (at least 8), each sampled 1 + retries times
    assert all(t["samples"] >= 8 for t in (t1, t2))
    assert result["pads"] >= sum(2 * (1 + 3 + t["samples"]) for t in (t1, t2))
    assert result["pads"] % 2 == 0
