"""Plan value: JSON round trip, flags, rank order, megatron-core's own argument validation."""

from __future__ import annotations

import copy
import os
import shlex
import sys

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import chunk_layers
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import DeviceSlot, Plan, StagePlan
from poseidon_plugin.search import SearchOptions, search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(schedule="1f1b", v=1, tp=1, dp=2, layers=(3, 5, 2)):
    stages = []
    node = 0
    for i, l in enumerate(layers):
        devs = tuple(tuple(DeviceSlot(i, r * tp + j) for j in range(tp)) for r in range(dp))
        stages.append(StagePlan(i, "A", tp, dp, l, 1.0, 2.0, 0.1 if i < len(layers) - 1 else 0.0,
                                0.1 if i < len(layers) - 1 else 0.0, 0.5, 10, 20, devs))
    return Plan(schedule, v, dp, 1, 8, 16, 128, tuple(stages), 123.456789123,
                model_name="m", cluster_name="c", num_layers=sum(layers))


def test_layout_and_flags():
    p = _plan()
    assert p.pipeline_layout() == "Et*3|t*5|t*2L"
    a = p.megatron_args()
    assert a[a.index("--pipeline-model-parallel-size") + 1] == "3"
    assert a[a.index("--pipeline-model-parallel-layout") + 1] == "Et*3|t*5|t*2L"
    m = p.mindspeed_llm_args()
    assert m[m.index("--num-layer-list") + 1] == "3,5,2"


def test_interleaved_layout_has_n_times_v_segments():
    p = _plan("interleaved-1f1b", 2, layers=(4, 3))
    assert p.pipeline_layout() == "Et*2|t*2|t*2|tL"
    assert p.pipeline_layout().count("|") == 3
    # MindSpeed-LLM refuses --num-layer-list with a virtual pipeline: the layout flag, which only
    # v26.1.0 and later register (the table says so)
    m = p.mindspeed_llm_args()
    assert "--num-layer-list" not in m
    assert m[m.index("--pipeline-model-parallel-layout") + 1] == p.pipeline_layout()
    line = next(ln for ln in p.table().splitlines() if ln.startswith("mindspeed:"))
    assert line.endswith("# layout flag: MindSpeed-LLM v26.1.0 or later")
    assert not any(ln.endswith("or later") for ln in _plan().table().splitlines())


@pytest.mark.parametrize("schedule, v, layers", [("1f1b", 1, (3, 5, 2)),
                                                 ("interleaved-1f1b", 2, (4, 3))])
def test_printed_flag_lines_are_shell_safe(schedule, v, layers):
    """The table's flag lines paste into a shell as the very argv the plan gives (the layout's
    '|' and '*' quoted; MindSpeed's note a shell comment), and so does the launch log's."""
    from poseidon_plugin.megatron.launch.runner import _shell_join
    p = _plan(schedule, v, layers=layers)
    lines = p.table().splitlines()
    for prefix, args in (("megatron:", p.megatron_args()), ("mindspeed:", p.mindspeed_llm_args())):
        line = next(ln for ln in lines if ln.startswith(prefix))[len(prefix):]
        assert _shell_words(line) == args
        assert "|" in p.pipeline_layout() and _shell_words(_shell_join(args)) == args


