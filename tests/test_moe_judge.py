"""The judge builds the model config; MoE plans carry MTP and pin their dispatcher (issue 36,
items 1 and 5; build items 2 and 6).

* a plan of a model with MTP layers puts them (``m``) at the end of its layout, before the loss,
  with ``--mtp-num-layers``; a MoE plan pins the token dispatcher it priced
  (``--moe-token-dispatcher-type``; megatron-core's default is ``allgather``), the user's own
  choice kept;
* the judge (``megatron/launch/judge.py``) runs Megatron's ``parse_args`` + ``validate_args`` **and**
  ``core_transformer_config_from_args`` (the layout's own checks run in the config's
  ``__post_init__``): a layout without the MTP layer passes ``validate_args`` and is refused by
  the config build; on a CPU host without emulation the device queries are answered for the
  block only;
* ``poseidon plan --megatron-args`` is judged by the installed Megatron the same way;
* CI (slow): each MoE preset's plan on ``moe-3type-512`` and a long-context Qwen3-30B-A3B plan
  with CP: the printed flags, after the model's, pass the core_v0.19.0 tree's ``parse_args`` +
  ``validate_args`` + ``core_transformer_config_from_args`` at the plan's world size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

import frameworks as fw
from poseidon_plugin import cli
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch import argv as argvmod
from poseidon_plugin.megatron.launch import judge
from poseidon_plugin.model import ModelSpec, model_from_megatron_args
from poseidon_plugin.plan import Plan
from poseidon_plugin.training import TrainingSetup

from test_megatron_argv import make_plan

# dense layer 0, MoE layers 1-3 (shared expert), one MTP layer
MIXED_MTP = ModelSpec(name="mixed-mtp", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=4, vocab_size=512, seq_length=64,
                      num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                      first_k_dense_replace=1, moe_shared_expert_intermediate_size=32,
                      mtp_num_layers=1)


def _moe_plan(layers=(2, 2), tp=1, dp=2, vpp=1, ep=2, mtp=1, dispatcher="alltoall") -> Plan:
    return replace(make_plan(layers=layers, tp=tp, dp=dp, vpp=vpp), moe=True, ep=ep,
                   mtp_num_layers=mtp, moe_token_dispatcher_type=dispatcher)


# --------------------------------------------------------------------------- the flags

def test_the_layout_carries_the_mtp_layers_and_the_flags_the_dispatcher():
    plan = _moe_plan()
    args = plan.megatron_args()
    assert argvmod.flag_value(args, "--pipeline-model-parallel-layout") == "Et*2|t*2mL"
    assert argvmod.flag_value(args, "--mtp-num-layers") == "1"
    assert argvmod.flag_value(args, "--moe-token-dispatcher-type") == "alltoall"
    assert argvmod.flag_value(plan.mindspeed_llm_args(), "--moe-token-dispatcher-type") \
        == "alltoall"
    # two MTP layers; interleaved: the last virtual stage of the last rank holds them
    assert _moe_plan(mtp=2).pipeline_layout() == "Et*2|t*2m*2L"
    assert _moe_plan(layers=(4, 4), vpp=2).pipeline_layout() == "Et*2|t*2|t*2|t*2mL"
    # the user's dispatcher is the one pinned; a dense model's plan pins none
    assert argvmod.flag_value(_moe_plan(dispatcher="allgather").megatron_args(),
                              "--moe-token-dispatcher-type") == "allgather"
    assert not argvmod.find_flag(make_plan().megatron_args(), "--moe-token-dispatcher-type")
    # the plan JSON keeps both; a dense plan's dispatcher is null, an older MoE plan's alltoall
    back = Plan.from_json(_moe_plan(dispatcher="allgather").to_json())
    assert (back.mtp_num_layers, back.moe_token_dispatcher_type) == (1, "allgather")
    assert json.loads(make_plan().to_json())["moe_token_dispatcher_type"] is None
    old = json.loads(_moe_plan().to_json())
    del old["moe_token_dispatcher_type"], old["mtp_num_layers"]
    assert Plan.from_json(json.dumps(old)).moe_token_dispatcher_type == "alltoall"
    old["moe_token_dispatcher_type"] = "bogus"
    with pytest.raises(PoseidonError, match="moe_token_dispatcher_type: expected one of"):
        Plan.from_json(json.dumps(old))


def test_the_users_dispatcher_is_kept_and_none_chosen_is_pinned():
    base = ["--num-layers", "4", "--num-experts", "4"]
    assert argvmod.pin_dispatcher(base) == [*base, "--moe-token-dispatcher-type", "alltoall"]
    mine = [*base, "--moe-token-dispatcher-type=allgather"]
    assert argvmod.pin_dispatcher(mine) == mine
    assert argvmod.pin_dispatcher(["--num-layers", "4"]) == ["--num-layers", "4"]
    # the model read from the launch's args records the dispatcher (what the plan prices)
    args = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64,
                vocab_size=512, num_experts=4, moe_router_topk=2)
    from types import SimpleNamespace
    for chosen in ("alltoall", "allgather"):
        spec = model_from_megatron_args(SimpleNamespace(**args, moe_token_dispatcher_type=chosen))
        assert spec.moe_token_dispatcher_type == chosen
    # poseidon plan --megatron-args: the user's choice, or a one-line error
    assert cli.users_dispatcher(MIXED_MTP, "--moe-token-dispatcher-type allgather") \
        .moe_token_dispatcher_type == "allgather"
    assert cli.users_dispatcher(MIXED_MTP, "").moe_token_dispatcher_type == "alltoall"
    with pytest.raises(PoseidonError, match="expected one of alltoall, allgather"):
        cli.users_dispatcher(MIXED_MTP, "--moe-token-dispatcher-type ring")


def test_another_dispatcher_than_the_priced_one_is_said(capsys):
    """A kept ``flex`` dispatcher is priced with the alltoall one's communication: one
    warning says so (it was silent); the two priced ones, and a dense model, get none."""
    flex = cli.users_dispatcher(MIXED_MTP, "--moe-token-dispatcher-type flex")
    note = flex.planning_note()
    assert note and "flex" in note and "priced as the alltoall" in note, note
    assert cli.users_dispatcher(MIXED_MTP, "").planning_note() is None
    assert cli.users_dispatcher(MIXED_MTP, "--moe-token-dispatcher-type allgather") \
        .planning_note() is None
    from types import SimpleNamespace
    dense = model_from_megatron_args(SimpleNamespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
        moe_token_dispatcher_type="allgather"))
    assert dense.planning_note() is None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["plan", "--cluster", os.path.join(root, "examples/clusters/small-two-type.yaml"),
            "--model", os.path.join(root, "examples/models/tiny-moe.yaml"),
            "--global-batch-size", "16", "--seq-length", "128", "--no-baselines",
            "--no-runner-up", "--json"]
    assert cli.main([*argv, "--megatron-args", "--moe-token-dispatcher-type flex"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["moe_token_dispatcher_type"] == "flex"
    (line,) = [l for l in err.splitlines() if "dispatcher" in l]
    assert line.startswith("poseidon: warning: --moe-token-dispatcher-type flex: "), line
    assert cli.main([*argv, "--megatron-args", "--moe-token-dispatcher-type allgather"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["moe_token_dispatcher_type"] == "allgather"
    assert not [l for l in err.splitlines() if "dispatcher" in l], err


# --------------------------------------------------------------------------- the judge

# no Transformer Engine on this host: megatron-core's default RoPE fusion needs it (a property of
# the host, not of the plan: the config build refuses it with or without the plan's flags)
NO_TE = ["--no-rope-fusion"]


def _megatron():
    return pytest.importorskip("megatron.training.arguments")


def _parsed(new_argv):
    margs = _megatron()
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *new_argv]
    try:
        return margs.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = saved


def test_the_judge_builds_the_model_config():
    """A layout without the model's MTP layer passes Megatron's validate_args; building the
    TransformerConfig refuses it (issue 36, item 1). The plan's own layout is accepted, and
    Megatron reads the dispatcher and MTP layers the plan pins."""
    argv = judge.model_argv(MIXED_MTP, 64, TrainingSetup()) + NO_TE
    good = argvmod.rewrite_argv(argv, _moe_plan(), "megatron")
    parsed = _parsed(good)
    assert (parsed.moe_token_dispatcher_type, parsed.mtp_num_layers) == ("alltoall", 1)
    assert parsed.moe_layer_freq == [0, 1, 1, 1]
    assert judge.framework_refusal("pretrain_gpt.py", good, 4, device=False) is None
    no_m = argvmod.rewrite_argv(argv, _moe_plan(mtp=0), "megatron")
    assert argvmod.flag_value(no_m, "--pipeline-model-parallel-layout") == "Et*2|t*2L"
    why = judge.framework_refusal("pretrain_gpt.py", no_m, 4, device=False)
    assert why == ("Megatron's core_transformer_config_from_args: Number of mtp layers in "
                   "layout must match mtp_num_layers")


@pytest.mark.integration   # torch / megatron-core
def test_the_judge_answers_the_device_queries_without_a_device_for_the_block_only():
    """TP 2 on a CPU host without emulation: validate_args asks the device's architecture;
    the planning judge answers as a Hopper (and CUDA_DEVICE_MAX_CONNECTIONS=1) within the
    check only."""
    import torch

    from poseidon_plugin.megatron.emulate import emulation

    _megatron()
    if torch.cuda.is_available() or emulation.shims_installed():
        pytest.skip("a device (or the emulation) answers here")
    before = (torch.cuda.get_device_properties, torch.cuda.get_device_capability,
              os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    new = argvmod.rewrite_argv(judge.model_argv(MIXED_MTP, 64, TrainingSetup()) + NO_TE,
                               _moe_plan(tp=2), "megatron")
    assert argvmod.find_flag(new, "--sequence-parallel")
    assert judge.framework_refusal("pretrain_gpt.py", new, 8, device=False) is None
    assert (torch.cuda.get_device_properties, torch.cuda.get_device_capability,
            os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")) == before


SMALL_CLUSTER = """name: small-moe
device_types:
  gpu: {memory_gib: 8, peak_tflops: 100, efficiency: 0.5, intra_node_gbps: 800}
