"""The estimator's MoE tensor-parallel traffic against what megatron-core's ``MoELayer`` moves.

``tests/moe_dispatch_probe.py`` builds megatron-core 0.19's MoE layer (``alltoall`` token
dispatcher, sequence parallel) on TP x EP gloo ranks, runs a micro-batch forward and backward
and logs every collective with its values. Per direction the TP group must move, for the MLP
part of the layer, exactly the exchanges ``tp_traffic.kind_tp_exchanges`` prices after the
attention's: an all-gather and a reduce-scatter of b*s*h values for the shared expert and of
k*b*s*h for the dispatcher's token copies (with EP > 1, the mean over ranks: routing need not
be balanced); and the EP all-to-all sends the b*s/t*k*h values ``comm.expert_alltoall_bytes``
is the (ep-1)/ep share of. The backward re-gathers the shared expert's input for its weight
gradient (megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``, overlapped with
the input-gradient GEMM): counted here, not priced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poseidon_plugin.layers import AttentionSpec, LayerKind, MLPSpec
from poseidon_plugin.tp_traffic import allgather_dispatch_values, kind_tp_exchanges

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from test_launch_e2e import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow     # 3 gloo launches (2, 4 and 4 ranks): about 55 CPU-s


def _probe(tmp_path, tp: int, ep: int, shared: bool, dispatcher: str = "alltoall") -> dict:
    out = tmp_path / f"probe-{tp}-{ep}-{int(shared)}-{dispatcher}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(ROOT / "tests/moe_dispatch_probe.py"), str(tp),
                          str(ep), "1" if shared else "0", str(free_port()), str(out),
                          dispatcher],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _kind(shape: dict, shared: bool) -> LayerKind:
    return LayerKind("moe", shape["hidden"], AttentionSpec(4, 4, shape["hidden"] // 4),
                     MLPSpec(32, num_experts=shape["experts"], top_k=shape["top_k"],
                             shared_ffn_hidden_size=48 if shared else 0))


def _tp_values(rank: dict, direction: str, ops: tuple[str, ...], tp_group, hidden: int):
    return sorted(v for op, group, v, last in rank[direction]
                  if op in ops and tuple(group) == tp_group and last == hidden)


AG = ("all_gather", "all_gather_into_tensor")
RS = ("reduce_scatter", "reduce_scatter_tensor")


@pytest.mark.parametrize("tp,ep,shared", [(2, 1, True), (2, 2, False)])
def test_megatrons_moe_layer_moves_the_priced_tp_volumes(tmp_path, tp, ep, shared):
    got = _probe(tmp_path, tp, ep, shared)
    shape, ranks = got["shape"], got["ranks"]
    h, b, s, k = shape["hidden"], shape["micro_batch"], shape["seq"], shape["top_k"]
    priced = sorted(kind_tp_exchanges(_kind(shape, shared), b, s)[1:])   # attention aside
    world = tp * ep
    means = {}
    for direction in ("forward", "backward"):
        for name, ops in (("ag", AG), ("rs", RS)):
            per_rank = []
            for r, rank in enumerate(ranks):
                tp_group = tuple(range(r - r % tp, r - r % tp + tp))
                per_rank.append(_tp_values(rank, direction, ops, tp_group, h))
            assert len({len(v) for v in per_rank}) == 1
            means[direction, name] = sorted(sum(col) / world for col in zip(*per_rank))
    assert means["forward", "ag"] == priced
    assert means["forward", "rs"] == priced
    assert means["backward", "rs"] == priced
    # the backward's all-gathers: the priced ones, plus the shared expert's re-gathered input
    extra = list(means["backward", "ag"])
    for v in priced:
        extra.remove(v)
    assert extra == ([b * s * h] if shared else [])
    if ep > 1:
        sent = [v for rank in ranks for op, group, v, last in rank["forward"]
                if op == "all_to_all_single" and last == h and len(group) == ep]
        # dispatch and combine: each rank's b*s/t tokens x k copies (the (ep-1)/ep share of
        # which leaves the rank: ``comm.expert_alltoall_bytes``)
        assert len(sent) == 2 * world
        assert sum(sent) / len(sent) == b * s / tp * k * h


def test_megatrons_allgather_dispatcher_moves_the_priced_tp_x_ep_volumes(tmp_path):
    """megatron-core's ``MoEAllGatherTokenDispatcher`` at TP 2 x EP 2 (shared expert): over the
    TP x EP group each direction all-gathers and reduce-scatters the ep*b*s*h tokens and moves
    the ep*b*s*E routing probabilities one way (forward: gathered beside the boolean routing
    map, which is not priced; backward: their gradient reduce-scattered), which is twice
    ``allgather_dispatch_values``; the TP group moves only the shared expert's b*s*h exchange,
    and nothing goes all-to-all."""
    tp, ep = 2, 2
    got = _probe(tmp_path, tp, ep, True, "allgather")
    shape, ranks = got["shape"], got["ranks"]
    h, b, s, e = shape["hidden"], shape["micro_batch"], shape["seq"], shape["experts"]
    kind = _kind(shape, True)
    priced = allgather_dispatch_values(h, e, b, s, ep)
    shared = kind_tp_exchanges(kind, b, s, "allgather")[1:-1]
    world = tp * ep
    for r, rank in enumerate(ranks):
        tp_group = tuple(range(r - r % tp, r - r % tp + tp))
        for direction in ("forward", "backward"):
            calls = rank[direction]
            assert not [c for c in calls if c[0] == "all_to_all_single"], calls
            wide = [(op, v, last) for op, group, v, last in calls if len(group) == world]
            tokens = sorted(("ag" if op in AG else "rs", v) for op, v, last in wide if last == h)
            assert tokens == [("ag", ep * b * s * h), ("rs", ep * b * s * h)], wide
            probs = [(op, v) for op, v, last in wide if last == e]
            if direction == "forward":   # the routing map and the probabilities
                assert sorted(probs) == [("all_gather_into_tensor", ep * b * s * e)] * 2
            else:                        # the probabilities' gradient
                assert probs == [("reduce_scatter_tensor", ep * b * s * e)]
            assert sum(v for _, v in tokens) + ep * b * s * e == pytest.approx(2 * priced)
            for name, ops in (("ag", AG), ("rs", RS)):
                mine = _tp_values(rank, direction, ops, tp_group, h)
                # the backward re-gathers the shared expert's input for its weight gradient
                again = [b * s * h] if (direction, name) == ("backward", "ag") else []
                assert mine == sorted(list(shared) + again), (direction, name, mine)
