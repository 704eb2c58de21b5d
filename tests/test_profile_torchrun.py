"""``poseidon profile`` under torchrun: two CPU processes measure the tiny model's layer at TP 1
and with a real TP 2 group, rank 0 writes the DB, and ``poseidon plan --profiles`` plans a TP 2
stage from the measured record (and charges the per-op overheads and p2p call costs the two
processes measured); a rank that never answers is named within ``--timeout`` (in the layers'
and in the p2p calls' phase); a TP
degree above the processes per node is one error line (integration: torch + megatron-core;
about 40 s on a 2-core box)."""

from __future__ import annotations

import json
import re

import pytest

from poseidon_plugin.model import get_model
from poseidon_plugin.profiles import ProfileDB
from test_launch_e2e import ok, torchrun
from test_profile_command import CLUSTER, TINY, poseidon

pytestmark = pytest.mark.integration
pytest.importorskip("megatron.core")

PROFILE = ["profile", "--model", TINY, "--seq-length", "128", "--device-type", "cpu",
           "--device", "cpu", "--micro-batch-sizes", "1", "--iters", "2"]


def profile(tmp_path, nproc: int, *extra: str, env: dict[str, str] | None = None,
            timeout: float = 180):
    return torchrun(nproc, [*PROFILE, *extra, "-o", str(tmp_path / "db.json")],
                    {"PYTHONWARNINGS": "ignore", **(env or {})}, timeout=timeout,
                    module=["poseidon_plugin"], cwd=str(tmp_path))


def test_two_processes_measure_tp_2_and_the_plan_uses_it(tmp_path):
    proc, out, _ = profile(tmp_path, 2, "--tp", "1", "2")
    assert proc.returncode == 0, ok(proc, out)
    records = {r.key.tp: r for r in ProfileDB.load(str(tmp_path / "db.json")).profiles()}
    assert sorted(records) == [1, 2]
    one, two = records[1], records[2]
    for r in (one, two):
        assert r.source == "measured" and r.key.device_type == "cpu"
        assert (r.key.attention, r.key.micro_batch_size, r.key.seq_length) == ("unfused", 1, 128)
        assert r.forward_ms > 0 and r.backward_ms > 0 and r.optimizer_ms > 0
        assert set(dict(r.env)) == {"device", "torch", "megatron_core"}
        assert dict(r.env)["device"] == "cpu (cpu)"
    assert two.key.describe() == "cpu decoder tp2 mbs1 seq128 bf16/unfused/none"
    # a TP 2 rank holds half of the sharded weights (the layer norms are replicated)
    assert 0.45 * one.param_bytes < two.param_bytes < 0.55 * one.param_bytes
    assert two.activation_bytes < one.activation_bytes
    assert out.count("cpu decoder tp") == 2   # rank 0 alone prints the records
    # ranks 0 -> 1's per-call p2p costs at the activation size (b x seq x hidden bf16)
    (call,) = ProfileDB.load(str(tmp_path / "db.json")).p2p_calls()
    assert (call.device_type, call.link) == ("cpu", "intra-node")
    assert call.message_bytes == 2 * 1 * 128 * get_model(TINY).hidden_size
    assert call.send_call_ms > 0 and call.recv_ready_ms > 0 and call.latency_ms >= 0
    assert out.count("p2p call cpu intra-node") == 1
    # megatron-core's per-op overheads (forward_step / backward_step around a zero-time model),
    # the median over the two processes
    (op,) = ProfileDB.load(str(tmp_path / "db.json")).op_overheads()
    assert op.device_type == "cpu" and op.source == "measured"
    assert 0 < op.forward_ms < 100 and 0 < op.backward_ms < 100
    assert out.count("op overhead cpu: forward") == 1

    (tmp_path / "c.yaml").write_text(CLUSTER)
    proc = poseidon("plan", "--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "4",
                    "--seq-length", "128", "--tp", "2", "--micro-batch-sizes", "1",
                    "--attention", "unfused", "--profiles", "db.json", "--no-baselines",
                    "--workers", "1", "--out", "plan.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^\s+decoder\s+measured\s+stage 0\s+cpu decoder tp2 mbs1 seq128",
                     proc.stdout, re.M), proc.stdout
    (stage,) = json.loads((tmp_path / "plan.json").read_text())["stages"]
    assert stage["tp"] == 2
    assert stage["provenance"]["decoder"] == {
        "source": "measured", "record": "cpu decoder tp2 mbs1 seq128 bf16/unfused/none"}
    assert stage["memory"]["activations_source"] == "measured"
    # the search charged them (named in the plan's timing model)
    tm = json.loads((tmp_path / "plan.json").read_text())["timing_model"]
    assert tm["send_call_ms"] == pytest.approx(call.send_call_ms, abs=1e-6)
    assert (tm["op_forward_ms"], tm["op_backward_ms"]) == pytest.approx(
        (op.forward_ms, op.backward_ms), abs=1e-6)
    assert tm["source"] == ("measured: op_overheads cpu (forward), cpu (backward); p2p_calls "
                            f"cpu intra-node at {call.message_bytes} B (send call), cpu "
                            f"intra-node at {call.message_bytes} B (receive ready)")


@pytest.mark.parametrize("phase, at", [("profiling", "profiling-tp1"),
                                       ("p2p-calls", "p2p-calls-0")])
def test_a_rank_that_never_answers_is_named(tmp_path, phase, at):
    # the 20 s wait is the product's (named in the error); the start-up's wall time is not
    # asserted: a hang still fails at the subprocess timeout. p2p-calls: the per-call costs'
    # phase, after the layers (the wait bounds every barrier before it too: 3 s was too short
    # for a loaded host's layer timing)
    tps = ("1", "2") if phase == "profiling" else ("1",)
    proc, out, _ = profile(tmp_path, 2, "--tp", *tps, "--timeout", "20",
                           env={"POSEIDON_FAULT_INJECT": f"{phase}:1:hang"}, timeout=300)
    assert proc.returncode != 0
    assert re.search(rf"poseidon: error: timed out after 20 s waiting for 1 rank\(s\) at "
                     rf"'{at}': rank 1 \(last seen entering '{phase}'", out), out[-4000:]
    assert not (tmp_path / "db.json").exists()


def test_tp_above_the_processes_is_one_error_line(tmp_path):
    proc, out, _ = profile(tmp_path, 2, "--tp", "1", "4", timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in out.splitlines() if ln.startswith("poseidon: error:")]
    assert len(errors) == 1, out[-3000:]
    assert "TP 4 needs 4 processes on one node" in errors[0]
    assert "torchrun --nproc-per-node >= 4" in errors[0]
    assert "poseidon_plugin/" not in out   # no traceback of ours (torchrun prints its own)
    assert not (tmp_path / "db.json").exists()
