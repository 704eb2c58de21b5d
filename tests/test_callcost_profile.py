"""Per-p2p-call costs measured between real gloo processes (``megatron/profile/callcost_profile.py``):
rank 0 gets one ``P2PCall`` record per message size, the others none; a third rank only passes
the barriers; the records store in a profile DB and the cost model charges them; on a pair's own
group (as a launch measures a link) the calls are megatron-core's ``P2PCommunicator``'s."""

from __future__ import annotations

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

from test_launch_e2e import free_port  # noqa: E402




def _worker(rank, world, port, out):
    import torch.distributed as dist

    from poseidon_plugin.callcosts import p2p_call_to_record
    from poseidon_plugin.megatron.profile.callcost_profile import p2p_call_records

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        recs = p2p_call_records("emu-x", "intra-node", {4096: 2048, 65536: 32768}, reps=4)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump([p2p_call_to_record(r) for r in recs], f)


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_call_records_between_processes(tmp_path, world):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    got = [json.load(open(tmp_path / f"{r}.json")) for r in range(world)]
    assert all(g == [] for g in got[1:])
    assert [r["message_bytes"] for r in got[0]] == [4096, 65536]
    for r in got[0]:
        assert r["device_type"] == "emu-x" and r["link"] == "intra-node"
        for k in ("send_call_ms", "recv_ready_ms", "latency_ms"):
            assert math.isfinite(r[k]) and 0.0 <= r[k] < 1000.0
        assert r["send_call_ms"] > 0.0 and r["recv_ready_ms"] > 0.0
    # they load as DB records, and the cost model's lookup reads them
    from poseidon_plugin.callcosts import engine_calls
    from poseidon_plugin.profiles import ProfileDB

    db = ProfileDB.from_json(json.dumps({"version": 1, "records": [], "p2p_calls": got[0]}))
    assert engine_calls(db, ("emu-x",), 4096).send_call_ms == pytest.approx(
        got[0][0]["send_call_ms"])


def _pair_worker(rank, world, port, out):
    """Ranks 0 and 2 measure on their own pair group (rank 1 only makes the group), through
    megatron-core's P2PCommunicator (its calls counted), as a launch's link pair does."""
    import torch.distributed as dist

    from poseidon_plugin.megatron.emulate.emulation import install_cpu_shims

    install_cpu_shims(local_rank=0, device_count=1)
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    from poseidon_plugin.callcosts import p2p_call_to_record
    from poseidon_plugin.megatron.profile.callcost_profile import p2p_call_records

    counted = {"send_forward": 0, "recv_forward": 0}
    for name in counted:
        orig = getattr(p2p.P2PCommunicator, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            counted[_name] += 1
            return _orig(self, *a, **k)

        setattr(p2p.P2PCommunicator, name, wrapped)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group([0, 2])
        recs = (p2p_call_records("emu-x", "cross-type", {4096: 2048}, a=0, b=2, reps=3,
                                 group=group) if rank != 1 else [])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"records": [p2p_call_to_record(r) for r in recs], "counted": counted}, f)


def test_a_pair_group_times_megatrons_own_calls(tmp_path):
    import torch.multiprocessing as mp

    pytest.importorskip("megatron.core.pipeline_parallel.p2p_communication",
                        exc_type=ImportError)
    mp.start_processes(_pair_worker, args=(3, free_port(), str(tmp_path)), nprocs=3,
                       join=True, start_method="spawn")
    got = [json.load(open(tmp_path / f"{r}.json")) for r in range(3)]
    (rec,) = got[0]["records"]
    assert (rec["device_type"], rec["link"], rec["message_bytes"]) == ("emu-x", "cross-type",
                                                                       4096)
    assert rec["send_call_ms"] > 0 and rec["recv_ready_ms"] > 0
    assert got[2]["records"] == [] and got[1]["records"] == []
    # 4 rounds (one warm-up) of: a send (timed), a send (untimed), a send in the round trip
    assert got[0]["counted"]["send_forward"] == 3 * 4
    assert got[2]["counted"]["recv_forward"] == 3 * 4
    assert got[1]["counted"] == {"send_forward": 0, "recv_forward": 0}
