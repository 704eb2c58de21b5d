"""Run by tests/test_mindspeed_llm.py in MindSpeed-LLM's side environment, one release on the path
(tests/frameworks.py): the real adaptor, the real feature patches, the real parse_args and
validate_args as MindSpeed-LLM patches them; NPU libraries from tests/npu_fakes. Prints one JSON
line (``PROBE {...}``) with what each check saw; the test asserts on it.

Usage: python msllm_probe.py RELEASE
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCRIPT = "pretrain_gpt.py"
LAYER_LIST_PATCH = "megatron.core.transformer.transformer_block.get_num_layers_to_build"
BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
        "--mock-data", "--lr", "1e-4", "--train-iters", "2"]
USER_ARGV = [*BASE, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4"]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _validated(argv: list[str], world_size: int):
    """MindSpeed-LLM's patched parse_args + validate_args on ``[SCRIPT] + argv`` (a fresh parse;
    Megatron's global args unset afterwards, as a fresh process has them)."""
    import megatron.training.arguments as margs
    from megatron.training import global_vars

    saved = sys.argv, os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    sys.argv = [SCRIPT, *argv]
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.parse_args()
            global_vars.set_args(args)       # MindSpeed-LLM's validation reads the global args
            margs.validate_args(args, {})
        return args
    finally:
        global_vars.set_args(None)
        sys.argv = saved[0]
        for k, v in (("WORLD_SIZE", saved[1]), ("RANK", saved[2])):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _patched(name: str) -> bool:
    from mindspeed.patch_utils import MindSpeedPatchesManager

    info = MindSpeedPatchesManager.patches_info.get(name)
    return info is not None and bool(getattr(info, "is_applied", True)) and (
        getattr(info, "patch_func", None) is not None or bool(getattr(info, "wrappers", None)))


def main(release: str) -> dict:
    from poseidon_plugin.megatron.emulate import emulation

    emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="emu", memory_bytes=1 << 32)
    from poseidon_plugin.errors import PoseidonError
    from poseidon_plugin.megatron.launch import argv as A
    from test_megatron_argv import make_plan

    out: dict = {"release": release}
    sys.argv = ["poseidon"]
    adaptor = A.import_mindspeed_llm(SCRIPT, [*USER_ARGV, "--num-layer-list", "1,2,2,3"])
    out["adaptor"] = adaptor.__name__
    out["adaptor_file"] = adaptor.__file__
    out["argv_restored"] = sys.argv == ["poseidon"]
    out["adaptor_is_submodule"] = importlib.util.find_spec("mindspeed_llm.megatron_adaptor") is not None
    out["layer_list_patched_at_import"] = _patched(LAYER_LIST_PATCH)
    out["layout_registered"] = A.mindspeed_llm_registers_layout()

    checks = {}

    def check(name, fn):
        try:
            checks[name] = {"ok": True, "value": fn()}
        except BaseException as e:  # noqa: BLE001 - reported, the test decides
            checks[name] = {"ok": False, "error": _error(e),
                            "trace": traceback.format_exc()[-1500:]}

    def uneven():
        new = A.rewrite_argv(USER_ARGV, make_plan(layers=(6, 2)), "mindspeed-llm",
                             mindspeed_layout=A.mindspeed_llm_registers_layout())
        a = _validated(new, world_size=2)
        return {"flag": A.flag_value(new, "--num-layer-list"),
                "layout_flag": A.flag_value(new, "--pipeline-model-parallel-layout"),
                "num_layers": a.num_layers, "pp": a.pipeline_model_parallel_size,
                "num_layer_list": a.num_layer_list,
                "layout": getattr(a, "pipeline_model_parallel_layout", None)}

    def interleaved():
        plan = make_plan(layers=(5, 3), vpp=2)
        layout = A.mindspeed_llm_registers_layout()
        try:
            new = A.rewrite_argv(USER_ARGV, plan, "mindspeed-llm", mindspeed_layout=layout)
        except PoseidonError as e:
            return {"refused": str(e)}
        a = _validated(new, world_size=2)
        return {"layer_list_flag": "--num-layer-list" in new,
                "layout": A.flag_value(new, "--pipeline-model-parallel-layout"),
                "expected_layout": plan.pipeline_layout(),
                "vpp": a.virtual_pipeline_model_parallel_size}

    def layer_list_with_vpp():
        _validated([*BASE, "--pipeline-model-parallel-size", "2", "--num-layer-list", "6,2",
                    "--num-layers-per-virtual-pipeline-stage", "1"], world_size=2)
        return "accepted"

    def repatch():
        seen = {}
        new = A.rewrite_argv(USER_ARGV, make_plan(layers=(6, 2)), "mindspeed-llm")
        sys.argv = [SCRIPT, *new]          # what the runner does before re-applying
        seen["applied"] = A.apply_mindspeed_llm(new)
        seen["layer_list_after_uneven"] = _patched(LAYER_LIST_PATCH)
        even = A.rewrite_argv(BASE, make_plan(layers=(8,)), "mindspeed-llm")
        sys.argv = [SCRIPT, *even]
        seen["applied_even"] = A.apply_mindspeed_llm(even)
        seen["layer_list_after_even"] = _patched(LAYER_LIST_PATCH)
        return seen

    def judged():
        """The judge (megatron/launch/judge.py) with MindSpeed-LLM loaded: parse_args, validate_args,
        the config build and the layout's checks; a layout without the MTP layer the flags ask
        for is refused, the plan's own (with ``m``) and the uneven split are accepted."""
        from dataclasses import replace

        from poseidon_plugin.megatron.launch import judge
        from poseidon_plugin.megatron.emulate import emulation as emu

        seen = {"shims": emu.shims_installed()}
        layout = A.mindspeed_llm_registers_layout()
        plans = {"uneven": (make_plan(layers=(6, 2)), USER_ARGV)}
        if layout:
            mtp = [*USER_ARGV, "--mtp-num-layers", "1", "--position-embedding-type", "rope"]
            plans["interleaved"] = (make_plan(layers=(5, 3), vpp=2), USER_ARGV)
            plans["interleaved_mtp"] = (replace(make_plan(layers=(5, 3), vpp=2),
                                                mtp_num_layers=1), mtp)
            plans["interleaved_mtp_no_m"] = (make_plan(layers=(5, 3), vpp=2), mtp)
        for name, (plan, user) in plans.items():
            new = A.rewrite_argv(user, plan, "mindspeed-llm", mindspeed_layout=layout)
            seen[name] = judge.framework_refusal(SCRIPT, new, plan.world_size, "mindspeed-llm")
        return seen

    check("judge", judged)
    check("uneven", uneven)
    check("interleaved", interleaved)
    check("layer_list_with_vpp", layer_list_with_vpp)
    check("repatch", repatch)
    out["checks"] = checks
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    print("PROBE " + json.dumps(result, default=str), flush=True)
