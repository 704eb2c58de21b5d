"""Options, refused flags, argv rewrite and MindSpeed-LLM translation (pure Python, no torch)."""

from __future__ import annotations

import sys
import types

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch import argv as A
from poseidon_plugin.megatron.launch.options import extract_options
from poseidon_plugin.plan import DeviceSlot, Plan, StagePlan


def make_plan(layers=(6, 2), tp=1, dp=2, mbs=1, gbs=16, vpp=1, types=None, nodes=None) -> Plan:
    """A real ``Plan`` (no search): stage i of type ``types[i]`` on cluster node ``nodes[i]``,
    devices[dp_rank][tp_rank] = slot (node, dp_rank * tp + tp_rank)."""
    types = types or [f"t{i}" for i in range(len(layers))]
    nodes = nodes or list(range(len(layers)))
    stages = tuple(StagePlan(i, types[i], tp, dp, n, 1.0, 2.0, 0.0, 0.0, 0.0, 1, 1,
                             tuple(tuple(DeviceSlot(nodes[i], d * tp + t) for t in range(tp))
                                   for d in range(dp)))
                   for i, n in enumerate(layers))
    schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    return Plan(schedule, vpp, dp, mbs, gbs // (mbs * dp), gbs, 128, stages, 10.0)


# ------------------------------------------------------------------------------------- options

def test_options_are_stripped_in_both_forms():
    opts, rest = extract_options(["--num-layers", "8", "--poseidon-auto", "--poseidon-timeout=7",
                                  "--poseidon-emulate", "e.yaml", "--lr", "1e-3",
                                  "--poseidon-schedules", "1f1b,interleaved-1f1b",
                                  "--poseidon-micro-batch-sizes=1,2", "--poseidon-dry-run"])
    assert rest == ["--num-layers", "8", "--lr", "1e-3"]
    assert opts.auto and opts.dry_run and opts.timeout_s == 7.0 and opts.emulate_file == "e.yaml"
    assert opts.schedules == ("1f1b", "interleaved-1f1b")
    assert opts.micro_batch_sizes == (1, 2)


def test_dry_run_alone_implies_auto():
    opts, rest = extract_options(["--poseidon-dry-run"])
    assert opts.auto and rest == []


def test_no_options_means_no_plan():
    opts, rest = extract_options(["--num-layers", "8"])
    assert not opts.auto and not opts.any_present and rest == ["--num-layers", "8"]


@pytest.mark.parametrize("argv, message", [
    (["--poseidon-bogus"], "unknown option --poseidon-bogus"),
    (["--poseidon-timeout", "-1"], "expected a number > 0"),
    (["--poseidon-timeout"], "expected a value"),
    (["--poseidon-backend", "deepspeed"], "megatron, mindspeed-llm"),
    (["--poseidon-tp", "1,x"], "comma-separated list of integers"),
    (["--poseidon-auto=1"], "takes no value"),
])
def test_bad_options(argv, message):
    with pytest.raises(PoseidonError, match=message):
        extract_options(argv)


# ---------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("flag", ["--use-checkpoint-args", "--inprocess-restart", "--yaml-cfg=x.yaml"])
def test_refused_flags(flag):
    with pytest.raises(PoseidonError, match="cannot be combined with " + flag.split("=")[0]):
        A.check_refused(["--num-layers", "8", flag])


def test_plans_context_and_expert_parallelism_but_refuses_a_malformed_ep():
    A.check_refused(["--context-parallel-size", "1"])
    A.check_refused(["--context-parallel-size", "2"])     # planned (the plan's flag replaces it)
    assert "--context-parallel-size" in A.PLAN_VALUE_FLAGS
    A.check_refused(["--expert-model-parallel-size=4"])   # planned, not refused
    for bad in ("0", "x", "-2"):
        with pytest.raises(PoseidonError, match=f"--expert-model-parallel-size: expected an "
                                                f"integer >= 1, got '{bad}'"):
            A.check_refused(["--expert-model-parallel-size", bad])


# ------------------------------------------------------------------------------------ rewrite

def test_layout_string():
    """The layout is the plan's own (``Plan.pipeline_layout``), no second derivation here."""
    assert make_plan(layers=(3, 5, 1)).pipeline_layout() == "Et*3|t*5|tL"
    assert make_plan(layers=(0, 6, 6, 1)).pipeline_layout() == "E|t*6|t*6|tL"
    assert make_plan(layers=(8,)).pipeline_layout() == "Et*8L"


def test_rewrite_strips_conflicts_and_appends_plan():
    argv = ["--num-layers", "8", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size=2",
            "--decoder-first-pipeline-num-layers", "3", "--account-for-loss-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage", "2", "--sequence-parallel",
            "--use-tp-pp-dp-mapping", "--micro-batch-size", "4", "--global-batch-size", "16", "--bf16"]
    out = A.rewrite_argv(argv, make_plan(), "megatron")
    assert out == ["--num-layers", "8", "--bf16",
                   "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                   "--pipeline-model-parallel-layout", "Et*6|t*2L",
                   "--micro-batch-size", "1", "--global-batch-size", "16"]


def test_rewrite_keeps_sequence_parallel_with_tp():
    out = A.rewrite_argv(["--sequence-parallel"], make_plan(tp=2), "megatron")
    assert "--sequence-parallel" in out


def test_rewrite_uses_the_plans_own_flags():
    plan = make_plan(layers=(6, 2), dp=1, gbs=8, vpp=2)  # interleaved: chunks 3+3 and 1+1
    out = A.rewrite_argv(["--lr", "1"], plan, "megatron")
    assert out[2:] == plan.megatron_args() == A.backend_flags(plan, "megatron")
    assert out[:2] == ["--lr", "1"] and "Et*3|t|t*3|tL" in out
    assert A.flag_value(out, "--micro-batch-size") == "1"
    assert A.flag_value(out, "--global-batch-size") == "8"


def test_flag_value_last_wins():
    assert A.flag_value(["--x", "1", "--x=2", "--x", "3"], "--x") == "3"
    assert A.flag_value(["--y", "1"], "--x", "d") == "d"


# --------------------------------------------------------------------------------- MindSpeed-LLM

def test_mindspeed_translation_uses_num_layer_list():
    argv = ["--num-layers", "8", "--pipeline-model-parallel-layout", "Et*4|t*4L",
            "--num-layer-list", "4,4", "--pipeline-num-transformer-layers", "[[4],[4]]"]
    out = A.rewrite_argv(argv, make_plan(), "mindspeed-llm")
    assert A.flag_value(out, "--num-layer-list") == "6,2"
    assert "--pipeline-model-parallel-layout" not in out
    assert "--pipeline-num-transformer-layers" not in out
    assert out.count("--num-layer-list") == 1


def test_mindspeed_refuses_what_num_layer_list_cannot_do():
    with pytest.raises(PoseidonError, match="noop-layers"):
        A.rewrite_argv(["--noop-layers", "7"], make_plan(), "mindspeed-llm")
    with pytest.raises(PoseidonError, match="dualpipev"):
        A.rewrite_argv(["--schedules-method", "dualpipev"], make_plan(), "mindspeed-llm")
    with pytest.raises(PoseidonError, match="virtual pipeline.*--poseidon-max-virtual-stages 1"):
        A.rewrite_argv([], make_plan(vpp=2), "mindspeed-llm")
    with pytest.raises(PoseidonError, match="--noop-layers with --pipeline-model-parallel-layout"):
        A.rewrite_argv(["--noop-layers", "7"], make_plan(vpp=2), "mindspeed-llm", mindspeed_layout=True)
    with pytest.raises(PoseidonError, match="--recompute-in-bubble"):
        A.rewrite_argv(["--recompute-in-bubble"], make_plan(vpp=2), "mindspeed-llm",
                       mindspeed_layout=True)


def test_mindspeed_interleaved_uses_the_layout_where_registered():
    out = A.rewrite_argv(["--num-layer-list", "4,4", "--num-layers-per-virtual-pipeline-stage", "2"],
                         make_plan(layers=(6, 2), vpp=2), "mindspeed-llm", mindspeed_layout=True)
    assert "--num-layer-list" not in out and "--num-layers-per-virtual-pipeline-stage" not in out
    assert A.flag_value(out, "--pipeline-model-parallel-layout") == make_plan(vpp=2).pipeline_layout()


def test_mindspeed_split_is_the_layout_where_registered():
    """Issue 36 item 11: MindSpeed-LLM numbers --num-layer-list's layers as if the split were
    even (stage 1 of 6,2 gets layers 5..10 of 8); where it registers the layout flag (v26.1.0)
    a non-interleaved split is written as the layout, which it numbers right."""
    argv = ["--num-layers", "8", "--num-layer-list", "4,4"]
    plan = make_plan(layers=(6, 2))
    out = A.rewrite_argv(argv, plan, "mindspeed-llm", mindspeed_layout=True)
    assert "--num-layer-list" not in out
    assert A.flag_value(out, "--pipeline-model-parallel-layout") == plan.pipeline_layout()
    assert plan.pipeline_layout() == "Et*6|t*2L"
    assert A.backend_flags(plan, "mindspeed-llm", True) == plan.mindspeed_llm_args(True)
    assert "--num-layer-list" in plan.mindspeed_llm_args()     # a release without it (2.3.0)
    with pytest.raises(PoseidonError, match="--noop-layers with --pipeline-model-parallel-layout"):
        A.rewrite_argv(["--noop-layers", "7"], plan, "mindspeed-llm", mindspeed_layout=True)
    assert A.mindspeed_repatch_args(out)["num_layer_list"] is None


def test_mindspeed_single_stage_has_no_layer_list():
    out = A.rewrite_argv([], make_plan(layers=(8,)), "mindspeed-llm")
    assert "--num-layer-list" not in out


def test_mindspeed_repatch_called_when_adaptor_already_imported(monkeypatch):
    calls = []
    pkg = types.ModuleType("mindspeed_llm")
    tasks = types.ModuleType("mindspeed_llm.tasks")
    adaptor = types.ModuleType("mindspeed_llm.tasks.megatron_adaptor_v2")
    adaptor.repatch = lambda d: calls.append(d)
    pkg.megatron_adaptor = adaptor  # a name in mindspeed_llm/__init__.py, as upstream
    for name, mod in (("mindspeed_llm", pkg), ("mindspeed_llm.tasks", tasks),
                      ("mindspeed_llm.tasks.megatron_adaptor_v2", adaptor)):
        monkeypatch.setitem(sys.modules, name, mod)
    out = A.rewrite_argv(["--tensor-model-parallel-size", "8"], make_plan(), "mindspeed-llm")
    assert A.apply_mindspeed_llm(out) is True
    (d,) = calls
    assert {k: d[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                              "micro_batch_size", "global_batch_size", "num_layer_list")} == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "micro_batch_size": 1,
        "global_batch_size": 16, "num_layer_list": "6,2"}
    # split flags the rewrite removed are cleared on what repatch re-parses
    assert d["num_layers_per_virtual_pipeline_stage"] is None and d["pipeline_model_parallel_layout"] is None
    assert d["account_for_loss_in_pipeline_split"] is False and d["sequence_parallel"] is False
    assert A.detect_backend("auto", None) == "mindspeed-llm"


