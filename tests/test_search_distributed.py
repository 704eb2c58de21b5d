"""Distributed search (search/distributed.py): several searchers share the outer
configurations and exchange the incumbent; the plan and its certificate are those of one
process, and a searcher that dies or never answers ends the search with an error in time."""

from __future__ import annotations

import os
import threading

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import get_model
from poseidon_plugin.search import SearchOptions, search_plan
from poseidon_plugin.search.distributed import MemoryStore, Searchers

from test_search import make_instance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setting(n: int):
    models = {1: "llama3-8b", 2: "llama2-13b", 3: "llama-30b", 5: "llama2-13b"}
    return (load_cluster(os.path.join(ROOT, "examples", "clusters", f"paper-setting{n}.yaml")),
            get_model(models[n]))


def run_threads(size: int, cluster, model, options, *, stall_s: float = 30.0,
                absent: tuple[int, ...] = (), die_after_roots: tuple[int, ...] = (),
                jobs: int = 1):
    """``size`` searchers as threads of this process on one MemoryStore; searcher 0's plans
    (or its error). ``absent``: never start; ``die_after_roots``: stop (heartbeat and all)
    once they sent their root bounds."""
    store = MemoryStore()
    out: dict = {}

    def coordinator():
        with store.turn(), Searchers(store, 0, size, stall_s=stall_s, workers=1) as g:
            try:
                out["plans"] = [g.search(cluster, model, options) for _ in range(jobs)]
            except PoseidonError as e:
                out["error"] = str(e)
            except BaseException as e:  # noqa: BLE001 - the test fails on it below
                out["error"] = repr(e)

    def worker(r):
        g = Searchers(store, r, size, stall_s=stall_s, workers=1)
        with store.turn():
            g.start()
            try:
                if r in die_after_roots:
                    orig = store.set

                    def set_(key, value, _orig=orig):
                        _orig(key, value)
                        if key.endswith(f"/roots/{r}"):
                            g._stop.set()          # the heartbeat stops: a dead process
                            raise SystemExit
                    store.set = set_
                out[r] = g.serve()
            except (PoseidonError, SystemExit) as e:
                out[r] = e
            finally:
                g._stop.set()

    threads = [threading.Thread(target=coordinator)]
    threads += [threading.Thread(target=worker, args=(r,)) for r in range(1, size)
                if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a searcher hangs"
    return out


def _same(a, b):
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "search"}
    assert strip(a) == strip(b)       # stages, layers, devices, times, lower bound
    assert a.lower_bound_ms == b.lower_bound_ms
    assert a.search["exhaustive"] == b.search["exhaustive"]


@pytest.mark.parametrize("size", [2, 3])
def test_same_plan_and_certificate_as_one_process(size):
    cluster, model = _setting(1)
    opts = SearchOptions(global_batch_size=128, seq_length=4096, workers=1, runner_up=False)
    one = search_plan(cluster, model, opts)
    out = run_threads(size, cluster, model, opts)
    assert "error" not in out, out.get("error")
    (many,) = out["plans"]
    _same(one, many)
    assert many.search["processes"] == size
    assert one.search["processes"] == 1
    # every configuration was searched or cut by some searcher, none twice at the root
    assert many.search["configs"] == one.search["configs"]
    assert all(out[r] == 1 for r in range(1, size))   # each worker served the one job


def test_per_stage_tp_and_runner_up_and_two_jobs():
    """Per-stage TP (its uniform seed), the runner-up on the merged state, and a second job on
    the same searchers."""
    cluster, model = _setting(1)
    opts = SearchOptions(global_batch_size=32, seq_length=2048, workers=1, tp_mode="per-stage")
    one = search_plan(cluster, model, opts)
    out = run_threads(2, cluster, model, opts, jobs=2)
    assert "error" not in out, out.get("error")
    for many in out["plans"]:
        _same(one, many)
        s1, s2 = one.search, many.search
        assert s2["runner_up_status"] != "off"
        if s1["runner_up_status"] == s2["runner_up_status"] == "exact":   # (else: time-sliced)
            assert s2["runner_up_ms"] == s1["runner_up_ms"]
    assert out[1] == 2


