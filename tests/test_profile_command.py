"""``poseidon profile`` end to end on the CPU: megatron-core builds the tiny model's layer, the
measured records land in a DB, and ``poseidon plan --profiles`` uses them with provenance
"measured" for time and activation memory (integration: torch + megatron-core)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from poseidon_plugin import memory
from poseidon_plugin.errors import PoseidonError
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


def poseidon(*argv, cwd, show_warnings=False):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="default" if show_warnings else "ignore")
    return subprocess.run([sys.executable, "-m", "poseidon_plugin", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_profile_on_cpu_then_plan_uses_the_measured_records(tmp_path):
    db = str(tmp_path / "db.json")
    proc = poseidon("profile", "--model", TINY, "--seq-length", "128", "--device-type", "cpu",
                    "--device", "cpu", "--micro-batch-sizes", "1", "--iters", "2", "-o", db,
                    cwd=tmp_path, show_warnings=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # on stderr: a progress line per configuration, then the result; megatron-core's notes that
    # Transformer Engine / Apex / absl are not installed (10 warnings, 20 lines) are nothing to
    # act on for a CPU profile, and no size warning for a small layer
    progress, wrote = proc.stderr.splitlines()
    assert re.fullmatch(r"poseidon: profiling 1/1: tp 1, micro-batch 1 -- 0 left, \d+ s elapsed",
                        progress), proc.stderr
    assert wrote.startswith("poseidon: wrote 1 measured record(s)"), proc.stderr
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


def test_a_large_layer_on_a_cpu_is_warned_about_up_front(capsys, monkeypatch, tmp_path):
    """llama3-8b at seq 4096 on the CPU (docs/usage.md's example: 5+ minutes, ~7 GB, no output):
    one warning before any profiling, naming the work, the memory and what to do; at seq 128
    (a small layer) none."""
    from poseidon_plugin import cli
    from poseidon_plugin.megatron.profile import offline

    def stop(*a, **k):
        raise PoseidonError("stopped before profiling")

    monkeypatch.setattr(offline, "profile_layers", stop)
    for seq, warned in (("4096", True), ("128", False)):
        rc = cli.main(["profile", "--model", "llama3-8b", "--seq-length", seq, "--device-type",
                       "cpu", "--device", "cpu", "-o", str(tmp_path / "db.json")])
        err = capsys.readouterr().err.splitlines()
        assert rc == 2 and err[-1] == "poseidon: error: stopped before profiling"
        warnings = [ln for ln in err if ln.startswith("poseidon: warning: profiling on a CPU")]
        assert len(warnings) == int(warned), err
        if warned:
            assert "llama3-8b's layer at micro-batch 1, seq 4096 is 5.8 TFLOP" in warnings[0]
            assert "GiB" in warnings[0] and "--device cuda / npu" in warnings[0]


def test_framework_notes_are_one_line_where_they_matter(caplog):
    """megatron-core's 'not installed' notes: dropped on a CPU, one warning naming the packages
    on a GPU; any other warning once, on one line."""
    import logging
    import warnings

    from poseidon_plugin.megatron.profile.profile_output import framework_notes

    def notes():
        for _ in range(2):
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch "
                          "optimizers.", UserWarning)
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
            warnings.warn("absl.logging is not installed. Using logging.getLogger", UserWarning)
            warnings.warn("something a user must\n  read", RuntimeWarning)

    for kind, fallback_lines in (("cpu", 0), ("cuda", 1)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="poseidon"):
            with framework_notes(kind):
                notes()
        lines = [r.getMessage() for r in caplog.records]
        fallback = [ln for ln in lines if "not installed here" in ln]
        assert len(fallback) == fallback_lines, lines
        if fallback:
            assert fallback[0].startswith("Apex / Transformer Engine / absl.logging not installed")
        assert [ln for ln in lines if "not installed here" not in ln] == [
            "RuntimeWarning: something a user must read"]
