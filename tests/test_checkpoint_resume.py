"""Resume under a new plan, the parts that need no launch (``megatron/checkpoint/``): the
change summary (``poseidon plan --keep`` on a changed cluster file, a real search), the
``--save`` prerequisite, a real torch distributed checkpoint with one shard removed, truncated
or altered, and what Megatron cannot reshard (refused before any model is built).

The launches (save under plan A, resume under plans B on Megatron-LM core_v0.19.0's own
``pretrain_gpt.py``) are in tests/test_resume_replan.py (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.checkpoint import reader as ck
from poseidon_plugin.megatron.checkpoint import resume
from poseidon_plugin.megatron.checkpoint.change import DeviceGroup, device_changes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "examples", "clusters", "small-two-type.yaml")
MODEL = os.path.join(ROOT, "examples", "models", "tiny-gpt.yaml")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poseidon_plugin.cli", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


def plan_args(cluster: str) -> list[str]:
    return ["plan", "--cluster", cluster, "--model", MODEL, "--global-batch-size", "16",
            "--seq-length", "128", "--no-baselines"]


def test_keep_on_a_changed_cluster_prints_what_changed(tmp_path):
    kept = tmp_path / "plan.json"
    first = cli(*plan_args(CLUSTER), "--out", str(kept))
    assert first.returncode == 0, first.stderr
    plan = json.loads(kept.read_text())
    assert plan["node_types"] == ["fast", "fast", "slow", "slow"]   # the devices it was made for
    # one of the two fast nodes gone
    text = open(CLUSTER, encoding="utf-8").read()
    assert "{device_type: fast, devices_per_node: 4, count: 2}" in text
    lost = tmp_path / "lost-one-fast-node.yaml"
    lost.write_text(text.replace("{device_type: fast, devices_per_node: 4, count: 2}",
                                 "{device_type: fast, devices_per_node: 4, count: 1}"))
    out = cli(*plan_args(str(lost)), "--keep", str(kept))
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stderr.splitlines()
               if ln.startswith(f"poseidon: note: since {kept}")]
    assert ": lost 4 x fast; plan " in line and line.endswith(" ms predicted"), line
    new = cli(*plan_args(str(lost)), "--json")
    new_plan = json.loads(new.stdout)
    old_ms, new_ms = plan["predicted_iteration_time_ms"], new_plan["predicted_iteration_time_ms"]
    assert f"{old_ms:.3g} -> {new_ms:.3g} ms predicted" in line, (line, old_ms, new_ms)
    # the same cluster: nothing lost, the plan kept
    same = cli(*plan_args(CLUSTER), "--keep", str(kept))
    (line,) = [ln for ln in same.stderr.splitlines() if "since" in ln]
    assert "the same devices; plan unchanged" in line, line


def test_keep_of_a_per_stage_tp_plan_lists_its_stages_tp(tmp_path):
    """A kept plan of per-stage TP degrees (``--per-stage-tp``; hypothesis found the change line
    asking it for one TP degree: an error after the plan was found) gets its change line."""
    kept = tmp_path / "plan.json"
    first = cli(*plan_args(CLUSTER), "--out", str(kept))
    assert first.returncode == 0, first.stderr
    doc = json.loads(kept.read_text())
    assert len(doc["stages"]) >= 2, doc["stages"]
    doc["stages"][1]["tp"] = doc["stages"][0]["tp"] * 2
    doc["tp"] = None
    kept.write_text(json.dumps(doc))
    out = cli(*plan_args(CLUSTER), "--keep", str(kept))
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stderr.splitlines()
               if ln.startswith(f"poseidon: note: since {kept}")]
    tps = ",".join(str(s["tp"]) for s in doc["stages"])
    assert f"tp={tps} -> tp=" in line, line


def test_device_changes_by_host_and_type():
    old = [DeviceGroup("host a", "A100", 8), DeviceGroup("host b", "A100", 8),
           DeviceGroup("host c", "H100", 4)]
    new = [DeviceGroup("host a", "A100", 8), DeviceGroup("host c", "H100", 4),
           DeviceGroup("host d", "H200", 8)]
    assert device_changes(old, new) == ["lost 8 x A100 (host b)", "added 8 x H200 (host d)"]
    assert device_changes(old, old) == []


def test_save_in_torch_dist_without_psutil_is_refused_up_front(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "psutil" else real(name, *a))
    with pytest.raises(PoseidonError, match=r"--save with --ckpt-format torch_dist: megatron-"
                       r"core's checkpoint writer needs psutil, which is not installed"):
        resume.check_save_prerequisites(["--save", "/x", "--train-iters", "8"])
    resume.check_save_prerequisites(["--save", "/x", "--ckpt-format", "torch"])   # no psutil needed
    resume.check_save_prerequisites(["--load", "/x"])


@pytest.mark.integration   # torch, psutil and the installed megatron-core 0.19.2
def test_np_product_is_restored_for_a_megatron_core_that_calls_it(tmp_path):
    """megatron-core 0.12.1 (MindSpeed-LLM's base) and 0.15.3 call np.product in their
    distributed checkpointing; NumPy 2 removed that alias of np.prod: every rank of a
    MindSpeed-LLM launch died at its first save (AttributeError). The launch puts the alias
    back (one line) where the megatron on the path calls it; megatron-core 0.19 gets nothing."""
    tree = os.environ.get("POSEIDON_FRAMEWORKS") or os.path.join(ROOT, "..", "shared",
                                                                 "frameworks")
    old = os.path.join(tree, "megatron-lm-core_v0.12.1")
    if not os.path.isdir(old):
        pytest.skip(f"the megatron-lm core_v0.12.1 tree is not here ({old}): a user's clone")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import numpy\n"
            "if hasattr(numpy, 'product'): del numpy.product\n"
            "from poseidon_plugin.megatron.checkpoint import resume\n"
            "note = resume.check_save_prerequisites(['--save', '/x'])\n"
            "print(hasattr(numpy, 'product') and numpy.product is numpy.prod, note)\n"
            "from megatron.core.dist_checkpointing import exchange_utils\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for where, restored in ((old, True), (str(tmp_path), False)):   # 0.19.2 installed
        out = subprocess.run([sys.executable, "-c", code, where], capture_output=True,
                             text=True, timeout=300, env=env, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith(f"{restored} "), (where, out.stdout)
        if restored:
            assert "numpy.product restored as numpy.prod" in out.stdout
            assert "dist_checkpointing" in out.stdout
        else:
            assert out.stdout.strip() == "False None", out.stdout
    no_ckpt = subprocess.run([sys.executable, "-c", code.replace("'--save', '/x'", ""), old],
                             capture_output=True, text=True, timeout=300, env=env)
    assert no_ckpt.stdout.startswith("False None"), no_ckpt.stdout   # nothing saved or loaded


WRITE_ITEM_PROBE = r"""
import io, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from poseidon_plugin.megatron.checkpoint import resume
note = resume.check_save_prerequisites(["--save", "/x"]) if sys.argv[2] == "1" else None
import numpy; numpy.product = numpy.prod
print("NOTE", note)
import torch
from torch import multiprocessing as mp
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.metadata import MetadataIndex
print("PATCHED", hasattr(fa._write_item, "poseidon_wraps"))
w = fa.FileSystemWriterAsync(tempfile.mkdtemp())
tl = [w.transforms] if hasattr(w, "transforms") else []
d = tempfile.mkdtemp()
fn = os.path.join(d, "b.distcp")
item = WriteItem(index=MetadataIndex("x"), type=WriteItemType.BYTE_IO)
ctx = mp.get_context("fork")
q, cq = ctx.Queue(), ctx.JoinableQueue()
cq.put(0)
fa.FileSystemWriterAsync.write_preloaded_data(tl, 0, (fn, "key", ([(item, io.BytesIO(b"abcdef"))], [])), q, cq, False)
idx, res = q.get(timeout=30)
print("RESULT", type(res).__name__, os.path.getsize(fn), res if isinstance(res, Exception) else "")
if "core_v0.12.1" in sys.argv[1]:
    # MindSpeed-LLM's caller spawns the writer: a fresh interpreter imports the writer module
    torch.distributed.get_rank = lambda: 0   # what the save function's arguments name
    w.write_buckets = [(os.path.join(d, "s.distcp"), "key", ([(item, io.BytesIO(b"abcdef"))], []))]
    w.results_queue = mp.get_context("spawn").Queue()
    fn_, _, args = w.get_save_function_and_args()
    args[0] = 0
    p = mp.get_context("spawn").Process(target=fn_, args=args)
    p.start(); p.join(120)
    res = w.results_queue.get(timeout=30)
    print("SPAWNED", type(res).__name__, os.path.getsize(os.path.join(d, "s.distcp")))
"""


@pytest.mark.integration   # torch and megatron-core's checkpoint writer
def test_megatron_core_0_12_1s_writer_gets_torchs_serialization_format(tmp_path):
    """megatron-core 0.12.1's FileSystemWriterAsync.write_preloaded_data calls torch's private
    _write_item without serialization_format, which this torch requires: every rank of a
    MindSpeed-LLM save failed with a TypeError. With the launch's hook the writer's own
    function writes the bucket, in a forked writer process and in a spawned one (MindSpeed-LLM
    spawns it: a fresh interpreter); megatron-core 0.19.2 (installed) is left alone."""
    tree = os.environ.get("POSEIDON_FRAMEWORKS") or os.path.join(ROOT, "..", "shared",
                                                                 "frameworks")
    old = os.path.join(tree, "megatron-lm-core_v0.12.1")
    if not os.path.isdir(old):
        pytest.skip(f"the megatron-lm core_v0.12.1 tree is not here ({old}): a user's clone")
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}

    def probe(where: str, hook: bool) -> dict[str, str]:
        out = subprocess.run([sys.executable, "-c", WRITE_ITEM_PROBE, where, str(int(hook))],
                             capture_output=True, text=True, timeout=300, env=env,
                             cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-2000:]
        return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.stdout.splitlines()
                if " " in ln}

    bare = probe(old, hook=False)
    assert bare["RESULT"].startswith("TypeError 0 ") and "serialization_format" in bare["RESULT"]
    fixed = probe(old, hook=True)
    assert fixed["PATCHED"] == "True" and fixed["RESULT"].startswith("list 6"), fixed
    assert "calls torch's _write_item without the serialization_format" in fixed["NOTE"]
    # a spawned writer process (MindSpeed-LLM's caller) binds it too
    assert bare["SPAWNED"].startswith("TypeError 0"), bare
    assert fixed["SPAWNED"] == "dict 6", fixed
    current = probe(str(tmp_path), hook=True)   # the installed megatron-core 0.19.2
    assert current["PATCHED"] == "False" and current["RESULT"].startswith("list 6"), current
    assert "_write_item" not in current["NOTE"]


def _saved_checkpoint(path) -> dict:
    """A real torch distributed checkpoint (the format megatron-core's torch_dist writes) with
    two shard files, and Poseidon's record of its files."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(4096, dtype=torch.float32),
             "b": torch.ones(64, 64, dtype=torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2),
             no_dist=True)
    return {"files": ck.shard_files(str(path))}


@pytest.mark.integration   # torch / megatron-core
def test_a_removed_truncated_or_altered_shard_is_one_error_naming_it(tmp_path):
    path = tmp_path / "iter_0000004"
    record = _saved_checkpoint(path)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert shards and all("sha256" in record["files"][n] for n in shards)
    ck.check_files(str(path), record)          # intact: no error
    victim = path / shards[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # truncated: .metadata alone tells
    with pytest.raises(PoseidonError, match=rf"shard {shards[-1]} is truncated"):
        ck.check_files(str(path), None)
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))   # same size, one byte altered
    ck.check_files(str(path), None)            # the format itself cannot tell ...
    with pytest.raises(PoseidonError, match=rf"shard {shards[-1]} differs from what was saved"):
        ck.check_files(str(path), record)      # ... the record's digest does
    victim.unlink()
    with pytest.raises(PoseidonError, match=rf"shard {shards[-1]} is missing"):
        ck.check_files(str(path), None)


