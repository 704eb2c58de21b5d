"""One search shared by several processes (hosts): ``poseidon plan --distributed`` under
torchrun and a ``--poseidon-auto`` launch on more than one host.

The root bounds are computed by every searcher for every S-th configuration; the
construction, warm-up and polish run on each searcher over its deal of the configurations
(positions r, r + S, ... of the global root-bound order). The iterative deepening is the
coordinator's (``SearchDriver.run_pass``, as in one process), but every round is shared by
every searcher (``SearchDriver._shared_round``): the round's configurations go out as units
claimed from a shared counter, and a giant configuration is split into subtrees that every
searcher claims in chunks, as the threads of one process share a round and split a giant. The
incumbent's time is exchanged every EXCHANGE_S: a searcher prunes with the best plan found
anywhere, which is sound because that time belongs to a real plan (>= the optimum), and the
branch and bound returns plans with time <= its threshold, so an optimal plan is still found.
Each searcher reports what it proved in a round; the coordinator merges: a configuration's
bound rises only when it was searched to the end (whole, or every chunk), and a round proves
its cap only when all of it was searched. At the end the coordinator gathers every searcher's
best plans and counters: the merged plan is the smallest (time, configuration, assignment), as
in one process. The tie rule, a previous plan (``--keep``) and the runner-up then run on the
coordinator over the merged state. Why this is sound: ``docs/search.md``, "Distributed search".

The core imports no torch: a searcher talks through a :class:`Store` (set / non-blocking get of
bytes, atomic add of a counter). :class:`MemoryStore` is the in-process one (threads as searchers, the tests);
``poseidon_plugin.megatron.launch.search_transport`` wraps torch.distributed's rendezvous store.

Liveness: every searcher writes a heartbeat every HEARTBEAT_S from its own thread (the search
itself runs in nogil C). A searcher that never joins, or whose heartbeat stops for ``stall_s``,
makes the others stop with a ``PoseidonError`` naming it: nothing waits forever.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import logging
import math
import os
import pickle
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Protocol

from ..errors import InfeasibleError, PoseidonError
from .incumbent import Incumbent

log = logging.getLogger("poseidon")

HEARTBEAT_S = 0.5     # each searcher's heartbeat period (its exchange thread)
EXCHANGE_S = 0.2      # the incumbent's time is published and read this often
POLL_S = 0.02         # a wait for a key polls this often
PASS_TURN_S = 0.002   # MemoryStore: how long a searcher hands its turn on between chunks
ROUND_POLL_S = (0.0005, 0.016)   # a searcher waiting inside a shared round (the next round's
                      # cap, the others' reports) polls first after 0.5 ms, then twice as long
                      # each time up to 16 ms (each poll is a store round trip; the store
                      # server runs in searcher 0's process)
CHUNKS_PER_SEARCHER = 16   # a giant configuration's subtrees go out in this many chunks per
                           # searcher (claimed one at a time; each searcher's memo spans
                           # every chunk it claims of one configuration)
STALL_S = 60.0        # a searcher silent this long (or never joined) is given up, with an error
                      # (POSEIDON_SEARCH_STALL_S overrides)


def _proxy(d: dict) -> MappingProxyType:
    return MappingProxyType(d)


def dumps(obj: Any) -> bytes:
    """Pickled, read-only mappings (the cluster's) as well."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = copyreg.dispatch_table.copy()
    p.dispatch_table[MappingProxyType] = lambda m: (_proxy, (dict(m),))
    p.dump(obj)
    return buf.getvalue()


class Store(Protocol):
    """The transport: a key-value store shared by the searchers."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None while the key is not set (never blocks)."""

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (0 when not set) and return the
        new value: the shared queues of a round (``JobShare.claim``)."""


class MemoryStore:
    """An in-process :class:`Store` (searchers as threads): the tests' transport.

    The search's DAG workspaces are per process, so searchers that are threads of one process
    take turns: each runs inside ``turn()`` and hands the turn on whenever it waits for a key
    (``idle``); their exchange threads (heartbeats, incumbents) run all the time."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._turn = threading.Lock()
        self._holder: int | None = None

    @contextlib.contextmanager
    def turn(self):
        self._turn.acquire()
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            self._turn.release()

    def idle(self, seconds: float = POLL_S) -> None:
        if self._holder != threading.get_ident():
            time.sleep(seconds)
            return
        self._holder = None
        self._turn.release()
        time.sleep(seconds)
        self._turn.acquire()
        self._holder = threading.get_ident()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._d[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._d.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            v = int(self._d.get(key, b"0")) + amount
            self._d[key] = str(v).encode()
            return v

    def pass_turn(self) -> None:
        """Let another searcher run for a moment (between two pieces of shared work, so that
        the searchers of a test share a configuration's subtrees as processes would)."""
        if self._holder == threading.get_ident():
            self.idle(PASS_TURN_S)


def stall_seconds() -> float:
    text = os.environ.get("POSEIDON_SEARCH_STALL_S")
    if not text:
        return STALL_S
    try:
        v = float(text)
    except ValueError:
        raise PoseidonError(f"POSEIDON_SEARCH_STALL_S={text!r} is not a number of seconds") \
            from None
    if not (v > 0 and math.isfinite(v)):
        raise PoseidonError(f"POSEIDON_SEARCH_STALL_S={text!r} must be a positive number")
    return v


class Searchers:
    """This process's place among ``size`` searchers (``rank`` 0 coordinates). Use as a context
    manager: the coordinator's exit tells the others to stop serving.

    ``names``: how an error names searcher r (e.g. its launch rank and host); ``workers``:
    search threads here when the options leave them open (None: one per core); ``join_s``: how
    long a searcher may take to join (default ``stall_s``; a launch's coordinator joins after
    its calibration)."""

    def __init__(self, store: Store, rank: int, size: int, *, stall_s: float | None = None,
                 workers: int | None = None, names: Callable[[int], str] | None = None,
                 join_s: float | None = None) -> None:
        if not 0 <= rank < size:
            raise PoseidonError(f"searcher {rank} of {size}: no such searcher")
        self.store, self.rank, self.size = store, rank, size
        self.stall_s = stall_seconds() if stall_s is None else stall_s
        self.join_s = self.stall_s if join_s is None else max(join_s, self.stall_s)
        self.workers = workers
        self.names = names or (lambda r: f"search process {r}")
        self._idle = getattr(store, "idle", None) or (lambda: time.sleep(POLL_S))
        self._store_idle = getattr(store, "idle", None)
        self.jobs = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self._seen: dict[int, tuple[bytes | None, float]] = {}
        self._job: JobShare | None = None     # the share being searched (its exchange)
        self._t_start = 0.0

    def round_waiter(self) -> Callable[[], None]:
        """An idle for one wait inside a shared round: ROUND_POLL_S, backing off."""
        wait = [ROUND_POLL_S[0]]

        def idle() -> None:
            if self._store_idle is not None:
                self._store_idle(wait[0])
            else:
                time.sleep(wait[0])
            wait[0] = min(ROUND_POLL_S[1], 2 * wait[0])
        return idle

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> "Searchers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self._t_start = time.monotonic()
        self._beat_once()
        self._thread = threading.Thread(target=self._run, name="poseidon-search-exchange",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.coordinator:
            try:
                self.store.set("stop", b"1")
            except Exception as e:  # noqa: BLE001 - the store may be gone with a dead peer
                log.debug("distributed search: cannot post stop: %s", e)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    # ---------------------------------------------------------------- the exchange thread
    def _beat_once(self) -> None:
        self._beat += 1
        self.store.set(f"hb/{self.rank}", str(self._beat).encode())

    def _run(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(EXCHANGE_S):
            try:
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_S:
                    self._beat_once()
                    last_beat = now
                job = self._job
                if job is not None:
                    job.exchange_io()
                self._check_alive(now)
            except Exception as e:  # noqa: BLE001 - a store error: the peer (or store) is gone
                self.error = self.error or f"the search store failed: {e}"

    def _check_alive(self, now: float) -> None:
        for r in range(self.size):
            if r == self.rank:
                continue
            hb = self.store.get(f"hb/{r}")
            old, since = self._seen.get(r, (None, self._t_start))
            limit = self.join_s if hb is None else self.stall_s
            if hb != old:
                self._seen[r] = (hb, now)
            elif now - since > limit:
                what = "never joined" if hb is None else "stopped answering"
                self.error = self.error or (
                    f"distributed search: {self.names(r)} {what} (no heartbeat for "
                    f"{limit:g} s; POSEIDON_SEARCH_STALL_S sets how long to wait)")

    def check(self) -> None:
        if self.error:
            raise PoseidonError(self.error)

    def wait_for(self, key: str, deadline: float | None = None, what: str = "") -> bytes:
        """The value of ``key`` once set; PoseidonError if a searcher stalls or ``deadline``
        (monotonic) passes first."""
        while True:
            v = self.store.get(key)
            if v is not None:
                return v
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise PoseidonError(f"distributed search: {what or key} did not arrive in time")
            self._idle()

    # ---------------------------------------------------------------- jobs
    def search(self, cluster, model, options, profiles=None, previous=None, seeds=()):
        """Coordinator: the plan of ``search_plan(cluster, model, options, profiles,
        previous, seeds)``, searched by every searcher (the seeds and the previous plan are
        offered here: their times reach the others with the incumbent)."""
        from .driver import SearchDriver

        if not self.coordinator:
            raise PoseidonError("distributed search: only searcher 0 starts a search")
        n = self.jobs
        self.jobs += 1
        self.store.set(f"job/{n}", dumps((cluster, model, options, profiles)))
        driver = SearchDriver(cluster, model, self._local(options), profiles,
                              previous=previous, seeds=seeds)
        driver.share = JobShare(self, n, driver)
        driver.search()
        return driver.plan()

    def serve(self) -> int:
        """Searchers 1..S-1: search the share of every job the coordinator posts, until it
        stops; the number of jobs served."""
        from .driver import SearchDriver

        while True:
            got = None
            while got is None:
                if self.store.get("stop") is not None:
                    return self.jobs
                got = self.store.get(f"job/{self.jobs}")
                if got is None:
                    self.check()
                    self._idle()
            n = self.jobs
            self.jobs += 1
            cluster, model, options, profiles = pickle.loads(got)
            options = self._local(options).replace(progress=False, runner_up=False,
                                                   tie_tolerance=0.0)
            try:
                driver = SearchDriver(cluster, model, options, profiles)
                driver.share = JobShare(self, n, driver)
                driver.search()
            except PoseidonError as e:
                if self.error:
                    raise
                self.store.set(f"job/{n}/error/{self.rank}", str(e).encode())
                if not isinstance(e, InfeasibleError):
                    log.error("distributed search, job %d: %s", n, e)
            except Exception as e:   # a bug: searcher 0 names it at once, then it propagates
                self.store.set(f"job/{n}/error/{self.rank}",
                               f"{type(e).__name__}: {e}".encode())
                raise

    def _local(self, options):
        if options.workers is None and self.workers is not None:
            return options.replace(workers=self.workers)
        return options


class JobShare:
    """One search's share on one searcher: the driver's hooks (``SearchDriver.share``)."""

    def __init__(self, group: Searchers, job: int, driver) -> None:
        self.g, self.job, self.d = group, job, driver
        driver.phase_share = 1.0 / group.size   # every searcher constructs and polishes in
                                                # its share: the same CPU time as one process
        self._mine = math.inf          # this share's threshold (written by the driver)
        self._sent = math.inf
        self._foreign = math.inf       # the best time published by the others
        self._lock = threading.Lock()
        self._owned: list[int] = []
        self.global_order: list[int] = []
        self._splits: dict[tuple[int, int], tuple] = {}   # (round, k) -> the split's record
        self._drained: set[tuple[int, int]] = set()       # ... every chunk of it claimed
        self.rounds = 0                                    # rounds posted (the coordinator)
        self._begun, self._begun_at = False, 0.0           # round 0 posted (rounds_begun)

    @property
    def coordinator(self) -> bool:
        return self.g.coordinator

    def _key(self, what: str, r: int | None = None) -> str:
        return f"job/{self.job}/{what}/{self.g.rank if r is None else r}"

    def _deadline(self) -> float | None:
        b = self.d.options.time_budget_s
        return None if b is None else time.monotonic() + b + self.g.stall_s

    def _gather(self, what: str, deadline: float | None = None,
                idle: Callable[[], None] | None = None) -> dict[int, Any]:
        out = {}
        for r in range(self.g.size):
            if r == self.g.rank:
                continue
            err = None
            while True:
                v = self.g.store.get(self._key(what, r))
                if v is not None:
                    out[r] = pickle.loads(v)
                    break
                err = self.g.store.get(self._key("error", r))
                if err is not None:
                    break
                self.g.check()
                if deadline is not None and time.monotonic() > deadline:
                    raise PoseidonError(f"distributed search: {self.g.names(r)} sent no "
                                        f"{what} within the time budget + "
                                        f"{self.g.stall_s:g} s")
                (idle or self.g._idle)()
            if err is not None:
                raise PoseidonError(f"distributed search: {self.g.names(r)}: "
                                    f"{err.decode(errors='replace')}")
        return out

    # ---------------------------------------------------------------- driver hooks
    def root_bounds(self) -> list[float]:
        """Every configuration's root bound: this searcher computes every S-th, the others
        the rest."""
        d, S, r = self.d, self.g.size, self.g.rank
        self.g._job = self
        mine = [d.ctx.root_bound(d.configs[i]) for i in range(r, len(d.configs), S)]
        self.g.store.set(self._key("roots"), dumps((len(d.configs), mine)))
        roots = [0.0] * len(d.configs)
        roots[r::S] = mine
        for q, (n, theirs) in self._gather("roots").items():
            if n != len(d.configs):
                raise PoseidonError(f"distributed search: {self.g.names(q)} enumerates {n} "
                                    f"configurations, this process {len(d.configs)} (different "
                                    "versions or inputs)")
            roots[q::S] = theirs
        return roots

    def owned(self, order: list[int]) -> list[int]:
        """This searcher's share of the global visit order (the construction, warm-up and
        polish phases; the rounds share every configuration through the store)."""
        self.g._job = self
        self.global_order = list(order)
        self._owned = order[self.g.rank::self.g.size]
        return self._owned

    # ---------------------------------------------------------------- the shared rounds
    # Every round of iterative deepening is one round of every searcher: the coordinator
    # decides its cap (``SearchDriver.run_pass``, as in one process) and posts it with the
    # round's units (runs of consecutive configurations of the pass's order, a giant alone);
    # every searcher claims units from a shared counter, splits a giant into subtrees that
    # every searcher claims in chunks, and sends what it proved; the coordinator merges.

    @property
    def size(self) -> int:
        return self.g.size

    def _rkey(self, n: int, what: str) -> str:
        return f"job/{self.job}/round/{n}/{what}"

    def announce(self, n: int, ann: dict | None) -> None:
        """Coordinator: round n's description (None: the rounds are over)."""
        self.g.store.set(self._rkey(n, "ann"), dumps(ann))

    def wait_round(self, n: int) -> dict | None:
        """A searcher: round n's description once posted, or None (the rounds are over, or
        the coordinator stopped)."""
        idle = self.g.round_waiter()
        while True:
            v = self.g.store.get(self._rkey(n, "ann"))
            if v is not None:
                return pickle.loads(v)
            if self.g.store.get("stop") is not None:
                return None
            self.g.check()
            idle()

    def rounds_begun(self) -> bool:
        """(Not the coordinator) whether round 0 is posted (read at most every POLL_S)."""
        if self.coordinator:
            return False
        if not self._begun:
            now = time.monotonic()
            if now - self._begun_at >= POLL_S:
                self._begun_at = now
                self._begun = self.g.store.get(self._rkey(0, "ann")) is not None
        return self._begun

    def claim(self, n: int, what: str) -> int:
        """The next index of round n's queue ``what`` (0, 1, ...: whoever asks first)."""
        return self.g.store.add(self._rkey(n, what), 1) - 1

    def pass_turn(self) -> None:
        f = getattr(self.g.store, "pass_turn", None)
        if f is not None:
            f()

    def publish_split(self, n: int, i: int, depth: int, prefixes, threshold: float) -> tuple:
        """A giant configuration's subtrees (``_search.split_prefixes``) as chunks every
        searcher may claim; (k, chunks): its number in round n and how many chunks."""
        per = 2 * depth
        count = len(prefixes) // per
        nchunks = max(1, min(count, CHUNKS_PER_SEARCHER * self.g.size))
        bounds = [count * c // nchunks for c in range(nchunks + 1)]
        k = self.g.store.add(self._rkey(n, "splits"), 1) - 1
        rec = (i, depth, prefixes.tobytes(), bounds, threshold, self.g.rank)
        self.g.store.set(self._rkey(n, f"split/{k}"), dumps(rec))
        self._splits[(n, k)] = (i, depth, prefixes, bounds, threshold, self.g.rank)
        return k, nchunks

    def open_splits(self, n: int) -> tuple[list[int], bool]:
        """(splits of round n that have chunks left to claim, whether one is announced but
        not readable yet)."""
        count = self.g.store.add(self._rkey(n, "splits"), 0)
        ready, pending = [], False
        for k in range(count):
            if (n, k) in self._drained:
                continue
            if (n, k) not in self._splits:
                v = self.g.store.get(self._rkey(n, f"split/{k}"))
                if v is None:
                    pending = True
                    continue
                i, depth, raw, bounds, thr, owner = pickle.loads(v)
                import numpy as np
                self._splits[(n, k)] = (i, depth, np.frombuffer(raw, dtype=np.int32),
                                        bounds, thr, owner)
            nchunks = len(self._splits[(n, k)][3]) - 1
            if self.g.store.add(self._rkey(n, f"split/{k}/next"), 0) >= nchunks:
                self._drained.add((n, k))
                continue
            ready.append(k)
        return ready, pending

    def split_info(self, n: int, k: int) -> tuple:
        return self._splits[(n, k)]

    def claim_chunk(self, n: int, k: int):
        """(chunk number, its prefixes) of split k, or None when every chunk is claimed."""
        i, depth, prefixes, bounds, thr, owner = self._splits[(n, k)]
        c = self.claim(n, f"split/{k}/next")
        if c >= len(bounds) - 1:
            self._drained.add((n, k))
            return None
        per = 2 * depth
        return c, prefixes[bounds[c] * per:bounds[c + 1] * per]

    def post_out(self, n: int) -> None:
        """This searcher claims no more configurations in round n (it publishes no new split;
        it helps the splits left)."""
        self.g.store.add(self._rkey(n, "out"), 1)

    def all_out(self, n: int) -> bool:
        return self.g.store.add(self._rkey(n, "out"), 0) >= self.g.size

    def post_round(self, n: int, report: dict) -> None:
        self.g.store.set(self._key(f"round{n}"), dumps(report))

    def gather_round(self, n: int) -> dict[int, dict]:
        return self._gather(f"round{n}", self._deadline(), self.g.round_waiter())

    def exchange(self, threshold: float) -> float:
        """Called by the driver (``tick``): offer this share's threshold; the best time found
        anywhere. Raises when a searcher stalled."""
        self.g.check()
        with self._lock:
            self._mine = min(self._mine, threshold)
            return min(self._mine, self._foreign)

    def exchange_io(self) -> None:
        """The exchange thread's part: publish this share's threshold, read the others'."""
        with self._lock:
            mine = self._mine
        if mine < self._sent:
            self.g.store.set(self._key("inc"), repr(mine).encode())
            self._sent = mine
        best = math.inf
        for r in range(self.g.size):
            if r != self.g.rank:
                v = self.g.store.get(self._key("inc", r))
                if v is not None:
                    best = min(best, float(v))
        with self._lock:
            self._foreign = min(self._foreign, best)

    def finish(self) -> bool:
        """After the passes: a searcher sends its share's result and is done (False); the
        coordinator merges every share's into its driver (True)."""
        d = self.d
        if self.coordinator:
            self.announce(self.rounds, None)     # the rounds are over
        mine = self.result()
        self.g._job = None
        if not self.coordinator:
            self.g.store.set(self._key("result"), dumps(mine))
            return False
        for q, res in self._gather("result", self._deadline()).items():
            self.merge(q, res)
        d.order = sorted(range(len(d.configs)), key=lambda i: (d.roots[i], d.configs[i].key))
        st = d.stats
        st.configs_cut_root = len(d.configs) - len(d.searched_ever)
        st.processes = self.g.size
        st.statistics_depend_on_timing = st.statistics_depend_on_timing or self.g.size > 1
        return True

    def result(self) -> dict:
        d, st = self.d, self.d.stats
        return dict(
            # (configurations as values: the per-stage seed's come from another space)
            found=[(c, inc.time_ms, inc.opts, inc.layers, inc.origin)
                   for c, inc in d.found.items()],
            best=(None if d.best is None else
                  (d.best.cfg, d.best.time_ms, d.best.opts, d.best.layers, d.best.origin)),
            searched=sorted(d.searched_ever),
            counters={k: getattr(st, k) for k in _SUMMED},
            first_plan_s=st.first_plan_s, rounds=st.rounds)

    def merge(self, q: int, res: dict) -> None:
        d, st = self.d, self.d.stats
        for cfg, t, opts, layers, origin in res["found"]:
            cand = Incumbent(t, cfg.key, tuple(opts), tuple(layers), cfg, origin)
            if cfg not in d.found or cand < d.found[cfg]:
                d.found[cfg] = cand
        if res["best"] is not None:
            cfg, t, opts, layers, origin = res["best"]
            cand = Incumbent(t, cfg.key, tuple(opts), tuple(layers), cfg, origin)
            if d.best is None or cand < d.best:
                d.best = cand
            d.threshold = min(d.threshold, t)
        d.searched_ever.update(res["searched"])
        for k, v in res["counters"].items():
            setattr(st, k, getattr(st, k) + v)
        st.rounds = max(st.rounds, res["rounds"])
        if res["first_plan_s"] is not None:
            st.first_plan_s = (res["first_plan_s"] if st.first_plan_s is None
                               else min(st.first_plan_s, res["first_plan_s"]))
        # (timed_out / exhaustive: the coordinator's passes decided them over the merged
        # rounds)


# the statistics every share adds to the merged ones
_SUMMED = ("nodes", "plans_simulated", "cut_bound", "cut_memory", "cut_ridge", "cut_devices",
           "cut_capacity", "cut_dominated", "configs_searched", "constructed_plans",
           "polished_plans", "polish_evals", "warmup_plans", "shared_splits",
           "shared_chunks_helped")


