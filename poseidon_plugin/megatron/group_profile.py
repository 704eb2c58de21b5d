"""Profiling on every rank of a launch: each TP degree timed with real tensor-parallel groups
(:func:`.profiler.profile_rank`), every rank's timings gathered to every rank.

Shared by the ``--poseidon-auto`` launch (:mod:`.runner`) and ``poseidon profile`` under torchrun
(:mod:`.offline`). Both phases run guarded (:func:`.bootstrap.run_guarded`): a rank that fails
posts its error and the others name it; a rank that hangs is named when ``--poseidon-timeout`` /
``--timeout`` passes at the next deadline barrier (one before every TP degree and, for TP > 1,
every micro-batch size).
"""

from __future__ import annotations

from typing import Any, Sequence

from . import bootstrap, profiler


def profile_and_gather(boot: bootstrap.Bootstrap, args: Any, tps: Sequence[int],
                       micro_batch_sizes: Sequence[int], *, device: Any, iters: int,
                       seed: int = 1234, turns: profiler.Turns | None = None
                       ) -> list[list[profiler.LayerTiming]]:
    """Every rank's ``LayerTiming`` list, indexed by launch rank (on every rank).

    ``boot``: started; its default process group is the one megatron-core's parallel state
    splits into TP groups (gloo on CPU; NCCL / HCCL for real TP timings on GPU / NPU).
    ``turns``: ranks sharing a host's CPU cores measure one TP group at a time."""
    env = boot.env
    timings = bootstrap.run_guarded(boot, "profiling", lambda: profiler.profile_rank(
        args, tps, micro_batch_sizes, world_size=env.world_size, rank=env.rank, device=device,
        iters=iters, seed=seed, checkpoint=boot.barrier, turns=turns))
    return bootstrap.run_guarded(boot, "profiling-gather",
                                 lambda: boot.all_gather_object(timings, "profiling-gather"))


__all__ = ["profile_and_gather"]