def _info(path="/ck/iter_0000004", fmt="torch_dist", **saved) -> ck.CheckpointInfo:
    content = {"distrib_optim_sharding_type": saved.pop("sharding")} if "sharding" in saved else {}
    args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, **saved}
    return ck.CheckpointInfo("/ck", 4, path, fmt, args, content)


PLAN_PP3 = SimpleNamespace(tp=1, pp=3)
PLAN_PP2 = SimpleNamespace(tp=1, pp=2)


def test_what_megatron_cannot_reshard_is_refused_with_the_fix(tmp_path):
    refusal = resume.resharding_refusal
    assert refusal(_info(), PLAN_PP3, [], fused_adam=False) is None   # model + Adam state
    dp_only = _info(use_distributed_optimizer=True, sharding="dp_reshardable")
    dist = ["--use-distributed-optimizer"]
    msg = refusal(dp_only, PLAN_PP3, dist, fused_adam=True)
    assert "sharded 'dp_reshardable'" in msg and "--dist-ckpt-optim-fully-reshardable" in msg
    assert refusal(dp_only, PLAN_PP2, dist, fused_adam=True) is None   # same TP and PP
    assert refusal(dp_only, PLAN_PP3, [*dist, "--no-load-optim"], fused_adam=True) is None
    full = _info(use_distributed_optimizer=True, sharding="fully_reshardable")
    assert refusal(full, PLAN_PP3, dist, fused_adam=True) is None
    assert "without Transformer Engine or Apex" in refusal(full, PLAN_PP3, dist, fused_adam=False)
    assert "loads optimizer state only into the kind that saved it" in \
        refusal(full, PLAN_PP3, [], fused_adam=True)
    # a MoE's optimizer state across EP > 1 <-> EP 1 (Megatron: expert parameters in an
    # optimizer of their own at EP > 1)
    moe = _info(num_experts=8, expert_model_parallel_size=2)
    at = lambda ep: SimpleNamespace(tp=1, pp=3, ep=ep)   # noqa: E731
    assert "saved at EP 2 and this plan runs EP 1" in refusal(moe, at(1), [], False)
    assert refusal(moe, at(4), [], False) is None and refusal(moe, at(2), [], False) is None
    assert refusal(moe, at(1), ["--no-load-optim"], False) is None
    assert refusal(_info(expert_model_parallel_size=2), at(1), [], False) is None   # dense
    # Megatron's legacy format: (TP, PP) read from its mp_rank_TT_PPP folders
    legacy = tmp_path / "iter_0000004"
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        (legacy / name).mkdir(parents=True)
    info = ck.CheckpointInfo("/ck", 4, str(legacy), ck.detect_format(str(legacy)))
    assert info.fmt == "torch"
    assert "legacy 'torch' format, saved at tp=1 pp=2" in refusal(info, PLAN_PP3, [], False)
    assert refusal(info, PLAN_PP2, [], False) is None


