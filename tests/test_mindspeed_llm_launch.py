"""The real launch flow (torchrun, CPU emulation, dry run) with the MindSpeed-LLM backend against
the stand-ins of tests/standin: the adaptor is imported as MindSpeed-LLM's scripts do, and the
interleaving rule follows the installed release."""

from __future__ import annotations

import os

import pytest

import mindspeed_standin
from test_launch_e2e import EMULATE4, GPT_ARGS, ROOT, ok, torchrun

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("release", ["2.3.0", "26.1.0"])
def test_dry_run_with_mindspeed_llm(tmp_path, release):
    site = mindspeed_standin.install(release, str(tmp_path / "site"))
    args = [*GPT_ARGS, "--train-iters", "2", "--num-layers-per-virtual-pipeline-stage", "2",
            "--poseidon-auto", "--poseidon-dry-run", "--poseidon-emulate", EMULATE4,
            "--poseidon-backend", "mindspeed-llm", "--poseidon-max-virtual-stages", "2",
            "--poseidon-tp", "1"]
    proc, out, _ = torchrun(4, args, {"PYTHONPATH": os.pathsep.join([site, ROOT]),
                                      "POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    assert "adaptor mindspeed_llm.tasks.megatron_adaptor_v2 (" + site in out, out[-3000:]
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    assert "the plan overrides your" in out and "--num-layers-per-virtual-pipeline-stage" in out
    if release == "26.1.0":
        assert "--pipeline-model-parallel-layout registered" in out
        assert "interleaved plans are not searched" not in out
        assert ("--num-layer-list" in flags) != ("--pipeline-model-parallel-layout" in flags) \
            or "--pipeline-model-parallel-size 1" in flags, flags
    else:
        assert "--pipeline-model-parallel-layout not registered" in out
        assert "interleaved plans are not searched (V = 1)" in out
        assert "--pipeline-model-parallel-layout" not in flags, flags
