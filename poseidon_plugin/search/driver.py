"""The search driver: which configurations are searched, in what order, with what threshold.

``search_plan`` runs one ``SearchDriver`` through its phases:

1. **order** -- every outer configuration gets its root bound; they are visited cheapest first.
2. **construct** -- a constructive plan per configuration (``construct.py``), cheapest root
   bound first, up to 8 plans: a good feasible incumbent at any size (the rest, and most of
   the polish, deferred until the tree turns out large: ``run_deferred``).
3. **seed** (per-stage TP only) -- the uniform-TP optimum, a much smaller search, is a valid
   incumbent of the per-stage space.
4. **warm-up** -- random feasible plans of the most promising configurations seed the
   incumbent threshold.
5. **polish** -- local search (``polish.py``) from the best plan found so far of the most
   promising configurations: a better incumbent, in a second or two.
6. **passes** -- iterative deepening over the configurations (``run_pass``: rounds of
   ``run_round`` with a rising cap, then the incumbent), first over contiguous device-type
   blocks, then over every type sequence where that space is larger.
7. **result** -- the best plan, the proven lower bound and the statistics (``SearchStats``).

Why this finds the optimum, and what each cut proves: ``docs/search.md``.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import os
import random
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from functools import partial

from ..costs import CostModel
from ..errors import InfeasibleError, PoseidonError
from ..plan import Plan
from ..safeio import bounded_join
from .configs import OuterConfig, chunk_totals_of, enumerate_with_exclusions, first_moe_layer
from .incumbent import Incumbent
from .instance import SearchContext, dag_build_seconds
from .progress import SearchProgress, Snapshot
from .shared_round import RoundWork

log = logging.getLogger("poseidon")

ROUND_STEP = 0.02   # iterative deepening: each round's threshold cap is 2 % above the last
BISECT_GAP = 0.006  # ... until it passes the incumbent: then one midpoint round if the gap > 0.6 %
                    # (0.2 % before: per-stage TP setting 5 spent 11 s on a midpoint round at
                    # 0.25 % below its incumbent, then 12 s on the last round; 0.6 %: just above
                    # the last milestone, 0.5 %, whose round is then followed by the last one)
GAP_MILESTONES = (0.10, 0.05, 0.02, 0.01, 0.005)  # a round's cap stops at incumbent x (1 - m)
MILESTONE_MERGE = 0.001   # ... unless the grid's next cap is within 0.1 % above that level
MAX_ROUNDS = 64     # per pass; the last round searches with the incumbent alone
JUMP_SAFETY = 1.0   # under a budget, a round may jump to a gap milestone above the grid's next
                    # cap when its predicted time x this fits in the time left (the prediction
                    # errs long by itself: 1.4-2.8x on every jump measured; with 1.2 on top,
                    # 70B/10,240's 2 % jump was refused in 2 runs of 3 and its 1 % round ran out)
JUMP_FIT_ROUNDS = 4  # ... predicted from the growth of the last this many rounds
JUMP_MIN_S = 0.25    # ... that took at least this long (shorter ones are mostly overhead)
SPLIT_NODES = 20000  # a configuration whose last search took this many nodes and
GIANT_SHARE = 0.5    # ... this share of the last round's is split over the threads (the others
                     # run side by side, one per thread,
CONCURRENT_NODES = 100  # ... those whose last search took this many nodes; the smaller ones and
                       # those not searched yet run in the driver's thread: with every one
                       # handed to the pool, per-stage TP settings 3 / 4 took 2.0 / 1.2 s with 2
                       # workers and 1.4 / 0.7 s with 1; now 1.1 / 0.6 s. At 5000 nodes, setting
                       # 5's round where the trees first grow ran in one thread: 6.0 s, not 2.9)
UNITS_PER_THREAD = 4   # a shared round (distributed.py) goes out in units of about 1 / (this x
UNIT_CONFIGS = 64      # the searchers' threads) of the last round's nodes, cut from fixed
                       # blocks of this many configurations (a claim is one store round trip)
WARMUP_CONFIGS = 16  # warm-up samples come from this many configurations of lowest root bound
WARMUP_PATIENCE = 100  # ... and end after this many draws in a row did not beat the incumbent
CONSTRUCT_CONFIGS = 64  # constructive plans for (at least) this many configurations, by root bound
BLOCKS_PASS_SHARE = 0.5  # under a budget, the blocks pass gets at most this share of what is left
CONSTRUCT_SECONDS = 2.0  # ... and for more while this long (or 10 % of a time budget) has not passed
CONSTRUCT_PLANS = 8  # ... or until this many plans were built,
CONSTRUCT_AFTER = 1.0  # ... or this long after the first plan (10 % of a budget at most)
POLISH_CONFIGS = 8   # local search from the best plan of this many configurations (fastest first)
POLISH_SECONDS = 2.0  # ... for at most this long (or 5 % of a time budget)
POLISH_QUICK = 2     # before the tree: constructive plans up to CONSTRUCT_PLANS (or the time
                     # slices) and the polish of this many plans; the rest of both waits until
DEFER_NODES = 200_000  # the tree has searched this many nodes without finishing (a count:
                       # load-independent; paper setting 6-288's whole tree is ~55 k nodes), or
DEFER_S = 2.0          # one configuration's search has run this long (it is stopped, and
                       # searched again after them). Setting 6-288: construction and polish
                       # took 2.7 s of a 3.5 s search whose tree needed 0.6 s, its first
                       # constructed plan the optimum
POLISH_TREE = 16     # the first this many incumbents the tree finds are polished, each for at
POLISH_TREE_EVALS = 20_000   # most this many timed plans (a count, not a clock: deterministic)
_COUNTERS = ("nodes", "plans_simulated", "cut_bound", "cut_memory", "cut_ridge", "cut_devices",
             "cut_capacity", "cut_dominated")


def _milestone_level(u: float, m: float) -> float:
    """The cap whose completed round proves gap <= m against the incumbent u: u (1 - m), a
    hair above it so that the gap computed from it, (u - level) / u, is <= m in floating point
    too (u (1 - m) itself gives 1.0000000000000052 % for m = 1 %)."""
    return u * (1.0 - m) * (1.0 + 1e-12)


@dataclass
class SearchStats:
    """What one search did; carried by the plan as ``plan.search`` (``as_dict``)."""

    configs: int = 0
    configs_cut_root: int = 0          # never searched: their root bound passed the incumbent
    configs_searched: int = 0          # branch-and-bound calls (a configuration once per round)
    plans_simulated: int = 0
    nodes: int = 0
    cut_bound: int = 0
    cut_memory: int = 0
    cut_ridge: int = 0
    cut_devices: int = 0
    cut_capacity: int = 0
    cut_dominated: int = 0             # subtrees skipped: one of the same key was searched
    rounds: int = 0
    constructed_plans: int = 0
    constructed_best_ms: float | None = None   # the best constructive plan (an upper bound)
    polished_plans: int = 0            # local searches run (polish.py)
    polish_evals: int = 0              # plans they timed
    polished_best_ms: float | None = None     # the incumbent after the polish phase
    warmup_plans: int = 0
    type_order_restricted_configs: int = 0
    uniform_tp_seed_ms: float | None = None   # per-stage TP: the uniform-TP seed's time
    passes: int = 0
    seconds: float = 0.0
    first_plan_s: float | None = None          # when the first feasible plan was known
    exhaustive: bool = False           # the whole stated space was searched to the end
    search_space: str = ""             # which device-type orders were searched
    timed_out: bool = False
    pruning: str = ""
    tp_mode: str = ""
    type_order: str = ""
    workers: int = 1
    processes: int = 1                 # searchers that shared the configurations (distributed.py)
    shared_splits: int = 0             # ... configurations split into subtrees for every searcher
    shared_chunks_helped: int = 0      # ... chunks of them searched by another searcher than
                                       # the one that split it
    statistics_depend_on_timing: bool = False   # a configuration was split over threads
    tie_tolerance: float = 0.0         # the tie rule (tiebreak.py): the window over the fastest,
    tie_rule: str = "off"              # off / preferred / fastest / timed out,
    fastest_ms: float | None = None    # the fastest plan's time (the plan may be slower by
    tie_queries: int = 0               # up to the tolerance), and its branch-and-bound calls
    previous_plan: str = "none"        # a previous plan offered (driver.keep): kept / replaced /
    previous_ms: float | None = None   # unusable (why), and its time under these costs
    runner_up_status: str = "off"      # runnerup.py: off / exact / best found / timed out /
    runner_up_ms: float | None = None  # none; the fastest other configuration's plan time,
    runner_up_bound_ms: float | None = None   # no other configuration is faster than this,
    runner_up_margin: float | None = None     # runner_up_ms / the returned plan's - 1,
    runner_up: dict | None = None      # that plan (runnerup.describe), and the
    runner_up_queries: int = 0         # branch-and-bound calls it took, the configurations
    runner_up_open: int = 0            # not ruled out below it when its time ran out,
    runner_up_s: float = 0.0           # and its seconds (part of ``seconds``)
    layout_status: str = "off"         # runnerup.layout: the same configuration with another
    layout_ms: float | None = None     # device type on some stage: its state, time,
    layout_bound_ms: float | None = None      # bound,
    layout_margin: float | None = None        # margin over the returned plan,
    layout: dict | None = None         # and the plan (runnerup.describe)
    excluded: list = field(default_factory=list)   # the framework's rules (rules.py) and its
                                                   # refusals: one line per class excluded
    plan_origin: str = ""              # what found the returned plan: search / construction /
                                       # polish / warm-up / uniform-TP seed / baseline <name> /
                                       # previous plan
    seeds: dict = field(default_factory=dict)   # plans offered from outside (the CLI's
                                                # baselines): name -> its time here, or why unusable
    _seeded: bool = field(default=False, repr=False)

    def add_counters(self, counters: dict) -> None:
        for k in _COUNTERS:
            setattr(self, k, getattr(self, k) + counters[k])

    def as_dict(self) -> dict:
        d = asdict(self)
        if not d.pop("_seeded"):
            del d["uniform_tp_seed_ms"]
        return d


class SearchDriver:
    """One plan search over the space ``options`` describes (see the module docstring)."""

    def __init__(self, cluster, model, options, profiles=None,
                 context: SearchContext | None = None, previous: Plan | None = None,
                 seeds=()) -> None:
        self.t0 = time.perf_counter()
        options.check_against(cluster, model)
        self.cluster, self.model, self.options, self.profiles = cluster, model, options, profiles
        self.ctx = context or SearchContext(
            CostModel(cluster, model, profiles, seq_length=options.seq_length,
                      training=options.training), moe_free_stages=options.moe_free_stages)
        self.configs, excluded = enumerate_with_exclusions(self.ctx.cm, options)
        if options.expert_parallel is not None and not self.configs and model.num_experts:
            eps = ", ".join(str(e) for e in options.expert_parallel)
            raise PoseidonError(f"expert parallelism (--ep / expert_parallel) {eps}: no "
                                f"configuration allows it (EP must divide DP x CP and "
                                f"the {model.num_experts} experts)")
        self.deadline = (None if options.time_budget_s is None
                         else time.monotonic() + options.time_budget_s)
        self.workers = options.num_workers
        self.stats = SearchStats(configs=len(self.configs), pruning=options.pruning,
                                 tp_mode=options.tp_mode, type_order=options.type_order,
                                 workers=self.workers, excluded=excluded)
        for line in excluded:
            log.debug("%s", line)
        self.best: Incumbent | None = None
        self.chosen: Incumbent | None = None   # the plan returned when not the fastest (best):
                                               # the tie rule's, or the previous plan kept
        self.previous = previous
        self.seeds = tuple(seeds)           # (name, Plan): offered as incumbents (offer_seeds)
        self.threshold = math.inf
        self.roots: list[float] = []
        self.order: list[int] = []
        self.lbs: list[float] = []          # per configuration: no plan of it is faster
        self.searched_ever: set[int] = set()
        self.found: dict[OuterConfig, tuple] = {}   # per configuration: its best plan so far
        self._by_shape: dict[tuple, OuterConfig] | None = None   # polish's grow / shrink
        self._tree_polished = 0             # incumbents from the tree polished so far
        self._seed_pass = False             # this pass only seeds a later one (_jump_cap)
        self._construct_next = 0            # the construction's place in its order (resumed)
        self._polished: set = set()         # plans the polish left at a local optimum
        self._deferred = False              # the rest of construction + polish still to run
        self.work: dict[int, int] = {}      # configuration -> nodes of its last search
        self.timed_out = False
        self.pass_deadline = self.deadline   # the current pass's deadline (<= the budget's)
        self.progress = SearchProgress.for_options(options)
        self.phase = "root bounds"
        self.pass_name = ""
        o = options
        self.restricted: list[int] = [      # configurations searched in type blocks only
            i for i, c in enumerate(self.configs)
            if c.type_sequences_restricted(o.type_order, o.type_sequence_limit)]
        self._unproven: set[int] = set()    # lbs not (yet) valid for the stated space
        self._done_in_round = 0
        self._round_times: list[tuple[float, float]] = []   # (cap, s): the pass's rounds
        self._last_round_nodes = 0
        self._pool: ThreadPoolExecutor | None = None     # the rounds' worker threads
        self._pass_at = 0                   # the current pass's place in ``passes()``
        self.share = None     # distributed.JobShare: this process searches a share of the
                              # configurations, exchanging the incumbent with the others
        self.phase_share = 1.0   # ... and the construction's and polish's time slices are
                                 # this share of one process's (1 / searchers)

    # ------------------------------------------------------------------ helpers
    @property
    def exact(self) -> bool:
        return self.options.pruning == "none"

    @property
    def heuristic(self) -> bool:
        """``--pruning ridge``: the paper's rule everywhere may cut the optimum, so the rounds
        prove nothing about the stated space (``_raise_lb``: only the root bounds hold)."""
        return self.options.pruning == "ridge"

    def giant_threads(self, i: int) -> int:
        """Threads for one search of configuration ``i`` outside the rounds (the runner-up):
        every worker where its last search was a giant (>= SPLIT_NODES nodes), else one."""
        return (self.workers if self.workers > 1 and self.work.get(i, 0) >= SPLIT_NODES
                else 1)

    def _raise_lb(self, i: int, value: float) -> None:
        """A completed search proved configuration i has no plan below ``value``; under
        ``--pruning ridge`` it proved nothing (the rule may have cut the optimum), so its
        bound stays the root bound."""
        if not self.heuristic:
            self.lbs[i] = max(self.lbs[i], value)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _rounds_begun(self) -> bool:
        """A distributed search's searcher other than the coordinator: the coordinator has
        begun the shared rounds, so this searcher's first-plan phases (which only seed the
        incumbent) end, not to hold the first round back."""
        return self.share is not None and self.share.rounds_begun()

    def _past_pass_deadline(self) -> bool:
        return self.pass_deadline is not None and time.monotonic() > self.pass_deadline

    def in_space(self, cfg: OuterConfig, opts) -> bool:
        """Whether a plan lies in the stated space: where ``cfg``'s type sequences are
        restricted to contiguous blocks (``--type-order blocks``/``auto``), its stage types
        form blocks (random warm-up samples need not)."""
        o = self.options
        if not cfg.type_sequences_restricted(o.type_order, o.type_sequence_limit):
            return True
        seq = [cfg.options[x][0] for x in opts]
        starts = [k for i, k in enumerate(seq) if i == 0 or k != seq[i - 1]]
        return len(starts) == len(set(starts))

    def consider(self, t: float, cfg: OuterConfig, opts, layers, origin: str = "search") -> bool:
        """Offer a feasible plan as the incumbent (and threshold); False if outside the space.
        ``origin``: what found it (the returned plan's is ``stats.plan_origin``)."""
        if not self.in_space(cfg, opts):
            return False
        self.threshold = min(self.threshold, t)
        cand = Incumbent(t, cfg.key, tuple(opts), tuple(layers), cfg, origin)
        if cfg not in self.found or cand < self.found[cfg]:
            self.found[cfg] = cand
        if self.best is None:
            self.stats.first_plan_s = round(time.perf_counter() - self.t0, 3)
            # a plan in hand: no DAG is built that would outlast the budget (SearchContext.replay)
            self.ctx.build_deadline = self.deadline
        if self.best is None or cand < self.best:
            improved = self.best is None or t < self.best.time_ms
            self.best = cand
            self.tick(improved=improved)
        return True

    # ------------------------------------------------------------------ progress
    def live_lower_bound_ms(self) -> float | None:
        """No plan of the stated space is faster than this, now (None before the root bounds).
        A configuration whose proof so far covers contiguous type blocks only counts with its
        root bound (valid for every order)."""
        if not self.lbs:
            return None
        lb = min((self.roots[i] if i in self._unproven else x) for i, x in enumerate(self.lbs))
        return lb if self.best is None else min(lb, self.best.time_ms)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.phase, None if self.best is None else self.best.time_ms,
                        self.live_lower_bound_ms(), self._done_in_round, len(self.configs),
                        self.stats.nodes)

    def tick(self, improved: bool = False) -> None:
        if self.share is not None:     # the best time found by any searcher prunes here too
            self.threshold = min(self.threshold, self.share.exchange(self.threshold))
        self.progress.tick(self.snapshot, improved=improved)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._done_in_round = 0
        self.tick()

    # ------------------------------------------------------------------ phases
    def search(self) -> None:
        """Run every phase; InfeasibleError when no plan was found."""
        if not self.configs:
            raise InfeasibleError(self._no_config_message())
        try:
            self.order_configs()
            self.offer_seeds()
            if not self.exact:
                self.set_phase("construct")
                self.construct(quick=True)
            if self.options.tp_mode == "per-stage" and not self.exact:
                self.set_phase("uniform-TP seed")
                self.seed_from_uniform_tp()
            if not self.exact and self.options.warmup_samples > 0:
                self.set_phase("warm-up")
                self.warm_up()
            if not self.exact and self.found and (self.share is None
                                                  or self.share.coordinator):
                # (a distributed search's other searchers skip it: one local search can run
                # 0.5 s past round 0's start, which waits for every searcher)
                self.set_phase("polish")
                self.polish_found(quick=True)
            # (the rest of the construction and polish: one process's, or the coordinator's
            # between two shared rounds; the other searchers skip it)
            self._deferred = not self.exact and (self.share is None or self.share.coordinator)
            if self.share is not None:
                self.order = self.share.global_order   # the rounds share every configuration
            if self.share is not None and not self.share.coordinator:
                self.follow_rounds()
            else:
                self.run_passes()
            if self.share is not None and not self.share.finish():
                return    # a share searched for a distributed search's coordinator
            if self.options.tie_tolerance > 0 and self.best is not None:
                self.set_phase("tie rule")
                self.tie_break()
            if self.previous is not None and self.best is not None:
                self.keep(self.previous)
            if self.options.runner_up and self.best is not None:
                self.set_phase("runner-up")
                self.find_runner_up()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.progress.close(self.snapshot() if self.best is not None else None)
        if self.best is None:
            if self.timed_out:
                raise InfeasibleError(self._timed_out_message())
            from .infeasible import explain_infeasible
            why = explain_infeasible(self.ctx.cm, self.configs)
            if self.stats.excluded:
                why += f" (the training framework's rules also excluded: " \
                       f"{'; '.join(self.stats.excluded)})"
            raise InfeasibleError(why)
        self.stats.plan_origin = (self.chosen or self.best).origin
        self.stats.seconds = round(time.perf_counter() - self.t0, 3)

    def offer_seeds(self) -> None:
        """The plans computed elsewhere (the CLI's baselines) as incumbents: each one that lies
        in this search's space (its configuration, device types, memory, the framework's
        rules) is timed under these costs and offered, so the returned plan is never slower
        than it; one that does not is recorded with why (``stats.seeds``)."""
        from .rules import Shape, excluded_line

        for name, plan in self.seeds:
            hit = self.options.rules.violation(Shape.of_plan(plan))
            if hit is not None:
                self.stats.seeds[name] = f"outside the searched space: {excluded_line(*hit)}"
                continue
            try:
                cfg, opts, layers = self._locate(plan)
                t = self.ctx.evaluate(cfg, opts, layers)
            except (PoseidonError, ValueError) as e:
                self.stats.seeds[name] = f"outside the searched space: {e}"
                continue
            self.stats.seeds[name] = round(t, 6)
            self.consider(t, cfg, opts, layers, origin=f"baseline {name}")

    def tie_break(self) -> None:
        """The tie rule (``tiebreak.py``): the preferred plan within the tolerance becomes the
        returned plan (``self.chosen``); ``self.best`` stays the fastest (the lower bound's)."""
        from .tiebreak import TIE_MIN_S, TIE_SHARE, TieBreaker

        spent = time.perf_counter() - self.t0
        end = time.monotonic() + max(TIE_MIN_S, TIE_SHARE * spent)
        if self.deadline is not None:
            end = min(end, self.deadline)
        res = TieBreaker(self, self.options.tie_tolerance, end).run()
        st = self.stats
        st.tie_tolerance, st.fastest_ms = self.options.tie_tolerance, self.best.time_ms
        st.tie_queries, st.tie_rule = res.queries, res.status
        if res.status == "preferred":
            cand = Incumbent(res.time_ms, res.cfg.key, res.opts, res.layers, res.cfg,
                             "tie rule")
            if cand.time_ms > self.best.time_ms * (1 + self.options.tie_tolerance) * (1 + 1e-9):
                raise AssertionError(f"tie rule: {cand} outside the window")
            if (cand.key, cand.opts, cand.layers) == (self.best.key, self.best.opts,
                                                      self.best.layers):
                st.tie_rule = "fastest"
            self.chosen = cand
        log.debug("tie rule (%.1f %%): %s after %d queries, %.1f ms (fastest %.1f ms)",
                  100 * self.options.tie_tolerance, st.tie_rule, res.queries,
                  (self.chosen or self.best).time_ms, self.best.time_ms)

    def find_runner_up(self) -> None:
        """How close the next choice came (``runnerup.py``): the fastest plan of any other
        configuration than the returned plan's, and the fastest of its own configuration with
        another device type on some stage, with their margins, into the statistics."""
        from .runnerup import RUNNER_MIN_S, RUNNER_SHARE, RunnerUp, describe

        t0 = time.perf_counter()
        spent = t0 - self.t0
        end = time.monotonic() + max(RUNNER_MIN_S, RUNNER_SHARE * spent)
        if self.deadline is not None:
            end = min(end, self.deadline)
        chosen = self.chosen or self.best
        res = RunnerUp(self, chosen, end).run()
        st = self.stats
        st.runner_up_status, st.runner_up_queries = res.status, res.queries
        st.runner_up_open = res.open
        st.runner_up_ms, st.runner_up_bound_ms = res.time_ms, res.bound_ms
        if res.time_ms is not None:
            st.runner_up_margin = res.time_ms / chosen.time_ms - 1.0
        if res.plan is not None:
            st.runner_up = describe(res.plan.cfg, self.ctx.cm.type_names, res.plan.opts,
                                    res.plan.layers, self.options.tp_mode)
        lay = RunnerUp(self, chosen, end).layout()
        st.runner_up_queries += lay.queries
        st.layout_status, st.layout_ms, st.layout_bound_ms = lay.status, lay.time_ms, lay.bound_ms
        if lay.time_ms is not None:
            st.layout_margin = lay.time_ms / chosen.time_ms - 1.0
        if lay.plan is not None:
            st.layout = describe(lay.plan.cfg, self.ctx.cm.type_names, lay.plan.opts,
                                 lay.plan.layers, self.options.tp_mode)
        st.runner_up_s = round(time.perf_counter() - t0, 3)
        log.debug("runner-up %s after %d queries: %s ms (bound %s ms)", res.status,
                  res.queries, res.time_ms, res.bound_ms)

    def keep(self, prev: Plan) -> None:
        """Stability across launches: the previous launch's plan ``prev`` is returned while it
        is still within ``keep_tolerance`` of the fastest plan under today's costs (a relaunch
        keeps its layout through a few per cent of measurement noise; a plan faster by more
        replaces it). It must still lie in the searched space and fit devices and memory."""
        st, tol = self.stats, self.options.keep_tolerance
        from .rules import Shape, excluded_line

        hit = self.options.rules.violation(Shape.of_plan(prev))
        if hit is not None:   # e.g. the user added --no-overlap-p2p-communication since
            st.previous_plan = f"unusable: {excluded_line(*hit)}"
            return
        try:
            cfg, opts, layers = self._locate(prev)
            t = self.ctx.evaluate(cfg, opts, layers)
        except (PoseidonError, ValueError) as e:
            st.previous_plan = f"unusable: {e}"
            return
        st.previous_ms = t
        st.fastest_ms = self.best.time_ms
        if t <= self.best.time_ms * (1 + tol) * (1 + 1e-9):
            st.previous_plan = "kept"
            self.chosen = Incumbent(t, cfg.key, tuple(opts), tuple(layers), cfg, "previous plan")
        else:
            st.previous_plan = "replaced"
        log.debug("previous plan %s: %.2f ms, fastest %.2f ms (window %.1f %%)",
                  st.previous_plan, t, self.best.time_ms, 100 * tol)

    def _locate(self, prev: Plan) -> tuple[OuterConfig, list[int], list[int]]:
        """(configuration, options, layers) of ``prev`` in this search's space, or ValueError
        naming what no longer matches."""
        names = self.ctx.cm.type_names
        n = len(prev.stages)
        tps = {s.tp for s in prev.stages}
        want_tp = tps.pop() if len(tps) == 1 and self.options.tp_mode == "uniform" else 0
        for cfg in self.configs:
            if (cfg.schedule, cfg.virtual_stages, cfg.micro_batch_size, cfg.dp,
                    cfg.num_stages, cfg.tp, cfg.cp, cfg.ep) != (
                        prev.schedule, prev.virtual_stages, prev.micro_batch_size, prev.dp, n,
                        want_tp, prev.cp, prev.ep):   # EP too: never kept at another degree
                continue
            if cfg.chunk_totals and cfg.chunk_totals != chunk_totals_of(
                    [s.layers for s in prev.stages], cfg.virtual_stages):
                continue      # (several kinds, interleaved: one configuration per totals)
            index = {(names[k], t): o for o, (k, t) in enumerate(cfg.options)}
            opts = [index.get((s.device_type, s.tp)) for s in prev.stages]
            if None in opts:
                break
            layers = [s.layers for s in prev.stages]
            lmax = self.ctx.lmax_rows(cfg)
            if sum(layers) != self.model.num_layers:
                raise ValueError(f"its {sum(layers)} layers are not the model's "
                                 f"{self.model.num_layers}")
            first_moe = None if self.options.moe_free_stages else first_moe_layer(self.model)
            if first_moe and len(layers) > 1 and cfg.virtual_stages == 1 \
                    and layers[0] <= first_moe:
                raise ValueError(f"its stage 0 holds dense layers only (1-{layers[0]}): "
                                 "megatron-core before 0.19 hangs on a pipeline stage without "
                                 "MoE layers")
            for x, (o, l) in enumerate(zip(opts, layers)):
                if l < cfg.virtual_stages:
                    raise ValueError(f"stage {x} has {l} layers, fewer than its "
                                     f"{cfg.virtual_stages} model chunks")
                if l > lmax[o][x]:
                    raise ValueError(f"stage {x}'s {l} layers no longer fit its memory "
                                     f"(at most {lmax[o][x]})")
            if not self.ctx.fits(cfg, opts, layers):
                raise ValueError("its stages' layers no longer fit their memory")
            if not self.in_space(cfg, opts):
                break
            return cfg, opts, layers
        grid = "".join(f" {name}={v}" for name, v in (("cp", prev.cp), ("ep", prev.ep)) if v > 1)
        raise ValueError(f"{prev.schedule} pp={n} dp={prev.dp}{grid} mbs={prev.micro_batch_size} "
                         f"on {bounded_join(s.device_type for s in prev.stages)} is not in this "
                         f"search's space")

    def order_configs(self) -> None:
        """Root bound per configuration; visit order cheapest first (deterministic)."""
        n = len(self.configs)
        if self.exact:
            self.roots, self.order = [0.0] * n, list(range(n))
        else:
            if self.share is not None:
                self.roots = self.share.root_bounds()
            else:
                self.roots = []
                for at, c in enumerate(self.configs):
                    if (at % 256 == 255 and not self.options.first_plan_overrun
                            and self._past_deadline()):
                        # (a baseline's search: its budget ran out before the root bounds)
                        raise InfeasibleError(self._timed_out_message())
                    self.roots.append(self.ctx.root_bound(c))
            self.order = sorted(range(n), key=lambda i: (self.roots[i], self.configs[i].key))
        self.lbs = list(self.roots)
        if self.share is not None:
            self.order = self.share.owned(self.order)
        log.debug("%d configurations and their root bounds: %.2f s", n,
                  time.perf_counter() - self.t0)

    def construct(self, quick: bool = False) -> None:
        """Constructive plans (``construct.construct_plan``) of the configurations in root-bound
        order until one plan is found; then until CONSTRUCT_CONFIGS configurations were tried
        and CONSTRUCT_PLANS plans built, or CONSTRUCT_SECONDS have passed and CONSTRUCT_AFTER
        since the first plan (both at most 10 % of a time budget). Where most configurations
        cannot hold the model (405B: the first plan came from the 571st) the polish then has
        more than one plan to start from. ``quick`` (before the tree): stop at CONSTRUCT_PLANS
        plans (or the time slices); a later call goes on from there (``run_deferred``)."""
        from .construct import construct_plan

        t0 = time.monotonic()
        f = self.phase_share
        slice_s, after_s = CONSTRUCT_SECONDS * f, CONSTRUCT_AFTER * f
        if self.options.time_budget_s is not None:
            slice_s = min(slice_s, 0.1 * self.options.time_budget_s)
            after_s = min(after_s, 0.1 * self.options.time_budget_s)
        first_at = None
        plans0 = self.stats.constructed_plans
        overrun_end = (None if self.deadline is None or self.options.overrun_s is None
                       else self.deadline + self.options.overrun_s)
        todo = [i for i in self.order if math.isfinite(self.roots[i])]
        for done in range(self._construct_next, len(todo)):
            i = todo[done]
            if self.best is not None:
                if self._rounds_begun():
                    break
                now = time.monotonic()
                first_at = now if first_at is None else first_at
                if quick and self.stats.constructed_plans - plans0 >= CONSTRUCT_PLANS:
                    break
                if ((done >= CONSTRUCT_CONFIGS
                     and self.stats.constructed_plans >= CONSTRUCT_PLANS)
                        or (now - t0 > slice_s and now - first_at > after_s)):
                    break
            if self._past_deadline() and (self.best is not None or (
                    not self.options.first_plan_overrun and (
                        done >= CONSTRUCT_CONFIGS or (overrun_end is not None
                                                      and time.monotonic() > overrun_end)))):
                break   # (a budget shorter than the first plan is overrun until a plan is
                        # constructed, unless a seed (offer_seeds) is a plan already: the
                        # configurations that cannot hold the model are skipped cheaply,
                        # construct.memory_room)
            self._construct_next = done + 1
            if overrun_end is not None and self.best is None:
                # a first plan by the budget's end plus the overrun: not where the DAG's
                # build alone outlasts it (a huge M: 4.2M ops, 0.4 CPU-s and up)
                cfg = self.configs[i]
                calls = self.ctx.cm.engine_calls(cfg.micro_batch_size).as_tuple()
                if time.monotonic() + dag_build_seconds(cfg, calls) > overrun_end:
                    continue
            self._done_in_round = done + 1
            self.tick()
            got = construct_plan(self.ctx, self.configs[i], self.in_space, self.deadline)
            if got is None:
                continue
            t, opts, layers = got
            self.stats.constructed_plans += 1
            if self.stats.constructed_best_ms is None or t < self.stats.constructed_best_ms:
                self.stats.constructed_best_ms = t
            self.consider(t, self.configs[i], opts, layers, origin="construction")
        log.debug("construction%s: %d plans, best %.3f ms (at %.2f s)", " (quick)" if quick else "",
                  self.stats.constructed_plans, self.threshold, time.perf_counter() - self.t0)

    def deferral_due(self) -> bool:
        """The rest of the construction and the polish are due: the tree has searched
        DEFER_NODES nodes without finishing."""
        return self._deferred and self.stats.nodes >= DEFER_NODES

    def run_deferred(self) -> None:
        """The rest of the construction and the polish (``deferral_due``): a search the tree
        ends quickly does not pay for them, and the rounds below the incumbent do not depend
        on it (their threshold is the cap). Their slices are time-limited: the statistics then
        depend on timing."""
        self._deferred = False
        self.stats.statistics_depend_on_timing = True
        phase = self.phase
        self.set_phase("construct")
        self.construct()
        if self.found:
            self.set_phase("polish")
            self.polish_found()
        self.set_phase(phase)

    def seed_from_uniform_tp(self) -> None:
        """The uniform-TP space is part of the per-stage one: its optimum is a valid
        incumbent, so the per-stage rounds stop below it and a time budget never returns a
        plan worse than the uniform one."""
        self.stats._seeded = True
        left = None if self.deadline is None else max(1e-3, self.deadline - time.monotonic())
        sub = SearchDriver(self.cluster, self.model,
                           self.options.replace(tp_mode="uniform", time_budget_s=left,
                                                progress=False, runner_up=False,
                                                tie_tolerance=0.0),
                           self.profiles, context=self.ctx)
        try:
            sub.search()
        except InfeasibleError:
            return
        self.stats.add_counters(asdict(sub.stats))
        self.stats.warmup_plans += sub.stats.warmup_plans
        self.stats.uniform_tp_seed_ms = round(sub.best.time_ms, 3)
        self.consider(sub.best.time_ms, sub.best.cfg, sub.best.opts, sub.best.layers,
                      origin="uniform-TP seed")

    def polish_found(self, quick: bool = False) -> None:
        """Local search from the best plan so far of each of the POLISH_CONFIGS configurations
        whose best is fastest (POLISH_QUICK when ``quick``), for at most POLISH_SECONDS (5 % of
        a time budget); each one ends at a local optimum, a cap or that deadline, and only
        improves. A plan already left at a local optimum is not polished again."""
        slice_s = POLISH_SECONDS * self.phase_share
        if self.options.time_budget_s is not None:
            slice_s = min(slice_s, 0.05 * self.options.time_budget_s)
        end = time.monotonic() + slice_s
        if self.deadline is not None:
            end = min(end, self.deadline)
        for cand in sorted(self.found.values())[:POLISH_QUICK if quick else POLISH_CONFIGS]:
            if time.monotonic() > end or self._rounds_begun():
                break
            self.polish_plan(cand, end)
        if self.best is not None:
            self.stats.polished_best_ms = self.best.time_ms
        log.debug("polish%s: %d plans, %d timed, best %.3f ms (at %.2f s)",
                  " (quick)" if quick else "", self.stats.polished_plans,
                  self.stats.polish_evals, self.threshold, time.perf_counter() - self.t0)

    def polish_plan(self, cand: Incumbent, deadline: float,
                    max_evals: int | None = None) -> None:
        from .polish import polish

        key = (cand.cfg, tuple(cand.opts), tuple(cand.layers))
        if key in self._polished:
            return
        if self._by_shape is None:
            self._by_shape = {c: c for c in self.configs}

        def resize(c: OuterConfig, n: int) -> OuterConfig | None:
            # the configuration that differs from c only in its pipeline depth (its CP, EP,
            # micro-batches and options kept)
            return self._by_shape.get(dataclasses.replace(c, num_stages=n))

        res = polish(self.ctx, cand.cfg, cand.opts, cand.layers, cand.time_ms,
                     deadline=deadline, allowed=self.in_space, resize=resize,
                     **({} if max_evals is None else {"max_evals": max_evals}))
        self.stats.polished_plans += 1
        self.stats.polish_evals += res.evals
        if res.complete:
            self._polished.add(key)
            self._polished.add((res.cfg, tuple(res.opts), tuple(res.layers)))
        if res.time_ms < cand.time_ms:
            self.consider(res.time_ms, res.cfg, res.opts, res.layers, origin="polish")

    def warm_up(self) -> None:
        """Random feasible plans seed the threshold. They come from the first WARMUP_CONFIGS
        configurations, by root bound, where a random assignment fits (a few tries each; the
        promising ones, whose DAGs the search needs anyway, and few DAGs to build), then at
        random among those. At most ``warmup_samples`` plans; the warm-up ends early when
        WARMUP_PATIENCE draws in a row (a draw that does not fit counts) gave no plan faster
        than the incumbent. With a constructed incumbent random plans seldom are faster: on
        the paper's settings one of twelve searches gained, by a plan its tree found too, while
        the draws' memory limits cost 6-96 a quarter of its search time."""
        want = self.options.warmup_samples
        rng = random.Random(self.options.seed)
        scan = iter([i for i in self.order if math.isfinite(self.roots[i])])
        pool: list[int] = []
        attempts = 0
        scanning = True
        best, best_at = self.threshold, 0      # the incumbent and the draw it came at
        while self.stats.warmup_plans < want and attempts < 4 * want:
            if ((self.stats.warmup_plans > 0 or self.best is not None)
                    and (self._past_deadline() or self._rounds_begun())):
                break   # (one plan at least, so that a tiny budget still returns a plan)
            if self.threshold < best:
                best, best_at = self.threshold, attempts
            elif attempts - best_at >= WARMUP_PATIENCE:
                break
            if scanning and len(pool) < WARMUP_CONFIGS:
                i = next(scan, None)
                if i is None:
                    scanning = False
                    continue
                for _ in range(4):
                    attempts += 1
                    if self._sample(i, rng):
                        pool.append(i)
                        break
                continue
            if not pool:
                break
            attempts += 1
            self._sample(rng.choice(pool), rng)
        log.debug("warm-up: %d plans, best %.3f ms (at %.2f s)", self.stats.warmup_plans,
                  self.threshold, time.perf_counter() - self.t0)

    def _sample(self, i: int, rng: random.Random) -> bool:
        cfg = self.configs[i]
        a = self.ctx.random_assignment(cfg, rng)
        if a is None:
            return False
        try:
            t = self.ctx.replay(cfg, *a)[1]
        except ValueError:      # its DAG's build would outlast the budget (replay)
            return False
        self.stats.warmup_plans += 1
        self.consider(t, cfg, *a, origin="warm-up")
        return True

    def passes(self) -> list[tuple[list[int], str]]:
        """``auto`` / ``any``: first the cheap contiguous-blocks space over every
        configuration (seeds the incumbent with the best blocks plan, a good plan early under a
        time budget), then the full space only over the configurations where it is larger
        (interleaving allowed, >= 2 usable types, N >= 2), with that incumbent. The full space
        is a superset, so the seed is a valid incumbent and the result is the full-space
        optimum."""
        o = self.options
        if o.type_order == "blocks" or self.exact:
            return [(self.order, o.type_order)]
        full = [i for i in self.order
                if self.configs[i].usable_types >= 2 and self.configs[i].num_stages >= 2
                and not self.configs[i].type_sequences_restricted(o.type_order,
                                                                  o.type_sequence_limit)]
        return [(self.order, "blocks")] + ([(full, o.type_order)] if full else [])

    def run_passes(self) -> None:
        passes = self.passes()
        complete = True
        self._unproven = set(self.restricted)
        for later, _ in passes[1:]:
            self._unproven.update(later)
        for at, (pass_order, pass_type_order) in enumerate(passes):
            self.pass_name = pass_type_order if len(passes) > 1 else ""
            self._seed_pass = at + 1 < len(passes)
            if pass_order is not self.order:
                for i in pass_order:   # the blocks pass proved nothing about the full space
                    self.lbs[i] = self.roots[i]
                self._unproven.difference_update(pass_order)
                self._unproven.update(self.restricted)
            self.pass_deadline = self.deadline
            self._pass_at = at
            if at + 1 < len(passes) and self.deadline is not None:
                # a good plan from the cheap space, then time left to prove the full one
                now = time.monotonic()
                self.pass_deadline = min(self.deadline,   # (past the budget: at once)
                                         now + BLOCKS_PASS_SHARE * (self.deadline - now))
            if self.run_pass(pass_order, pass_type_order):
                continue
            complete = False
            if at + 1 < len(passes) and not self._past_deadline():
                self.timed_out = False     # only this pass's share ran out: go on
                continue
            for later, _ in passes[at + 1:]:   # a space never searched proves nothing
                for i in later:
                    self.lbs[i] = self.roots[i]
            break
        self.pass_deadline = self.deadline
        self.stats.configs_cut_root = len(self.configs) - len(self.searched_ever)
        o = self.options
        self.stats.type_order_restricted_configs = len(self.restricted)
        self.stats.passes = len(passes)
        self.stats.timed_out = not complete      # a pass stops early only when its time is up
        self.stats.exhaustive = complete and not self.restricted and not self.heuristic
        if (not self.stats.exhaustive and not self.restricted and not self.heuristic
                and self.best is not None and self.lower_bound_ms() >= self.best.time_ms):
            # a pass ran out of its share (the blocks pass's), but every configuration's
            # proven bound reaches the plan: it is the optimum of the stated space all the same
            self.stats.exhaustive = True
        self.stats.search_space = (
            "every device-type order" if not self.restricted else
            f"contiguous device-type blocks only for {len(self.restricted)} of "
            f"{len(self.configs)} configurations (--type-order {o.type_order}"
            + (f": more than {o.type_sequence_limit} orders" if o.type_order == "auto" else "")
            + "); the lower bound uses their root bounds")
        if self.heuristic:
            self.stats.search_space += (", layer counts cut by the ridge rule everywhere "
                                        "(--pruning ridge: may miss the optimum; the lower "
                                        "bound uses the root bounds)")

    def run_pass(self, pass_order: list[int], pass_type_order: str) -> bool:
        """Iterative deepening over ``pass_order``; True when the pass completed (the
        incumbent is the best plan of the pass's space, or better).

        Round r searches with cap_r = root * (1+step)^r; a cap that would pass the incumbent
        becomes, once per pass, the midpoint of the proven bound and the incumbent if their gap
        is > BISECT_GAP, else the incumbent (cap = inf: threshold = incumbent). A round
        that ends with no plan <= cap_r proves every plan of the pass is > cap_r; the first
        round that finds one (threshold <= cap_r) has found the best plan, since every better
        plan would have been <= cap_r too. With an incumbent from an earlier pass (a seed),
        the rounds stop below it and the last round searches with the seed as threshold: any
        plan found beats or ties the seed, and if none, the seed is the best plan."""
        r0 = self.roots[pass_order[0]] if pass_order else math.inf
        deepen = not self.exact and math.isfinite(r0) and r0 > 0
        grid = r0 * (1 + ROUND_STEP) if deepen else math.inf   # the geometric caps
        proven = 0.0
        rounds = 0
        bisected = False
        self._round_times = []          # (cap, seconds) of the pass's completed rounds
        while True:
            cap = grid
            on_grid = True
            if deepen and cap >= self.threshold:
                # the next geometric cap passes the incumbent: once, if the gap is wide, search
                # with the midpoint of the proven bound and the incumbent (a round that finds
                # the optimum early is much cheaper than one that starts from a distant
                # incumbent), then with the incumbent itself
                if (not bisected and math.isfinite(self.threshold) and proven > 0
                        and self.threshold > proven * (1 + BISECT_GAP)):
                    bisected = True
                    cap = 0.5 * (proven + self.threshold)
                else:
                    cap = math.inf
            elif deepen:
                cap = self._jump_cap(self._milestone_cap(max(proven, r0), cap),
                                     max(proven, r0))
                on_grid = cap == grid
            if rounds >= MAX_ROUNDS - 1:
                cap = math.inf
            rounds += 1
            self.stats.rounds += 1
            if self.deferral_due():
                self.run_deferred()
            t_round = time.monotonic()
            self.run_round(cap, pass_order, pass_type_order)
            if self.timed_out or self.threshold <= cap or not math.isfinite(cap):
                break
            self._round_times.append((cap, time.monotonic() - t_round))
            proven = max(proven, cap)
            if on_grid or cap >= grid:
                grid = cap * (1 + ROUND_STEP)
        # every configuration of the pass has no plan below ``proven`` (completed rounds) in
        # the pass's space
        for i in pass_order:
            self._raise_lb(i, proven)
        return not self.timed_out

    def _milestone_cap(self, proven: float, cap: float) -> float:
        """A round inserted at the first gap milestone the next cap would step over: with
        the incumbent U, a completed round at cap U (1 - m) proves a gap <= m, while a step of
        the 2 % grid past that level that does not complete in time (the rounds grow steeply)
        proves nothing more than the last one. The grid itself does not move: the inserted
        round costs a fraction of the grid round after it (a lower cap cuts more). A level
        within MILESTONE_MERGE below the grid's cap gets no round of its own: the grid round
        costs about the same and proves it too (per-stage TP setting 5 had spent 19 s on a
        round at 13,700.3 ms and 19 s more on the next at 13,700.6)."""
        u = self.threshold
        if not math.isfinite(u):
            return cap
        for m in GAP_MILESTONES:
            level = _milestone_level(u, m)
            if proven * (1 + 1e-6) < level < cap:
                return cap if level >= cap * (1 - MILESTONE_MERGE) else level
        return cap

    def _jump_cap(self, cap: float, proven: float = 0.0) -> float:
        """Under a time budget, the next gap milestone (the coarsest level U (1 - m) above
        ``proven`` not yet proven) when it lies above ``cap`` and its round is predicted
        (x JUMP_SAFETY) to end before the pass's deadline, else ``cap``. The grid rounds
        below it are insurance: each costs a fraction of the next and proves a bound only if
        the budget ends before the next (70B on 10,240 devices: the grid's rounds at 1,633.8
        and 1,648.1 ms took 26 s of the 60 before the 1 % round). In the pass whose
        proofs are reported (the last) a jump never passes a milestone that is not proven:
        its round is the insurance of the finer ones, whose rounds grow faster than any fit of
        the coarse ones says (405B on close-4096.yaml: the rounds at 4.3 / 2.4 / 2.0 % took
        0.9 / 1.8 / 1.9 s, the 0.5 % jump was predicted at 4.4 s and had not ended after 44 s,
        while the 1 % round it passed ends in 14 CPU-s). A seed pass (the blocks pass before
        the full one, ``_seed_pass``: the full pass searches its configurations again from
        their root bounds) only needs to end, so it jumps to the finest milestone predicted to
        fit (70B/10,240's blocks pass: one jump to 0.5 %, 2.1 s, instead of four rounds, 7 s).
        A jump that does not end in time leaves the bound of the last completed round, so the
        prediction errs long: log(round time) linear in sqrt(1 - cap / U), least squares over
        the pass's last JUMP_FIT_ROUNDS completed rounds of >= JUMP_MIN_S (at least three),
        from the last one's time. (Measured on 70B/10,240, a round's time grows about as
        exp(-16 sqrt(gap)) near U and faster than that far from it, so a fit on far rounds
        over-predicts the near ones; log time linear in log cap under-predicted the 0.5 %
        round 2x.)"""
        u = self.threshold
        if self.pass_deadline is None or not math.isfinite(u) or not math.isfinite(cap):
            return cap
        # the milestones above this round's cap (which (about) proves those below), coarsest
        # first; the pass whose proofs are reported takes only the next one not yet proven
        ahead = [m for m in GAP_MILESTONES
                 if _milestone_level(u, m) > max(cap * (1 + MILESTONE_MERGE),
                                                 proven * (1 + 1e-6))]
        nxt = next((m for m in GAP_MILESTONES if _milestone_level(u, m) > proven * (1 + 1e-6)),
                   None)
        if not self._seed_pass:
            ahead = [m for m in ahead if m == nxt]
        if not ahead:
            return cap
        hist = [(c, t) for c, t in self._round_times if t >= JUMP_MIN_S and c < u]
        hist = hist[-JUMP_FIT_ROUNDS:]
        if len(hist) < 3:
            return cap
        xs = [math.sqrt(1.0 - c / u) for c, _ in hist]
        ys = [math.log(t) for _, t in hist]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0.0:
            return cap
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if not slope < 0.0:
            return cap
        left = self.pass_deadline - time.monotonic()
        for m in reversed(ahead):           # the finest first
            predicted = math.exp(ys[-1] + slope * (math.sqrt(m) - xs[-1]))
            if predicted * JUMP_SAFETY <= left:
                level = _milestone_level(u, m)
                log.debug("pass: round cap %.1f, the %.1f %% level (predicted %.1f s, %.1f s "
                          "left)", level, 100 * m, predicted, left)
                return level
        return cap

    def run_round(self, cap: float, pass_order: list[int], pass_type_order: str) -> None:
        """Search every configuration of ``pass_order`` whose root bound is <= min(cap,
        threshold) with the threshold min(cap, incumbent): afterwards the best plan of the
        pass's space with time <= cap is known.

        With ``workers`` > 1 the configurations run side by side, one per worker thread (the
        searches run in nogil C), each with the threshold known when it starts: a plan another
        one finds meanwhile only lowers the next ones'. A configuration whose last search took
        >= SPLIT_NODES nodes and >= GIANT_SHARE of the last round's is searched alone by every
        worker (its subtrees shared: ``_search.search_config``); one whose last search took
        < CONCURRENT_NODES (or that was not searched yet) runs in this thread, between the
        others' hand-offs. Each configuration's result
        is its best plan under its own threshold, >= the round's, so the merged result (the
        smallest (time, configuration, assignment)) is the one of a sequential round; only the
        statistics depend on the interleaving.

        In a distributed search (``self.share``) the round is every searcher's
        (``_shared_round``)."""
        if self.share is not None:
            self._shared_round(cap, pass_order, pass_type_order)
            return
        t_round, n_before, searched = time.perf_counter(), self.stats.nodes, 0
        self.set_phase(f"{self.pass_name + ' ' if self.pass_name else ''}round "
                       f"{self.stats.rounds}")
        giant = max(SPLIT_NODES, GIANT_SHARE * self._last_round_nodes)
        running: dict = {}            # future -> (configuration, threshold, DAG slot)
        free = list(range(self.workers, 0, -1))   # DAG slots (0: this thread's, the polish's)

        def finish(j: int, res, thr_j: float) -> None:
            nonlocal searched
            self.work[j] = res.nodes
            self.absorb(j, res, thr_j)
            searched += 1
            self._done_in_round = searched
            self.tick()

        def collect(block: bool) -> None:
            if not running:
                return
            done, _ = wait(list(running), return_when=FIRST_COMPLETED if block else ALL_COMPLETED)
            for fut in sorted(done, key=lambda f: running[f][0]):   # (a deterministic order)
                j, thr_j, slot = running.pop(fut)
                free.append(slot)
                finish(j, fut.result(), thr_j)

        try:
            for i in pass_order:
                if self._past_pass_deadline():
                    self.timed_out = True
                    break
                if self.deferral_due():
                    self.run_deferred()
                work = self.work.get(i, 0)
                split = self.workers > 1 and work >= giant
                inline = self.workers == 1 or work < CONCURRENT_NODES
                if split:
                    collect(block=False)           # alone, split over every worker
                elif not inline and not free:
                    collect(block=True)
                thr = math.inf if self.exact else min(cap, self.threshold)
                if not self.exact and self.roots[i] > thr * (1 + 1e-9):
                    break   # order is by root bound: the rest are cut too
                run = self._config_run(i, thr, pass_type_order)
                if split:
                    finish(i, *self._run_here(run, i, thr, threads=self.workers))
                elif inline:
                    finish(i, *self._run_here(run, i, thr))
                else:
                    slot = free.pop()
                    if running:
                        self.stats.statistics_depend_on_timing = True
                    running[self._executor().submit(run, slot=slot)] = (i, thr, slot)
        finally:
            collect(block=False)
        self._last_round_nodes = self.stats.nodes - n_before
        log.debug("pass %s: round cap %.1f, incumbent %.1f, %d configs, %d nodes, %.2f s",
                  pass_type_order, cap, self.threshold, searched, self.stats.nodes - n_before,
                  time.perf_counter() - t_round)

    def _config_run(self, i: int, thr: float, pass_type_order: str):
        """``ctx.run`` of configuration ``i`` under threshold ``thr`` in this pass (its type
        blocks), the pass's deadline; keywords (threads, deadline, ...) may still be given."""
        cfg = self.configs[i]
        blocks = cfg.type_sequences_restricted(pass_type_order, self.options.type_sequence_limit)
        return partial(self.ctx.run, cfg, pruning=self.options.pruning, blocks=blocks,
                       threshold_ms=thr, deadline=self.pass_deadline or 0.0)

    def _run_here(self, run, j: int, thr_j: float, **kw):
        """(result, threshold used) of ``run`` in this thread. While the construction and
        polish are deferred, a search that runs DEFER_S is stopped, they run, and it is
        searched again under the threshold they leave (the stopped search's best plan, a real
        one, kept)."""
        d = self.pass_deadline or 0.0
        defer = self._deferred
        if defer:
            d = min(d, time.monotonic() + DEFER_S) if d else time.monotonic() + DEFER_S
        res = run(deadline=d, **kw)
        if defer and res.timed_out and not self._past_pass_deadline():
            self.stats.add_counters(res.counters())
            if res.best is not None:
                t, opts, layers = res.best
                self.consider(t, self.configs[j], opts, layers)
            self.run_deferred()
            thr_j = thr_j if self.exact else min(thr_j, self.threshold)
            res = run(threshold_ms=thr_j, deadline=self.pass_deadline or 0.0, **kw)
        return res, thr_j

    # ------------------------------------------------------------------ distributed rounds
    def _shared_round(self, cap: float, pass_order: list[int], pass_type_order: str) -> None:
        """Coordinator: round ``cap`` of ``run_pass`` shared by every searcher. The round's
        configurations (those whose root bound is <= min(cap, incumbent)) go out as units,
        runs of consecutive configurations of the pass's order (a giant alone), that the
        searchers claim from a shared counter; a giant (its last search took >= the split
        size and GIANT_SHARE / searchers of the last round's nodes) is split into subtrees
        that every searcher claims in chunks (``_search.split_prefixes`` /
        ``search_prefixes``). Every searcher reports what it proved (``_round_work``); the
        merge (``_merge_round``) is the state a one-process round leaves: each configuration
        searched whole or in every one of its chunks with threshold <= min(cap, incumbent)
        has no plan below that threshold but the best one returned."""
        sh = self.share
        n = sh.rounds
        sh.rounds += 1
        thr0 = math.inf if self.exact else min(cap, self.threshold)
        end = len(pass_order)
        if not self.exact:
            end = next((p for p, i in enumerate(pass_order)
                        if self.roots[i] > thr0 * (1 + 1e-9)), len(pass_order))
        size, workers = sh.size, self.workers
        giant = (max(split_nodes(SPLIT_NODES), GIANT_SHARE * self._last_round_nodes / size)
                 if size * workers > 1 else math.inf)
        work = {pass_order[p]: self.work[pass_order[p]] for p in range(end)
                if pass_order[p] in self.work}
        ann = dict(pass_at=self._pass_at, cap=cap, giant=giant, work=work,
                   units=_units(pass_order[:end], work, giant, size * workers, size),
                   left=(None if self.pass_deadline is None
                         else max(0.0, self.pass_deadline - time.monotonic())))
        sh.announce(n, ann)
        mine = self._round_work(n, cap, pass_order, pass_type_order, ann)
        reports = sh.gather_round(n)
        reports[sh.g.rank] = mine
        self._merge_round(reports)

    def follow_rounds(self) -> None:
        """A searcher other than the coordinator: every round the coordinator posts, until
        it posts the end."""
        passes = self.passes()
        n = 0
        while True:
            ann = self.share.wait_round(n)
            if ann is None:
                break
            pass_order, pass_type_order = passes[ann["pass_at"]]
            self.pass_name = pass_type_order if len(passes) > 1 else ""
            self.pass_deadline = (None if ann["left"] is None
                                  else time.monotonic() + ann["left"])
            self.timed_out = False
            self.stats.rounds += 1
            self.share.post_round(n, self._round_work(n, ann["cap"], pass_order,
                                                      pass_type_order, ann))
            n += 1
        self.pass_deadline = self.deadline
        self.stats.passes = len(passes)

    def _round_work(self, n: int, cap: float, pass_order: list[int], pass_type_order: str,
                    ann: dict) -> dict:
        """One searcher's part of shared round ``n`` (``shared_round.RoundWork``): claim units
        and search their configurations (as ``run_round`` does, with this searcher's threads),
        split the giants it claims, help with every split that has chunks left; then a report
        of what it proved for the coordinator."""
        return RoundWork(self, n, cap, pass_order, pass_type_order, ann,
                         concurrent_nodes=CONCURRENT_NODES).run()

    def _merge_round(self, reports: dict[int, dict]) -> None:
        """Coordinator: every searcher's report of one shared round into this driver's state
        (its own whole configurations are absorbed already). A split configuration proves
        its threshold only when every chunk was searched to the end; its plan is the
        smallest (time, assignment) over the chunks' (``_search._lex_less``'s order: the
        threads' merge)."""
        me = self.share.g.rank
        self._last_round_nodes = sum(r["nodes"] for r in reports.values())
        parts: dict[int, list] = {}
        for q, rep in sorted(reports.items()):
            if rep["timed_out"]:
                self.timed_out = True
            for k, got, best, to, nodes in rep["parts"]:
                parts.setdefault(k, []).append((got, best, to, nodes))
            if q == me:
                continue
            for j, thr, best, to, nodes in rep["whole"]:
                self.work[j] = nodes
                self.searched_ever.add(j)
                if to:
                    self.timed_out = True
                else:
                    self._raise_lb(j, thr)
                if best is not None:
                    self.consider(best[0], self.configs[j], best[1], best[2])
        for rep in reports.values():
            for k, i, nchunks, thr, nodes in rep["splits"]:
                covered: set[int] = set()
                best, to = None, False
                for got, b, t_o, nn in parts.get(k, ()):
                    covered.update(got)
                    to = to or t_o
                    nodes += nn
                    if b is not None and (best is None or _assignment_key(b)
                                          < _assignment_key(best)):
                        best = b
                self.work[i] = nodes
                self.searched_ever.add(i)
                if to or covered != set(range(nchunks)):
                    self.timed_out = True
                else:
                    self._raise_lb(i, thr)
                if best is not None:
                    self.consider(best[0], self.configs[i], best[1], best[2])
        self.stats.statistics_depend_on_timing = True

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers,
                                            thread_name_prefix="poseidon-search")
        return self._pool

    def absorb(self, i: int, res, thr_used: float) -> None:
        self.stats.configs_searched += 1
        self.searched_ever.add(i)
        self.stats.add_counters(res.counters())
        if res.split_depth:
            self.stats.statistics_depend_on_timing = True
        if res.timed_out:
            self.timed_out = True
        else:
            self._raise_lb(i, thr_used)
        if res.best is not None:
            t, opts, layers = res.best
            before = self.best
            self.consider(t, self.configs[i], opts, layers)
            if (not self.exact and self.best is not before and self.best.time_ms == t
                    and self._tree_polished < POLISH_TREE):
                # a new incumbent from the tree: its neighbours may be faster still
                self._tree_polished += 1
                end = time.monotonic() + POLISH_SECONDS
                if self.pass_deadline is not None:
                    end = min(end, self.pass_deadline)
                self.polish_plan(self.best, end, POLISH_TREE_EVALS)

    # ------------------------------------------------------------------ result
    def lower_bound_ms(self) -> float:
        """No plan of the whole stated space is faster (the best plan's time when exhaustive).
        A configuration searched only in contiguous type blocks counts with its root bound,
        which holds for every type order."""
        if self.stats.exhaustive:
            return self.best.time_ms
        lbs = list(self.lbs)
        for i in self.restricted:
            lbs[i] = self.ctx.root_bound(self.configs[i])
        return min([self.best.time_ms] + lbs)

    def plan(self) -> Plan:
        from .build import build_plan

        b = self.chosen or self.best
        return build_plan(self.ctx.cm, b.cfg, b.opts, b.layers,
                          global_batch_size=self.options.global_batch_size,
                          predicted_ms=b.time_ms, lower_bound_ms=self.lower_bound_ms(),
                          search_stats=self.stats.as_dict())

    def _timed_out_message(self) -> str:
        return (f"time budget (--time-budget / time_budget_s) of "
                f"{self.options.time_budget_s:g} s ran out before any plan was found; "
                f"give the search more time")

    def _no_config_message(self) -> str:
        g, mbs = self.options.global_batch_size, self.options.micro_batch_sizes
        if self.stats.excluded:
            why = "; ".join(self.stats.excluded)
            return (f"the training framework refuses every configuration this cluster allows: {why}; "
                    "change or remove the flags named")
        if not [b for b in mbs if g % b == 0]:
            return (f"global batch size {g} is not divisible by any micro-batch size in "
                    f"{list(mbs)}: no batch split M = G / (dp x mbs) is an integer")
        cp = self._cp_message()
        if cp:
            return cp
        return (f"no (dp, tp, pp, schedule) fits the cluster for global batch size {g} with "
                f"micro-batch sizes {list(mbs)} (check the device counts, TP divisibility and "
                f"that interleaving has M a multiple of pp)")

    def _cp_message(self) -> str | None:
        """The refusal's line when only CP degrees > 1 were asked for: a TP x CP group stays
        in one node (``configs.cp_candidates``), so name CP and the nodes' sizes."""
        cps = self.options.context_parallel
        if not cps or 1 in cps:
            return None
        sizes = sorted({n.num_devices for n in self.cluster.nodes})
        most = sizes[-1]
        asked = f"CP {' '.join(map(str, cps))} (--cp / --context-parallel-size)"
        if all(c > most for c in cps):
            return (f"{asked}: no node can hold a CP group (a TP x CP group stays in one node; "
                    f"the largest node has {most} devices): ask for CP <= {most}")
        return (f"{asked}: no configuration fits: a TP x CP group stays in one node, so TP x CP "
                f"must divide the device count of every node of a stage's type "
                f"({', '.join(map(str, sizes))}), and the global batch must split over the rest")


