"""Megatron's process-wide state around the launch's planning (poseidon_plugin/megatron/
framework_state.py), the emulation's ``Tensor.type`` rename under a framework's wrapper, the NPU
library stand-ins of tests/npu_fakes, and Megatron's dataset helpers built outside its tree.
Each case runs in a fresh interpreter: they set process-wide state (Megatron's globals, torch's
function mode, torch.npu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKES = os.path.join(ROOT, "tests", "npu_fakes")


def run(code: str, extra_path: str = "", env: dict[str, str] | None = None) -> str:
    path = os.pathsep.join(p for p in (extra_path, ROOT) if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore",
                               **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_hold_profiling_release():
    out = run("""
        import argparse
        from megatron.training import global_vars, get_args
        from megatron.core import num_microbatches_calculator as nmc
        from poseidon_plugin.megatron import framework_state as fs
        parsed = argparse.Namespace(micro_batch_size=1, rank=0)
        fs.hold(parsed)
        assert get_args() is parsed
        v = argparse.Namespace(micro_batch_size=2, rank=0)
        with fs.profiling(v, data_parallel_size=4):
            assert get_args() is v
            assert nmc.get_num_microbatches() == 1
            assert nmc.get_micro_batch_size() == 2
            assert nmc.get_current_global_batch_size() == 8
        assert get_args() is parsed                      # the launch's args come back
        assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
        with fs.args_during(v):
            assert get_args() is v
        assert get_args() is parsed
        fs.release()
        assert global_vars._GLOBAL_ARGS is None
        # pretrain can now set its own (no 'args is already initialized')
        global_vars._ensure_var_is_not_initialized(global_vars._GLOBAL_ARGS, "args")
        fs.release()                                     # idempotent
        print("OK")
    """)
    assert out.strip().endswith("OK")


def test_profiling_restores_after_an_error():
    out = run("""
        import argparse
        from megatron.training import get_args
        from megatron.core import num_microbatches_calculator as nmc
        from poseidon_plugin.megatron import framework_state as fs
        parsed = argparse.Namespace(micro_batch_size=1, rank=0)
        fs.hold(parsed)
        try:
            with fs.profiling(argparse.Namespace(micro_batch_size=1, rank=0), 2):
                raise RuntimeError("layer build failed")
        except RuntimeError:
            pass
        assert get_args() is parsed and nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
        print("OK")
    """)
    assert out.strip().endswith("OK")


def test_model_parallel_leftovers_are_cleared():
    """megatron-core 0.12.1's destroy_model_parallel leaves the embedding groups' ranks set; a
    stale value makes the last stage of a PP > 1 training look for a group it is not in."""
    out = run("""
        from megatron.core import parallel_state as ps
        from poseidon_plugin.megatron import framework_state as fs
        for name in fs._LEFT_BY_DESTROY:
            setattr(ps, name, [0, 1])
        fs.clear_model_parallel_leftovers()
        left = [n for n in fs._LEFT_BY_DESTROY if getattr(ps, n, None) is not None]
        assert not left, left
        print("OK")
    """)
    assert out.strip().endswith("OK")


def test_tensor_type_renamed_through_a_framework_wrapper():
    """MindSpeed replaces torch.Tensor.type with a wrapper; torch then hands the wrapper, not the
    method, to the emulation's function mode: the rename to torch.cuda.* must still happen
    (Megatron's clip_grads and Float16Optimizer assert it)."""
    out = run("""
        import functools
        from poseidon_plugin.megatron.emulate import emulation
        emulation.install_cpu_shims(device_name="emu", memory_bytes=1 << 30)
        import torch
        orig = torch.Tensor.type
        @functools.wraps(orig)
        def wrapper(*a, **k):
            r = orig(*a, **k)
            return r.replace("npu", "cuda") if isinstance(r, str) else r
        torch.Tensor.type = wrapper
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor", torch.zeros(1).type()
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64   # conversions untouched
        print("OK")
    """)
    assert out.strip().endswith("OK")


def test_npu_stand_ins():
    out = run("""
        from poseidon_plugin.megatron.emulate import emulation
        emulation.install_cpu_shims(device_count=2, device_name="emu-npu", memory_bytes=1 << 30)
        import torch, torch_npu, torchair, acl
        from torch_npu.contrib import transfer_to_npu
        from torchair import ge, register_fx_node_ge_converter
        from torch_npu.utils.collect_env import get_cann_version
        assert torch.npu is torch_npu.npu
        assert torch.npu.is_available() and torch.npu.device_count() == 2
        assert torch.npu.get_device_name() == "emu-npu"
        assert len(torch.npu.default_generators) == 2
        assert isinstance(get_cann_version(), str)
        assert register_fx_node_ge_converter("op")(len) is len    # graph lowering: no-op
        assert not hasattr(torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options, "hccl_config")
        x = torch.randn(3, 8)
        g = torch.randn(8)
        y, rstd = torch_npu.npu_rms_norm(x, g, epsilon=1e-6)
        ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        assert torch.allclose(y, ref, atol=1e-5)
        a, b = x.chunk(2, -1)
        assert torch.allclose(torch_npu.npu_swiglu(x), torch.nn.functional.silu(a) * b)
        cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
        assert torch.allclose(torch_npu.npu_rotary_mul(x, cos, sin), x)  # angle 0: identity
        for call in (lambda: torch_npu.npu_fusion_attention(x), lambda: ge.custom_op(1),
                     lambda: acl.rt.get_device()):
            try:
                call()
            except NotImplementedError as e:
                assert "needs Ascend" in str(e), e
            else:
                raise AssertionError("an NPU-only call ran")
        print("OK")
    """, extra_path=FAKES)
    assert out.strip().endswith("OK")


def test_dataset_helpers_built_outside_the_tree(tmp_path):
    """A Megatron-LM checkout's helpers.cpp is compiled into the cache, not into the checkout,
    and imported as megatron.core.datasets.helpers_cpp; a second build is a cache hit."""
    pytest.importorskip("pybind11")
    src = tmp_path / "helpers.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nint twice(int x) { return 2 * x; }\n"
                   "PYBIND11_MODULE(helpers_cpp, m) { m.def(\"twice\", &twice); }\n")
    out = run(f"""
        import os, sys, types
        from poseidon_plugin.megatron.launch import compat
        so = compat.build_helpers_cached({str(src)!r})
        assert so.startswith({str(tmp_path / 'cache')!r}), so
        assert compat.build_helpers_cached({str(src)!r}) == so
        pkg = types.ModuleType("fakepkg"); pkg.__path__ = []; sys.modules["fakepkg"] = pkg
        compat._import_as("fakepkg.helpers_cpp", so)
        import fakepkg.helpers_cpp as h
        assert h.twice(21) == 42
        print("OK")
    """, env={"POSEIDON_HELPERS_CACHE": str(tmp_path / "cache")})
    assert out.strip().endswith("OK")
    assert sorted(os.listdir(tmp_path)) == ["cache", "helpers.cpp"]   # nothing written beside it


