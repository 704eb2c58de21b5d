"""``poseidon validate``: the simulator against real megatron-core pipeline runs (CPU emulation).

For every case (PP degree, per-stage layer split, emulated device type per stage, schedule,
micro-batch count) the harness

1. spawns ``PP x DP`` processes (``torch.multiprocessing``, gloo), installs the CPU shims of
   ``poseidon_plugin.megatron.emulation`` and calls megatron-core's
   ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP, ...)``;
2. builds a tiny real model per stage: ``layers[s]`` emulated layers, each a real ``Linear``
   (``hidden x hidden``) whose forward and backward are padded by ``sleep`` to
   ``forward_ms_per_layer / speed`` and ``backward_ms_per_layer / speed`` (the emulated device
   type's speed), so a stage costs layers x per-layer time / speed;
3. **profiles the way the plugin would**, on the same emulation: the forward and backward of each
   stage's chunk(s) timed alone (median of a few), the activation send of every pipeline link
   (gloo ping-pong, half the round trip), the gradient finalisation (DP all-reduce) and the
   optimizer step of every stage, plus -- for the engine-aware model only -- megatron-core's
   per-op overheads (the schedule run once with zero-time layers);
4. **measures** with megatron-core's own ``get_forward_backward_func()`` (real p2p, real
   ``send_forward_recv_backward`` pairs, real finalize hook), followed by a Megatron-like
   optimizer step (grad-norm all-reduce over the model-parallel group, then the update): 30
   iterations, the first 5 discarded, the mean of the rest (``--iterations`` / ``--discard``);
   the span of an iteration is max over ranks of its end minus min over ranks of its start
   (one host, one monotonic clock); every op of every stage is recorded by
   ``poseidon_plugin.megatron.recorder``;
5. predicts the iteration time with (a) the paper's DAG (``simulator.simulate_pipeline``),
   (b) Eq. (1) (``simulator.static_estimate_ms``) and (c) the engine-aware model
   (``poseidon_plugin.simulator.engine``), and prints a table with the relative errors, their median and max.

The per-stage tail R[s] given to (a) and (b) is the measured finalize + optimizer time of stage s
(what the plugin would profile as the stage's all-reduce); (c) models the tail as megatron runs it.

``main(argv)`` accepts a list of argv strings (or an argparse namespace from the CLI);
``--gantt FILE`` draws the measured and the predicted timeline of one case side by side;
``--json FILE`` writes every row; ``--full`` runs the larger case set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .errors import PoseidonError

# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

DEVICE_SPEEDS: dict[str, float] = {"emu-fast": 1.0, "emu-mid": 0.6, "emu-slow": 0.4}


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str                  # "1f1b" or "interleaved-1f1b"
    layers: tuple[int, ...]        # per stage (device); split over the V chunks for interleaved
    devices: tuple[str, ...]       # emulated device type per stage (keys of DEVICE_SPEEDS)
    num_microbatches: int
    virtual_stages: int = 1
    dp: int = 1

    @property
    def pp(self) -> int:
        return len(self.layers)

    def chunk_layers(self, stage: int) -> list[int]:
        n, v = self.layers[stage], self.virtual_stages
        return [n // v + (1 if c < n % v else 0) for c in range(v)]

    def speed(self, stage: int) -> float:
        return DEVICE_SPEEDS[self.devices[stage]]


def _c(name, schedule, layers, devices, m, v=1, dp=1) -> Case:
    return Case(name, schedule, tuple(layers), tuple(devices), m, v, dp)


F_, M_, S_ = "emu-fast", "emu-mid", "emu-slow"

DEFAULT_CASES: tuple[Case, ...] = (
    _c("pp2-1f1b-m4", "1f1b", (3, 2), (F_, S_), 4),
    _c("pp2-1f1b-m8", "1f1b", (3, 2), (F_, S_), 8),
    _c("pp2-int2-m4", "interleaved-1f1b", (4, 2), (F_, S_), 4, 2),
    _c("pp4-1f1b-m4", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 4),
    _c("pp4-1f1b-m8", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 8),
    _c("pp4-1f1b-m8b", "1f1b", (2, 4, 4, 2), (S_, F_, F_, M_), 8),
    _c("pp4-int2-m8", "interleaved-1f1b", (4, 4, 2, 4), (F_, M_, S_, M_), 8, 2),
)

FULL_EXTRA: tuple[Case, ...] = (
    _c("pp2-1f1b-m16", "1f1b", (3, 2), (F_, S_), 16),
    _c("pp2-1f1b-m2", "1f1b", (2, 4), (S_, F_), 2),
    _c("pp2-int2-m8", "interleaved-1f1b", (4, 2), (F_, S_), 8, 2),
    _c("pp2-int3-m6", "interleaved-1f1b", (3, 6), (S_, F_), 6, 3),
    _c("pp4-1f1b-m2", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 2),
    _c("pp4-1f1b-m16", "1f1b", (4, 3, 2, 3), (F_, M_, S_, M_), 16),
    _c("pp4-1f1b-m12c", "1f1b", (1, 3, 5, 3), (S_, M_, F_, M_), 12),
    _c("pp4-int2-m4", "interleaved-1f1b", (4, 4, 2, 4), (F_, M_, S_, M_), 4, 2),
    _c("pp4-int2-m16", "interleaved-1f1b", (2, 4, 4, 2), (S_, F_, F_, M_), 16, 2),
    _c("pp2-dp2-1f1b-m8", "1f1b", (3, 2), (F_, S_), 8, 1, 2),
)


@dataclass(frozen=True)
class Emulation:
    """Per-layer emulated costs at speed 1.0 (ms); a stage of L layers on a device of speed v
    takes L * x / v."""

    forward_ms_per_layer: float = 4.0
    backward_ms_per_layer: float = 8.0
    optimizer_ms_per_layer: float = 1.0
    allreduce_ms_per_layer: float = 2.0     # emulated DP all-reduce, only when dp > 1
    hidden: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2


# ---------------------------------------------------------------------------------------------
# results, statistics, table (pure Python: unit-tested without torch)
# ---------------------------------------------------------------------------------------------


@dataclass
class StageProfile:
    """What the plugin would profile for one stage (ms)."""

    forward_ms: list[float]          # per chunk
    backward_ms: list[float]         # per chunk
    send_ms: float                   # activation send on the link stage -> next (ring)
    finalize_ms: float               # gradient finalisation (DP all-reduce)
    optimizer_ms: float              # optimizer step (incl. the grad-norm all-reduce)
    # engine overheads (forward_step / backward_step / p2p call costs with zero-time layers)
    overhead: dict[str, float] = field(default_factory=dict)


@dataclass
class Row:
    case: str
    schedule: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    measured_ms: float
    dag_ms: float
    eq1_ms: float
    engine_ms: float
    measured_std_ms: float = 0.0
    iterations: int = 0

    def error(self, which: str) -> float:
        """Relative error of a prediction: (predicted - measured) / measured."""
        return (getattr(self, f"{which}_ms") - self.measured_ms) / self.measured_ms


PREDICTORS = ("dag", "eq1", "engine")


def error_stats(rows: Sequence[Row], which: str) -> tuple[float, float]:
    """(median, max) of |relative error| over the rows."""
    if not rows:
        return float("nan"), float("nan")
    errs = [abs(r.error(which)) for r in rows]
    return statistics.median(errs), max(errs)


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'case':<18} {'sched':<12} {'PP':>2} {'M':>3} {'V':>2} {'measured':>10} "
            f"{'DAG':>9} {'err':>7} {'Eq.(1)':>9} {'err':>7} {'engine':>9} {'err':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case:<18} {r.schedule:<12} {r.pp:>2} {r.num_microbatches:>3} "
            f"{r.virtual_stages:>2} {r.measured_ms:>8.2f}ms "
            f"{r.dag_ms:>9.2f} {100 * r.error('dag'):>+6.1f}% "
            f"{r.eq1_ms:>9.2f} {100 * r.error('eq1'):>+6.1f}% "
            f"{r.engine_ms:>9.2f} {100 * r.error('engine'):>+6.1f}%")
    lines.append("-" * len(head))
    for label, agg in (("median |err|", 0), ("max |err|", 1)):
        vals = [error_stats(rows, w)[agg] for w in PREDICTORS]
        lines.append(f"{label:<50} {'':>9} {100 * vals[0]:>6.1f}% {'':>9} "
                     f"{100 * vals[1]:>6.1f}% {'':>9} {100 * vals[2]:>6.1f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# predictions
# ---------------------------------------------------------------------------------------------


def _profile_arrays(case: Case, profiles: Sequence[StageProfile]):
    import numpy as np

    n, v = case.pp, case.virtual_stages
    fwd = np.array([[profiles[s].forward_ms[c] for s in range(n)] for c in range(v)])
    bwd = np.array([[profiles[s].backward_ms[c] for s in range(n)] for c in range(v)])
    links = n if case.schedule == "interleaved-1f1b" else n - 1
    send = np.array([profiles[s].send_ms for s in range(links)])
    tail = np.array([p.finalize_ms + p.optimizer_ms for p in profiles])
    return fwd, bwd, send, tail


def predict_dag(case: Case, profiles: Sequence[StageProfile]):
    """The paper's DAG (``simulate_pipeline``); returns the SimResult."""
    from .simulator import simulate_pipeline

    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    if case.virtual_stages == 1:
        fwd, bwd = fwd[0], bwd[0]
    return simulate_pipeline(fwd, bwd, send, send, tail, case.num_microbatches, case.schedule,
                             case.virtual_stages)


