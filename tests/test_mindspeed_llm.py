"""MindSpeed-LLM's real releases (v26.1.0 on MindSpeed 26.1.0, v2.3.0 on MindSpeed 2.3.0, both on
Megatron-LM core_v0.12.1; the unchanged trees of ../shared/frameworks) under Poseidon's argv code:
the adaptor imported as MindSpeed-LLM's scripts do, the rewritten command lines through
MindSpeed-LLM's own patched ``parse_args`` + ``validate_args``, its patches re-applied for them.
The NPU libraries are tests/npu_fakes. One probe process per release (tests/msllm_probe.py: real
MindSpeed patches torch process-wide, so it never runs inside pytest)."""

from __future__ import annotations

import json

import pytest

import frameworks as fw

pytestmark = pytest.mark.integration

RELEASES = sorted(fw.MINDSPEED_LLM_RELEASES)


@pytest.fixture(scope="module", params=RELEASES)
def probe(request):
    release = request.param
    reason = fw.mindspeed_llm_skip_reason(release)
    if reason:
        pytest.skip(reason)
    proc = fw.run_python(release, ["tests/msllm_probe.py", release])
    lines = [l for l in proc.stdout.splitlines() if l.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("PROBE "):])


def _check(probe: dict, name: str):
    c = probe["checks"][name]
    assert c["ok"], f"{name}: {c['error']}\n{c.get('trace', '')}"
    return c["value"]


def test_the_real_release_is_imported(probe):
    llm_tree = fw.MINDSPEED_LLM_RELEASES[probe["release"]][0]
    assert probe["adaptor"] == "mindspeed_llm.tasks.megatron_adaptor_v2"
    assert f"/{llm_tree}/mindspeed_llm/tasks/" in probe["adaptor_file"]


def test_adaptor_is_a_name_in_the_package_not_a_submodule(probe):
    assert probe["adaptor_is_submodule"] is False
    assert probe["argv_restored"] is True
    # the adaptor parsed the script's command line at import and gated its patches on it
    assert probe["layer_list_patched_at_import"] is True


def test_layout_flag_registered_from_26_1_only(probe):
    assert probe["layout_registered"] is (probe["release"] in fw.LAYOUT_RELEASES)


def test_uneven_plan_passes_mindspeed_llm_validation(probe):
    """An uneven split as the release takes it: the layout flag where it registers it (its
    --num-layer-list numbers the layers as if the split were even), else --num-layer-list."""
    v = _check(probe, "uneven")
    if probe["release"] in fw.LAYOUT_RELEASES:
        assert v["flag"] is None and v["num_layer_list"] is None, v
        assert v["layout_flag"] == "Et*6|t*2L" and v["layout"] is not None, v
        assert (v["num_layers"], v["pp"]) == (8, 2), v
    else:
        assert v == {"flag": "6,2", "layout_flag": None, "num_layers": 8, "pp": 2,
                     "num_layer_list": "6,2", "layout": None}


def test_interleaved_rule_layout_where_registered_else_refused(probe):
    v = _check(probe, "interleaved")
    if probe["release"] not in fw.LAYOUT_RELEASES:
        assert "--poseidon-max-virtual-stages 1" in v["refused"]
        return
    assert v["layer_list_flag"] is False
    assert v["layout"] == v["expected_layout"]
    assert v["vpp"] == 2


def test_the_release_refuses_a_layer_list_with_a_virtual_pipeline(probe):
    """What makes the interleaving rule necessary: MindSpeed-LLM's own validation says no."""
    c = probe["checks"]["layer_list_with_vpp"]
    assert not c["ok"]
    assert "num_layer_list" in c["error"]


def test_patches_follow_the_rewritten_command_line(probe):
    v = _check(probe, "repatch")
    assert v == {"applied": True, "layer_list_after_uneven": True, "applied_even": True,
                 "layer_list_after_even": False}


def test_the_judge_builds_mindspeed_llms_config_and_checks_the_layout(probe):
    """MindSpeed-LLM's patched parse_args + validate_args, its config build and the layout's own
    checks (MindSpeed's backport, not patched into the config for a layout the launch did not
    have): an MTP layer the layout leaves out is refused; the plans' flags are accepted."""
    v = _check(probe, "judge")
    assert v["uneven"] is None
    if probe["release"] in fw.LAYOUT_RELEASES:
        assert v["interleaved"] is None and v["interleaved_mtp"] is None, v
        assert v["interleaved_mtp_no_m"] == ("MindSpeed-LLM's pipeline layout check: Number of "
                                             "mtp layers in layout must match mtp_num_layers"), v