SMALL = [([(100.0, 2, 2, 1.0), (50.0, 2, 2, 1.0)], 6, 8),
         ([(150.0, 1, 2, 0.1), (80.0, 2, 2, 1.0), (50.0, 2, 1, 0.05)], 5, 4),
         ([(80.0, 2, 2, 0.1), (50.0, 1, 2, 1.0)], 4, 8)]


@pytest.mark.parametrize("pruning", ["none", "safe", "ridge"])
@pytest.mark.parametrize("inst", SMALL)
def test_random_clusters_every_pruning(inst, pruning):
    """Small random clusters (the search tests' builder), every pruning rule, 3 searchers:
    without pruning the searchers share one tree (the same node count); with it the plan,
    its bound and exactness are one process's."""
    types, layers, gbs = inst
    cluster, model = make_instance(types, layers, None)
    opts = SearchOptions(global_batch_size=gbs, seq_length=128, workers=1, pruning=pruning,
                         runner_up=False, schedules=("1f1b", "interleaved-1f1b"))
    one = search_plan(cluster, model, opts)
    out = run_threads(3, cluster, model, opts)
    assert "error" not in out, out.get("error")
    (many,) = out["plans"]
    _same(one, many)
    if pruning == "none":
        assert many.search["nodes"] == one.search["nodes"]


# one configuration holds most of a round's nodes: 32 layers on two types, 1F1B, b = 1; the
# deep pipeline (pp=10, dp=1) takes ~40k nodes of its last round
DOMINANT = ([(150.0, 2, 2, 1.0), (100.0, 2, 3, 1.0)], 32, 16)


def _dominant():
    types, layers, gbs = DOMINANT
    cluster, model = make_instance(types, layers, None)
    return cluster, model, SearchOptions(global_batch_size=gbs, seq_length=128, workers=1,
                                         runner_up=False, schedules=("1f1b",),
                                         micro_batch_sizes=(1,))


@pytest.mark.parametrize("size", [2, 3])
def test_a_dominant_configuration_is_split_over_the_searchers(size):
    """The giant configuration's subtrees go to every searcher (not only its claimer): the
    plan, the bound and exactness are one process's."""
    cluster, model, opts = _dominant()
    one = search_plan(cluster, model, opts)
    out = run_threads(size, cluster, model, opts)
    assert "error" not in out, out.get("error")
    (many,) = out["plans"]
    _same(one, many)
    assert many.search["exhaustive"]
    assert many.search["shared_splits"] >= 1
    assert many.search["shared_chunks_helped"] >= 1     # another searcher took chunks
    assert one.search["shared_splits"] == 0


def test_split_searchers_with_threads_and_a_budget(monkeypatch):
    """Two threads per searcher on the shared chunks, every giant split
    (POSEIDON_SEARCH_SPLIT_NODES=1), and a budget too short to end: the bound is a real lower
    bound (<= the exact optimum) and the plan a real plan (>= it)."""
    monkeypatch.setenv("POSEIDON_SEARCH_SPLIT_NODES", "1")
    cluster, model, opts = _dominant()
    exact = search_plan(cluster, model, opts)
    opts2 = opts.replace(workers=2)
    out = run_threads(2, cluster, model, opts2)
    assert "error" not in out, out.get("error")
    (many,) = out["plans"]
    _same(exact, many)
    assert many.search["shared_splits"] >= 1
    out = run_threads(2, cluster, model, opts2.replace(time_budget_s=0.5))
    assert "error" not in out, out.get("error")
    (short,) = out["plans"]
    assert short.lower_bound_ms <= exact.predicted_iteration_time_ms * (1 + 1e-12)
    assert short.predicted_iteration_time_ms >= exact.predicted_iteration_time_ms * (1 - 1e-12)


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_search import SCHEDS, type_st  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.tuples(st.lists(type_st, min_size=2, max_size=3), st.integers(3, 8),
                 st.sampled_from([4, 8]),
                 st.lists(st.sampled_from(SCHEDS), min_size=1, max_size=2, unique=True),
                 st.sampled_from(["uniform", "per-stage"]), st.sampled_from([2, 3])))