def predict_eq1(case: Case, profiles: Sequence[StageProfile]) -> float:
    """Eq. (1) on the per-device totals (for interleaved: the chunks of a device summed)."""
    from .simulator import static_estimate_ms

    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    n = case.pp
    return static_estimate_ms(fwd.sum(0), bwd.sum(0), send[:n - 1], send[:n - 1], tail,
                              case.num_microbatches)


def predict_engine(case: Case, profiles: Sequence[StageProfile]):
    """The engine-aware model (``poseidon_plugin.simulator.engine``); returns its result."""
    from .simulator.engine import EngineCosts, simulate_engine

    fwd, bwd, send, _ = _profile_arrays(case, profiles)
    costs = EngineCosts.from_profiles(fwd, bwd, send,
                                      [p.finalize_ms for p in profiles],
                                      [p.optimizer_ms for p in profiles],
                                      [p.overhead for p in profiles])
    return simulate_engine(costs, case.num_microbatches, case.schedule, case.virtual_stages)


# ---------------------------------------------------------------------------------------------
# the worker (one process per rank)
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emu_modules(emu: Emulation):
    """Import torch lazily and build the emulated layer / chunk classes."""
    import torch

    def pad_to(t0: float, target_s: float) -> None:
        rest = target_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)

    class EmuLinearFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, fwd_s, bwd_s):
            t0 = time.perf_counter()
            ctx.save_for_backward(x, weight)
            ctx.bwd_s = bwd_s
            y = torch.nn.functional.linear(x, weight)
            pad_to(t0, fwd_s)
            return y

        @staticmethod
        def backward(ctx, g):
            t0 = time.perf_counter()
            x, weight = ctx.saved_tensors
            gx = g @ weight
            gw = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
            pad_to(t0, ctx.bwd_s)
            return gx, gw, None, None

    class EmuLayer(torch.nn.Module):
        def __init__(self, hidden: int, fwd_ms: float, bwd_ms: float) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))
            self.fwd_s, self.bwd_s = fwd_ms / 1e3, bwd_ms / 1e3

        def forward(self, x):
            return EmuLinearFn.apply(x, self.weight, self.fwd_s, self.bwd_s)

    class EmuChunk(torch.nn.Module):
        """One model chunk: megatron's schedule calls set_input_tensor, then forward."""

        def __init__(self, config, layers: int, fwd_ms: float, bwd_ms: float,
                     is_first: bool, is_last: bool) -> None:
            super().__init__()
            self.config = config
            self.layers = torch.nn.ModuleList(
                EmuLayer(emu.hidden, fwd_ms, bwd_ms) for _ in range(layers))
            self.is_first, self.is_last = is_first, is_last
            from megatron.core.enums import ModelType

            self.model_type = ModelType.encoder_or_decoder
            self.input_tensor = None

        def set_input_tensor(self, tensor) -> None:
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            self.input_tensor = tensor

        def forward(self, x):
            h = x if self.is_first else self.input_tensor
            for layer in self.layers:
                h = layer(h)
            return h

    return EmuChunk


