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
    env["GPU_CHECK_COPY_TO"] = str(tmp_path / "back")
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
    # the offline profiler ran first: TP 1, micro-batches 1 and 2, into a DB plan can read
    assert "poseidon profile (exit code 0):" in summary
    assert "decoder tp1 mbs1 seq128" in summary and "decoder tp1 mbs2 seq128" in summary
    db = tmp_path / "back" / "tiny-gpt-cpu-emulated.json"
    from poseidon_plugin.profiles import ProfileDB
    assert len(ProfileDB.load(str(db))) >= 2
    # what comes back from a lent machine ($OUT): at most 8 files
    back = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert {"summary.txt", "run.log", "profile.log", "plan.json"} <= set(back)
    assert any(n.startswith("profiles-") for n in back) and len(back) <= 8