def test_rng_not_resharded_is_said():
    notes = resume.resume_notes(_info(), PLAN_PP3, [])
    assert len(notes) == 1 and "RNG state not resumed" in notes[0]
    assert resume.resume_notes(_info(), PLAN_PP2, []) == []


def test_a_tp_or_pp_change_adds_no_load_rng(tmp_path, monkeypatch):
    """megatron-core 0.12.1 says "RNG state will be ignored" at a load across a TP / PP
    change, then reads the saved RNG state anyway and ends with sys.exit() (status 0, no
    training): every rank adds --no-load-rng there, and only there."""
    seen = []
    monkeypatch.setattr(ck, "read_checkpoint",
                        lambda load_dir, step: seen.append((load_dir, step)) or _info())
    load = ["--load", str(tmp_path)]
    assert resume.rng_flag(load, PLAN_PP3) == "--no-load-rng"
    assert seen == [(str(tmp_path), None)]
    assert resume.rng_flag([*load, "--ckpt-step", "4"], PLAN_PP3) == "--no-load-rng"
    assert seen[-1] == (str(tmp_path), 4)
    assert resume.rng_flag(load, PLAN_PP2) is None                      # the same TP and PP
    assert resume.rng_flag(load, SimpleNamespace(tp=2, pp=2)) == "--no-load-rng"
    for given in ("--no-load-rng", "--finetune"):
        assert resume.rng_flag([*load, given], PLAN_PP3) is None
    assert resume.rng_flag(["--load", str(tmp_path / "absent")], PLAN_PP3) is None
    assert resume.rng_flag([], PLAN_PP3) is None
    # a --ckpt-step that is no integer: rank 0's check names it, and no rank adds the flag
    bad = [*load, "--ckpt-step", "four"]
    assert resume.rng_flag(bad, PLAN_PP3) is None
    with pytest.raises(PoseidonError, match=r"--ckpt-step: expected an integer, got 'four'"):
        resume.rank0_check_resume(bad, PLAN_PP3, [])
    monkeypatch.setattr(ck, "read_checkpoint", lambda load_dir, step: ck.CheckpointInfo(
        load_dir, -1))
    assert resume.rng_flag(load, PLAN_PP3) is None                      # nothing saved there
