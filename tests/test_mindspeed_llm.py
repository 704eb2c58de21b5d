"""MindSpeed-LLM launches against stand-ins of its 2.x and 26.x package layout (tests/standin/).

The real argv code imports the adaptor as MindSpeed-LLM's scripts do, asks the installed release
whether it registers ``--pipeline-model-parallel-layout``, rewrites the command line and
re-applies the release's argv-gated patches; the stand-in's own argument registration and
validation then accept (or refuse) the result. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import pytest

import mindspeed_standin
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron import argv as A
from test_megatron_argv import make_plan

RELEASES = sorted(mindspeed_standin.RELEASES)
SCRIPT = "pretrain_gpt.py"
LAYER_LIST_PATCH = "megatron.core.transformer.transformer_block.get_num_layers_to_build"
USER_ARGV = ["--num-layers", "8", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
             "--global-batch-size", "16"]


@pytest.fixture(params=RELEASES)
def release(request, tmp_path, monkeypatch):
    """One stand-in release importable as ``mindspeed`` / ``mindspeed_llm``."""
    mindspeed_standin.forget()
    monkeypatch.syspath_prepend(mindspeed_standin.install(request.param, str(tmp_path / "site")))
    monkeypatch.delenv("TRAINING_BACKEND", raising=False)
    yield request.param
    mindspeed_standin.forget()


def _adaptor():
    return sys.modules["mindspeed_llm"].megatron_adaptor


def _active_patches() -> list[str]:
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return MindSpeedPatchesManager.active_patches()


def _validate_like_mindspeed_llm(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` with a few Megatron flags plus the release's feature flags and validate it
    in MindSpeed-LLM's order, with Megatron's ``num_layers % pp`` check in the middle."""
    from mindspeed_llm.training.arguments import process_args_v2, validate_args_v2_decorator

    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--num-layers", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
                 "--global-batch-size"):
        parser.add_argument(flag, type=int, default=None)
    args = process_args_v2(parser).parse_args(argv)

    def megatron_validate_args(a, defaults):
        split_given = a.num_layers_per_virtual_pipeline_stage or getattr(
            a, "pipeline_model_parallel_layout", None)
        if not split_given and a.num_layers % a.pipeline_model_parallel_size:
            raise AssertionError("num_layers should be divisible by pipeline_model_parallel_size")

    return validate_args_v2_decorator(megatron_validate_args)(args)


# ----------------------------------------------------------------------------------------------


def test_adaptor_is_a_name_in_the_package_not_a_submodule(release, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["poseidon"])
    adaptor = A.import_mindspeed_llm(SCRIPT, [*USER_ARGV, "--num-layer-list", "2,2,2,2"])
    assert importlib.util.find_spec("mindspeed_llm.megatron_adaptor") is None  # imports the package
    assert adaptor.__name__ == "mindspeed_llm.tasks.megatron_adaptor_v2"
    assert sys.argv == ["poseidon"]  # restored
    # the adaptor parsed the script's command line at import and gated its patches on it
    assert adaptor.PARSED[-1].num_layer_list == "2,2,2,2"
    assert LAYER_LIST_PATCH in _active_patches()


def test_layout_flag_registered_from_26_1_only(release):
    assert A.mindspeed_llm_registers_layout() is (release in mindspeed_standin.LAYOUT_RELEASES)


def test_uneven_plan_passes_mindspeed_llm_validation(release):
    A.import_mindspeed_llm(SCRIPT, USER_ARGV)
    new = A.rewrite_argv(USER_ARGV, make_plan(layers=(6, 2)), "mindspeed-llm",
                         mindspeed_layout=A.mindspeed_llm_registers_layout())
    assert A.flag_value(new, "--num-layer-list") == "6,2"
    args = _validate_like_mindspeed_llm(new)
    assert (args.num_layers, args.pipeline_model_parallel_size, args.num_layer_list) == (8, 2, "6,2")


def test_interleaved_rule_layout_where_registered_else_refused(release):
    A.import_mindspeed_llm(SCRIPT, USER_ARGV)
    plan = make_plan(layers=(5, 3), vpp=2)
    layout = A.mindspeed_llm_registers_layout()
    if not layout:
        with pytest.raises(PoseidonError, match="--poseidon-max-virtual-stages 1"):
            A.rewrite_argv(USER_ARGV, plan, "mindspeed-llm", mindspeed_layout=layout)
        return
    new = A.rewrite_argv(USER_ARGV, plan, "mindspeed-llm", mindspeed_layout=layout)
    assert "--num-layer-list" not in new
    assert A.flag_value(new, "--pipeline-model-parallel-layout") == plan.pipeline_layout()
    assert _validate_like_mindspeed_llm(new).virtual_pipeline_model_parallel_size == 2


def test_stand_in_refuses_a_layer_list_with_a_virtual_pipeline(release):
    """What makes the rule necessary (and keeps the stand-in honest)."""
    A.import_mindspeed_llm(SCRIPT, USER_ARGV)
    with pytest.raises(ValueError, match="virtual pipeline cannot be enabled"):
        _validate_like_mindspeed_llm(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                      "--num-layer-list", "6,2",
                                      "--num-layers-per-virtual-pipeline-stage", "1"])


def test_patches_follow_the_rewritten_command_line(release, monkeypatch):
    A.import_mindspeed_llm(SCRIPT, USER_ARGV)
    assert LAYER_LIST_PATCH not in _active_patches()  # no --num-layer-list at import
    new = A.rewrite_argv(USER_ARGV, make_plan(layers=(6, 2)), "mindspeed-llm")
    monkeypatch.setattr(sys, "argv", [SCRIPT, *new])  # what the runner does before re-applying
    assert A.apply_mindspeed_llm(new) is True
    assert LAYER_LIST_PATCH in _active_patches()
    assert _adaptor().PARSED[-1].num_layer_list == "6,2"
    # and back to an even split: the layer-list patch goes away again
    even = A.rewrite_argv(USER_ARGV, make_plan(layers=(8,)), "mindspeed-llm")
    monkeypatch.setattr(sys, "argv", [SCRIPT, *even])
    assert A.apply_mindspeed_llm(even) is True
    assert LAYER_LIST_PATCH not in _active_patches()


def test_26x_binds_the_adaptor_only_for_mcore(release, monkeypatch):
    monkeypatch.setenv("TRAINING_BACKEND", "mindspore")
    if release.startswith("2."):
        assert A.import_mindspeed_llm(SCRIPT, USER_ARGV) is not None
        return
    with pytest.raises(PoseidonError, match="TRAINING_BACKEND=mindspore"):
        A.import_mindspeed_llm(SCRIPT, USER_ARGV)


def test_not_installed_is_one_clear_error(monkeypatch, tmp_path):
    mindspeed_standin.forget()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "standin" not in p])
    if A.mindspeed_llm_installed():
        pytest.skip("a mindspeed_llm is installed here")
    with pytest.raises(PoseidonError, match="--poseidon-backend megatron"):
        A.import_mindspeed_llm(SCRIPT, USER_ARGV)
    assert A.mindspeed_llm_registers_layout() is False