def test_property_split_rounds_match_one_process(inst):
    """Small random clusters, every configuration that a round finds large split over the
    searchers (POSEIDON_SEARCH_SPLIT_NODES=1): the plan and certificate are one process's."""
    from poseidon_plugin.errors import InfeasibleError

    types, layers, gbs, scheds, tp_mode, size = inst
    cluster, model = make_instance(types, layers, None)
    opts = SearchOptions(global_batch_size=gbs, seq_length=128, schedules=tuple(scheds),
                         tp_mode=tp_mode, micro_batch_sizes=(1, 2), warmup_samples=20,
                         workers=1, runner_up=False)
    try:
        one = search_plan(cluster, model, opts)
    except InfeasibleError:
        return
    old = os.environ.get("POSEIDON_SEARCH_SPLIT_NODES")
    os.environ["POSEIDON_SEARCH_SPLIT_NODES"] = "1"
    try:
        out = run_threads(size, cluster, model, opts)
    finally:
        if old is None:
            del os.environ["POSEIDON_SEARCH_SPLIT_NODES"]
        else:
            os.environ["POSEIDON_SEARCH_SPLIT_NODES"] = old
    assert "error" not in out, out.get("error")
    (many,) = out["plans"]
    _same(one, many)


def test_bad_split_setting(monkeypatch):
    cluster, model, opts = _dominant()
    monkeypatch.setenv("POSEIDON_SEARCH_SPLIT_NODES", "many")
    out = run_threads(2, cluster, model, opts, stall_s=5.0)
    assert "POSEIDON_SEARCH_SPLIT_NODES='many' is not a whole number" in out["error"]


def test_a_searcher_that_never_joins_is_named_in_time():
    cluster, model = _setting(1)
    opts = SearchOptions(global_batch_size=128, seq_length=4096, workers=1, runner_up=False)
    out = run_threads(3, cluster, model, opts, stall_s=1.5, absent=(2,))
    assert "plans" not in out
    assert "search process 2 never joined" in out["error"]
    assert isinstance(out[1], PoseidonError)     # the others stop too


def test_a_searcher_that_dies_mid_search_is_named_in_time():
    cluster, model = _setting(1)
    opts = SearchOptions(global_batch_size=128, seq_length=4096, workers=1, runner_up=False)
    out = run_threads(2, cluster, model, opts, stall_s=1.5, die_after_roots=(1,))
    assert "plans" not in out
    assert "search process 1 stopped answering" in out["error"]


def test_bad_stall_setting(monkeypatch):
    monkeypatch.setenv("POSEIDON_SEARCH_STALL_S", "soon")
    with pytest.raises(PoseidonError, match="POSEIDON_SEARCH_STALL_S"):
        Searchers(MemoryStore(), 0, 2)
    with pytest.raises(PoseidonError, match="no such searcher"):
        Searchers(MemoryStore(), 2, 2, stall_s=1.0)


# ---------------------------------------------------------------- real processes (torchrun)
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from test_launch_e2e import TORCHRUN, free_port  # noqa: E402


def _torchrun(nproc: int, args: list[str], stall_s: float = 30.0, timeout: float = 240):
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
           "POSEIDON_SEARCH_STALL_S": str(stall_s)}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    return proc, proc.stdout + proc.stderr, time.monotonic() - t0


PLAN_ARGS = ["--cluster", "examples/clusters/paper-setting1.yaml", "--model", "llama3-8b",
             "--global-batch-size", "128", "--seq-length", "4096", "--json", "--no-runner-up"]


