"""``SearchOptions``: everything that shapes one plan search, validated once.

The CLI (``poseidon plan``), the launch runner (``--poseidon-auto``) and the baselines build one
``SearchOptions`` value and pass it down; nothing re-threads keyword arguments. A bad value is a
``PoseidonError`` naming the CLI flag and the field (``--pruning / pruning: ...``).

Checks that need the cluster and the model (is any allowed TP degree valid there?
``tp_candidates``, which ``configs`` enumerates with too) are done by
``SearchOptions.check_against`` when the search starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import PoseidonError
from ..model import MAX_SEQ_LENGTH
from ..simulator.schedules import LAUNCHABLE_SCHEDULES, SCHEDULES
from ..training import TrainingSetup
from .rules import FrameworkRules

SEARCH_SCHEDULES: tuple[str, ...] = SCHEDULES   # every schedule the simulator times
DEFAULT_SCHEDULES: tuple[str, ...] = ("1f1b", "eager-1f1b", "interleaved-1f1b")
PRUNING_MODES: tuple[str, ...] = ("safe", "ridge", "none")
TP_MODES: tuple[str, ...] = ("uniform", "per-stage")
TYPE_ORDERS: tuple[str, ...] = ("auto", "any", "blocks")
DEFAULT_MICRO_BATCH_SIZES: tuple[int, ...] = (1, 2, 4)
TYPE_SEQUENCE_LIMIT = 3 ** 20
"""``type_order="auto"``: every type sequence while (#usable types)^N <= this (3 types: N <= 20;
with the capacity bound the interleaved orders cost ~2x, and on paper-setting6 (288 NPUs) the
contiguous ``blocks`` orders lose 2.1 %), contiguous blocks beyond."""

# upper bounds that keep the search's arrays and loops finite (a typo of a few zeros is refused,
# not searched for minutes): sequences per iteration, tokens per sequence, interleaving depth
MAX_GLOBAL_BATCH_SIZE = 1 << 17
MAX_VIRTUAL_STAGES = 4096
MAX_WARMUP_SAMPLES = 1_000_000   # ~30 s of sampling on 2 cores for the tiny example
MAX_PLAN_WINDOW = 0.2     # a plan may be kept / preferred at most 20 % over the fastest

_TP_MODE_ALIASES = {"uniform": "uniform", "uniform-tp": "uniform", "per-stage": "per-stage",
                    "per-stage-tp": "per-stage"}


def percent_option(name: str, text: str) -> float:
    """``--tie-tolerance PCT`` / ``--poseidon-keep-plan-within PCT``: a percent in [0, 20] as a
    fraction (``SearchOptions.tie_tolerance`` / ``keep_tolerance``)."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 <= value <= 100 * MAX_PLAN_WINDOW:
        raise PoseidonError(f"{name}: expected a percent in [0, {100 * MAX_PLAN_WINDOW:g}], "
                            f"got {text!r}")
    return value / 100.0