nodes:
  - {device_type: gpu, devices_per_node: 4, count: 1}
links:
  inter_node_gbps: {gpu: 200}
  cross_type_gbps: 100
  latency_ms: 0.001
"""


def _plan_cli(capsys, tmp_path, megatron_args):
    _megatron()
    (tmp_path / "c.yaml").write_text(SMALL_CLUSTER)
    fields = {f.name: getattr(MIXED_MTP, f.name) for f in dataclasses.fields(MIXED_MTP)}
    (tmp_path / "m.yaml").write_text("".join(f"{k}: {v}\n" for k, v in fields.items()
                                             if v is not None))
    rc = cli.main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model",
                   str(tmp_path / "m.yaml"), "--global-batch-size", "8", "--seq-length", "64",
                   "--workers", "1", "--no-baselines", "--no-runner-up", "--json",
                   "--megatron-args", megatron_args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_megatron_args_keep_the_users_dispatcher_and_are_judged(capsys, tmp_path):
    rc, out, err = _plan_cli(capsys, tmp_path, "--moe-token-dispatcher-type allgather")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["moe_token_dispatcher_type"] == "allgather"
    assert argvmod.flag_value(plan["megatron_args"], "--moe-token-dispatcher-type") \
        == "allgather"


@pytest.mark.parametrize("version,allowed", [("0.12.1", False), ("0.19.2", True)])
def test_plan_megatron_args_search_under_the_installed_megatrons_moe_free_stage_rule(
        capsys, tmp_path, monkeypatch, version, allowed):
    """``poseidon plan --megatron-args`` is judged by the installed Megatron, so its search
    follows that megatron-core's rule as a launch's does: before 0.19 no pipeline stage may
    hold only the leading dense layers (it hangs at the first optimizer step); the plan has
    none such. Before, the offline search always allowed them."""
    from poseidon_plugin import search as search_pkg
    from poseidon_plugin.megatron import provenance
    from poseidon_plugin.search import rules

    monkeypatch.setattr(provenance, "megatron_core",
                        lambda module=None: provenance.Component("megatron-core", version))
    seen = []
    real = search_pkg.search_plan

    def recording(cluster, model, options, *args, **kwargs):
        seen.append(options.moe_free_stages)
        return real(cluster, model, options, *args, **kwargs)

    monkeypatch.setattr(search_pkg, "search_plan", recording)
    rc, out, err = _plan_cli(capsys, tmp_path, "--moe-token-dispatcher-type alltoall")
    assert rc == 0, err
    assert seen and set(seen) == {allowed}, seen
    plan = Plan.from_json(out)
    if not allowed:
        assert rules.stages_without_moe_layers(plan, MIXED_MTP) == [], plan.stages


def test_plan_megatron_args_refused_whatever_the_plan_is_a_warning(capsys, tmp_path, caplog):
    """Megatron builds no config with the shared-expert overlap on the allgather dispatcher
    (TransformerConfig.__post_init__; validate_args lets it through) whatever the plan: not the
    plan's fault, so the plan is kept and a warning says it is not judged."""
    rc, out, err = _plan_cli(capsys, tmp_path,
                             "--moe-token-dispatcher-type allgather --moe-shared-expert-overlap")
    assert rc == 0, err
    assert not any("core_transformer_config_from_args" in line
                   for line in json.loads(out)["search"]["excluded"])
    assert ("not judged here: the installed Megatron refuses the model's and --megatron-args' "
            "flags without them too (Megatron's core_transformer_config_from_args: "
            "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.)"
            ) in caplog.text


