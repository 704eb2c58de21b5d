"""Per-p2p-call costs measured between real gloo processes (``megatron/callcost_profile.py``):
rank 0 gets one ``P2PCall`` record per message size, the others none; a third rank only passes
the barriers; the records store in a profile DB and the cost model charges them."""

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
    from poseidon_plugin.megatron.callcost_profile import p2p_call_records

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