def _build(case: Case, emu: Emulation, pp_rank: int, zero_time: bool = False):
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    v = case.virtual_stages
    config = ModelParallelConfig(
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        pipeline_dtype=torch.float32)
    config.hidden_size = emu.hidden
    config.calculate_per_token_loss = False
    EmuChunk = _emu_modules(emu)
    speed = case.speed(pp_rank)
    scale = 0.0 if zero_time else 1.0 / speed
    chunks = []
    for c, n_layers in enumerate(case.chunk_layers(pp_rank)):
        chunks.append(EmuChunk(config, n_layers, emu.forward_ms_per_layer * scale,
                               emu.backward_ms_per_layer * scale,
                               is_first=(pp_rank == 0 and c == 0),
                               is_last=(pp_rank == case.pp - 1 and c == v - 1)))
    return config, chunks


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _worker(rank: int, world: int, port: int, cases: list[dict], emu_d: dict, iterations: int,
            discard: int, out_path: str, gantt_case: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from .megatron.emulation import install_cpu_shims

    torch.set_num_threads(1)
    install_cpu_shims(local_rank=0, device_count=1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    emu = Emulation(**emu_d)
    results = []
    try:
        for cd in cases:
            case = Case(**{**cd, "layers": tuple(cd["layers"]), "devices": tuple(cd["devices"])})
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
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .megatron.recorder import OpRecorder

    v = case.virtual_stages
    ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=case.pp,
                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
    try:
        pp_rank = ps.get_pipeline_model_parallel_rank()
        pp_group = ps.get_pipeline_model_parallel_group()
        dp_group = ps.get_data_parallel_group()
        mp_group = ps.get_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        speed = case.speed(pp_rank)
        n_layers = case.layers[pp_rank]
        shape = (emu.seq_length, emu.micro_batch_size, emu.hidden)
        fb = get_forward_backward_func()

        def finalize(model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
            grads = [p.grad for m in model_list for p in m.parameters() if p.grad is not None]
            if case.dp > 1 and grads:
                time.sleep(emu.allreduce_ms_per_layer * n_layers / 1e3)
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=dp_group)

        def make(zero_time: bool):
            config, chunks = _build(case, emu, pp_rank, zero_time)
            config.finalize_model_grads_func = finalize
            params = [p for c in chunks for p in c.parameters()]
            return config, chunks, params

        def optimizer_step(params) -> None:
            # Megatron: grad-norm all-reduce over the model-parallel group, then the update.
            sq = torch.zeros(1)
            for p in params:
                if p.grad is not None:
                    sq += p.grad.pow(2).sum()
            dist.all_reduce(sq, group=mp_group)
            t0 = time.perf_counter()
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-4)
                        p.grad = None
            rest = emu.optimizer_ms_per_layer * n_layers / speed / 1e3 - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)

        def data():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(*shape, generator=g)
            while True:
                yield x

        def forward_step_func(data_iterator, model):
            x = next(data_iterator)
            out = model(x)
            return out, (lambda o: (o.float().pow(2).mean(), {}))

        def run_iteration(config, chunks, params, rec: OpRecorder | None):
            if rec is not None:
                rec.begin_iteration()
            fb(forward_step_func=forward_step_func,
               data_iterator=[data() for _ in range(v)] if v > 1 else data(),
               model=chunks if v > 1 else chunks[0],
               num_microbatches=case.num_microbatches, seq_length=emu.seq_length,
               micro_batch_size=emu.micro_batch_size, forward_only=False)
            optimizer_step(params)
            if rec is not None:
                return rec.end_iteration()
            return None

        # ---- 1. engine overheads: the same schedule with zero-time layers ----------------------
        config0, chunks0, params0 = make(zero_time=True)
        rec0 = OpRecorder(pp_rank)
        rec0.set_chunks(chunks0)
        with rec0.installed(config0):
            for _ in range(4):
                dist.barrier()
                run_iteration(config0, chunks0, params0, rec0)
        overhead = _overheads(rec0.iterations[1:])

        # ---- 2. profile like the plugin: compute alone, p2p ping-pong, tail --------------------
        config, chunks, params = make(zero_time=False)
        fwd_ms, bwd_ms = [], []
        for c, chunk in enumerate(chunks):
            f_s, b_s = [], []
            for _ in range(5):
                x = torch.randn(*shape, requires_grad=True)
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
        for p in params:
            p.grad = None
        send_ms = _ping_pong(pp_ranks, pp_group, shape)
        overhead.update(_p2p_costs(config, pp_group, pp_rank, case, shape))
        fin, opt = [], []
        for _ in range(5):
            for p in params:
                p.grad = torch.zeros_like(p)
            dist.barrier()
            t0 = time.perf_counter()
            finalize(chunks)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            optimizer_step(params)
            t3 = time.perf_counter()
            fin.append(t1 - t0)
            opt.append(t3 - t2)
        profile = StageProfile(fwd_ms, bwd_ms, send_ms, _median(fin[1:]) * 1e3,
                               _median(opt[1:]) * 1e3, overhead)

        # ---- 3. measure ------------------------------------------------------------------------
        rec = OpRecorder(pp_rank)
        rec.set_chunks(chunks)
        dist.barrier()
        with rec.installed(config):
            for _ in range(iterations):
                run_iteration(config, chunks, params, rec)
        keep = rec.iterations[discard:]
        its = [(r.start_s, r.end_s) for r in keep]
        timelines = [r.to_dict() for r in (rec.iterations if record_all else keep[-1:])]
        return {"case": case.name, "rank": dist.get_rank(), "pp_rank": pp_rank,
                "dp_rank": ps.get_data_parallel_rank(), "profile": asdict(profile),
                "iterations": its, "records": timelines,
                "ops_per_iteration": len(keep[-1].ops) if keep else 0}
    finally:
        ps.destroy_model_parallel()