def test_plan_megatron_args_a_plan_megatron_refuses_is_searched_again(capsys, tmp_path,
                                                                      monkeypatch):
    """The planning judge in the loop: a plan its Megatron check refuses (here: every pp=2
    one) is excluded, noted, and the search goes on."""
    real = judge.framework_refusal
    judged = []

    def refuse_the_first(script, new_argv, world_size, backend="megatron", device=True):
        shape = [argvmod.flag_value(new_argv, f) for f in PLAN_SHAPE]
        if shape[1] is not None:      # not the check of the flags alone (no plan flags)
            judged.append(shape)
        if judged and shape == judged[0]:
            return "Megatron's core_transformer_config_from_args: refused here"
        return real(script, new_argv, world_size, backend, device)

    monkeypatch.setattr(judge, "framework_refusal", refuse_the_first)
    rc, out, err = _plan_cli(capsys, tmp_path, "--lr 1e-4")
    assert rc == 0, err
    plan = json.loads(out)
    assert len(judged) == 2
    assert [argvmod.flag_value(plan["megatron_args"], f) for f in PLAN_SHAPE] == judged[1]
    assert judged[1] != judged[0]
    assert any(line.endswith("excluded: Megatron's core_transformer_config_from_args: "
                             "refused here") for line in plan["search"]["excluded"]), err


