"""A slow device named while the job trains: every stage's measured compute against its plan.

Every iteration, each rank times its own forward and backward ops (an
:class:`~poseidon_plugin.megatron.calibrate.recorder.OpRecorder`, the live calibration's) and the ranks
all-gather one :class:`StageSample` each (rank, launch rank, stage, device type, node, compute per
micro-batch). Every rank keeps the last K iterations; :func:`find_stragglers` (pure) names every
rank whose compute was above its stage's planned forward + backward per micro-batch by more than
``--poseidon-straggler-pct`` (default 15) in EACH of the last K iterations
(``--poseidon-straggler-iters``, default 3): one slow iteration (a page fault, a checkpoint
write) names nobody, a device that stays slow is named. The launch's rank 0 then logs ONE line
(:func:`straggler_line`), once per launch, with the plan the launch's search chooses when the
named device type's layer times are scaled by its measured slowdown (:func:`search_suggester`)::

    poseidon: straggler: iteration 9: rank 0 = launch rank 1 (emu-fast on vm, stage 0) computes
    413.6 ms per micro-batch, planned 48.1 ms (+759%) over iterations 8-9; with the measured
    speed the search chooses plan layers 6,2 -> 7,1, ...; 6,655 -> 2,116 ms predicted (-68%)

With ``--poseidon-replan-on-straggler`` (and ``--save``) every rank, deciding alike on the same
gathered times, sets Megatron's ``exit_interval`` to that iteration (Megatron saves and leaves its
loop), rank 0 writes the measured speed into the profile cache (:func:`record_measured_speeds`),
and the launcher exits with :data:`STRAGGLER_EXIT_CODE` (:func:`exit_status`) for torchrun's
``--max-restarts`` to relaunch. Otherwise nothing here changes the training; a failure inside the
monitor is logged and it stops on every rank. ``POSEIDON_STRAGGLER=0`` turns it off (as
``POSEIDON_CALIBRATION=0`` does the calibration).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

log = logging.getLogger("poseidon")

# The exit status of every rank after a straggler's checkpoint (--poseidon-replan-on-straggler):
# sysexits.h's EX_TEMPFAIL ("try again later"); non-zero, so torchrun's --max-restarts relaunches
# the group, which plans with the measured speeds and resumes from that checkpoint.
STRAGGLER_EXIT_CODE = 75
_EXIT = {"requested": False}

DEFAULT_PCT = 15.0      # --poseidon-straggler-pct
DEFAULT_ITERS = 3       # --poseidon-straggler-iters (K)
MAX_NAMED = 8           # ranks named in the line at most (the rest counted)


@dataclass(frozen=True)
class StageSample:
    """One rank's compute in one iteration: forward + backward per micro-batch (ms)."""
    rank: int              # in the training's process group (after the plan's renumbering)
    stage: int
    device_type: str
    node: str
    compute_ms: float
    launch_rank: int = -1  # torchrun's RANK (-1: the same as ``rank``)


@dataclass(frozen=True)
class Straggler:
    rank: int
    stage: int
    device_type: str
    node: str
    measured_ms: float     # mean over the K iterations
    planned_ms: float
    launch_rank: int = -1

    @property
    def name(self) -> str:
        """``rank 3`` (``rank 3 = launch rank 1`` when the plan renumbered it)."""
        if self.launch_rank < 0 or self.launch_rank == self.rank:
            return f"rank {self.rank}"
        return f"rank {self.rank} = launch rank {self.launch_rank}"

    @property
    def slower(self) -> float:
        """How much slower than planned (0.25 = 25 % slower)."""
        return self.measured_ms / self.planned_ms - 1.0


def find_stragglers(history: Sequence[Sequence[StageSample]], planned_ms: Sequence[float],
                    pct: float, iters: int) -> tuple[Straggler, ...]:
    """The ranks slower than their stage's ``planned_ms`` by more than ``pct`` % in each of the
    last ``iters`` iterations of ``history`` (oldest first; one sample per rank each), the
    slowest first; () with fewer iterations recorded, or for a stage without a plan time."""
    if iters <= 0 or len(history) < iters:
        return ()
    window = list(history)[-iters:]
    limit = 1.0 + pct / 100.0
    slow: dict[int, list[StageSample]] = {}
    for n, samples in enumerate(window):
        seen = set()
        for s in samples:
            planned = planned_ms[s.stage] if 0 <= s.stage < len(planned_ms) else 0.0
            if planned > 0 and s.compute_ms > planned * limit and (n == 0 or s.rank in slow):
                slow.setdefault(s.rank, []).append(s)
                seen.add(s.rank)
        for rank in [r for r in slow if r not in seen]:   # a streak broken: not a straggler
            del slow[rank]
    out = []
    for rank, samples in slow.items():
        last = samples[-1]
        mean = sum(s.compute_ms for s in samples) / len(samples)
        out.append(Straggler(rank, last.stage, last.device_type, last.node, mean,
                             planned_ms[last.stage], last.launch_rank))
    return tuple(sorted(out, key=lambda s: (-s.slower, s.rank)))


