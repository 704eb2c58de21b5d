"""The constructive plan of a model of several layer kinds (``construct.py``): the layers are
filled by the exact limits and costs of each stage's own layer range (``lmax_from``, the
per-kind layer costs, the embedding on the first stage and the output layer on the last), so
the plan is feasible under the exact limits and no worse than simple even splits.

The instance: DeepSeek-V3 (3 dense + 58 MoE layers) on scale-512, global batch 1024, sequence
4096, 51 stages of TP 8. It was 45 stages, where the memory model of the time allowed one MoE
layer per A100-40 stage from stage 17 on only, and a construction that did not see the output
layer put it on an A100-40 stage (35.2 s against about 20.5 s; before that fix). Since the
expert activations are counted as megatron-core keeps them (not divided by TP) and MTP is on the
last stage, 45 (to 50) stages of TP 8 fit no split at all; 51 is the fewest that fit again,
as tight (construction 45.4 s, best even split 48.6 s)."""

from __future__ import annotations

import itertools

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import CostModel
from poseidon_plugin.model import get_model
from poseidon_plugin.search import SearchContext, SearchOptions, enumerate_configs
from poseidon_plugin.search.construct import _stage_types, construct_plan


@pytest.fixture(scope="module")
def deepseek_51():
    cm = CostModel(load_cluster("examples/clusters/scale-512.yaml"), get_model("deepseek-v3"),
                   None, seq_length=4096)
    assert cm.per_kind
    opts = SearchOptions(global_batch_size=1024, seq_length=4096, schedules=("1f1b",),
                         micro_batch_sizes=(1,), tp_degrees=(8,), workers=1)
    cfg = next(c for c in enumerate_configs(cm, opts)
               if c.num_stages == 51 and c.dp == 1 and c.micro_batch_size == 1)
    return SearchContext(cm), cfg


def _even_split(ctx, cfg, opts):
    """Layers as even as the exact limits allow: the smallest per-stage cap c at which the
    stages, in order, each take min(c, its limit from its first layer), leaving one layer per
    later stage, and the last stage the rest, fit; None when no c does."""
    n, v, L = cfg.num_stages, cfg.virtual_stages, ctx.cm.model.num_layers
    frm = ctx.lmax_from(cfg)
    for c in range(v, L + 1):
        a, layers = 0, []
        for x, o in enumerate(opts):
            take = L - a if x == n - 1 else min(c, int(frm[o, x, a]), L - a - (n - 1 - x) * v)
            layers.append(take)
            a += take
        if ctx.fits(cfg, opts, layers):
            return layers
    return None


def _reference(ctx, cfg):
    """The best of the even splits (``_even_split``) over the type orders of the
    construction's stage types (each type one block, and each order with one stage of some
    type moved to the end), timed by the Python cost path (``SearchContext.evaluate``)."""
    stages = _stage_types(ctx, cfg)
    blocks: dict[int, list[int]] = {}
    for k, o in stages:
        blocks.setdefault(k, []).append(o)
    best = None
    for order in itertools.permutations(sorted(blocks)):
        base = [o for k in order for o in blocks[k]]
        seqs = [base] + [base[:i] + base[i + 1:] + [base[i]]
                         for i in {max(i for i, o in enumerate(base) if o == oo)
                                   for oo in set(base)}]
        for opts in seqs:
            layers = _even_split(ctx, cfg, opts)
            if layers is None:
                continue
            t = ctx.evaluate(cfg, opts, layers)
            if best is None or t < best[0]:
                best = (t, opts, layers)
    return best


def test_mixed_construction_is_feasible_and_no_worse_than_even_splits(deepseek_51):
    ctx, cfg = deepseek_51
    ref = _reference(ctx, cfg)
    assert ref is not None
    got = construct_plan(ctx, cfg)
    assert got is not None
    t, opts, layers = got
    assert sum(layers) == ctx.cm.model.num_layers
    assert ctx.fits(cfg, opts, layers)
    assert ctx.evaluate(cfg, opts, layers) == pytest.approx(t, rel=1e-9)
    assert t <= ref[0] * (1 + 1e-9), (t, ref)
