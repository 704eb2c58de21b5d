"""The spawned-worker harness: real megatron-core pipelines on CPU (torch, gloo, megatron-core).

``run_cases`` spawns ``PP x DP`` processes per world size (``torch.multiprocessing``, gloo); each
worker installs the CPU shims of ``poseidon_plugin.megatron.emulate.emulation``, then for every case
calls ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP, ...)`` and runs
a ``_StageRun``: engine overheads (the schedule with zero-time layers; the emulated model and
the overheads' medians are ``megatron/profile/op_overhead.py``'s, which the profilers' own op-overhead
measurement uses too), a profile like the
plugin's (compute alone, p2p ping-pong and megatron's own p2p call costs, finalize and optimizer),
then the measured iterations with every op recorded (``megatron.recorder.OpRecorder``). Rank 0
writes every rank's results to a JSON file; ``report.assemble_case`` turns them into rows.

torch and megatron-core are imported inside the functions, never at module level: the CPU shims
must be in place before megatron-core is imported in a worker.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Sequence

from ..errors import PoseidonError
from .cases import Case, Emulation
from .predict import StageProfile
from .report import CaseResult, assemble_case


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------------------------
# the emulated model (megatron/profile/op_overhead.py: shared with the profilers' op-overhead measurement)
# ---------------------------------------------------------------------------------------------


def _build(case: Case, emu: Emulation, pp_rank: int, zero_time: bool = False):
    from poseidon_plugin.megatron.profile.op_overhead import emulated_chunk_class, schedule_config

    v = case.virtual_stages
    config = schedule_config(emu.hidden, case.pp, v)
    EmuChunk = emulated_chunk_class()
    speed = case.speed(pp_rank)
    scale = 0.0 if zero_time else 1.0 / speed
    chunks = []
    for c, n_layers in enumerate(case.chunk_layers(pp_rank)):
        chunks.append(EmuChunk(config, n_layers, emu.forward_ms_per_layer * scale,
                               emu.backward_ms_per_layer * scale,
                               is_first=(pp_rank == 0 and c == 0),
                               is_last=(pp_rank == case.pp - 1 and c == v - 1),
                               hidden=emu.hidden))
    return config, chunks


# ---------------------------------------------------------------------------------------------
# one worker (one process per rank)
# ---------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, cases: list[dict], emu_d: dict, iterations: int,
            discard: int, out_path: str, gantt_case: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from poseidon_plugin.megatron.emulate.emulation import install_cpu_shims

    torch.set_num_threads(1)
    install_cpu_shims(local_rank=0, device_count=1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    emu = Emulation(**emu_d)
    results = []
    try:
        for cd in cases:
            case = Case.from_dict(cd)
            results.append(_run_case(case, emu, iterations, discard,
                                     record_all=(gantt_case == case.name)))
    finally:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(gathered, f)
        dist.barrier()
        dist.destroy_process_group()


def _run_case(case: Case, emu: Emulation, iterations: int, discard: int,
              record_all: bool) -> dict:
    """One case on this rank: overheads, profile, measurement (see ``_StageRun``)."""
    from megatron.core import parallel_state as ps

    v = case.virtual_stages
    ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=case.pp,
                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
    try:
        run = _StageRun(case, emu)
        overhead = run.engine_overheads()
        config, chunks, params = run.make(zero_time=False)
        profile = run.profile(config, chunks, params, overhead)
        return run.measure(config, chunks, params, profile, iterations, discard, record_all)
    finally:
        ps.destroy_model_parallel()


class _StageRun:
    """This rank's stage of one case inside ``initialize_model_parallel``: builds the emulated
    chunks, runs megatron-core's schedule on them, profiles them like the plugin and measures.
    Every rank calls the same methods in the same order (they hold barriers and collectives)."""

    def __init__(self, case: Case, emu: Emulation) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.case, self.emu = case, emu
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.speed = case.speed(self.pp_rank)
        self.n_layers = case.layers[self.pp_rank]
        self.shape = (emu.seq_length, emu.micro_batch_size, emu.hidden)
        self.fb = get_forward_backward_func()

    # -- the pieces megatron-core's schedule calls -------------------------------------------
    def finalize(self, model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
        """The finalize hook: the emulated DP all-reduce (only when dp > 1)."""
        import torch
        import torch.distributed as dist

        grads = [p.grad for m in model_list for p in m.parameters() if p.grad is not None]
        if self.case.dp > 1 and grads:
            time.sleep(self.emu.allreduce_ms_per_layer * self.n_layers / 1e3)
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)

    def make(self, zero_time: bool):
        config, chunks = _build(self.case, self.emu, self.pp_rank, zero_time)
        config.finalize_model_grads_func = self.finalize
        params = [p for c in chunks for p in c.parameters()]
        return config, chunks, params

    def optimizer_step(self, params) -> None:
        """Megatron: grad-norm all-reduce over the model-parallel group, then the update."""
        import torch
        import torch.distributed as dist

        sq = torch.zeros(1)
        for p in params:
            if p.grad is not None:
                sq += p.grad.pow(2).sum()
        dist.all_reduce(sq, group=self.mp_group)
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-4)
                    p.grad = None
        rest = (self.emu.optimizer_ms_per_layer * self.n_layers / self.speed / 1e3
                - (time.perf_counter() - t0))
        if rest > 0:
            time.sleep(rest)

    def run_iteration(self, chunks, params, rec) -> None:
        """One training iteration: megatron-core's forward/backward, then the optimizer step."""
        from poseidon_plugin.megatron.profile.op_overhead import loss_forward_step, repeat_input

        v = self.case.virtual_stages
        if rec is not None:
            rec.begin_iteration()
        self.fb(forward_step_func=loss_forward_step,
                data_iterator=([repeat_input(self.shape) for _ in range(v)] if v > 1
                               else repeat_input(self.shape)),
                model=chunks if v > 1 else chunks[0],
                num_microbatches=self.case.num_microbatches, seq_length=self.emu.seq_length,
                micro_batch_size=self.emu.micro_batch_size, forward_only=False)
        self.optimizer_step(params)
        if rec is not None:
            rec.end_iteration()

    # -- 1. engine overheads: the same schedule with zero-time layers ------------------------
    def engine_overheads(self) -> dict[str, float]:
        import torch.distributed as dist

        from poseidon_plugin.megatron.profile.op_overhead import engine_overheads
        from poseidon_plugin.megatron.calibrate.recorder import OpRecorder

        config0, chunks0, params0 = self.make(zero_time=True)
        rec0 = OpRecorder(self.pp_rank)
        rec0.set_chunks(chunks0)
        with rec0.installed(config0):
            for _ in range(4):
                dist.barrier()
                self.run_iteration(chunks0, params0, rec0)
        return engine_overheads(rec0.iterations[1:])

    # -- 2. profile like the plugin: compute alone, p2p ping-pong, tail ----------------------
    def profile(self, config, chunks, params, overhead: dict) -> StageProfile:
        fwd_ms, bwd_ms = self._time_chunks(chunks)
        for p in params:
            p.grad = None
        send_ms = _ping_pong(self.pp_ranks, self.pp_group, self.shape)
        overhead.update(_p2p_costs(config, self.pp_group, self.pp_rank, self.case, self.shape))
        fin_ms, opt_ms = self._time_tail(chunks, params)
        return StageProfile(fwd_ms, bwd_ms, send_ms, fin_ms, opt_ms, overhead)

    def _time_chunks(self, chunks) -> tuple[list[float], list[float]]:
        """Forward and backward of each chunk timed alone (median of 4 after one warm-up)."""
        import torch

        fwd_ms, bwd_ms = [], []
        for chunk in chunks:
            f_s, b_s = [], []
            for _ in range(5):
                x = torch.randn(*self.shape, requires_grad=True)
                chunk.set_input_tensor(x)
                t0 = time.perf_counter()
                y = chunk(x)
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                t2 = time.perf_counter()
                f_s.append(t1 - t0)
                b_s.append(t2 - t1)
            chunk.set_input_tensor(None)
            fwd_ms.append(_median(f_s[1:]) * 1e3)
            bwd_ms.append(_median(b_s[1:]) * 1e3)
        return fwd_ms, bwd_ms

    def _time_tail(self, chunks, params) -> tuple[float, float]:
        """(finalize ms, optimizer step ms), medians of 4 after one warm-up."""
        import torch
        import torch.distributed as dist

        fin, opt = [], []
        for _ in range(5):
            for p in params:
                p.grad = torch.zeros_like(p)
            dist.barrier()
            t0 = time.perf_counter()
            self.finalize(chunks)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            self.optimizer_step(params)
            t3 = time.perf_counter()
            fin.append(t1 - t0)
            opt.append(t3 - t2)
        return _median(fin[1:]) * 1e3, _median(opt[1:]) * 1e3

    # -- 3. measure ---------------------------------------------------------------------------
    def measure(self, config, chunks, params, profile: StageProfile, iterations: int,
                discard: int, record_all: bool) -> dict:
        """``iterations`` recorded iterations; the worker's result for this case (JSON-able)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from poseidon_plugin.megatron.calibrate.recorder import OpRecorder

        rec = OpRecorder(self.pp_rank)
        rec.set_chunks(chunks)
        dist.barrier()
        with rec.installed(config):
            for _ in range(iterations):
                self.run_iteration(chunks, params, rec)
        keep = rec.iterations[discard:]
        its = [(r.start_s, r.end_s) for r in keep]
        timelines = [r.to_dict() for r in (rec.iterations if record_all else keep[-1:])]
        return {"case": self.case.name, "rank": dist.get_rank(), "pp_rank": self.pp_rank,
                "dp_rank": ps.get_data_parallel_rank(), "profile": asdict(profile),
                "iterations": its, "records": timelines,
                "ops_per_iteration": len(keep[-1].ops) if keep else 0}


# ---------------------------------------------------------------------------------------------
# profiling helpers
# ---------------------------------------------------------------------------------------------


def _p2p_costs(config, pp_group, pp_rank: int, case: Case, shape, reps: int = 8) -> dict:
    """Costs of megatron-core's own blocking p2p calls (``P2PCommunicator``), per link where this
    rank is the sender / receiver (medians over ``reps``):

    - ``send_call_ms``: a ``send_forward`` whose receiver has long posted its ``recv_forward``;
    - ``recv_ready_ms``: a ``recv_forward`` posted after the data was sent (no waiting);
    - ``latency_ms``: one-way latency, half a ``send_forward``/``recv_forward`` then
      ``send_backward``/``recv_backward`` round trip minus ``recv_ready_ms``.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    p2p = P2PCommunicator(pp_group=pp_group, config=config)
    n = case.pp
    links = n if case.schedule == "interleaved-1f1b" else n - 1
    x = torch.zeros(*shape)
    send_call, recv_ready, latency = [], [], []
    pause = 0.004
    for link in range(links):
        a, b = link, (link + 1) % n
        for _ in range(reps):
            dist.barrier(group=pp_group)
            if pp_rank == a:                       # 1. send into a posted receive
                time.sleep(pause)
                t0 = time.perf_counter()
                p2p.send_forward(x, is_last_stage=False)
                send_call.append(time.perf_counter() - t0)
            elif pp_rank == b:
                p2p.recv_forward(shape, is_first_stage=False)
            dist.barrier(group=pp_group)
            if pp_rank == a:                       # 2. receive of data already sent
                p2p.send_forward(x, is_last_stage=False)
            elif pp_rank == b:
                time.sleep(pause)
                t0 = time.perf_counter()
                p2p.recv_forward(shape, is_first_stage=False)
                recv_ready.append(time.perf_counter() - t0)
            dist.barrier(group=pp_group)
            if pp_rank == a:                       # 3. round trip
                t0 = time.perf_counter()
                p2p.send_forward(x, is_last_stage=False)
                p2p.recv_backward(shape, is_last_stage=False)
                latency.append((time.perf_counter() - t0) / 2)
            elif pp_rank == b:
                g = p2p.recv_forward(shape, is_first_stage=False)
                p2p.send_backward(g, is_first_stage=False)
    med = (lambda xs: _median(xs[1:] if len(xs) > 2 else xs) * 1e3 if xs else float("nan"))
    vals = torch.tensor([med(send_call), med(recv_ready), med(latency)], dtype=torch.float64)
    out = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(out, vals, group=pp_group)
    # every rank sends on some link and receives on some link (except at the ends of 1f1b):
    # use the pipeline-wide median of each quantity, separately per rank where it exists
    sc = [float(o[0]) for o in out if not math.isnan(float(o[0]))]
    rr = [float(o[1]) for o in out if not math.isnan(float(o[1]))]
    lat = [float(o[2]) for o in out if not math.isnan(float(o[2]))]
    ready = _median(rr)
    return {"send_call_ms": float(vals[0]) if not math.isnan(float(vals[0])) else _median(sc),
            "recv_ready_ms": float(vals[1]) if not math.isnan(float(vals[1])) else ready,
            "latency_ms": max(0.0, _median(lat) - ready)}