def test_mindspeed_repatch_not_needed_before_import(monkeypatch):
    monkeypatch.delitem(sys.modules, "mindspeed_llm", raising=False)
    assert A.apply_mindspeed_llm(["--num-layer-list", "6,2"]) is False


def test_detect_backend_from_script(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("mindspeed_llm")]:
        monkeypatch.delitem(sys.modules, name)
    ms = tmp_path / "ms.py"
    ms.write_text("from mindspeed_llm import megatron_adaptor\n")
    mg = tmp_path / "mg.py"
    mg.write_text("from megatron.training import pretrain\n")
    assert A.detect_backend("auto", str(ms)) == "mindspeed-llm"
    assert A.detect_backend("auto", str(mg)) == "megatron"
    assert A.detect_backend("megatron", str(ms)) == "megatron"


def test_overridden_user_flags_are_named():
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=4",
            "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "2",
            "--global-batch-size", "16", "--use-tp-pp-dp-mapping", "--lr", "1"]
    new = A.rewrite_argv(argv, make_plan(layers=(6, 2), tp=1), "megatron")
    assert A.overridden_flags(argv, new) == [
        "--tensor-model-parallel-size 2 -> 1", "--pipeline-model-parallel-size 4 -> 2",
        "--num-layers-per-virtual-pipeline-stage dropped",
        "--use-tp-pp-dp-mapping dropped: Poseidon places ranks in the default order",
        "--sequence-parallel dropped: tp=1"]
    # the same values, or flags the user never set: nothing to say
    assert A.overridden_flags(["--lr", "1"], new) == []
    same = ["--tensor-model-parallel-size", "1", "--micro-batch-size", "1"]
    assert A.overridden_flags(same, A.rewrite_argv(same, make_plan(), "megatron")) == []