def _overheads(iters) -> dict[str, float]:
    """Engine costs seen with zero-time layers: the duration of a forward / backward op as
    megatron runs it (its wrapper around the model) and the gap between consecutive ops (the p2p
    calls and the schedule's bookkeeping), medians over the recorded ops."""
    f, b, gap, head, tail = [], [], [], [], []
    for r in iters:
        ops = r.ops
        if not ops:
            continue
        head.append(ops[0][3] - r.start_s)
        tail.append(r.end_s - ops[-1][4])
        for i, (_, _, bw, t0, t1) in enumerate(ops):
            (b if bw else f).append(t1 - t0)
            if i:
                gap.append(t0 - ops[i - 1][4])
    med = (lambda xs: _median(xs) * 1e3 if xs else 0.0)
    return {"forward_ms": med(f), "backward_ms": med(b), "gap_ms": med(gap),
            "head_ms": med(head), "tail_ms": med(tail)}


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
# driver
# ---------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    case: Case
    row: Row
    profiles: list[StageProfile]
    measured_records: list[dict]      # one IterationRecord dict per stage (a late iteration)
    ops_per_stage: list[int]
    all_records: list[list[dict]] = field(default_factory=list)


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
            out.append(_assemble(case, [per_rank[r][k] for r in range(world)]))
    order = {c.name: i for i, c in enumerate(cases)}
    return sorted(out, key=lambda r: order[r.case.name])


