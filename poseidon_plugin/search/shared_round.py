"""One searcher's part of a shared round of the distributed search (``driver._shared_round``).

The coordinator announces the round: its units (runs of consecutive configurations of the
pass's order; a giant alone), the configurations' last node counts and the giant size. Every
searcher, the coordinator too, runs ``RoundWork.run``:

* **claim** (``claim_unit``) -- units from the shared counters, its own queue first; a unit's
  configurations past the incumbent's root bound end the queue (``cut_at``);
* **search** (``search_unit``) -- each configuration whole (in this thread, or on one of the
  searcher's worker threads: ``collect`` / ``finish``), or, a giant, **split** into subtrees
  published for every searcher (``split_giant``); one searched whole past ``SPLIT_AFTER_S``
  (its last search was small, so no one knew) is split after all (``split_late``);
* **help** (``help_splits``) -- chunks of every open split, between units and after its own;
* **report** -- what it proved, for the coordinator's merge (``driver._merge_round``).
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait
from functools import partial

log = logging.getLogger("poseidon")

SPLIT_AFTER_S = 0.5    # a distributed round's configuration searched whole for this long is
                       # stopped and split over every searcher (its last search was small)
SPLIT_POLL_S = 0.02    # ... a searcher looks for others' split giants between units this often


class RoundWork:
    """Searcher ``d``'s part of shared round ``n`` (capped at ``cap``) over ``pass_order``;
    ``ann`` is the coordinator's announcement. A configuration whose last search took fewer
    than ``concurrent_nodes`` nodes runs in this thread (the driver's ``CONCURRENT_NODES``)."""

    def __init__(self, d, n: int, cap: float, pass_order: list[int], pass_type_order: str,
                 ann: dict, concurrent_nodes: int) -> None:
        self.d, self.sh, self.n, self.cap = d, d.share, n, cap
        self.pass_order, self.pass_type_order = pass_order, pass_type_order
        (self.units, self.queues), self.work, self.giant = ann["units"], ann["work"], ann["giant"]
        self.concurrent_nodes = concurrent_nodes
        self.pruning = d.options.pruning
        self.whole: list[tuple] = []   # (configuration, threshold, best, timed out, nodes)
        self.parts: list[tuple] = []   # (split, chunks, best, timed out, nodes)
        self.splits: list[tuple] = []  # (split, configuration, chunks, threshold, nodes)
        self.running: dict = {}        # future -> (configuration, threshold, thread slot)
        self.free = list(range(d.workers, 0, -1))
        self.searched = 0
        self.late: list[int] = []      # searched whole past SPLIT_AFTER_S: to be split
        me = self.sh.g.rank
        self.order_q = [(me + k) % len(self.queues) for k in range(len(self.queues))]
        self.done_q: set[int] = set()
        self.cut_at = math.inf         # positions from here on are cut by their root bound

    # ------------------------------------------------------------------ thresholds, budgets
    def thr_now(self) -> float:
        d = self.d
        return math.inf if d.exact else min(self.cap, d.threshold)

    def blocks_of(self, cfg) -> bool:
        return cfg.type_sequences_restricted(self.pass_type_order,
                                             self.d.options.type_sequence_limit)

    def deadline(self, timer: bool) -> float:
        """The pass's deadline; with ``timer`` (several searchers) at most SPLIT_AFTER_S on."""
        dl = self.d.pass_deadline
        if timer and self.sh.size > 1:
            t = time.monotonic() + SPLIT_AFTER_S
            return t if dl is None else min(dl, t)
        return dl or 0.0

    # ------------------------------------------------------------------ whole configurations
    def finish(self, j: int, res, thr_j: float, timer: bool = False) -> None:
        d = self.d
        if timer and res.timed_out and not d._past_pass_deadline():
            # still running after SPLIT_AFTER_S: the others may be idle (its last search
            # was small, so no one knew): its subtrees are shared instead. Its nodes so
            # far are spent; a plan it found only lowers the threshold (the split's merge
            # returns the configuration's plan).
            d.stats.add_counters(res.counters())
            if res.best is not None:
                d.threshold = min(d.threshold, res.best[0])
            self.late.append(j)
            return
        d.work[j] = res.nodes
        d.absorb(j, res, thr_j)
        self.whole.append((j, thr_j, res.best, bool(res.timed_out), res.nodes))
        self.searched += 1
        d._done_in_round = self.searched
        d.tick()

    def collect(self, block: bool) -> None:
        """The worker threads' finished searches (``block``: wait for one at least)."""
        if not self.running:
            return
        done, _ = wait(list(self.running),
                       return_when=FIRST_COMPLETED if block else ALL_COMPLETED)
        for fut in sorted(done, key=lambda f: self.running[f][0]):
            j, thr_j, slot = self.running.pop(fut)
            self.free.append(slot)
            self.finish(j, fut.result(), thr_j, timer=True)

    # ------------------------------------------------------------------ splits
    def split_late(self) -> None:
        while self.late:
            self.split_giant(self.late.pop(0), self.thr_now())

    def split_giant(self, i: int, thr: float) -> None:
        d, sh = self.d, self.sh
        cfg = d.configs[i]
        blocks = self.blocks_of(cfg)
        depth, prefixes, rc = d.ctx.split(cfg, pruning=self.pruning, blocks=blocks,
                                          threshold_ms=thr, deadline=d.pass_deadline or 0.0,
                                          threads=d.workers * sh.size)
        if rc.timed_out or depth == -1:      # out of time, or no subtree survives
            self.finish(i, rc, thr)
            return
        d.stats.add_counters(rc.counters())
        if depth == 0:                       # one subtree (or too many): search it here
            self.finish(i, d.ctx.run(cfg, pruning=self.pruning, blocks=blocks,
                                     threshold_ms=thr, deadline=d.pass_deadline or 0.0,
                                     threads=d.workers), thr)
            return
        k, nchunks = sh.publish_split(self.n, i, depth, prefixes, thr)
        d.stats.shared_splits += 1
        d.stats.configs_searched += 1
        d.searched_ever.add(i)
        self.splits.append((k, i, nchunks, thr, rc.nodes))
        self.help_splits([k])

    def help_splits(self, k_list) -> None:
        self.collect(block=False)         # every thread of this searcher on the subtrees
        for k in k_list:
            self._help_split(k)

    def _help_split(self, k: int) -> None:
        """Chunks of open split ``k`` until none is left (or the pass's time is up)."""
        d, sh, n = self.d, self.sh, self.n
        i, depth, _, _, _, owner = sh.split_info(n, k)
        cfg = d.configs[i]
        got: list[int] = []

        def fetch():
            if d._past_pass_deadline():
                return None
            c = sh.claim_chunk(n, k)
            if c is None:
                return None
            got.append(c[0])
            d.tick()
            sh.pass_turn()
            return c[1], self.thr_now()

        res = d.ctx.run_prefixes(cfg, depth, fetch, pruning=self.pruning,
                                 blocks=self.blocks_of(cfg), threshold_ms=self.thr_now(),
                                 deadline=d.pass_deadline or 0.0, threads=d.workers)
        if not got:
            return
        d.stats.add_counters(res.counters())
        if owner != sh.g.rank:
            d.stats.shared_chunks_helped += len(got)
        if res.best is not None:   # (the plan itself goes to the coordinator: the merge
            d.threshold = min(d.threshold, res.best[0])   # picks, as threads do, the
            d.tick()                                       # smallest (time, assignment))
        if res.timed_out:
            d.timed_out = True
        self.parts.append((k, got, res.best, bool(res.timed_out), res.nodes))

    # ------------------------------------------------------------------ units
    def claim_unit(self) -> int | None:
        for q in self.order_q:
            if q in self.done_q:
                continue
            j = self.sh.claim(self.n, f"units/{q}")
            if j < len(self.queues[q]) and self.units[self.queues[q][j]][0] < self.cut_at:
                return self.queues[q][j]
            self.done_q.add(q)      # (each queue is in the pass's order)
        return None

    def search_unit(self, u: int) -> None:
        """Unit ``u``'s configurations, in the pass's order, until one's root bound passes
        the threshold (the rest are cut) or the pass's time is up."""
        d = self.d
        for pos in range(*self.units[u]):
            if d._past_pass_deadline():
                d.timed_out = True
                break
            i = self.pass_order[pos]
            w = self.work.get(i, 0)
            split = w >= self.giant
            inline = d.workers == 1 or w < self.concurrent_nodes
            if split:
                self.collect(block=False)
            elif not inline and not self.free:
                self.collect(block=True)
            thr = self.thr_now()
            if not d.exact and d.roots[i] > thr * (1 + 1e-9):
                self.cut_at = min(self.cut_at, pos)   # order is by root bound: the rest too
                break
            cfg = d.configs[i]
            run = partial(d.ctx.run, cfg, pruning=self.pruning, blocks=self.blocks_of(cfg),
                          threshold_ms=thr, deadline=self.deadline(True))
            if split:
                self.split_giant(i, thr)
            elif inline:
                self.finish(i, run(), thr, timer=True)
            else:
                slot = self.free.pop()
                self.running[d._executor().submit(run, slot=slot)] = (i, thr, slot)
            if self.late:
                self.collect(block=False)
                self.split_late()

    # ------------------------------------------------------------------ the round
    def run(self) -> dict:
        """Claim and search units (helping with open splits between them), then help until
        no chunk is left anywhere; the report for the coordinator."""
        d, sh, n = self.d, self.sh, self.n
        t_round, n_before = time.perf_counter(), d.stats.nodes
        d.set_phase(f"{d.pass_name + ' ' if d.pass_name else ''}round {d.stats.rounds}")
        try:
            self._claim_and_search()
            self.collect(block=False)
            self.split_late()
            sh.post_out(n)
            self._help_until_done()
        finally:
            self.collect(block=False)
        nodes = d.stats.nodes - n_before
        log.debug("pass %s: shared round %d, cap %.1f, incumbent %.1f, %d configs, %d splits "
                  "here, %d chunks, %d nodes, %.2f s", self.pass_type_order, n, self.cap,
                  d.threshold, self.searched, len(self.splits),
                  sum(len(p[1]) for p in self.parts), nodes, time.perf_counter() - t_round)
        return dict(whole=self.whole, parts=self.parts, splits=self.splits,
                    timed_out=d.timed_out, nodes=nodes)

    def _claim_and_search(self) -> None:
        last_poll = 0.0
        while True:
            now = time.monotonic()
            if now - last_poll >= SPLIT_POLL_S:
                last_poll = now
                ready, _ = self.sh.open_splits(self.n)
                if ready:
                    self.help_splits(ready)
            u = self.claim_unit()
            if u is None:
                break
            self.search_unit(u)
            if self.d.timed_out:
                break

    def _help_until_done(self) -> None:
        """Help with open splits until no chunk is left anywhere and every searcher is out."""
        sh, n = self.sh, self.n
        idle = sh.g.round_waiter()
        while not self.d._past_pass_deadline():
            ready, pending = sh.open_splits(n)
            if ready:
                self.help_splits(ready)
                idle = sh.g.round_waiter()
                continue
            if not pending and sh.all_out(n):
                break
            sh.g.check()
            idle()