def straggler_line(found: Sequence[Straggler], iteration: int, iters: int,
                   suggestion: str = "") -> str:
    """The one log line naming ``found`` (see the module docstring); iteration 1-based;
    ``suggestion``: what the search would choose with the measured speeds (appended)."""
    first = iteration - iters + 1
    span = f"iterations {first}-{iteration}" if iters > 1 else f"iteration {iteration}"
    named = [f"{s.name} ({s.device_type} on {s.node}, stage {s.stage}) computes "
             f"{s.measured_ms:.1f} ms per micro-batch, planned {s.planned_ms:.1f} ms "
             f"({100 * s.slower:+.0f}%)" for s in found[:MAX_NAMED]]
    more = f"; {len(found) - MAX_NAMED} more rank(s)" if len(found) > MAX_NAMED else ""
    tail = f"; {suggestion}" if suggestion else ""
    return f"straggler: iteration {iteration}: {'; '.join(named)}{more} over {span}{tail}"


def type_slowdowns(found: Sequence[Straggler]) -> dict[str, float]:
    """Per device type of ``found``: measured / planned compute, the largest of its ranks (the
    factor the search scales that type's layer times by)."""
    out: dict[str, float] = {}
    for s in found:
        out[s.device_type] = max(out.get(s.device_type, 1.0), s.measured_ms / s.planned_ms)
    return out


def scaled_profiles(db: Any, factors: dict[str, float]) -> Any:
    """A copy of the ProfileDB ``db`` whose layer records of each type in ``factors`` have
    their forward and backward times multiplied by its factor (the rest shared, unchanged)."""
    out = copy.copy(db)
    out._records = {k: (replace(p, forward_ms=p.forward_ms * factors[k.device_type],
                                backward_ms=p.backward_ms * factors[k.device_type])
                        if k.device_type in factors else p)
                    for k, p in db._records.items()}
    out._measured_index = None
    return out


def suggestion_text(current: Any, suggested: Any) -> str:
    """``with the measured speed the search chooses plan 1f1b pp=2 -> pp=1, ...; 720 -> 560 ms
    predicted (-22%)``: ``suggested`` is a search's result given ``current`` as the previous
    plan, so its ``search["previous_ms"]`` is the current plan under the measured speed."""
    from poseidon_plugin.megatron.checkpoint.change import plan_changes

    now_ms = float((suggested.search or {}).get("previous_ms") or 0.0)
    if now_ms <= 0:
        return (f"with the measured speed the search chooses a plan of "
                f"{suggested.predicted_iteration_time_ms:.1f} ms predicted")
    new_ms = float(suggested.predicted_iteration_time_ms)
    was = replace(current, predicted_iteration_time_ms=now_ms)
    return (f"with the measured speed the search chooses {plan_changes(was, suggested)} "
            f"({100 * (new_ms / now_ms - 1):+.0f}%)")


class StragglerWatch:
    """The logging rank's side: the last K iterations' samples, and the line the first time any
    rank is named (None before, and after: one line per launch). ``suggest``: the stragglers ->
    what the search would choose with their measured speed (its failure is said in the line)."""

    def __init__(self, planned_ms: Sequence[float], pct: float = DEFAULT_PCT,
                 iters: int = DEFAULT_ITERS,
                 suggest: Callable[[Sequence[Straggler]], str] | None = None) -> None:
        self.planned_ms = tuple(float(p) for p in planned_ms)
        self.pct = float(pct)
        self.iters = int(iters)
        self.suggest = suggest
        self.history: deque[tuple[StageSample, ...]] = deque(maxlen=max(1, self.iters))
        self.iteration = 0
        self.found: tuple[Straggler, ...] = ()

    def update(self, samples: Sequence[StageSample], iteration: int | None = None) -> str | None:
        """``iteration``: the training's 1-based iteration number (default: the count of
        updates; a resumed run starts past 1)."""
        self.iteration = self.iteration + 1 if iteration is None else int(iteration)
        if self.found:
            return None
        self.history.append(tuple(samples))
        self.found = find_stragglers(self.history, self.planned_ms, self.pct, self.iters)
        if not self.found:
            return None
        text = ""
        if self.suggest is not None:
            try:
                text = self.suggest(self.found)
            except Exception as exc:  # noqa: BLE001 - the line still names the rank
                text = f"no plan with the measured speed ({type(exc).__name__}: {exc})"
        return straggler_line(self.found, self.iteration, self.iters, text)