def _assemble(case: Case, per_rank: list[dict]) -> CaseResult:
    # one pipeline (dp rank 0) for the profiles and the timeline; all ranks for the span
    pipe = sorted((d for d in per_rank if d["dp_rank"] == 0), key=lambda d: d["pp_rank"])
    profiles = [StageProfile(**d["profile"]) for d in pipe]
    n_it = len(per_rank[0]["iterations"])
    spans = [max(d["iterations"][i][1] for d in per_rank)
             - min(d["iterations"][i][0] for d in per_rank) for i in range(n_it)]
    measured = statistics.fmean(spans) * 1e3
    std = statistics.pstdev(spans) * 1e3
    dag = predict_dag(case, profiles)
    row = Row(case.name, case.schedule, case.pp, case.num_microbatches, case.virtual_stages,
              measured, dag.iteration_time_ms, predict_eq1(case, profiles),
              predict_engine(case, profiles).iteration_time_ms, std, n_it)
    records = [d["records"][-1] for d in pipe]
    all_records = [d["records"] for d in pipe] if len(pipe[0]["records"]) > 1 else []
    return CaseResult(case, row, profiles, records, [d["ops_per_iteration"] for d in pipe],
                      all_records)


def draw_case(result: CaseResult, path: str) -> str:
    """Measured timeline (a late iteration) above the engine-aware and the DAG prediction."""
    from .simulator.engine import timeline_from_engine
    from .gantt import draw_gantt
    from .megatron.recorder import IterationRecord, timeline_from_records
    from .simulator.timeline import timeline_from_sim

    recs = [IterationRecord.from_dict(d) for d in result.measured_records]
    measured = timeline_from_records(recs, label="measured (megatron-core, CPU emulation)")
    engine = timeline_from_engine(predict_engine(result.case, result.profiles),
                                  label="predicted, engine-aware")
    dag = timeline_from_sim(predict_dag(result.case, result.profiles),
                            label="predicted, paper DAG")
    c = result.case
    title = (f"{c.name}: {c.schedule}, PP={c.pp}, V={c.virtual_stages}, M={c.num_microbatches}, "
             f"layers {list(c.layers)}, devices {list(c.devices)}")
    return draw_gantt([measured, engine, dag], path, title=title)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poseidon validate",
                                description="Measure the simulator against real megatron-core "
                                "pipeline runs on CPU emulation.")
    p.add_argument("--full", action="store_true", help="run the larger case set")
    p.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                   help="run only these cases (names from the table)")
    p.add_argument("--iterations", type=int, default=30, help="iterations per case (30)")
    p.add_argument("--discard", type=int, default=5, help="first iterations discarded (5)")
    p.add_argument("--layer-ms", type=float, nargs=2, default=None, metavar=("FWD", "BWD"),
                   help="emulated forward/backward ms per layer at speed 1 (4.0 8.0)")
    p.add_argument("--gantt", default=None, metavar="FILE",
                   help="draw measured vs predicted timelines of one case (.png/.svg)")
    p.add_argument("--gantt-case", default=None, help="the case to draw (default: the first)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row as JSON")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p