PLAN_SHAPE = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--pipeline-model-parallel-layout", "--micro-batch-size",
              "--expert-model-parallel-size")


# --------------------------------------------------------------------------- CI: the presets

TREE = fw.tree("megatron-lm-core_v0.19.0")
MOE_CLUSTER = os.path.join(fw.ROOT, "examples", "clusters", "moe-3type-512.yaml")
PRESET_PLANS = {
    "deepseek-v3": ["--model", "deepseek-v3", "--global-batch-size", "1024",
                    "--seq-length", "4096", "--distributed-optimizer"],
    "qwen3-235b-a22b": ["--model", "qwen3-235b-a22b", "--global-batch-size", "1024",
                        "--seq-length", "4096", "--distributed-optimizer"],
    "qwen3-30b-a3b": ["--model", "qwen3-30b-a3b", "--global-batch-size", "512",
                      "--seq-length", "4096", "--distributed-optimizer"],
    "qwen3-30b-a3b-cp": ["--model", "qwen3-30b-a3b", "--global-batch-size", "64",
                         "--seq-length", "32768", "--cp", "4", "--ep", "8",
                         "--distributed-optimizer"],
}
PROBE = r"""
import json, sys
import megatron.training.arguments as margs
from poseidon_plugin.megatron.launch import judge
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.training import TrainingSetup
out = {"megatron": margs.__file__}
for name, path in json.loads(sys.argv[1]).items():
    plan = Plan.from_json(open(path).read())
    d = json.loads(open(path).read())
    setup = TrainingSetup(distributed_optimizer=True)
    argv = judge.model_argv(get_model(plan.model_name), plan.seq_length, setup)
    argv += ["--no-rope-fusion"]        # no Transformer Engine here (the test's NO_TE)
    argv += d["megatron_args"]          # the printed flags, verbatim, after the model's
    sys.argv = ["pretrain_gpt.py", *argv]
    a = margs.parse_args(ignore_unknown_args=True)
    out[name] = {"refusal": judge.framework_refusal("pretrain_gpt.py", argv, plan.world_size,
                                                    device=False),
                 "parsed": [a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                            a.expert_model_parallel_size, a.context_parallel_size,
                            a.moe_token_dispatcher_type, a.mtp_num_layers],
                 "plan": [plan.tp, plan.pp, plan.ep, plan.cp, "alltoall",
                          plan.mtp_num_layers or None],
                 "world_size": plan.world_size}
print("PROBE " + json.dumps(out))
"""