def _shell_words(line: str) -> list[str]:
    """The words a POSIX shell makes of ``line``: an unquoted '|' (or ';', '&', ...) is an
    operator of its own, a '#' starts a comment."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def test_layout_segments_split_stages_by_chunk_layers():
    # one split rule (costs.chunk_layers) for the layout; segments chunk-major: c*N + s
    for layers, v in (((4, 3), 2), ((7, 5, 6), 3), ((3, 9), 4), ((8,), 3)):
        p = _plan("interleaved-1f1b", v, layers=layers)
        segs = p.layout_segments()
        assert len(segs) == len(layers) * v
        for s, n in enumerate(layers):
            assert tuple(segs[c * len(layers) + s] for c in range(v)) == chunk_layers(n, v)
        assert sum(segs) == sum(layers)
    assert _plan("interleaved-1f1b", 2, layers=(4, 3)).layout_segments() == [2, 2, 2, 1]
    assert _plan(layers=(3, 5, 2)).layout_segments() == [3, 5, 2]


def test_rank_order_is_tp_dp_pp():
    p = _plan(tp=2, dp=2, layers=(1, 1))
    order = p.rank_order()
    # rank = stage * (tp*dp) + dp_rank * tp + tp_rank
    assert order[0 * 4 + 1 * 2 + 1] == p.stages[0].devices[1][1]
    assert order[1 * 4 + 0 * 2 + 1] == p.stages[1].devices[0][1]
    assert len(order) == 8


def test_json_round_trip_and_deterministic():
    p = _plan()
    text = p.to_json()
    q = Plan.from_json(text)
    assert q.to_json() == text
    assert text == _plan().to_json()
    for key in ("predicted_iteration_time_ms", "schedule", "virtual_stages", "dp",
                "micro_batch_size", "num_microbatches", "stages", "megatron_args",
                "mindspeed_llm_args", "rank_order", "unused_devices", "search"):
        assert key in p.to_dict()


def _megatron_validate(argv, world_size):
    from megatron.training.arguments import parse_args, validate_args
    old = sys.argv
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    try:
        sys.argv = ["pretrain_gpt.py", "--num-layers", "8", "--hidden-size", "256",
                    "--num-attention-heads", "8", "--seq-length", "128",
                    "--max-position-embeddings", "128", "--vocab-size", "1024",
                    "--tokenizer-type", "NullTokenizer", "--lr", "1e-4",
                    "--train-iters", "10", "--bf16"] + argv
        args = parse_args(ignore_unknown_args=True)
        args.world_size = world_size
        args.rank = 0
        validate_args(copy.deepcopy(args))
    finally:
        sys.argv = old
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.integration
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_megatron_accepts_flags(schedule, v):
    pytest.importorskip("megatron.training")
    p = _plan(schedule, v, layers=(2, 3, 3) if v == 1 else (4, 4))
    p = Plan(p.schedule, p.virtual_stages, p.dp, p.micro_batch_size,
             16 // (p.dp * p.micro_batch_size) if v == 1 else 8, 16, 128, p.stages,
             p.predicted_iteration_time_ms, num_layers=8)
    _megatron_validate(p.megatron_args(), p.world_size)


@pytest.mark.integration
def test_megatron_accepts_searched_plan():
    pytest.importorskip("megatron.training")
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/small-two-type.yaml"))
    model = get_model(os.path.join(ROOT, "examples/models/tiny-gpt.yaml"))
    p = search_plan(cluster, model, SearchOptions(
        global_batch_size=16, seq_length=128, workers=1, warmup_samples=20,
        schedules=("1f1b", "interleaved-1f1b")))
    assert sum(p.layers_per_stage) == 8
    _megatron_validate(p.megatron_args(), p.world_size)


def test_node_ranges_are_compact():
    from poseidon_plugin.plan import node_ranges

    assert node_ranges(range(36)) == "0-35"
    assert node_ranges([8, 9, 10, 11, 0, 1, 2, 3]) == "0-3,8-11"
    assert node_ranges([5]) == "5" and node_ranges([1, 3, 4]) == "1,3-4"
    assert node_ranges(range(0, 40, 2)) == "0,2,4,6,8,10,12,14,... +12 ranges, 20 nodes"


def test_table_node_column_and_per_microbatch_note():
    """A stage on 36 consecutive nodes reads "0-35", not 36 numbers; the table says its stage
    times are per micro-batch."""
    devs = tuple((DeviceSlot(n, 0),) for n in range(36))
    st = StagePlan(0, "A", 1, 36, 4, 1.0, 2.0, 0.0, 0.0, 0.5, 10, 20, devs)
    table = Plan("1f1b", 1, 36, 1, 2, 72, 128, (st,), 5.0, num_layers=4).table()
    row = next(ln for ln in table.splitlines() if ln.split()[:2] == ["0", "A"])
    assert row.endswith("  0-35") and "35," not in row
    assert "fwd, bwd and send ms per micro-batch; allred ms per iteration" in table


def test_table_groups_consecutive_identical_stages():
    """32 stages, 31 alike but for their memory and nodes: two stage rows (``0-30`` with the
    memory's range, and ``31``); ``verbose``: 32 rows; the JSON keeps every stage."""
    import dataclasses
    import json

    gib = 1024 ** 3
    p = _plan(layers=(2,) * 32)
    p = dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, memory_bytes=(10 + s.index % 3) * gib, memory_capacity_bytes=80 * gib,
                            memory_parts=(("dense_layers", 1), ("moe_layers", 1),
                                          ("dense_layers_bytes", 4 * gib),
                                          ("moe_layers_bytes", (5 + s.index % 2) * gib)))
        for s in p.stages))

    def stage_rows(text):
        return [ln for ln in text.splitlines() if ln.split()[1:2] == ["A"]]

    rows = stage_rows(p.table())
    assert [r.split()[0] for r in rows] == ["0-30", "31"]
    assert "10.0-12.0 /   80.0  0-30" in rows[0]
    assert "  stages 0-31: dense 1 layers 4.0 GiB, moe 1 layers 5.0-6.0 GiB" in p.table()
    assert "(a-b: stages a to b" in p.table()
    full = p.table(verbose=True)
    assert [r.split()[0] for r in stage_rows(full)] == [str(i) for i in range(32)]
    assert "  stage 7: dense 1 layers 4.0 GiB, moe 1 layers 6.0 GiB" in full
    assert "(a-b: stages a to b" not in full
    assert len(json.loads(p.to_json())["stages"]) == 32
    assert p.table() == p.table()   # the same plan, the same bytes