def _ping_pong(pp_ranks: Sequence[int], pp_group, shape, reps: int = 12) -> float:
    """Half the round trip of an activation-sized message on the link this rank sends on
    (pp rank s -> s+1, and N-1 -> 0 for the wrap-around), median over ``reps``."""
    import torch
    import torch.distributed as dist

    n = len(pp_ranks)
    me = dist.get_rank()
    buf = torch.zeros(*shape)
    mine = 0.0
    links = n if n > 2 else 1
    for link in range(links):
        a, b = pp_ranks[link], pp_ranks[(link + 1) % n]
        dist.barrier(group=pp_group)
        if me not in (a, b):
            continue
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if me == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            else:
                dist.recv(buf, a)
                dist.send(buf, a)
            samples.append((time.perf_counter() - t0) / 2)
        if me == a:
            mine = _median(samples[2:]) * 1e3
    if n == 2:   # one physical pair: both directions share it
        t = torch.tensor([mine])
        dist.all_reduce(t, group=pp_group, op=dist.ReduceOp.MAX)
        mine = float(t)
    return mine


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


def run_cases(cases: Sequence[Case], emu: Emulation = Emulation(), iterations: int = 30,
              discard: int = 5, gantt_case: str | None = None, progress=None) -> list[CaseResult]:
    """Run every case for real (grouped by world size: one spawn per group) and predict."""
    import torch.multiprocessing as mp

    if iterations <= discard:
        raise PoseidonError(f"--iterations ({iterations}) must exceed --discard ({discard})")
    groups: dict[int, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.pp * c.dp, []).append(c)
    out: list[CaseResult] = []
    for world, group in groups.items():
        if progress:
            progress(f"running {len(group)} case(s) on {world} processes: "
                     + ", ".join(c.name for c in group))
        with tempfile.TemporaryDirectory(prefix="poseidon-validate-") as tmp:
            path = os.path.join(tmp, "result.json")
            payload = [asdict(c) for c in group]
            mp.start_processes(_worker, args=(world, _free_port(), payload, asdict(emu),
                                              iterations, discard, path, gantt_case),
                               nprocs=world, join=True, start_method="spawn")
            with open(path, encoding="utf-8") as f:
                per_rank = json.load(f)
        for k, case in enumerate(group):
            out.append(assemble_case(case, [per_rank[r][k] for r in range(world)]))
    order = {c.name: i for i, c in enumerate(cases)}
    return sorted(out, key=lambda r: order[r.case.name])