def test_spec_keywords_follow_the_installed_signature():
    from poseidon_plugin.megatron.profile.profiler import _call_with_known

    def old_spec(num_experts=None, normalization=None):
        return (num_experts, normalization)

    def wrapped(*args, **kwargs):  # a MindSpeed-style wrapper forwards everything
        return kwargs

    assert _call_with_known(old_spec, num_experts=None, normalization="RMSNorm",
                            multi_latent_attention=False) == (None, "RMSNorm")
    with pytest.raises(PoseidonError, match="takes no multi_latent_attention"):
        _call_with_known(old_spec, multi_latent_attention=True)
    assert _call_with_known(wrapped, multi_latent_attention=True) == {"multi_latent_attention": True}


# ------------------------------------------------------------------------ expert parallelism


class _WithEP:
    """``plan`` with an EP degree (``Plan.ep``): the plan itself where ``Plan`` has the field,
    else a view of it that adds one (what the rewrite reads of a plan is the same)."""

    def __new__(cls, plan: Plan, ep: int | None):
        import dataclasses

        if ep is not None and "ep" in {f.name for f in dataclasses.fields(Plan)}:
            return dataclasses.replace(plan, ep=ep)
        return super().__new__(cls)

    def __init__(self, plan: Plan, ep: int | None) -> None:
        self._plan, self._ep = plan, ep

    def __getattr__(self, name):
        if name == "ep":
            if self._ep is None:
                raise AttributeError(name)
            return self._ep
        return getattr(self._plan, name)


