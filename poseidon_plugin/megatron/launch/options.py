"""``--poseidon-*`` options: parsed and stripped from argv before Megatron ever sees it.

Every option also accepts the ``--opt=value`` form. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from poseidon_plugin.errors import PoseidonError

BACKENDS = ("auto", "megatron", "mindspeed-llm")
# --poseidon-timeout bounds, seconds: below a second a healthy rendezvous times out; past a week
# the value overflows torch's timedelta long before anyone waits for it
TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)
MAX_PROFILE_ITERS = 1000   # timed iterations per profiled configuration (default 5)
MAX_STRAGGLER_PCT = 10000.0   # --poseidon-straggler-pct at most (100x slower than planned)


@dataclass(frozen=True)
class PoseidonOptions:
    auto: bool = False                    # --poseidon-auto: plan this launch
    dry_run: bool = False                 # --poseidon-dry-run: print plan + flags, exit 0
    cluster_file: str | None = None       # --poseidon-cluster FILE: overrides (bandwidths, names)
    profile_dir: str | None = None        # --poseidon-profile-dir DIR (profile cache)
    reprofile: bool = False               # --poseidon-reprofile: ignore cached profiles
    schedules: tuple[str, ...] = ()       # --poseidon-schedules 1f1b,interleaved-1f1b (search default if empty)
    pruning: str = "safe"                 # --poseidon-pruning MODE
    time_budget_s: float | None = None    # --poseidon-time-budget SECONDS (search)
    keep_within: float = 0.02             # --poseidon-keep-plan-within PCT (default 2; 0: off)
    replan: bool = False                  # --poseidon-replan: ignore the previous launch's plan
    backend: str = "auto"                 # --poseidon-backend megatron|mindspeed-llm|auto
    emulate_file: str | None = None       # --poseidon-emulate FILE: CPU emulation of device types
    timeout_s: float = 300.0              # --poseidon-timeout SECONDS: every collective / barrier
    tp_candidates: tuple[int, ...] = ()   # --poseidon-tp 1,2,4: TP degrees to profile (default: all fitting)
    micro_batch_sizes: tuple[int, ...] = ()  # --poseidon-micro-batch-sizes 1,2 (default: the script's)
    max_virtual_stages: int = 2           # --poseidon-max-virtual-stages N
    save_plan: str | None = None          # --poseidon-save-plan FILE: rank 0 writes the plan JSON
    profile_iters: int = 5                # --poseidon-profile-iters N: timed iterations per config
    seed: int = 0                         # --poseidon-seed N (search warm-up sampling)
    search_workers: int | None = None     # --poseidon-search-workers N: search threads (default:
                                          # this host's cores / ranks on it; rank 0 searches)
    search_ep: bool = False               # --poseidon-search-ep: the search may change the
                                          # script's --expert-model-parallel-size (else kept)
    search_cp: bool = False               # --poseidon-search-cp: the script's CP may change
    straggler_pct: float = 15.0           # --poseidon-straggler-pct PCT: a stage this much slower
                                          # than planned ...
    straggler_iters: int = 3              # --poseidon-straggler-iters K: ... K iterations running
                                          # is named (megatron/calibrate/straggler.py)
    replan_on_straggler: bool = False     # --poseidon-replan-on-straggler: then save, exit with
                                          # calibrate/straggler.STRAGGLER_EXIT_CODE (torchrun relaunches)
    present: tuple[str, ...] = field(default=(), compare=False)  # option names seen on argv

    @property
    def any_present(self) -> bool:
        return bool(self.present)


def default_profile_dir() -> str:
    env = os.environ.get("POSEIDON_PROFILE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "poseidon", "profiles")


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PoseidonError(f"{name}: expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise PoseidonError(f"{name}: expected positive integers, got {text!r}")
    return values


def _positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PoseidonError(f"{name}: expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise PoseidonError(f"{name}: expected a number > 0 and finite, got {text!r}")
    return value


def timeout_seconds(name: str, text: str) -> float:
    """``text`` as a --poseidon-timeout / --timeout value (seconds in TIMEOUT_RANGE_S)."""
    value = _positive_float(name, text)
    low, high = TIMEOUT_RANGE_S
    if not low <= value <= high:
        raise PoseidonError(f"{name}: expected a number of seconds in [{low:g}, {high:g}], "
                            f"got {text!r}")
    return value


def _slowdown_percent(name: str, text: str) -> float:
    """--poseidon-straggler-pct: a percent in (0, MAX_STRAGGLER_PCT] (``%`` allowed)."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 < value <= MAX_STRAGGLER_PCT:
        raise PoseidonError(f"{name}: expected a percent > 0 and <= {MAX_STRAGGLER_PCT:g}, "
                            f"got {text!r}")
    return value


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise PoseidonError(f"{name}: expected an integer, got {text!r}") from None
    if value <= 0:
        raise PoseidonError(f"{name}: expected an integer > 0, got {text!r}")
    return value