def planned_compute_ms(plan: Any) -> tuple[float, ...]:
    """Each stage's planned forward + backward per micro-batch (ms; all chunks of the device)."""
    return tuple(float(s.forward_ms) + float(s.backward_ms) for s in plan.stages)


def _compute_ms(ops: Sequence[tuple[int, int, bool, float, float]]) -> float:
    """An iteration's forward + backward op time per micro-batch (ms; chunks summed)."""
    mbs = {mb for _, mb, _, _, _ in ops}
    return 1e3 * sum(t1 - t0 for _, _, _, t0, t1 in ops) / len(mbs) if mbs else 0.0


class StragglerMonitor:
    """Wraps Megatron's ``train_step``: records this rank's ops, gathers one sample per rank
    each iteration, and (rank 0) logs the straggler line. Install it BEFORE the live
    calibration, so the calibration's own wrappers, removed after its report, restore these."""

    def __init__(self, plan: Any, pct: float = DEFAULT_PCT, iters: int = DEFAULT_ITERS,
                 emit: Callable[[str], None] | None = None,
                 suggest: Callable[[Sequence[Straggler]], str] | None = None,
                 replan: bool = False,
                 record: Callable[[Sequence[Straggler]], None] | None = None) -> None:
        self.watch = StragglerWatch(planned_compute_ms(plan), pct, iters, suggest)
        self.replan = bool(replan)   # then: save and exit (every rank decides alike)
        self._record = record        # the measured speeds where the relaunch plans from
        self.pp = len(plan.stages)
        self._emit = emit
        self._undo: list[Callable[[], None]] = []
        self.recorder = None
        self.lines: list[str] = []

    def install(self) -> "StragglerMonitor":
        from poseidon_plugin.megatron.calibrate.calibration import _device_event_class
        from poseidon_plugin.megatron.calibrate.recorder import OpRecorder
        from poseidon_plugin.megatron.calibrate.train_step_hook import wrap_train_step

        self.recorder = OpRecorder(0, event_class=_device_event_class())
        ctx = self.recorder.installed(None)
        ctx.__enter__()
        self._undo.append(lambda: ctx.__exit__(None, None, None))
        self._undo.append(wrap_train_step(self._begin, lambda began: began and self._end()))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _begin(self) -> bool:
        if self.recorder is None:
            return False
        self.recorder.begin_iteration()
        return True

    def _end(self) -> None:
        mine: StageSample | None = None
        try:
            rec = self.recorder.end_iteration()
            self.recorder.flush()
            mine = StageSample(_rank(), _pp_rank(), os.environ.get("POSEIDON_DEVICE_TYPE", "?"),
                               socket.gethostname(), _compute_ms(rec.ops),
                               int(os.environ.get("POSEIDON_LAUNCH_RANK", "-1")))
            self.recorder.iterations.clear()
        except Exception as exc:  # never break the training; the others stop with this rank
            log.warning("straggler monitor stopped: %s", exc)
        try:
            samples = _gather(mine)
            if any(s is None for s in samples):   # every rank stops at the same iteration
                self._stop()
                return
            logger = _logger_order(mine) == min(map(_logger_order, samples))
            if not logger:
                self.watch.suggest = None   # every rank decides; the logger alone searches
            iteration = _megatron_iteration()
            line = self.watch.update(samples, iteration)
            if line and self.replan and iteration is not None:
                line += self._exit_after(iteration, logger)
            if line and logger:
                self.lines.append(line)
                (self._emit or log.warning)(line)
        except Exception as exc:  # never break the training
            log.warning("straggler monitor stopped: %s", exc)
            self._stop()

    def _exit_after(self, iteration: int, logger: bool) -> str:
        """--poseidon-replan-on-straggler: Megatron's own exit path (``--exit-interval``: it
        saves a checkpoint when ``--save`` is given and leaves its training loop) at this
        iteration; :func:`exit_status` then turns the exit into :data:`STRAGGLER_EXIT_CODE`."""
        from megatron.training.global_vars import get_args

        get_args().exit_interval = iteration
        _EXIT["requested"] = True
        if logger and self._record is not None:
            self._record(self.watch.found)
        return (f"; --poseidon-replan-on-straggler: checkpoint at iteration {iteration}, then "
                f"every rank exits with {STRAGGLER_EXIT_CODE} for torchrun to relaunch "
                f"(--max-restarts) with the measured speeds")

    def _stop(self) -> None:
        """Stop timing; the wrappers stay, passing through (removing them here would drop the
        live calibration's, installed over them)."""
        if self.recorder is not None:
            self.recorder._current = None   # its op wrappers record nothing from now on
        self.recorder = None