def _one_and_two_processes(args):
    """``poseidon plan ARGS --json`` in one process and with ``--distributed`` under torchrun
    (2 processes): (plan JSON, plan JSON, search, search), the searches popped."""
    one = subprocess.run([sys.executable, "-m", "poseidon_plugin", "plan", *args],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
                         cwd=ROOT, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    proc, out, _ = _torchrun(2, ["-m", "poseidon_plugin", "plan", "--distributed", *args])
    assert proc.returncode == 0, out[-5000:]
    a, b = json.loads(one.stdout), json.loads(proc.stdout)   # rank 0 alone prints
    return a, b, a.pop("search"), b.pop("search")


@pytest.mark.integration   # torchrun, torch.distributed's store: not in the torch-free core venv
def test_cli_distributed_under_torchrun_matches_one_process():
    a, b, sa, sb = _one_and_two_processes(PLAN_ARGS)
    assert a == b
    assert sb["processes"] == 2 and sa["processes"] == 1
    assert sb["exhaustive"] == sa["exhaustive"]


@pytest.mark.integration
def test_cli_distributed_splits_a_dominant_configuration_across_processes(tmp_path,
                                                                          monkeypatch):
    """Two torchrun processes, the dominant configuration's subtrees shared through the
    TCP store (every configuration of >= 2,000 nodes split: several splits): the plan JSON
    is one process's (but for ``search``)."""
    monkeypatch.setenv("POSEIDON_SEARCH_SPLIT_NODES", "2000")
    types, layers, gbs = DOMINANT
    tnames = {}
    for i, (tflops, dpn, count, mem) in enumerate(types):
        tnames[f"T{i}"] = (tflops, dpn, count, mem)
    cluster = {"name": "rand",
               "device_types": {n: {"memory_gib": m, "peak_tflops": f, "intra_node_gbps": 400}
                                for n, (f, _, _, m) in tnames.items()},
               "nodes": [{"device_type": n, "devices_per_node": d, "count": c}
                         for n, (_, d, c, _) in tnames.items()],
               "links": {"inter_node_gbps": {n: 100 for n in tnames}, "cross_type_gbps": 50,
                         "latency_ms": 0.01}}
    model = {"name": "tiny", "num_layers": layers, "hidden_size": 256, "ffn_hidden_size": 1024,
             "num_attention_heads": 8, "vocab_size": 1024, "seq_length": 128}
    (tmp_path / "c.yaml").write_text(json.dumps(cluster))
    (tmp_path / "m.yaml").write_text(json.dumps(model))
    args = ["--cluster", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "m.yaml"),
            "--global-batch-size", str(gbs), "--seq-length", "128", "--schedules", "1f1b",
            "--micro-batch-sizes", "1", "--workers", "1", "--json", "--no-runner-up"]
    a, b, sa, sb = _one_and_two_processes(args)
    assert a == b
    assert sb["processes"] == 2 and sb["exhaustive"] and sa["exhaustive"]
    assert sb["shared_splits"] >= 1 and sb["shared_chunks_helped"] >= 1, sb


@pytest.mark.integration
@pytest.mark.parametrize("mode,what", [("never", "rank 1 stopped answering"),
                                       ("die", "rank 1 stopped answering")])
def test_a_rank_lost_under_torchrun_ends_with_an_error(mode, what):
    proc, out, took = _torchrun(2, ["tests/dist_search_probe.py", mode], stall_s=3.0)
    assert proc.returncode != 0
    assert what in out, out[-3000:]


@pytest.mark.integration
def test_emulated_launch_on_two_hosts_shares_the_search(tmp_path):
    """A --poseidon-auto dry run whose two ranks sit on two (emulated) hosts: each host's
    first rank searches a share; rank 0 broadcasts the merged plan as usual."""
    from test_launch_e2e import GPT_ARGS, ok, torchrun

    emu = tmp_path / "emu.yaml"
    emu.write_text("device_types:\n  emu-fast: {speed: 1.0, memory_gib: 16}\n"
                   "  emu-slow: {speed: 0.5, memory_gib: 16}\n"
                   "ranks: [emu-slow, emu-fast]\nhosts: [host-a, host-b]\n")
    args = [*GPT_ARGS, "--train-iters", "2", "--poseidon-dry-run", "--poseidon-emulate",
            str(emu)]
    proc, out, _ = torchrun(2, args, {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    assert "search: shared by 2 searchers (one per host)" in out, out[-3000:]