def test_dataset_helpers_without_pybind11_is_one_clear_error(tmp_path):
    src = tmp_path / "helpers.cpp"
    src.write_text("int x;\n")
    out = run(f"""
        import sys
        sys.modules["pybind11"] = None          # not installed
        from poseidon_plugin.errors import PoseidonError
        from poseidon_plugin.megatron.launch import compat
        try:
            compat.build_helpers_cached({str(src)!r})
        except PoseidonError as e:
            print("ERR", e)
    """, env={"POSEIDON_HELPERS_CACHE": str(tmp_path / "cache")})
    assert "ERR" in out and "pip install pybind11" in out and "helpers.cpp" in out


# one MoE layer with an aux loss profiled as the launch profiles it (one gloo process, the CPU
# shims), then: what the framework's modules and classes hold, and the training's first step
# of megatron-core's own aux-loss scale (initialize_megatron: set_loss_scale(torch.ones(1)))
_PROFILE_MOE = r"""
import os, sys, tempfile, warnings
warnings.simplefilter("ignore")
from poseidon_plugin.megatron import framework_state as fs
from poseidon_plugin.megatron.emulate import emulation
from poseidon_plugin.megatron.profile import offline, profiler
emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="cpu", memory_bytes=1 << 30)
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 1 "
         "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
         "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
         "--disable-bias-linear --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-4 "
         "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
         "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01").split()
args = profiler.parse_megatron_args("pretrain_gpt.py", flags)
offline._init_alone("cpu", tempfile.mkdtemp())
before = fs.DataState.capture()
kinds = [profiler.ProfiledKind(name="moe", moe=True)]
(t,) = profiler.profile_rank(args, (1,), (1,), world_size=1, rank=0,
                             device=torch.device("cpu"), iters=1, kinds=kinds)
assert t.forward_ms > 0 and t.backward_ms > 0
left = before.restore()
print("LEFT", ",".join(left))
print("SCALE", MoEAuxLossAutoScaler.main_loss_backward_scale)
MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))     # initialize_megatron's
MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) * 2)  # the schedule's, every micro-batch
print("OK")
"""


def test_profiling_a_moe_layer_leaves_no_framework_state(tmp_path):
    """Issue 36 item 9: the profiled MoE layer's backward stores a 0-dim aux-loss scale on
    megatron-core's MoEAuxLossAutoScaler (and its router fills the aux-loss tracker); the
    training's set_loss_scale(torch.ones(1)) then died in initialize_megatron on every rank.
    Every data attribute of the framework's modules and classes is as before the profiling."""
    pytest.importorskip("megatron.core")
    out = run(_PROFILE_MOE.replace("tempfile.mkdtemp()", repr(str(tmp_path))))
    assert "LEFT \n" in out and "SCALE None" in out, out
    assert out.strip().endswith("OK")
