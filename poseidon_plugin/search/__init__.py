"""The plan search: the fastest plan for a cluster, a model and a training setup.

======================  =================================================================
``options``             ``SearchOptions``: every setting of one search, validated once
``configs``             outer configurations (schedule, V, b, d, N, TP), their root bounds
                        and the schedule constants the bounds need
``instance``            ``SearchContext``: per-configuration data and caches, the calls into
                        the branch and bound
``_search`` (Cython)    the branch and bound over (stage option, layers); typed boundary in
                        ``_search.pxd``
``_bounds`` (Cython)    the lower bounds and capacity cuts it prunes with
``driver``              ``SearchDriver``: order, seed, warm-up, passes and rounds, result;
                        ``search_plan``
``construct``, ``polish`` constructive plans and the local search from them
``tiebreak``            ``--tie-tolerance``: the preferred plan within a window of the fastest
``runnerup``            how sure the choice is: the fastest plan of any other configuration
``build``               the ``Plan`` value of a searched assignment
``baselines``           Megatron's even split and the best single-type plan; why nothing fits
======================  =================================================================

Method and proofs: ``docs/search.md``.
"""

from .baselines import (baseline_entries, baseline_plans, baseline_results,
                        skipped_baseline_entries)
from .build import build_plan
from .configs import OuterConfig, enumerate_configs, root_bound
from .driver import SearchDriver, SearchStats, search_plan
from .infeasible import explain_infeasible
from .instance import SearchContext
from .options import SearchOptions, tp_candidates

__all__ = ["SearchOptions", "SearchStats", "SearchDriver", "SearchContext", "OuterConfig",
           "search_plan", "baseline_plans", "build_plan", "enumerate_configs", "root_bound",
           "tp_candidates", "explain_infeasible", "baseline_results", "baseline_entries",
           "skipped_baseline_entries"]