@pytest.mark.integration   # torch / megatron-core
@pytest.mark.slow   # 14 CPU-s (4 searches of 8 s wall each, one probe process) on the 2-core box
def test_the_moe_presets_printed_flags_build_a_config_on_the_0_19_tree(tmp_path):
    """Each MoE preset's plan on moe-3type-512 (and Qwen3-30B-A3B at 32k tokens with CP 4 and EP 8):
    the model's flags and the printed ``megatron_args`` pass core_v0.19.0's parse_args,
    validate_args and core_transformer_config_from_args at the plan's world size, with the
    plan's TP / PP / EP / CP, the all-to-all dispatcher and DeepSeek-V3's MTP layer."""
    if not os.path.isdir(TREE):
        pytest.skip(f"the Megatron-LM core_v0.19.0 tree is not here ({TREE}): a user's clone")
    paths = {}
    for name, flags in PRESET_PLANS.items():
        paths[name] = str(tmp_path / f"{name}.json")
        rc = cli.main(["plan", "--cluster", MOE_CLUSTER, *flags, "--time-budget", "8",
                       "--no-baselines", "--no-runner-up", "--json", "--out", paths[name]])
        assert rc == 0, name
    python = os.environ.get("POSEIDON_MCORE_PYTHON") or sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TREE, fw.ROOT]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    proc = subprocess.run([python, "-c", PROBE, json.dumps(paths)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=str(tmp_path))
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[0][6:])
    assert out.pop("megatron").startswith(TREE)
    assert out["deepseek-v3"]["plan"][-1] == 1           # its MTP layer is in the flags
    assert out["qwen3-30b-a3b-cp"]["plan"][2:4] == [8, 4]   # EP 8 beside CP 4
    for name, seen in out.items():
        assert seen["refusal"] is None, (name, seen)
        assert seen["parsed"] == seen["plan"], name
