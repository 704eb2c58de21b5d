"""Which TP degrees one ``poseidon profile`` run can measure: this run's processes (torchrun's
environment, or one process) and the rule for the ``--tp`` list. Checked before torch is
imported; every refusal is one line naming the fix. Imports no torch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from poseidon_plugin.errors import PoseidonError


@dataclass(frozen=True)
class Processes:
    """This run's processes, from torchrun's environment (one process without it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Processes":
        env = os.environ if environ is None else environ
        try:
            world = int(env.get("WORLD_SIZE", "1") or 1)
            if world <= 1:
                return cls()
            return cls(int(env.get("RANK", "0")), world, int(env.get("LOCAL_RANK", "0")),
                       int(env.get("LOCAL_WORLD_SIZE", str(world))))
        except ValueError as e:
            raise PoseidonError(f"malformed torchrun environment: {e}") from None


def check_tps(tps: Sequence[int], procs: Processes, model: Any = None) -> tuple[int, ...]:
    """The TP degrees to profile (sorted, once each), or a one-line PoseidonError naming the fix.

    Each degree ``t`` needs ``t`` processes of one node (a TP group never spans nodes) and must
    divide the processes per node (the node's ranks form ``local / t`` groups side by side) and,
    when ``model`` is given, its attention heads and query groups (Megatron shards them)."""
    bad = sorted({t for t in tps if t < 1})
    if bad or not tps:
        raise PoseidonError(f"--tp: expected integers >= 1, got {list(tps)}")
    out = tuple(sorted(set(tps)))
    local = procs.local_world_size
    big = [t for t in out if t > local]
    if big:
        have = ("this run is one process" if procs.world_size == 1 else
                f"this run has {local} process(es) per node")
        raise PoseidonError(f"--tp {_words(big)}: TP {big[-1]} needs {big[-1]} processes on one "
                            f"node (one per TP rank) and {have}: run it with torchrun "
                            f"--nproc-per-node >= {big[-1]}, a multiple of every TP degree "
                            f"(e.g. torchrun --nproc-per-node {_lcm(out)} -m poseidon_plugin "
                            f"profile ...)")
    odd = [t for t in out if local % t]
    if odd:
        raise PoseidonError(f"--tp {_words(odd)}: TP {odd[0]} does not divide the {local} "
                            f"processes per node (each node's ranks form equal TP groups): run "
                            f"with --nproc-per-node {_lcm(out)} or drop TP {_words(odd)}")
    if model is not None:
        check_tps_divide_model(out, model)
    return out


def check_tps_divide_model(tps: Sequence[int], model: Any, flag: str = "--tp") -> None:
    """A one-line PoseidonError for a TP degree that does not divide the model's attention
    heads or query groups (Megatron's ``parallel_state`` would raise on every rank)."""
    for what, count in (("attention heads", model.num_attention_heads),
                        ("query groups", model.num_query_groups)):
        odd = [t for t in tps if count % t]
        if odd:
            raise PoseidonError(f"{flag} {_words(odd)}: TP {odd[0]} does not divide the "
                                f"model's {count} {what} (Megatron splits them over the TP "
                                f"ranks)")


def _words(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)


def _lcm(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


__all__ = ["Processes", "check_tps"]