def _select(ns) -> list[Case]:
    pool = list(DEFAULT_CASES) + list(FULL_EXTRA)
    if ns.cases:
        by_name = {c.name: c for c in pool}
        missing = [n for n in ns.cases if n not in by_name]
        if missing:
            raise PoseidonError(f"--cases: unknown case(s) {missing}; known: {sorted(by_name)}")
        return [by_name[n] for n in ns.cases]
    return pool if ns.full else list(DEFAULT_CASES)


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    if isinstance(argv, argparse.Namespace):
        argv = list(getattr(argv, "args", None) or [])
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    ns = _parser().parse_args(argv)
    cases = _select(ns)
    if ns.list:
        for c in cases:
            print(f"{c.name:<18} {c.schedule:<17} V={c.virtual_stages} M={c.num_microbatches:<3} "
                  f"dp={c.dp} layers={list(c.layers)} devices={list(c.devices)}")
        return 0
    emu = Emulation()
    if ns.layer_ms:
        emu = Emulation(forward_ms_per_layer=ns.layer_ms[0], backward_ms_per_layer=ns.layer_ms[1])
    gantt_case = ns.gantt_case or (cases[0].name if ns.gantt else None)
    if gantt_case and gantt_case not in {c.name for c in cases}:
        raise PoseidonError(f"--gantt-case {gantt_case!r} is not among the cases run")
    t0 = time.time()
    results = run_cases(cases, emu, ns.iterations, ns.discard, gantt_case=None,
                        progress=lambda m: print(f"poseidon validate: {m}", file=sys.stderr))
    rows = [r.row for r in results]
    print(format_table(rows))
    print(f"({len(rows)} cases, {ns.iterations} iterations each, first {ns.discard} discarded; "
          f"{time.time() - t0:.0f} s)")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"rows": [asdict(r) for r in rows],
                       "profiles": {r.case.name: [asdict(p) for p in r.profiles]
                                    for r in results},
                       "measured_records": {r.case.name: r.measured_records for r in results}},
                      f, indent=1, sort_keys=True)
    if ns.gantt:
        res = next(r for r in results if r.case.name == gantt_case)
        print(f"Gantt chart: {draw_case(res, ns.gantt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