def _assignment_key(best) -> tuple:
    """(time, stage 0's option and layers, stage 1's, ...): the order in which the search
    breaks ties between plans of one configuration (``_search._lex_less``)."""
    t, opts, layers = best
    return (t, *(v for pair in zip(opts, layers) for v in pair))


def _units(configs: list[int], work: dict[int, int], giant: float, threads: int,
           searchers: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A shared round's units and queues. ``configs``: the round's, in the pass's order. Its
    positions form fixed blocks of UNIT_CONFIGS; block b goes to searcher b mod S (the same
    configurations to the same searcher round after round: its instances and DAGs are built
    once); inside a block, a giant is a unit alone (its subtrees are shared) and the rest is
    cut into runs whose last searches took at most 1 / (UNITS_PER_THREAD x threads) of the
    round's nodes. (units: (start, end) positions; queues: per searcher, its units in
    order.)"""
    total = sum(max(1, work.get(i, 0)) for i in configs)
    target = max(1.0, total / (UNITS_PER_THREAD * max(1, threads)))
    units: list[tuple[int, int]] = []
    queues: list[list[int]] = [[] for _ in range(max(1, searchers))]
    for b0 in range(0, len(configs), UNIT_CONFIGS):
        q = queues[(b0 // UNIT_CONFIGS) % len(queues)]
        b1 = min(len(configs), b0 + UNIT_CONFIGS)
        start, acc = b0, 0.0
        for p in range(b0, b1):
            w = work.get(configs[p], 0)
            if w >= giant:
                if p > start:
                    q.append(len(units))
                    units.append((start, p))
                q.append(len(units))
                units.append((p, p + 1))
                start, acc = p + 1, 0.0
                continue
            acc += max(1, w)
            if acc >= target and p + 1 < b1:
                q.append(len(units))
                units.append((start, p + 1))
                start, acc = p + 1, 0.0
        if start < b1:
            q.append(len(units))
            units.append((start, b1))
    return units, queues


def split_nodes(default: int) -> int:
    """A configuration whose last search took this many nodes (and a large share of the
    round's) is split over every searcher: ``default`` (the driver's SPLIT_NODES), or
    POSEIDON_SEARCH_SPLIT_NODES (the tests force splits on small instances)."""
    text = os.environ.get("POSEIDON_SEARCH_SPLIT_NODES")
    if not text:
        return default
    try:
        v = int(text)
    except ValueError:
        raise PoseidonError(f"POSEIDON_SEARCH_SPLIT_NODES={text!r} is not a whole number") \
            from None
    if v < 1:
        raise PoseidonError(f"POSEIDON_SEARCH_SPLIT_NODES={text!r} must be at least 1")
    return v


def search_plan(cluster, model, options, profiles=None, previous: Plan | None = None,
                seeds=()) -> Plan:
    """The fastest plan of the space ``options`` (a ``SearchOptions``) describes on
    ``cluster`` for ``model``, with costs from ``profiles`` (measured records) or the analytic
    estimator; InfeasibleError when nothing fits (the closest candidate explained).
    ``previous``: a plan kept while within ``options.keep_tolerance`` of the fastest.
    ``seeds``: (name, Plan) pairs offered as incumbents (the CLI's baselines): the returned
    plan is never slower than one that lies in the searched space."""
    driver = SearchDriver(cluster, model, options, profiles, previous=previous, seeds=seeds)
    driver.search()
    return driver.plan()
