"""Profiling on every rank of a launch: each TP degree timed with real tensor-parallel groups
(:func:`.profiler.profile_rank`), every rank's timings gathered to every rank.

Shared by the ``--poseidon-auto`` launch (:mod:`.runner`) and ``poseidon profile`` under torchrun
(:mod:`.offline`). megatron-core (0.19.2: ``parallel_state.create_group``) makes its TP groups
with ``new_group(backend=None)``: they inherit the default group's backend. The timing therefore
runs with the default group on the device's backend (:func:`.bootstrap.device_backend`: NCCL on
GPU, HCCL on NPU; :meth:`.bootstrap.Bootstrap.device_group`), not on the gloo probe group, which
is the default group again for the gather and whatever follows. Under CPU emulation the probe
group itself (gloo) is the profiling group.

Both phases run guarded (:func:`.bootstrap.run_guarded`): a rank that fails posts its error and
the others name it; a rank that hangs is named when ``--poseidon-timeout`` / ``--timeout``
passes at the next deadline barrier (one before every TP degree and, for TP > 1, every
micro-batch size).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from poseidon_plugin.megatron.launch import bootstrap
from poseidon_plugin.megatron.profile import profiler


def profile_and_gather(boot: bootstrap.Bootstrap, args: Any, tps: Sequence[int],
                       micro_batch_sizes: Sequence[int], *, device: Any, iters: int,
                       backend: str, seed: int = 1234,
                       turns: profiler.Turns | None = None,
                       contention: Any = None,
                       kinds: Sequence[profiler.ProfiledKind] | None = None,
                       progress: Any = None) -> list[list[profiler.LayerTiming]]:
    """Every rank's ``LayerTiming`` list, indexed by launch rank (on every rank).

    ``boot``: started (its gloo probe group is the default group, before and after).
    ``backend``: the collective backend the TP groups time on (:func:`.bootstrap.device_backend`
    of the device; no default: gloo with a GPU's tensors is the mistake this avoids): other than
    gloo, the default group is switched to it for the timing.
    ``turns``: ranks sharing a host's CPU cores measure one TP group at a time.
    ``contention``: under emulation, the host-contention probe (``profiler.profile_rank``).
    ``kinds``: the layer kinds each rank profiles (``profiler.ProfiledKind``; default: the
    first layer's), each rank's list holding every kind's timings (``LayerTiming.kind``)."""
    env = boot.env

    def measure() -> list[profiler.LayerTiming]:
        with (boot.device_group(backend) if backend != "gloo" else contextlib.nullcontext()):
            return profiler.profile_rank(
                args, tps, micro_batch_sizes, world_size=env.world_size, rank=env.rank,
                device=device, iters=iters, seed=seed, checkpoint=boot.barrier, turns=turns,
                contention=contention, kinds=kinds,
                **({"progress": progress} if progress is not None and env.rank == 0 else {}))

    timings = bootstrap.run_guarded(boot, "profiling", measure)
    return bootstrap.run_guarded(boot, "profiling-gather",
                                 lambda: boot.all_gather_object(timings, "profiling-gather"))


__all__ = ["profile_and_gather"]
