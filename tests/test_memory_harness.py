"""The memory model held to megatron-core's own layers (``poseidon_plugin/fidelity/
memory_check.py``): each cell builds the real megatron-core layer of a kind (dense, MoE with the
all-to-all and with the allgather dispatcher, MLA, MTP) on gloo ranks at its TP / SP / EP / CP,
counts what one micro-batch forward keeps for backward and the layer's parameters on each rank,
and compares ``memory.layer_activation_bytes`` and the parameter split within 3 %.

The CI subset covers each mechanism once (TP with SP, EP with the all-to-all dispatcher's TP
gather, the allgather dispatcher with shared experts, MLA at TP, CP's sequence shard, an MTP
layer under SP) on the
venv's megatron-core (0.19) and, where the side environment and the Megatron-LM core_v0.12.1
tree are at hand, two cells on 0.12.1. The full grid is
``python -m poseidon_plugin.fidelity.memory_check --grid full`` (docs/fidelity.md).
"""

from __future__ import annotations

import os

import pytest

from poseidon_plugin.fidelity import memory_check as mc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = os.environ.get("POSEIDON_FRAMEWORKS") or os.path.join(ROOT, "..", "shared",
                                                                   "frameworks")
TREE_012 = os.path.join(FRAMEWORKS, "megatron-lm-core_v0.12.1")
MCORE_PYTHON = os.environ.get("POSEIDON_MCORE_PYTHON", "")


@pytest.mark.parametrize("cell", mc.grid("ci"), ids=lambda c: c.name().replace(" ", "-"))
def test_memory_model_holds_on_megatron_core_019(cell):
    pytest.importorskip("megatron.core")
    row = mc.check(cell)
    assert not row.error, row.error
    assert row.holds, mc.table([row])


@pytest.mark.skipif(not (os.path.isdir(TREE_012) and os.access(MCORE_PYTHON, os.X_OK)),
                    reason="needs the Megatron-LM core_v0.12.1 tree (POSEIDON_FRAMEWORKS) and "
                    "the older megatron-core side environment (POSEIDON_MCORE_PYTHON)")
@pytest.mark.parametrize("cell", [mc.Cell("moe-alltoall", 2, 2, sp=True),
                                  # a dense decoder layer inside 0.12.1's MTP layer form
                                  mc.Cell("mtp", 2, sp=True)],
                         ids=lambda c: c.name().replace(" ", "-"))
def test_memory_model_holds_on_megatron_core_012(cell):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TREE_012, ROOT]))
    row = mc.check(cell, python=MCORE_PYTHON, env=env)
    assert not row.error, row.error
    assert row.holds, mc.table([row])


@pytest.mark.parametrize("cell", [mc.Cell("moe-alltoall", 2, 2, sp=True),
                                  mc.Cell("mla", 2, sp=True)],
                         ids=lambda c: c.name().replace(" ", "-"))
def test_memory_model_holds_on_mindspeed_llm_over_megatron_core_012(cell):
    """The same layers as MindSpeed-LLM v26.1.0 builds them (its adaptor and MindSpeed 26.1.0
    patch megatron-core 0.12.1 first, as in a launch; the NPU stand-ins of tests/npu_fakes
    keep what the NPU kernels keep): the all-to-all dispatcher across EP under MindSpeed-LLM's
    communication wrappers, and MLA from the ``--spec`` its DeepSeek recipes name (its down
    projections duplicated on every TP rank, as ``memory.py`` counts them: no local-spec
    correction)."""
    import frameworks as fw

    reason = fw.mindspeed_llm_skip_reason("26.1.0")
    if reason:
        pytest.skip(reason)
    row = mc.check(cell, python=fw.msllm_python(), env=fw.mindspeed_llm_env("26.1.0"),
                   mindspeed_llm=True)
    assert not row.error, row.error
    assert row.holds, mc.table([row])
