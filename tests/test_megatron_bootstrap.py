"""Store barriers with deadlines: a silent rank is named, a failing rank is reported at once."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from poseidon_plugin.errors import DistributedError, PoseidonError
from poseidon_plugin.megatron.launch.bootstrap import LaunchEnv, StoreSync

dist = pytest.importorskip("torch.distributed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def store():
    return dist.TCPStore("127.0.0.1", free_port(), world_size=None, is_master=True,
                         wait_for_workers=False)


def test_silent_rank_is_named_with_its_last_phase(store):
    a = StoreSync(store, 0, 3, "t1")
    b = StoreSync(store, 1, 3, "t1")
    b.names = a.names = {2: "rank 2 (host h, local rank 2, emu-slow)"}
    # rank 2 joined earlier and then went quiet in 'profiling'
    StoreSync(store, 2, 3, "t1").enter("profiling")
    def arrive_and_wait():
        try:
            b.barrier("gather", 1.0)
        except DistributedError:
            pass  # rank 2 never comes: expected on this side too

    t = threading.Thread(target=arrive_and_wait, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as err:
        a.barrier("gather", 0.5)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "rank 2 (host h, local rank 2, emu-slow)" in msg and "'profiling'" in msg
    assert "rank 1" not in msg.split(":", 1)[1]  # rank 1 arrived
    t.join(5)


def test_rank_that_never_connected(store):
    with pytest.raises(DistributedError, match=r"rank 1 \(never connected\)"):
        StoreSync(store, 0, 2, "t2").barrier("join", 0.3)


def test_posted_error_stops_the_wait_immediately(store):
    a = StoreSync(store, 0, 2, "t3")
    b = StoreSync(store, 1, 2, "t3")
    b.enter("profiling")
    b.post_error("RuntimeError: CUDA out of memory")
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 failed during profiling: RuntimeError: CUDA out"):
        a.barrier("profiled", 30.0)
    assert time.monotonic() - t0 < 5


def test_barrier_passes_when_everyone_arrives(store):
    syncs = [StoreSync(store, r, 3, "t4") for r in range(3)]
    threads = [threading.Thread(target=s.barrier, args=("b", 5.0)) for s in syncs[1:]]
    for t in threads:
        t.start()
    syncs[0].barrier("b", 5.0)
    for t in threads:
        t.join()


def test_launch_env_needs_a_distributed_launch():
    with pytest.raises(PoseidonError, match="missing: RANK, WORLD_SIZE"):
        LaunchEnv.from_environ({"MASTER_ADDR": "x", "MASTER_PORT": "1"})
    env = LaunchEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
                                  "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.rank, env.local_rank, env.use_agent_store) == (3, 1, True)


def test_tracebacks_carry_one_rank_prefix_after_renumbering(monkeypatch, capsys):
    """torch prefixes tracebacks with "[rank<r>]:" at every init_process_group; the probe
    group's hook goes with it, so the training's tracebacks read "[rank0]: ..." once."""
    import sys

    from poseidon_plugin.megatron.launch.bootstrap import Bootstrap

    env = LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(free_port())})
    # Python's own hook: under pytest-xdist an earlier test in this worker may have left
    # torch's prefixing hook installed (a real launch starts from a fresh interpreter)
    original = sys.__excepthook__
    monkeypatch.setattr(sys, "excepthook", original)
    boot = Bootstrap(env, 30).start()
    try:
        assert sys.excepthook is not original  # torch's prefixing hook for the probe group
        boot.init_main(0, 1, "gloo", 1)
        try:
            raise ValueError("boom")
        except ValueError:
            sys.excepthook(*sys.exc_info())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    err = capsys.readouterr().err
    last = [ln for ln in err.splitlines() if "ValueError: boom" in ln]
    assert last and last[-1].count("[rank") == 1, err


@pytest.mark.parametrize("raised, code", [(PoseidonError("--poseidon-tp 3: bad"), 2),
                                          (RuntimeError("CUDA out of memory"), 1)])
def test_a_refusal_on_one_rank_exits_every_rank_with_2(store, capsys, raised, code):
    """Rank 1 refuses the input (a PoseidonError, exit 2): rank 0, waiting at a barrier, learns
    it was a refusal and exits 2 as well, each after its one error line; a failure (anything
    else) exits 1 on both."""
    from types import SimpleNamespace

    from poseidon_plugin.megatron.launch import runner
    from poseidon_plugin.megatron.launch.bootstrap import Bootstrap, run_guarded

    boot = Bootstrap.__new__(Bootstrap)
    boot.env, boot.sync = SimpleNamespace(rank=1), StoreSync(store, 1, 2, f"t5-{code}")

    def refuse():
        raise raised

    with pytest.raises(type(raised)) as mine:
        run_guarded(boot, "read-model", refuse)
    with pytest.raises(DistributedError) as peer:
        StoreSync(store, 0, 2, f"t5-{code}").barrier("model-read", 30.0)
    assert "rank 1 failed during read-model" in str(peer.value)
    assert [runner._fail(mine.value), runner._fail(peer.value)] == [code, code]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("] error: " in ln for ln in err)
