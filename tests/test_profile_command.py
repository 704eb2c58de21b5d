"""``poseidon profile`` end to end on the CPU: megatron-core builds the tiny model's layer, the
measured records land in a DB, and ``poseidon plan --profiles`` uses them with provenance
"measured" for time and activation memory (integration: torch + megatron-core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from poseidon_plugin import memory
from poseidon_plugin.model import load_model
from poseidon_plugin.profiles import ProfileDB
from poseidon_plugin.training import TrainingSetup

pytestmark = pytest.mark.integration
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")
CLUSTER = """name: one-cpu
device_types:
  cpu: {memory_gib: 16, intra_node_gbps: 100, reserve_gib: 0.5}   # no peak: measured only
nodes:
  - {device_type: cpu, devices_per_node: 2}
links: {inter_node_gbps: 10, cross_type_gbps: 10}
"""


def poseidon(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "poseidon_plugin", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_profile_on_cpu_then_plan_uses_the_measured_records(tmp_path):
    db = str(tmp_path / "db.json")
    proc = poseidon("profile", "--model", TINY, "--seq-length", "128", "--device-type", "cpu",
                    "--device", "cpu", "--micro-batch-sizes", "1", "--iters", "2", "-o", db,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = ProfileDB.load(db).profiles()
    assert rec.source == "measured" and rec.key.device_type == "cpu"
    assert (rec.key.attention, rec.key.recompute, rec.key.tp) == ("unfused", "none", 1)
    assert rec.forward_ms > 0 and rec.backward_ms > 0
    assert dict(rec.env)["megatron_core"] and dict(rec.env)["device"] == "cpu (cpu)"
    model = load_model(TINY)
    assert rec.param_bytes == 2 * model.layer_params()
    est = memory.layer_activation_bytes(model, micro_batch_size=1, seq_length=128, tp=1,
                                        setup=TrainingSetup(attention="unfused"))
    assert rec.activation_bytes == pytest.approx(est, rel=0.25)
    # megatron-core's per-op overheads, measured on this one process (no p2p calls: no peer)
    (op,) = ProfileDB.load(db).op_overheads()
    assert op.device_type == "cpu" and op.source == "measured"
    assert 0 < op.forward_ms < 100 and 0 < op.backward_ms < 100
    assert ProfileDB.load(db).p2p_calls() == []
    assert "op overhead cpu: forward" in proc.stdout

    (tmp_path / "c.yaml").write_text(CLUSTER)
    proc = poseidon("plan", "--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "4",
                    "--seq-length", "128", "--tp", "1", "--micro-batch-sizes", "1",
                    "--attention", "unfused", "--profiles", db, "--json", "--no-baselines",
                    "--workers", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    plan = json.loads(proc.stdout)
    tm = plan["timing_model"]   # the search charged them
    assert (tm["op_forward_ms"], tm["op_backward_ms"]) == pytest.approx(
        (op.forward_ms, op.backward_ms), abs=1e-6)
    assert tm["source"] == "measured: op_overheads cpu (forward), cpu (backward)"
    for st in plan["stages"]:
        assert st["provenance"]["decoder"]["source"] == "measured"
        assert st["memory"]["activations_source"] == "measured"
        assert st["memory"]["reserve_bytes"] == 512 << 20
    # the same DB for a flash-attention plan: unusable, named, an error without the flag
    proc = poseidon("plan", "--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "4",
                    "--seq-length", "128", "--profiles", db, cwd=tmp_path)
    assert proc.returncode == 2
    assert "attention unfused (planning flash)" in proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2"], "this run is one process: run it with torchrun --nproc-per-node >= 2"),
    (["--attention", "flash"], "pass --attention unfused"),
])
def test_profile_refusals(tmp_path, extra, message):
    proc = poseidon("profile", "--model", TINY, "--seq-length", "128", "--device-type", "cpu",
                    "--device", "cpu", "-o", str(tmp_path / "db.json"), *extra, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "db.json").exists()
