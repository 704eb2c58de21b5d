"""examples/gpu_check.sh rehearsed on CPU (--cpu: one emulated device, a tiny model): the flow a
person with one GPU runs produces the summary (versions, the plan, the profiled layer, the
calibration line with predicted vs measured iteration time and the peak-memory comparison)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_rehearsal_on_cpu(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", ""), "POSEIDON_LOG_LEVEL": "INFO"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "gpu_check.sh"), "--cpu"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = open(os.path.join(ROOT, "build", "gpu-check", "cpu-emulated", "summary.txt"),
                   encoding="utf-8").read()
    assert "megatron-core" in summary and "predicted iteration" in summary
    assert "tp=1 mbs=1" in summary and "optimizer" in summary
    cal = [l for l in summary.splitlines() if "calibration: iteration" in l]
    assert len(cal) == 1
    assert "predicted" in cal[0] and "measured" in cal[0]
    assert "peak memory not measurable on this device" in cal[0]   # CPU: no allocator stats
