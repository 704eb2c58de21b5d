"""How often `--pruning ridge` (paper's behaviour) misses the optimum of `none` on random small
instances, and how often `safe` could apply Theorem 2 at all. A finding, not a test."""
import random
import sys
import os

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_search import make_instance  # noqa: E402

from poseidon_plugin.costs import CostModel  # noqa: E402
from poseidon_plugin.errors import InfeasibleError  # noqa: E402
from poseidon_plugin.search import _search  # noqa: E402
from poseidon_plugin.search import (SearchContext, SearchOptions,  # noqa: E402
                                    enumerate_configs, search_plan)


def main(n=200, seed=0):
    rng = random.Random(seed)
    miss = total = 0
    worst = 0.0
    safe_cfgs = all_cfgs = 0
    for _ in range(n):
        types = [(rng.choice([50.0, 80.0, 100.0, 150.0]), rng.choice([1, 2]), rng.randint(1, 2),
                  rng.choice([0.05, 0.1, 1.0])) for _ in range(rng.randint(2, 3))]
        layers = rng.randint(3, 8)
        gbs = rng.choice([4, 8, 16])
        scheds = tuple(rng.sample(["1f1b", "eager-1f1b", "interleaved-1f1b"], rng.randint(1, 2)))
        cluster, model = make_instance(types, layers, None)
        kw = dict(global_batch_size=gbs, seq_length=128, schedules=scheds, workers=1,
                  micro_batch_sizes=(1, 2), warmup_samples=20, type_order="any")
        try:
            exact = search_plan(cluster, model, SearchOptions(pruning="none", **kw))
        except InfeasibleError:
            continue
        ridge = search_plan(cluster, model, SearchOptions(pruning="ridge", **kw))
        total += 1
        gap = ridge.predicted_iteration_time_ms / exact.predicted_iteration_time_ms - 1
        if gap > 1e-9:
            miss += 1
            worst = max(worst, gap)
        ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
        for cfg in enumerate_configs(ctx.cm, SearchOptions(**{**kw, "pruning": "safe"})):
            all_cfgs += 1
            safe_cfgs += ctx.ridge_rule(cfg, "safe").mode == _search.RIDGE_MODES["safe"]
    print(f"instances: {total}, ridge missed the optimum on {miss} "
          f"({100.0 * miss / max(total, 1):.1f}%), worst excess {100 * worst:.2f}%")
    print(f"outer configurations where `safe` may apply Theorem 2: {safe_cfgs}/{all_cfgs}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