def _megatron_iteration() -> int | None:
    """The iteration that just ran, as Megatron numbers it (``args.curr_iteration`` is the count
    before it); None outside Megatron's training loop."""
    try:
        from megatron.training.global_vars import get_args

        done = getattr(get_args(), "curr_iteration", None)
        return None if done is None else int(done) + 1
    except Exception:  # noqa: BLE001 - no Megatron arguments (a loop of one's own)
        return None


def _logger_order(s: StageSample) -> tuple[int, int]:
    """The rank that logs: the launch's rank 0 (it holds the profiles the suggestion searches
    with), else the lowest launch rank that trains."""
    return (s.launch_rank if s.launch_rank >= 0 else s.rank, s.rank)


def _rank() -> int:
    from poseidon_plugin.megatron.calibrate.calibration import _rank as rank

    return rank()


def _pp_rank() -> int:
    from poseidon_plugin.megatron.calibrate.calibration import _pp_rank as pp_rank

    return pp_rank()


def _gather(mine: StageSample | None) -> list[StageSample | None]:
    """Every rank's sample (None: that rank's monitor failed), in rank order."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, mine)
            return out
    except ImportError:
        pass
    return [mine]


def install_straggler_monitor(plan: Any, pct: float = DEFAULT_PCT, iters: int = DEFAULT_ITERS,
                              emit: Callable[[str], None] | None = None,
                              suggest: Callable[[Sequence[Straggler]], str] | None = None,
                              replan: bool = False,
                              record: Callable[[Sequence[Straggler]], None] | None = None
                              ) -> StragglerMonitor:
    """Create and install a :class:`StragglerMonitor` (see the module docstring)."""
    return StragglerMonitor(plan, pct, iters, emit, suggest, replan, record).install()


def exit_status(code: object) -> object:
    """The exit status of a script that ended with ``SystemExit(code)``: after a straggler's
    exit (``--poseidon-replan-on-straggler``) a clean one becomes :data:`STRAGGLER_EXIT_CODE`."""
    if _EXIT["requested"] and code in (None, 0):
        return STRAGGLER_EXIT_CODE
    return code


def record_measured_speeds(cache_path: str, profiles: Any,
                           found: Sequence[Straggler]) -> None:
    """The stragglers' device types' layer records scaled by their measured slowdown, written to
    the profile cache as ``measured`` (they replace the profiled ones: the relaunch, its
    profiles all cached, plans with them)."""
    from poseidon_plugin.profiles import ProfileDB

    factors = type_slowdowns(found)
    db = ProfileDB(cache_path)
    for p in scaled_profiles(profiles, factors):
        if p.key.device_type in factors:
            db.put(replace(p, source="measured"))
    db.save()
    log.warning("straggler: the measured speed of %s written to %s for the relaunch",
                ", ".join(f"{t} (x{f:.2f})" for t, f in sorted(factors.items())), cache_path)


SUGGEST_BUDGET_S = 10.0   # the suggestion's search time budget at most (the training waits)


def search_suggester(plan: Any, search: Callable[[Any, Any, Any], Any], profiles: Any,
                     options: Any) -> Callable[[Sequence[Straggler]], str]:
    """The suggestion: ``search(options, profiles, previous)`` (the launch's search entry
    point) with the stragglers' device types' layer times scaled by their measured slowdown,
    the launch's search options with a time budget of at most :data:`SUGGEST_BUDGET_S` and the
    current plan as the previous one (timed under the same costs: the predicted gain)."""
    budget = min(options.time_budget_s or SUGGEST_BUDGET_S, SUGGEST_BUDGET_S)
    opts = replace(options, time_budget_s=budget, keep_tolerance=1e-9)

    def suggest(found: Sequence[Straggler]) -> str:
        return suggestion_text(plan, search(opts, scaled_profiles(profiles,
                                                                  type_slowdowns(found)), plan))
    return suggest