def _positive_int(name: str, value: object, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoseidonError(f"{name}: expected an integer >= 1, got {value!r}")
    if limit is not None and value > limit:
        raise PoseidonError(f"{name}: expected an integer <= {limit}, got {value!r}")
    return value


def _int_tuple(name: str, values: object) -> tuple[int, ...]:
    try:
        out = tuple(values)  # type: ignore[arg-type]
    except TypeError:
        raise PoseidonError(f"{name}: expected a list of integers >= 1, got {values!r}") from None
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise PoseidonError(f"{name}: expected integers >= 1, got {list(out)!r}")
    return out


def tp_candidates(cluster, model, type_name: str, allowed=None) -> tuple[int, ...]:
    """TP degrees a stage of this type may use: powers of two dividing every node's device
    count, the attention heads and the query groups (and in ``allowed`` when given)."""
    sizes = [n.num_devices for n in cluster.nodes_of_type(type_name)]
    out = []
    t = 1
    while sizes and t <= min(sizes):
        if (all(s % t == 0 for s in sizes) and model.num_attention_heads % t == 0
                and model.num_query_groups % t == 0 and (allowed is None or t in allowed)):
            out.append(t)
        t *= 2
    return tuple(out)


@dataclass(frozen=True)
class SearchOptions:
    """One plan search's settings (see ``docs/search.md`` for what each changes).

    ``global_batch_size`` and ``seq_length`` are the training setup; the rest shape the search:
    the schedules, the pruning mode (``safe`` = exact, ``ridge`` = the paper's heuristic cut,
    ``none`` = exhaustive), uniform or per-stage TP and the TP degrees allowed (None: every
    valid one), the micro-batch sizes, the largest interleaving depth V, which device-type
    sequences are searched (``auto``/``any``/``blocks``), the warm-up samples and their seed,
    the wall-clock budget in seconds (None: none), the search threads (None: one per core);
    ``training`` is the training setup (recompute, optimizer, dtypes, attention: ``training.py``);
    ``tie_tolerance`` (0 = off): return the preferred plan among those within this fraction of
    the fastest (``search/tiebreak.py``); ``keep_tolerance`` (0 = off): a previous plan passed
    to the search is kept while it is within this fraction of the fastest (``driver.keep``);
    ``runner_up``: after the search, find the fastest plan of another configuration and the
    margin to it (``search/runnerup.py``: how sure the choice is); ``rules``: what the training
    framework refuses, excluded before the search (``search/rules.py``: from the user's
    Megatron flags, and configurations its validation refused at launch);
    ``context_parallel``: the CP degrees searched (None: CP 1 only; ``poseidon plan --cp N``
    fixes one, ``--search-cp`` gives every power of two dividing the sequence into 2 x CP
    chunks, ``search_cp_degrees``);
    ``expert_parallel``: the expert-parallel degrees allowed (None: every valid one; a model
    without experts has EP 1 only).
    """

    global_batch_size: int
    seq_length: int
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    pruning: str = "safe"
    tp_mode: str = "uniform"
    tp_degrees: tuple[int, ...] | None = None
    micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES
    max_virtual_stages: int = 2
    type_order: str = "any"
    type_sequence_limit: int = TYPE_SEQUENCE_LIMIT
    warmup_samples: int = 500
    seed: int = 0
    time_budget_s: float | None = None
    workers: int | None = None
    training: TrainingSetup = TrainingSetup()
    tie_tolerance: float = 0.0
    keep_tolerance: float = 0.0
    # False: no pipeline stage may hold only the model's leading dense layers (megatron-core
    # before 0.19 hangs on a stage without MoE layers: search/rules.py, MOE_FREE_STAGE_FIXED_IN)
    moe_free_stages: bool = True
    runner_up: bool = True
    rules: FrameworkRules = FrameworkRules()
    context_parallel: tuple[int, ...] | None = None
    expert_parallel: tuple[int, ...] | None = None
    progress: bool = field(default=False, compare=False)
    # a time budget shorter than the first constructed plan is overrun until it (True), or the
    # construction stops at the budget after 64 configurations (False: the baselines' searches)
    first_plan_overrun: bool = field(default=True, compare=False)
    # with first_plan_overrun False: how long past the budget the construction may still look
    # for a first plan (None: until 64 configurations were tried; the CLI's baselines: 0.5 s)
    overrun_s: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _positive_int("global batch size (--global-batch-size / global_batch_size)",
                      self.global_batch_size, MAX_GLOBAL_BATCH_SIZE)
        _positive_int("sequence length (--seq-length / seq_length)", self.seq_length,
                      MAX_SEQ_LENGTH)
        _positive_int("max virtual stages (--max-virtual-stages / max_virtual_stages)",
                      self.max_virtual_stages, MAX_VIRTUAL_STAGES)
        if isinstance(self.schedules, str):
            set_(self, "schedules", (self.schedules,))
        set_(self, "schedules", tuple(self.schedules))
        if not self.schedules:
            raise PoseidonError("schedules (--schedules / schedules): expected at least one "
                                "schedule")
        for s in self.schedules:
            if s not in SEARCH_SCHEDULES:
                raise PoseidonError(f"schedules (--schedules / schedules): expected some of "
                                    f"{', '.join(SEARCH_SCHEDULES)}, got {s!r}")
        if self.pruning not in PRUNING_MODES:
            raise PoseidonError(f"pruning (--pruning / pruning): expected one of "
                                f"{', '.join(PRUNING_MODES)}, got {self.pruning!r}")
        if self.tp_mode not in _TP_MODE_ALIASES:
            raise PoseidonError(f"TP mode (--uniform-tp / --per-stage-tp, tp_mode): expected "
                                f"'uniform' or 'per-stage', got {self.tp_mode!r}")
        set_(self, "tp_mode", _TP_MODE_ALIASES[self.tp_mode])
        if self.type_order not in TYPE_ORDERS:
            raise PoseidonError(f"type order (--type-order / type_order): expected one of "
                                f"{', '.join(TYPE_ORDERS)}, got {self.type_order!r}")
        set_(self, "micro_batch_sizes", _int_tuple(
            "micro-batch sizes (--micro-batch-sizes / micro_batch_sizes)",
            DEFAULT_MICRO_BATCH_SIZES if self.micro_batch_sizes is None
            else self.micro_batch_sizes))
        if self.tp_degrees is not None:
            set_(self, "tp_degrees", _int_tuple("TP degrees (--tp / tp_degrees)",
                                                self.tp_degrees))
        if self.context_parallel is not None:
            cps = _int_tuple("CP degrees (--cp / context_parallel)", self.context_parallel)
            for c in cps:
                if c > 1 and self.seq_length % (2 * c):
                    raise PoseidonError(
                        f"CP degrees (--cp / context_parallel): CP {c} needs the sequence "
                        f"length ({self.seq_length}) divisible by 2 x CP = {2 * c}")
            set_(self, "context_parallel", tuple(sorted(set(cps))))
        if self.expert_parallel is not None:
            set_(self, "expert_parallel", _int_tuple(
                "expert-parallel degrees (--ep / expert_parallel)", self.expert_parallel))
        if (isinstance(self.warmup_samples, bool) or not isinstance(self.warmup_samples, int)
                or not 0 <= self.warmup_samples <= MAX_WARMUP_SAMPLES):
            raise PoseidonError(f"warm-up samples (--warmup-samples / warmup_samples): "
                                f"expected an integer in [0, {MAX_WARMUP_SAMPLES}], got "
                                f"{self.warmup_samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise PoseidonError(f"seed (--seed / seed): expected an integer, got {self.seed!r}")
        if self.time_budget_s is not None:
            b = self.time_budget_s
            if (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                    or b <= 0):
                raise PoseidonError(f"time budget (--time-budget / time_budget_s): expected a "
                                    f"finite number > 0, got {b!r}")
        if self.workers is not None:
            _positive_int("search threads (--workers / workers)", self.workers)
        for what, t in (("tie tolerance (--tie-tolerance / tie_tolerance)", self.tie_tolerance),
                        ("keep tolerance (--poseidon-keep-plan-within / keep_tolerance)",
                         self.keep_tolerance)):
            if (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                    or not 0.0 <= t <= MAX_PLAN_WINDOW):
                raise PoseidonError(f"{what}: expected a fraction in "
                                    f"[0, {MAX_PLAN_WINDOW:g}], got {t!r}")
        if not isinstance(self.runner_up, bool):
            raise PoseidonError(f"runner_up: expected true or false, got {self.runner_up!r}")
        _positive_int("type_sequence_limit", self.type_sequence_limit)
        if not isinstance(self.training, TrainingSetup):
            raise PoseidonError(f"training: expected a TrainingSetup, got {self.training!r}")
        if not isinstance(self.rules, FrameworkRules):
            raise PoseidonError(f"rules: expected FrameworkRules, got {self.rules!r}")

    # ------------------------------------------------------------------ derived values
    @staticmethod
    def search_cp_degrees(seq_length: int, start: int = 1, limit: int = 64) -> tuple[int, ...]:
        """``--search-cp``: 1, 2, 4, ... up to ``limit`` dividing ``seq_length`` into 2 x CP
        chunks (``start`` included: a launch's CP is one of them where valid)."""
        out = {1}
        c = 2
        while c <= limit:
            if seq_length % (2 * c) == 0:
                out.add(c)
            c *= 2
        if start > 1 and seq_length % (2 * start) == 0:
            out.add(start)
        return tuple(sorted(out))

    @property
    def num_workers(self) -> int:
        """Search threads: ``workers``, or one per core."""
        import os

        return self.workers if self.workers is not None else max(1, os.cpu_count() or 1)

    def replace(self, **changes) -> "SearchOptions":
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def check_against(self, cluster, model) -> None:
        """Errors that need the cluster and the model: some allowed TP degree must be valid;
        an expert-parallel degree > 1 needs a model with experts, dividing their count."""
        if self.expert_parallel is not None:
            experts = int(getattr(model, "num_experts", 0) or 0)
            bad = [e for e in self.expert_parallel if e > 1]
            if bad and experts <= 0:
                raise PoseidonError(f"expert parallelism (--ep / expert_parallel) {bad[0]}: "
                                    f"{model.name} has no experts (EP is 1)")
            if experts > 0 and not any(experts % e == 0 for e in self.expert_parallel):
                raise PoseidonError(f"expert parallelism (--ep / expert_parallel): none of "
                                    f"{sorted(self.expert_parallel)} divides the {experts} "
                                    f"experts of {model.name}")
        if self.tp_degrees is None:
            return
        valid = sorted({t for n in cluster.type_names for t in tp_candidates(cluster, model, n)})
        if not set(self.tp_degrees) & set(valid):
            raise PoseidonError(f"TP degrees (--tp / tp_degrees): none of "
                                f"{sorted(self.tp_degrees)} is valid on this cluster for "
                                f"{model.name} (valid: {valid}; a TP group stays in one node "
                                f"and divides the attention heads and query groups)")
