"""Megatron's default fused CUDA kernels whose modules are not installed (Apex's gradient-
accumulation and masked-softmax kernels, Transformer Engine's RoPE) are turned off on a CUDA
launch and in ``poseidon profile`` on a GPU: megatron-core's wheel has none of them, and Megatron
stops at model build without them. No GPU here: which modules are installed is faked."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.training")

from poseidon_plugin.megatron.launch import compat, runner
from poseidon_plugin.megatron.profile import offline, profiler  # noqa: E402

ALL_FLAGS = ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm"]
EVERY_MODULE = ("fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda", "transformer_engine",
                "apex")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32",
         "--position-embedding-type", "rope"]


def installed(monkeypatch, *present: str) -> None:
    monkeypatch.setattr(compat, "module_available", lambda name: name in present)


def test_each_missing_module_turns_its_kernel_off(monkeypatch):
    installed(monkeypatch)
    assert [f for _, _, f in compat.missing_kernel_flags([])] == ALL_FLAGS
    installed(monkeypatch, "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda", "apex")
    assert [f for _, _, f in compat.missing_kernel_flags([])] == ["--no-rope-fusion"]
    installed(monkeypatch, *EVERY_MODULE)
    assert compat.missing_kernel_flags([]) == []


def test_a_flag_already_given_is_not_repeated(monkeypatch):
    installed(monkeypatch)
    out = compat.missing_kernel_flags(["--bf16", "--no-masked-softmax-fusion"])
    assert [f for _, _, f in out] == ["--no-gradient-accumulation-fusion", "--no-rope-fusion",
                                      "--no-persist-layer-norm"]


def test_module_available_reads_what_is_installed():
    assert compat.module_available("json") is True
    assert compat.module_available("no_such_module_poseidon") is False
    assert compat.module_available("no_such_package.sub") is False


def test_the_flags_are_megatrons_own_and_turn_the_kernels_off():
    """Megatron's defaults ask for the three kernels; the appended flags (names Megatron's parser
    knows) turn each one off."""
    before = profiler.parse_megatron_args("pretrain_gpt.py", MODEL)
    after = profiler.parse_megatron_args("pretrain_gpt.py", MODEL + ALL_FLAGS)
    names = ("gradient_accumulation_fusion", "masked_softmax_fusion", "apply_rope_fusion")
    assert [getattr(before, n) for n in names] == [True, True, True]
    assert [getattr(after, n) for n in names] == [False, False, False]
    assert (before.no_persist_layer_norm, after.no_persist_layer_norm) == (False, True)


def cuda_launch(argv: list[str]) -> runner.LaunchContext:
    ctx = runner.LaunchContext.__new__(runner.LaunchContext)
    ctx.argv = list(argv)
    ctx.env = SimpleNamespace(rank=0)
    return ctx


def test_a_cuda_launch_appends_the_flags_and_says_so(monkeypatch, caplog):
    installed(monkeypatch, "scaled_masked_softmax_cuda")
    ctx = cuda_launch(["--bf16"])
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        runner._turn_off_missing_kernels(ctx)
    assert ctx.argv == ["--bf16", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                        "--no-persist-layer-norm"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "fused_weight_gradient_mlp_cuda (gradient-accumulation fusion)" in line
    assert "transformer_engine (RoPE fusion)" in line and "scaled_masked" not in line


def test_a_cuda_launch_with_every_kernel_installed_is_left_alone(monkeypatch, caplog):
    installed(monkeypatch, *EVERY_MODULE)
    ctx = cuda_launch(["--bf16"])
    with caplog.at_level(logging.WARNING, logger="poseidon"):
        runner._turn_off_missing_kernels(ctx)
    assert ctx.argv == ["--bf16"] and not caplog.records


def test_poseidon_profile_turns_them_off_on_cuda_only(monkeypatch):
    installed(monkeypatch, "transformer_engine")
    assert offline.kernel_flags("cuda") == ALL_FLAGS[:2] + ALL_FLAGS[3:]
    assert offline.kernel_flags("npu") == [] and offline.kernel_flags("cpu") == []