def test_rewrite_carries_the_plans_expert_parallelism():
    argv = ["--num-experts", "8", "--expert-model-parallel-size", "4", "--bf16"]
    out = A.rewrite_argv(argv, _WithEP(make_plan(dp=2), 2), "megatron")
    assert out.count("--expert-model-parallel-size") == 1
    assert A.flag_value(out, "--expert-model-parallel-size") == "2"
    assert out[:3] == ["--num-experts", "8", "--bf16"]
    assert "--expert-model-parallel-size 4 -> 2" in A.overridden_flags(argv, out)
    # a plan at EP 1 takes the user's EP away: Megatron's default, said as such
    one = A.rewrite_argv(argv, _WithEP(make_plan(dp=2), 1), "megatron")
    assert A.flag_value(one, "--expert-model-parallel-size", "1") == "1"
    assert "--expert-model-parallel-size 4 -> 1" in A.overridden_flags(argv, one)
    # MindSpeed-LLM: the same flag, and repatch restates it (1 where the rewrite left it out)
    ms = A.rewrite_argv(argv, _WithEP(make_plan(dp=2), 2), "mindspeed-llm")
    assert A.flag_value(ms, "--expert-model-parallel-size") == "2"
    assert A.mindspeed_repatch_args(ms)["expert_model_parallel_size"] == 2
    assert A.mindspeed_repatch_args(
        A.rewrite_argv(argv, _WithEP(make_plan(dp=2), 1), "mindspeed-llm")
    )["expert_model_parallel_size"] == 1


def test_a_plan_without_an_ep_degree_leaves_the_users_flag():
    argv = ["--expert-model-parallel-size", "2", "--lr", "1"]
    out = A.rewrite_argv(argv, _WithEP(make_plan(), None), "megatron")
    assert A.flag_value(out, "--expert-model-parallel-size") == "2"
    assert not any("expert" in line for line in A.overridden_flags(argv, out))


def test_the_users_ep_is_kept_unless_the_search_may_change_it():
    assert A.expert_parallel_choice(["--expert-model-parallel-size=4"], search_ep=False) == (4,)
    assert A.expert_parallel_choice([], search_ep=False) == (1,)
    assert A.expert_parallel_choice(["--expert-model-parallel-size", "4"], search_ep=True) is None
    with pytest.raises(PoseidonError, match="expected an integer >= 1, got 'two'"):
        A.expert_parallel_choice(["--expert-model-parallel-size", "two"], search_ep=True)
    opts, rest = extract_options(["--poseidon-auto", "--poseidon-search-ep", "--lr", "1"])
    assert opts.search_ep and rest == ["--lr", "1"]
    assert not extract_options(["--poseidon-auto"])[0].search_ep
    with pytest.raises(PoseidonError, match="takes no value"):
        extract_options(["--poseidon-search-ep=4"])


def test_rewrite_sets_the_plans_context_parallelism():
    from dataclasses import replace

    from poseidon_plugin.megatron.launch.runner import launch_cp_degrees

    user = ["--num-layers", "8", "--context-parallel-size", "4", "--context-parallel-algo",
            "ulysses_cp_algo"]
    cp1 = make_plan()
    got = A.rewrite_argv(user, cp1, "megatron")
    assert "--context-parallel-size" not in got and "ulysses_cp_algo" not in got  # CP 1
    cp2 = replace(cp1, cp=2)
    got = A.rewrite_argv(user, cp2, "megatron")
    assert got[got.index("--context-parallel-size") + 1] == "2" and got.count("4") == 0
    got = A.rewrite_argv(user, cp2, "mindspeed-llm")
    assert got[got.index("--context-parallel-algo") + 1] == "megatron_cp_algo"
    assert A.mindspeed_repatch_args(got)["context_parallel_size"] == 2
    assert A.mindspeed_repatch_args(A.rewrite_argv(user, cp1, "mindspeed-llm"))[
        "context_parallel_size"] == 1
    # the launch keeps the script's CP; --poseidon-search-cp lets it change
    assert launch_cp_degrees(user, 4096, False) == (4,)
    assert launch_cp_degrees(["--num-layers", "8"], 4096, False) == (1,)
    assert launch_cp_degrees(user, 96, True) == (1, 2, 4, 8, 16)
    with pytest.raises(PoseidonError, match="--context-parallel-size: expected an integer"):
        launch_cp_degrees(["--context-parallel-size", "two"], 4096, False)
    opts, _ = extract_options(["--poseidon-auto", "--poseidon-search-cp"])
    assert opts.search_cp