# option -> (field, kind); kind "flag" takes no value
_SPEC: dict[str, tuple[str, str]] = {
    "--poseidon-auto": ("auto", "flag"),
    "--poseidon-dry-run": ("dry_run", "flag"),
    "--poseidon-reprofile": ("reprofile", "flag"),
    "--poseidon-cluster": ("cluster_file", "str"),
    "--poseidon-profile-dir": ("profile_dir", "str"),
    "--poseidon-schedules": ("schedules", "csv"),
    "--poseidon-pruning": ("pruning", "str"),
    "--poseidon-time-budget": ("time_budget_s", "float"),
    "--poseidon-keep-plan-within": ("keep_within", "percent"),
    "--poseidon-replan": ("replan", "flag"),
    "--poseidon-backend": ("backend", "backend"),
    "--poseidon-emulate": ("emulate_file", "str"),
    "--poseidon-timeout": ("timeout_s", "timeout"),
    "--poseidon-tp": ("tp_candidates", "ints"),
    "--poseidon-micro-batch-sizes": ("micro_batch_sizes", "ints"),
    "--poseidon-max-virtual-stages": ("max_virtual_stages", "int"),
    "--poseidon-save-plan": ("save_plan", "str"),
    "--poseidon-profile-iters": ("profile_iters", "iters"),
    "--poseidon-seed": ("seed", "int0"),
    "--poseidon-search-workers": ("search_workers", "int"),
    "--poseidon-search-ep": ("search_ep", "flag"),
    "--poseidon-search-cp": ("search_cp", "flag"),
    "--poseidon-straggler-pct": ("straggler_pct", "slowdown"),
    "--poseidon-straggler-iters": ("straggler_iters", "iters"),
    "--poseidon-replan-on-straggler": ("replan_on_straggler", "flag"),
}


def _check_search_flags(values: dict[str, object]) -> None:
    """--poseidon-pruning and --poseidon-schedules refused as the launch starts (not after the
    discovery and the profiling, where the search options are built)."""
    from poseidon_plugin.search.options import PRUNING_MODES
    from poseidon_plugin.simulator.schedules import LAUNCHABLE_SCHEDULES

    pruning = values.get("pruning", "safe")
    if pruning not in PRUNING_MODES:
        raise PoseidonError(f"--poseidon-pruning: expected one of {', '.join(PRUNING_MODES)}, "
                            f"got {pruning!r}")
    if "schedules" in values and not values["schedules"]:
        raise PoseidonError("--poseidon-schedules: expected at least one schedule")
    bad = [s for s in values.get("schedules", ()) if s not in LAUNCHABLE_SCHEDULES]  # type: ignore[attr-defined]
    if bad:
        raise PoseidonError(f"--poseidon-schedules: Megatron can run "
                            f"{', '.join(LAUNCHABLE_SCHEDULES)}; got {', '.join(bad)} (other "
                            "schedules can only be planned offline: poseidon plan)")


def extract_options(argv: list[str]) -> tuple[PoseidonOptions, list[str]]:
    """Split ``argv`` (without the program name) into Poseidon options and the rest, in order.

    Raises PoseidonError on an unknown ``--poseidon-*`` option or a bad value.
    """
    values: dict[str, object] = {}
    present: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--poseidon-"):
            rest.append(tok)
            i += 1
            continue
        name, eq, inline = tok.partition("=")
        if name not in _SPEC:
            known = ", ".join(sorted(_SPEC))
            raise PoseidonError(f"unknown option {name}; the Poseidon options are: {known}")
        fld, kind = _SPEC[name]
        present.append(name)
        if kind == "flag":
            if eq:
                raise PoseidonError(f"{name} takes no value, got {tok!r}")
            values[fld] = True
            i += 1
            continue
        if eq:
            raw = inline
            i += 1
        else:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise PoseidonError(f"{name}: expected a value")
            raw = argv[i + 1]
            i += 2
        if kind == "str":
            if not raw:
                raise PoseidonError(f"{name}: expected a non-empty value")
            values[fld] = raw
        elif kind == "csv":
            values[fld] = tuple(s.strip() for s in raw.split(",") if s.strip())
        elif kind == "float":
            values[fld] = _positive_float(name, raw)
        elif kind == "percent":
            from poseidon_plugin.search.options import percent_option

            values[fld] = percent_option(name, raw)
        elif kind == "slowdown":
            values[fld] = _slowdown_percent(name, raw)
        elif kind == "timeout":
            values[fld] = timeout_seconds(name, raw)
        elif kind == "int":
            values[fld] = _positive_int(name, raw)
        elif kind == "iters":
            values[fld] = _positive_int(name, raw)
            if values[fld] > MAX_PROFILE_ITERS:
                raise PoseidonError(f"{name}: expected an integer <= {MAX_PROFILE_ITERS}, "
                                    f"got {raw!r}")
        elif kind == "int0":
            try:
                values[fld] = int(raw)
            except ValueError:
                raise PoseidonError(f"{name}: expected an integer, got {raw!r}") from None
        elif kind == "ints":
            values[fld] = _int_list(name, raw)
        elif kind == "backend":
            if raw not in BACKENDS:
                raise PoseidonError(f"{name}: expected one of {', '.join(BACKENDS)}, got {raw!r}")
            values[fld] = raw
    _check_search_flags(values)
    opts = replace(PoseidonOptions(), **values, present=tuple(present))  # type: ignore[arg-type]
    if opts.any_present and not opts.auto and (opts.dry_run or opts.emulate_file):
        # --poseidon-dry-run / --poseidon-emulate alone imply the automatic plan
        opts = replace(opts, auto=True)
    return opts, rest
