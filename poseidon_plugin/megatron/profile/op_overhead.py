"""Megatron-core's per-op overhead, measured: its own ``forward_step`` / ``backward_step`` (the
per-micro-batch wrapper every pipeline schedule runs around the model) on a zero-time model.

Shared by ``poseidon validate`` (``fidelity/harness.py``: the case's own pipeline, run with
zero-time layers) and by the profilers (``poseidon profile`` and the ``--poseidon-auto``
launch, :func:`.profiler.profile_rank`: :func:`measure_op_overheads`, megatron-core's
forward-backward function at PP 1 on the rank's own device, ``ops`` micro-batches a few times,
a few hundred ms on a CPU). Each op is timed by :class:`.recorder.OpRecorder` (the schedules
module's ``forward_step`` / ``backward_step`` wrapped; on a GPU / NPU with device events,
:func:`.profiler.device_event_class`, read after one synchronisation); the overheads are the
medians of the recorded ops (:func:`engine_overheads`) and are stored as the profile DB's
``op_overheads`` records (``callcosts.OpOverhead``, per device type: the median over its ranks).

The emulated model (:func:`emulated_chunk_class`): chunks of ``hidden x hidden`` linear layers
padded to the emulated forward / backward times (0: the zero-time model), with megatron's
``set_input_tensor`` and ``config``; torch is imported only when it is built.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Sequence

OVERHEAD_HIDDEN = 16          # the zero-time model: one 16 x 16 linear on a (16, 1, 16) input
OVERHEAD_SEQ = 16
OVERHEAD_MICROBATCHES = 4     # per run of the schedule
OVERHEAD_RUNS = 5             # runs of the schedule; the first is a warm-up


def engine_overheads(iters: Sequence[Any]) -> dict[str, float]:
    """Engine costs seen with zero-time layers in recorded iterations
    (``recorder.IterationRecord``): the duration of a forward / backward op as megatron runs it
    (its wrapper around the model) and the gap between consecutive ops (the p2p calls and the
    schedule's bookkeeping), medians over the recorded ops (ms)."""
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
    med = (lambda xs: float(statistics.median(xs)) * 1e3 if xs else 0.0)
    return {"forward_ms": med(f), "backward_ms": med(b), "gap_ms": med(gap),
            "head_ms": med(head), "tail_ms": med(tail)}


def emulated_chunk_class():
    """The emulated model chunk class (torch imported here): ``EmuChunk(config, layers,
    fwd_ms, bwd_ms, is_first, is_last, hidden)``: ``layers`` linear layers of ``hidden`` whose
    forward / backward are padded (sleep) to ``fwd_ms`` / ``bwd_ms`` each."""
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
                     is_first: bool, is_last: bool, hidden: int) -> None:
            super().__init__()
            self.config = config
            self.layers = torch.nn.ModuleList(
                EmuLayer(hidden, fwd_ms, bwd_ms) for _ in range(layers))
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


def schedule_config(hidden: int, pp: int = 1, virtual_stages: int = 1):
    """The ``ModelParallelConfig`` megatron-core's schedule reads from an emulated chunk."""
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None,
        pipeline_dtype=torch.float32)
    config.hidden_size = hidden
    config.calculate_per_token_loss = False
    return config


def repeat_input(shape: Sequence[int], device: Any = None):
    """A data iterator yielding one random tensor of ``shape`` (on ``device``) forever."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    if device is not None:
        x = x.to(device)
    while True:
        yield x


def loss_forward_step(data_iterator, model):
    """The ``forward_step_func`` of the emulated runs: the chunk on the next input, a mean
    square loss."""
    out = model(next(data_iterator))
    return out, (lambda o: (o.float().pow(2).mean(), {}))


def measure_op_overheads(device: Any = None, *, runs: int = OVERHEAD_RUNS,
                         microbatches: int = OVERHEAD_MICROBATCHES,
                         hidden: int = OVERHEAD_HIDDEN, seq: int = OVERHEAD_SEQ
                         ) -> dict[str, float]:
    """This rank's megatron-core op overheads (ms; :func:`engine_overheads` of ``runs - 1``
    runs after a warm-up): megatron-core's forward-backward function at PP 1 (its
    ``forward_step`` / ``backward_step`` around a zero-time one-layer model) on ``device``.

    Needs megatron-core's model-parallel state (the profiler's TP groups); without one, a PP 1
    / TP 1 state is made on the default process group for the run and destroyed after it. What
    the schedule leaves on megatron-core's modules and classes is put back after it."""
    from poseidon_plugin.megatron.framework_state import untouched

    with untouched("timing megatron-core's schedule"):
        return _measure_op_overheads(device, runs, microbatches, hidden, seq)


def _measure_op_overheads(device: Any, runs: int, microbatches: int, hidden: int,
                          seq: int) -> dict[str, float]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from poseidon_plugin.megatron.profile.profiler import _sync, device_event_class
    from poseidon_plugin.megatron.calibrate.recorder import OpRecorder

    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        parallel_state.initialize_model_parallel()
    try:
        config = schedule_config(hidden)
        chunk = emulated_chunk_class()(config, 1, 0.0, 0.0, True, True, hidden)
        if device is not None:
            chunk = chunk.to(device)
        params = list(chunk.parameters())
        data = repeat_input((seq, 1, hidden), device)
        fb = get_forward_backward_func()
        event_class = device_event_class(device) if device is not None else None
        rec = OpRecorder(0, event_class=event_class)
        rec.set_chunks([chunk])
        if device is not None:
            _sync(device)
        with rec.installed(config):
            for _ in range(max(2, runs)):
                rec.begin_iteration()
                fb(forward_step_func=loss_forward_step, data_iterator=data, model=chunk,
                   num_microbatches=microbatches, seq_length=seq, micro_batch_size=1,
                   forward_only=False)
                rec.end_iteration()
                for p in params:
                    p.grad = None
        rec.flush()
        return engine_overheads(rec.iterations[1:])
    finally:
        if own_state:
            from poseidon_plugin.megatron.framework_state import clear_model_parallel_leftovers

            clear_model_parallel_leftovers()


__all__ = ["engine_overheads", "emulated_chunk_class", "schedule_config", "repeat_input",
           "loss_forward_step", "measure_op_overheads"]
