"""CPU emulation: the emulation file, the torch.cuda shims and the per-type slowdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from poseidon_plugin.errors import SpecError
from poseidon_plugin.megatron.emulate.emulation import emulation_from_dict, load_emulation

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
    from poseidon_plugin.megatron.emulate import emulation
    from poseidon_plugin.megatron.profile import profiler
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


@pytest.mark.integration   # torch / megatron-core
def test_pipeline_sends_go_from_a_private_copy():
    """megatron-core < 0.19 frees an interleaved output while its isend runs (issue 36 item
    12): under the emulation its p2p module's ``torch.distributed`` sends a copy, through
    ``isend`` and through a ``P2POp`` of it (torch's own isend handed on: torch checks the op),
    and receives into the caller's tensor."""
    import torch

    from poseidon_plugin.megatron.emulate.emulation import _PrivateSendTorch

    calls = []

    class FakeDist:
        def isend(self, tensor, dst=None, group=None, tag=0):
            calls.append(("isend", tensor))

        def irecv(self, tensor, src=None, group=None, tag=0):
            calls.append(("irecv", tensor))

        def P2POp(self, op, tensor, peer, group=None):  # noqa: N802
            assert op in (self.isend, self.irecv), op
            return ("op", op.__name__, tensor, peer)

        def get_rank(self):
            return 3

    fake_torch = type("T", (), {"distributed": FakeDist(), "float32": torch.float32})()
    proxy = _PrivateSendTorch(fake_torch)
    x = torch.randn(4)
    send = proxy.distributed.P2POp(proxy.distributed.isend, x, 1)
    assert send[1] == "isend" and send[2] is not x and torch.equal(send[2], x)
    recv = proxy.distributed.P2POp(proxy.distributed.irecv, x, 1)
    assert recv[1] == "irecv" and recv[2] is x                  # received into the caller's
    proxy.distributed.isend(x, 1)
    assert calls[-1][1] is not x and torch.equal(calls[-1][1], x)
    x.data = torch.empty(1)                  # deallocate_output_tensor: the copy is unaffected
    assert send[2].numel() == 4
    assert proxy.distributed.get_rank() == 3 and proxy.float32 is torch.float32


@pytest.mark.integration   # torch / megatron-core
def test_the_dispatchers_split_sizes_reach_gloo_as_from_a_device(monkeypatch):
    """megatron-core's all-to-all dispatcher asks maybe_move_tensor_to_cpu(as_numpy=True) for
    its split sizes, which converts only an accelerator tensor; on the emulated device (CPU
    tensors) megatron-core 0.12.1 handed gloo tensors and its all_to_all_single refused them at
    the first EP 2 step of MindSpeed-LLM v26.1.0. Under the emulation they come as numpy."""
    import numpy as np
    import torch

    dispatcher = pytest.importorskip("megatron.core.transformer.moe.token_dispatcher")
    from poseidon_plugin.megatron.emulate.emulation import host_split_sizes

    monkeypatch.setattr(dispatcher, "maybe_move_tensor_to_cpu",
                        dispatcher.maybe_move_tensor_to_cpu)   # put back after the test
    splits = torch.tensor([58, 60])
    assert torch.is_tensor(dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True))
    assert host_split_sizes() and host_split_sizes()           # once, idempotent
    out = dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [58, 60]
    assert dispatcher.maybe_move_tensor_to_cpu(splits) is splits   # no numpy asked: as before
    assert dispatcher.maybe_move_tensor_to_cpu(None, as_numpy=True) is None


_WRAPPED_A2A_SCRIPT = textwrap.dedent("""
    import functools, json, os, torch
    import torch.distributed as dist
    from poseidon_plugin.megatron.emulate import emulation
    emulation.install_cpu_shims()
    original = dist.all_to_all_single

    @functools.wraps(original)        # as MindSpeed-LLM's communication patch wraps it, later
    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    # MindSpeed's patch manager rebinds the name wherever it is bound: torch.distributed's
    # own dispatch to the torch-function mode then names the wrapper
    dist.all_to_all_single = dist.distributed_c10d.all_to_all_single = wrapped
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    out, x = torch.empty(3, 2), torch.arange(6.0).view(3, 2)
    dist.all_to_all_single(out, x, torch.tensor([3]), torch.tensor([3]))   # splits as tensors
    print(json.dumps(out.tolist()))
""")


@pytest.mark.integration   # torch
def test_split_sizes_reach_gloo_as_lists_through_a_later_wrapper():
    """The emulation hands gloo's ``all_to_all_single`` its tensor split sizes as lists also
    when a framework wraps torch.distributed's function after the shims are installed
    (MindSpeed-LLM v26.1.0's ``high_availability`` communication patch): before, its all-to-all
    dispatcher at EP 2 on megatron-core 0.12.1 failed in gloo's binding ("incompatible function
    arguments")."""
    pytest.importorskip("torch")
    from test_launch_e2e import free_port

    env = {**os.environ, "PYTHONPATH": ROOT, "PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", _WRAPPED_A2A_SCRIPT], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


_SUBCLASS_SCRIPT = textwrap.dedent("""
    import json, torch
    from megatron.core.transformer import transformer_layer
    from poseidon_plugin.megatron.emulate import emulation
    pads = []
    emulation._pad = lambda s: pads.append(s)
    emulation.install_slowdown(2.0)

    # as MindSpeed-LLM v26.1.0 does after the emulation is installed: its own subclass in
    # megatron-core's place, with a forward that never calls megatron-core's
    class FrameworkLayer(transformer_layer.TransformerLayer):
        def forward(self, hidden_states=None, **kwargs):
            return hidden_states * 2, None

    class Inner(FrameworkLayer):     # a forward that calls its parent's: padded once, not twice
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    transformer_layer.TransformerLayer = FrameworkLayer
    x = torch.ones(2, requires_grad=True)
    layer, inner = FrameworkLayer.__new__(FrameworkLayer), Inner.__new__(Inner)   # no __init__
    FrameworkLayer.forward(layer, hidden_states=x)
    before = len(pads)                  # not wrapped yet
    wrapped = emulation.pad_transformer_layers()
    out, _ = FrameworkLayer.forward(layer, hidden_states=x)
    after_one = len(pads)
    out.sum().backward()                # its backward: padded between the two gradient hooks
    after_backward = len(pads)
    Inner.forward(inner, hidden_states=x)
    print(json.dumps({"before": before, "wrapped": wrapped, "one": after_one,
                      "backward": after_backward, "inner": len(pads),
                      "again": emulation.pad_transformer_layers()}))
""")


@pytest.mark.integration
def test_a_frameworks_own_layer_class_is_padded_once():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SUBCLASS_SCRIPT], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == 0               # megatron-core's wrapped forward is not called
    assert got["wrapped"] == 2              # FrameworkLayer, Inner
    assert got["one"] == 1 and got["backward"] == 2
    assert got["inner"] == 3                # Inner -> FrameworkLayer: one pad
    assert got["again"] == 0
